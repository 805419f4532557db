"""Hand-derived gradients: the VJP libraries, check_vjp, custom_vjp, manual_grads, show_grad."""
