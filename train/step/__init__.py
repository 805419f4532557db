"""The step machinery: the compiled step (gradients, microbatches, the update), its
backward (``loss.grad`` modes, per-layer policies and taps, the rule checks before step 0),
precision policies, and the ``train``/``eval``/``loss`` config sections they read. The loop
(``train/loop/``) runs these; nothing here knows the loop."""
