"""What a run tells its user: the console lines, loggers, curves and timings."""
