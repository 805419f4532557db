"""Run directories and checkpoints: the files a run writes, resuming from them exactly."""
