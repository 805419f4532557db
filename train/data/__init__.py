"""Data: the data-source protocol, the built-in data sets, the seeded batch order and the
host-side feed of batches to the devices."""
