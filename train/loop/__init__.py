"""The training loop: building a run, the compiled step, the loop and its events."""
