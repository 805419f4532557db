"""The model contract, the registry of shipped models and the gradient-mode choice."""
