"""The core: ParamsDict, Module, save/load, manual mode's flag and the JAX-internal shims."""
