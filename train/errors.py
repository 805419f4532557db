"""The trainer's error types: bad user input is one line and exit status 2."""

import contextlib


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


# -- the user's own code failing ----------------------------------------------------------
# What a run calls of the user's (a callback, a logger, a data source, a metric, an
# optimizer or schedule factory) may raise anything. The run ends with one line naming the
# user's file and line (the innermost frame of the traceback outside nnlite, its installed
# packages and the libraries), the full traceback in the run directory's error.log.

#: The file in the run directory that holds the traceback of a failure of the user's code.
ERROR_LOG = "error.log"


class UserCodeError(ConfigError):
    """The user's own code raised ``exc``: one line, ``{kind} {file}:{line} in {function}:
    {type}: {message}``. Before the run's first step the CLI exits 2 (bad input); during
    the run the trainer fills in ``step`` (the steps done), ``checkpoint`` (the newest one,
    kept) and ``log`` (error.log) and the CLI exits 1 (docs/faults.md). ``trace``: the full
    traceback, for error.log."""

    def __init__(self, kind: str, exc: BaseException, where: str | None = None, context: str = ""):
        import traceback

        self.kind, self.exc = kind, exc
        self.where = where or user_frame(exc.__traceback__) or "(nnlite)"
        self.trace = "".join(traceback.format_exception(exc))
        self.step: int | None = None  # set by the loop when it failed during the run
        self.checkpoint = None  # ... and the newest checkpoint then (None: none yet)
        self.log = None  # error.log, once written
        detail = one_line(exc)
        message = f"{kind} {self.where}: {type(exc).__name__}{': ' if detail else ''}{detail}"
        super().__init__(message + (f" ({context})" if context else ""))


def one_line(e: BaseException) -> str:
    """An exception's message, one line (the rest of a multi-line message left out)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: the trainer, the shipped models, nnlite,
    the standard library and the installed packages (site-packages)."""
    import importlib.util
    import sysconfig
    from pathlib import Path

    here = Path(__file__).resolve().parent  # train/ (nnlite/train when installed)
    dirs = {here, here.parent / "models"}
    spec = importlib.util.find_spec("nnlite")
    if spec is not None and spec.origin:
        dirs.add(Path(spec.origin).resolve().parent)
    paths = sysconfig.get_paths()
    dirs.update(Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return tuple(str(d) + "/" for d in dirs)


def user_frame(tb) -> str | None:
    """``"mycb.py:12 in on_step_end"``: the innermost frame of the traceback ``tb`` in the
    user's code (a path relative to the current directory when under it), or None when
    every frame is nnlite's or a library's."""
    import os
    import traceback

    library = _library_dirs()
    for frame in reversed(traceback.extract_tb(tb)):
        name = frame.filename
        if name.startswith("<frozen") or not name:
            continue
        path = os.path.realpath(name) if not name.startswith("<") else name
        if path.startswith(library):
            continue
        shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else name
        return f"{shown}:{frame.lineno} in {frame.name}"
    return None


def users_error(kind: str, exc: BaseException, context: str = "") -> UserCodeError | None:
    """``exc`` as a :class:`UserCodeError` if the user's code raised it (None: nnlite's
    own, or a library's on nnlite's behalf: its traceback is a bug report)."""
    if isinstance(exc, ConfigError) or not isinstance(exc, Exception):
        return None
    where = user_frame(exc.__traceback__)
    return None if where is None else UserCodeError(kind, exc, where, context)


@contextlib.contextmanager
def users_code(kind: str):
    """``with users_code("callback"): cb.on_step_end(...)``: an exception the user's code
    raised becomes a :class:`UserCodeError` (one line); anything else passes unchanged."""
    try:
        yield
    except Exception as e:
        err = users_error(kind, e)
        if err is None:
            raise
        raise err from e
