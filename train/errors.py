"""The trainer's error types: bad user input is one line and exit status 2."""


class ConfigError(ValueError):
    """Bad user input (config, CLI, data, checkpoint, a user's class): the CLI prints it in
    one line and exits 2."""


#: The ``[train]`` extra: import name -> the package that provides it.
TRAIN_EXTRA = {
    "yaml": "PyYAML",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "safetensors": "safetensors",
    "sklearn": "scikit-learn",
    "mnist1d": "mnist1d",
}


def missing_extra(e: ImportError) -> str | None:
    """The one line for a missing package of the ``[train]`` extra (None: another import
    failed, which is not the user's install)."""
    top = (e.name or "").split(".")[0]
    if top not in TRAIN_EXTRA:
        return None
    return (
        f"the trainer needs {TRAIN_EXTRA[top]}, which is not installed: pip install 'nnlite[train]'"
    )


def relative_to(path) -> str:
    """For a relative ``path``, the base it was looked for in: `` (relative to the current
    directory /home/me/proj)``; for an absolute one, nothing (it names its base)."""
    import os

    if os.path.isabs(path):
        return ""
    return f" (relative to the current directory {os.getcwd()})"


def not_found(path, what: str = "file not found") -> str:
    """``path: what``, with the base a relative path was looked for in (every "not found"
    message states it)."""
    return f"{path}: {what}{relative_to(path)}"
