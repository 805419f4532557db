"""Loggers: where a run's records go (metrics.jsonl, TensorBoard, CSV, W&B, MLflow, yours).

A logger is any object with two methods::

    log(step: int, metrics: dict) -> None   # one record: {"split": "train", "loss": ...}
    close() -> None                         # the run ended (finished, stopped or failed)

and, optionally, ``open(run_dir, start)`` (called once before the first record: the run
directory and the step the run starts at, > 0 when it resumes) and ``log_config(config)``
(the resolved config as plain data, once, after ``open``). ``metrics`` is the record
metrics.jsonl holds, less its ``step``: ``"split"`` ("train", "test" or "val") and the
numbers (a non-finite value stays a float nan/inf; metrics.jsonl writes it as null);
:func:`scalars` turns it into the ``"train/loss"`` form trackers show.

A config names loggers in ``log.loggers`` by the short names of :data:`LOGGERS`, a user's
``"module:Class"``, or ``{name: ..., other keys: its constructor's arguments}``;
``train.fit(loggers=[...])`` takes logger objects. Only process 0 logs.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError, users_code, users_error
from ..registry import Registry, check_kwargs

#: Shipped loggers: config name -> "module:Class" (imported on first use).
LOGGERS = Registry(
    "logger",
    {
        "jsonl": ".report.loggers:JsonlLogger",
        "tensorboard": ".report.loggers:TensorBoardLogger",
        "csv": ".report.loggers:CsvLogger",
        "wandb": ".report.loggers:WandbLogger",
        "mlflow": ".report.loggers:MlflowLogger",
    },
    form="module:Class",
)

#: The logger every run has: metrics.jsonl is the run directory's own record (resume cuts
#: it back, curves.png, ``train.load_run`` and the already-finished message read it).
DEFAULT = "jsonl"


@runtime_checkable
class Logger(Protocol):
    """What the loop calls; ``open`` and ``log_config`` are optional (see the module)."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{"split": "train", "loss": 0.5}`` -> ``{"train/loss": 0.5}`` (numbers only)."""
    split = metrics.get("split", "train")
    return {
        f"{split}/{k}": float(v)
        for k, v in metrics.items()
        if k != "split" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"optimizer.learning_rate": 0.001, ...}`` (for trackers'
    flat parameter tables)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _finite_or_none(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


# -- the shipped loggers ------------------------------------------------------------------


class JsonlLogger:
    """``<run dir>/metrics.jsonl``: one JSON object per record, ``{"step": ..., "split":
    ..., metrics...}`` (strict JSON: a non-finite value is written as null). A resumed run
    appends after the records up to its starting step (the run directory cuts the rest)."""

    def __init__(self):
        self.file = None

    def open(self, run_dir: Path, start: int) -> None:
        self.file = open(Path(run_dir) / "metrics.jsonl", "a")  # noqa: SIM115

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class TensorBoardLogger:
    """TensorBoard event files in ``<run dir>/<subdir>``: ``<split>/<metric>`` scalars by
    step (tensorboardX: ``pip install 'nnlite[tensorboard]'``). A resumed run purges the
    events after its starting step."""

    requires = ("tensorboardX", "nnlite[tensorboard]")

    def __init__(self, subdir: str = "tensorboard"):
        self.subdir, self.writer = subdir, None

    def open(self, run_dir: Path, start: int) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / self.subdir), purge_step=start or None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for tag, v in scalars(metrics).items():
            self.writer.add_scalar(tag, v, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class CsvLogger:
    """``<run dir>/<filename>``: a header ``step,split,<metrics...>`` and one row per
    record (a metric a split lacks is an empty cell; a non-finite value is ``nan``/``inf``).
    A record with a metric new to the file widens the header (the file is rewritten). A
    resumed run keeps the rows up to its starting step."""

    def __init__(self, filename: str = "metrics.csv"):
        self.filename = filename
        self.path: Path | None = None
        self.columns: list[str] = []

    def open(self, run_dir: Path, start: int) -> None:
        self.path = Path(run_dir) / self.filename
        if not self.path.exists():
            return
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        with open(self.path, newline="") as f:
            header = next(csv.reader(f), [])
        kept = [r for r in rows if r.get("step", "").isdigit() and int(r["step"]) <= start]
        self.columns = header
        self._rewrite(kept)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step, **metrics}
        new = [k for k in row if k not in self.columns]
        if new or not self.columns:
            old = []
            if self.path.exists():
                with open(self.path, newline="") as f:
                    old = list(csv.DictReader(f))
            self.columns = self.columns + new
            self._rewrite([*old, row])
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self, rows: list[dict]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        pass


class WandbLogger:
    """A Weights & Biases run (``pip install 'nnlite[wandb]'``): ``<split>/<metric>`` by
    step, and the resolved config as the run's config. Its files go under
    ``<run dir>/wandb``; with ``mode: offline`` (or ``WANDB_MODE=offline``) nothing leaves
    the machine (``wandb sync`` uploads later). A resumed run continues the same W&B run
    (its id is kept in ``<run dir>/wandb-run-id``); W&B drops records for steps it has
    already seen. Other keys are ``wandb.init``'s arguments (``entity``, ``group``,
    ``tags``, ``notes``, ``settings``...)."""

    requires = ("wandb", "nnlite[wandb]")

    def __init__(
        self, project: str = "nnlite", name: str | None = None, mode: str | None = None, **init
    ):
        self.project, self.name, self.mode, self.init = project, name, mode, init
        self.run = None

    def open(self, run_dir: Path, start: int) -> None:
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if start and id_file.exists() else None
        run_id = run_id or "".join(
            secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8)
        )
        id_file.write_text(run_id + "\n")
        init = dict(self.init)
        settings = init.pop("settings", None)
        if isinstance(settings, Mapping):  # a config's mapping; the run's lines stay ours
            settings = wandb.Settings(**{"console": "off", **settings})
        self.run = wandb.init(
            project=self.project,
            name=self.name or run_dir.name,
            mode=self.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            settings=settings or wandb.Settings(console="off"),
            **init,
        )

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MlflowLogger:
    """An MLflow run (``pip install 'nnlite[mlflow]'``): ``<split>/<metric>`` by step,
    and the resolved config as the run's parameters (``optimizer.learning_rate``...).
    ``tracking_uri``: where runs are stored (``http://host:5000``, ``sqlite:///mlflow.db``,
    ``file:/path/mlruns``); unset, MLflow's own default (``MLFLOW_TRACKING_URI``). A
    resumed run continues the same MLflow run (its id is kept in ``<run dir>/mlflow-run-id``;
    a step it already holds is not logged again, and the parameters are those of the first
    start)."""

    requires = ("mlflow", "nnlite[mlflow]")

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "nnlite",
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.run_name, self.tags = run_name, dict(tags or {})
        self.client, self.run_id, self.resumed = None, None, False
        self.last: dict[str, int] = {}  # a resumed run: the last step of each metric

    def open(self, run_dir: Path, start: int) -> None:
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir)
        self.client = MlflowClient(self.tracking_uri)
        id_file = run_dir / "mlflow-run-id"
        if start and id_file.exists():
            self.run_id, self.resumed = id_file.read_text().strip(), True
            self.client.update_run(self.run_id, status="RUNNING")
            # the stopped run's records after the checkpoint: MLflow keeps them (it cannot
            # delete a value), so they are not logged twice
            for key in self.client.get_run(self.run_id).data.metrics:
                history = self.client.get_metric_history(self.run_id, key)
                self.last[key] = max(m.step for m in history)
            return
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(self.experiment)
        )
        run = self.client.create_run(
            experiment_id, run_name=self.run_name or run_dir.name, tags=self.tags
        )
        self.run_id = run.info.run_id
        id_file.write_text(self.run_id + "\n")

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self.resumed:  # MLflow's parameters cannot change; they are the first start's
            return
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(k, v, now, step)
            for k, v in scalars(metrics).items()
            if step > self.last.get(k, -1)
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


# -- the config's loggers -------------------------------------------------------------------


def entries(loggers: Sequence[Any], tensorboard: bool = False) -> list[tuple[str, str, dict]]:
    """``log.loggers`` as ``(where, name, arguments)``: metrics.jsonl first (always), the
    TensorBoard logger added for ``log.tensorboard: true``; ``where`` names the config key.
    Raises ConfigError for an entry that is neither a name nor a mapping with a name, and
    for a logger listed twice."""
    out: list[tuple[str, str, dict]] = [("metrics.jsonl", DEFAULT, {})]
    if isinstance(loggers, str | bytes | Mapping) or not isinstance(loggers, Sequence):
        raise ConfigError(
            f"log.loggers: expected a list of loggers ({', '.join(LOGGERS.names)}, "
            f"'module:Class' or {{name: ..., arguments}}), got {loggers!r}"
        )
    for i, entry in enumerate(loggers):
        where = f"log.loggers[{i}]"
        if isinstance(entry, Mapping):
            name = entry.get("name")
            kwargs = {k: v for k, v in entry.items() if k != "name"}
        else:
            name, kwargs = entry, {}
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                f"{where}: expected a logger name ({', '.join(LOGGERS.names)}), a "
                f"'module:Class' or {{name: ..., arguments}}, got {entry!r}"
            )
        name = name.strip()
        if name == DEFAULT and not kwargs:
            continue  # always there
        if any(name == n for _, n, _ in out):
            raise ConfigError(f"{where}: {name} is listed twice; list each logger once")
        out.append((f"{where}={name}", name, kwargs))
    if tensorboard and not any(n == "tensorboard" for _, n, _ in out):
        out.append(("log.tensorboard=true", "tensorboard", {}))
    return out


def check(
    loggers: Sequence[Any], tensorboard: bool = False, source: str = "", search: Iterable = ()
) -> None:
    """Validate ``log.loggers`` (``source``: where it was set, for messages): every name
    registered or importable, every argument one its class takes. Imports a user's
    module (from ``search`` first), never a tracker's package."""
    prefix = f"{source}: " if source else ""
    try:
        pairs = entries(loggers, tensorboard)
    except ConfigError as e:
        raise ConfigError(prefix + str(e)) from None
    for where, name, kwargs in pairs[1:]:
        cls = LOGGERS.get(name, prefix + where, tuple(search))
        if not callable(cls):
            raise ConfigError(f"{prefix}{where}: {cls!r} is not a class")
        check_kwargs(cls, kwargs, prefix + where, where.partition("=")[0] + ".")


def check_installed(loggers: Sequence[Any], tensorboard: bool = False) -> None:
    """ConfigError (one line, the ``pip install`` to run) for a shipped logger whose
    package is missing, before anything is built."""
    for where, name, _ in entries(loggers, tensorboard):
        if ":" in name or name not in LOGGERS:
            continue
        module, extra = getattr(LOGGERS.get(name, where), "requires", (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{where} needs the {module} package: pip install '{extra}'")


def check_object(logger: Any, where: str) -> None:
    """ConfigError unless ``logger`` has callable ``log`` and ``close``."""
    missing = [m for m in ("log", "close") if not callable(getattr(logger, m, None))]
    if missing or isinstance(logger, type):
        raise ConfigError(
            f"{where}: {logger!r} is not a logger: a logger is an object with "
            "log(step, metrics) and close() (a class? pass an instance)"
        )


class MetricsLog:
    """Every record to every logger of a run (process 0): the config's (metrics.jsonl
    first) and the objects given to ``train.fit(loggers=...)``."""

    def __init__(self, loggers: Sequence[tuple[str, Any]]):
        self.loggers = list(loggers)

    @classmethod
    def open(
        cls,
        run_dir: Path,
        start: int,
        config: Mapping[str, Any],
        names: Sequence[Any] = (),
        tensorboard: bool = False,
        given: Sequence[Any] = (),
    ) -> MetricsLog:
        """Make the config's loggers, then open each (``open``, ``log_config``). One that
        cannot start is a ConfigError naming it (the loggers opened so far are closed)."""
        made: list[tuple[str, Callable[[], Any]]] = []  # (where, how to make the logger)
        for where, name, kwargs in entries(names, tensorboard):
            cls_ = LOGGERS.get(name, where, (Path.cwd(),))
            made.append((where, lambda cls_=cls_, kwargs=kwargs: cls_(**kwargs)))
        for i, obj in enumerate(given):
            where = f"train.fit(loggers=...)[{i}]"
            check_object(obj, where)
            made.append((where, lambda obj=obj: obj))
        log = cls([])
        for where, make in made:
            try:
                obj = make()
                check_object(obj, where)
                if callable(getattr(obj, "open", None)):
                    obj.open(Path(run_dir), start)
                log.loggers.append((where, obj))
                if callable(getattr(obj, "log_config", None)):
                    obj.log_config(dict(config))
            except Exception as e:
                with contextlib.suppress(Exception):  # the error below says what failed
                    log.close()
                if isinstance(e, ConfigError):
                    raise
                err = users_error("logger", e, f"{where} could not start")  # its file and line
                if err is not None:
                    raise err from e
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise ConfigError(
                    f"{where}: the logger could not start: {type(e).__name__}: {first}"
                ) from None
        return log

    def write(self, record: Mapping[str, Any]) -> None:
        """One record ``{"step": ..., "split": ..., metrics...}`` to every logger."""
        step = int(record["step"])
        metrics = {k: v for k, v in record.items() if k != "step"}
        for _, logger in self.loggers:
            with users_code("logger"):
                logger.log(step, dict(metrics))  # a copy each: one cannot change another's

    def close(self) -> None:
        """Close every logger (each once, all of them even if one fails; the first
        failure is raised after)."""
        loggers, self.loggers = self.loggers, []
        failed = None
        for _, logger in loggers:
            try:
                with users_code("logger"):
                    logger.close()
            except Exception as e:  # the others still close
                failed = failed or e
        if failed is not None:
            raise failed
