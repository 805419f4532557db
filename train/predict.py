"""``nnlite-train predict --run DIR --data FILE.npz [--out FILE.npz] [--batch-size N]
[--best]``: a trained classifier's or regression's predictions for new data (from the
run's newest checkpoint, or with ``--best`` its best by ``checkpoint.monitor``).

The data file holds ``x`` (and optionally ``y``, the labels or targets), as for
``data.name: npz``. The output ``.npz`` (default ``DIR/predictions.npz``, written whole or
not at all) holds ``predictions`` (class ids, or the regression's values) and, for a
classifier, ``probabilities [n, num_classes]``. With ``y`` the command also prints the
accuracy (or mean squared error). Bad arguments print one line and exit 2.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from . import faults
from .config import ArgumentParser
from .errors import ConfigError, relative_to
from .inference import load_run


def parse_args(argv):
    ap = ArgumentParser(
        prog="nnlite-train predict",
        description="Predict with a trained classifier or regression from its run directory.",
    )
    ap.add_argument("--run", required=True, help="run directory, e.g. runs/digits_mlp")
    ap.add_argument("--data", required=True, help=".npz with x (and optionally y)")
    ap.add_argument("--out", default=None, help="output .npz (default: RUN/predictions.npz)")
    ap.add_argument("--batch-size", type=int, default=1024, help="rows per compiled call")
    ap.add_argument(
        "--best", action="store_true",
        help="the best checkpoint by checkpoint.monitor (a run with checkpoint.keep_best), "
        "not the newest",
    )  # fmt: skip
    ap.add_argument(
        "--ema",
        action="store_true",
        help="predict with the params' moving average (train.ema_decay)",
    )
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    return args


def read_data(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """``(x, y or None)`` of a prediction data file."""
    where = f"--data {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where}: file not found{relative_to(path)}")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files} if hasattr(f, "files") else {}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{where}: not a readable .npz file without pickles ({e})") from None
    if "x" not in arrays:
        raise ConfigError(f"{where}: missing array 'x'; found {sorted(arrays) or 'none'}")
    x, y = arrays["x"], arrays.get("y")
    if not (np.issubdtype(x.dtype, np.number) and x.ndim >= 1):
        raise ConfigError(f"{where}: x must be a numeric array [n, ...], got {x.dtype}{x.shape}")
    x = x[:, None] if x.ndim == 1 else x
    if y is not None and len(y) != len(x):
        raise ConfigError(f"{where}: y has {len(y)} rows but x has {len(x)}")
    return x.astype(np.float32), y


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        run = load_run(Path(args.run), "best" if args.best else "latest", ema=args.ema)
        task = run.model.task
        if task == "language_model":
            raise ConfigError(
                f"run {args.run} is a language model; generate text with nnlite-train sample"
            )
        x, y = read_data(Path(args.data))
        out_path = Path(args.out) if args.out else run.run_dir / "predictions.npz"
        if out_path.is_dir():
            raise ConfigError(f"--out {str(out_path)!r} is a directory; give a file name")
        outputs = run.predict(x, args.batch_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    if task == "classification":
        z = outputs - outputs.max(axis=-1, keepdims=True)
        probs = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
        result = {"predictions": outputs.argmax(axis=-1), "probabilities": probs}
    else:
        result = {"predictions": outputs}
    _write_npz(out_path, result)
    line = f"wrote {len(x)} predictions to {out_path}"
    if y is not None:
        if task == "classification":
            line += f"; accuracy {np.mean(result['predictions'] == y):.4f}"
        else:
            err = np.mean((outputs - np.asarray(y, np.float32).reshape(outputs.shape)) ** 2)
            line += f"; mean squared error {err:.6g}"
    print(line)
    return 0


def _write_npz(path: Path, arrays: dict) -> None:
    """Write ``arrays`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


if __name__ == "__main__":
    sys.exit(main())
