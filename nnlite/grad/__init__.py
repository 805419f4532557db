"""Hand-derived gradients: the VJP libraries, the checker and plug-in, hand_rule and
manual_grads, show_grad."""
