"""The shipped models, one readable file each: ``mlp``, ``linreg``, ``cnn``, ``resnet``,
``gpt``. Each is an ``nl.Module`` following the trainer's model contract
(``train/model/contract.py``); the trainer's registry (``train/model/registry.py``) maps a
config's short name to its class, and a user's own model is named ``module:Class``."""
