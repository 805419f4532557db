"""The core: ParamsDict, Module, save/load, and small utilities every other part shares."""
