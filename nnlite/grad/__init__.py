"""Rules: the rule table and its rules, check_rule, custom_vjp, manual_grads, show_grad."""
