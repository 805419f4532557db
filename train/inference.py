"""Back from a run: :func:`load_run` rebuilds a run's model and params from its directory
(any model, a user's own included), for prediction and text generation.

Example (after ``nnlite-train --config configs/digits_mlp.yaml``)::

    run = train.load_run("runs/digits_mlp")
    probabilities = run.predict(x)                # [n, num_classes]
    text = train.load_run("runs/shakespeare_gpt").generate("ROMEO:", 200)
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nnlite as nl

from .checkpoint import best
from .checkpoint import store as ckpt
from .config import Config, ModelConfig, load_config
from .data.builtin import apply_preprocess, recorded_preprocess
from .data.text.tokenizer import from_spec
from .errors import ConfigError, relative_to
from .model import registry as models
from .model.contract import Model, accepts, call, call_stateful, is_stateful, param_shapes
from .model.registry import MODEL_SOURCE_KEY
from .optim.ema import ema_params, ema_prefix
from .optim.params import make_optimizer, plan_params
from .step.precision import with_loss_scaling


@dataclass
class LoadedRun:
    """A run read back from its directory (see :func:`load_run`)."""

    run_dir: Path
    config: Config  # the run's resolved config (config.yaml)
    model: Model
    params: nl.ParamsDict
    step: int  # the checkpoint's step
    checkpoint: Path
    opt_state: Any = None  # the optimizer state (None unless asked for)
    vocab: str | None = None  # text runs: the characters, in id order
    metadata: dict = field(default_factory=dict)  # the checkpoint's metadata
    state: nl.ParamsDict | None = None  # a stateful model's state (running statistics)
    # runs on prepared tokens (data.name: tokens): their tokenizer (train/data/text/tokenizer.py)
    tokenizer: Any = None
    # what training did to raw inputs ({"scale": s}: the digits' pixels 0..16 -> [0, 1])
    preprocess: dict | None = None

    def predict(
        self, x: np.ndarray, batch_size: int = 1024, *, preprocessed: bool = False
    ) -> np.ndarray:
        """The model's outputs for inputs ``x`` (logits for a classifier, predictions for
        a regression), computed ``batch_size`` rows at a time; no dropout, and a stateful
        model in eval mode (BatchNorm with its running statistics).

        ``x`` is raw, as the data source gives it (digits: ``load_digits`` pixels 0..16):
        the run's preprocessing (:attr:`preprocess`) is applied first, unless
        ``preprocessed`` (``x`` as the model saw it, e.g. ``Dataset.x_test``)."""
        if not preprocessed:
            x = apply_preprocess(x, self.preprocess)
        return predict(self.model, self.params, x, batch_size, state=self.state)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` in the run's vocabulary (a ConfigError names characters
        it does not have); runs on prepared tokens encode with their tokenizer."""
        if self.vocab is None and self.tokenizer is not None:
            return self.tokenizer.encode(text).tolist()
        if self.vocab is None:
            raise ConfigError(f"run {self.run_dir} is not a text model: it has no vocabulary")
        lut = {c: i for i, c in enumerate(self.vocab)}
        unknown = sorted(set(text) - set(lut))
        if unknown:
            raise ConfigError(
                f"characters outside the model's vocabulary: {''.join(unknown)!r}; the "
                f"vocabulary is {self.vocab!r}"
            )
        return [lut[c] for c in text]

    def decode(self, ids) -> str:
        if self.vocab is None and self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return "".join(self.vocab[int(i)] for i in ids)

    def generate(
        self,
        prompt: str = "\n",
        n_tokens: int = 200,
        *,
        seed: int = 0,
        temperature: float = 0.8,
        top_k: int | None = 40,
    ) -> str:
        """``prompt`` continued by ``n_tokens`` sampled tokens (the prompt included)."""
        ids = self.encode(prompt)
        out = generate(
            self.model,
            self.params,
            ids,
            n_tokens,
            jax.random.key(seed),
            temperature,
            top_k,
            state=self.state,
        )
        return self.decode(until_stop(out, len(ids), getattr(self.model, "stop_ids", ())))


def load_run(
    run_dir: str | Path,
    which: str = "latest",
    *,
    checkpoint: str | Path | None = None,
    with_opt_state: bool = False,
    ema: bool = False,
) -> LoadedRun:
    """The model, params (and optimizer state), a stateful model's state, config and
    vocabulary of a training run, from its ``config.yaml`` and its newest checkpoint
    (``which="latest"`` or ``"last"``), its best one by ``checkpoint.monitor``
    (``which="best"``, a run trained with ``checkpoint.keep_best``), or ``checkpoint``.

    ``ema``: the params are the moving average the run kept (``train.ema_decay``); a run
    without one is a ConfigError.

    A user's model class is imported as the run names it (``module:Class``): from the
    directory its module was in when the run trained, the current directory, or
    ``sys.path``. Raises ConfigError (one line) for a directory that is not a run.
    """
    run_dir = Path(run_dir)
    where = f"run {str(run_dir)!r}"
    if not run_dir.is_dir():
        raise ConfigError(f"{where}: no such run directory{relative_to(run_dir)}")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"{where}: no config.yaml; is it a training run?")
    if checkpoint is None:
        checkpoint = best.find(run_dir, which)
    elif which not in ("latest", "last"):
        raise ConfigError(f"load_run: give checkpoint= or which={which!r}, not both")
    checkpoint = Path(checkpoint)
    meta = ckpt.read_metadata(checkpoint)
    _add_model_source(meta)
    cfg = load_config(cfg_path, resolve_paths=False)  # its paths were resolved to train
    model = model_of(cfg.model)
    template = param_shapes(model)
    s_template = jax.eval_shape(model.init_state) if is_stateful(model) else None
    opt_state = state = None
    if ema and cfg.train.ema_decay is None:
        raise ConfigError(
            f"{where} trained without a moving average of its params (train.ema_decay is "
            "unset in its config.yaml); load it without ema=True"
        )
    if with_opt_state or ema:
        optimizer, _ = make_optimizer(cfg, model)
        optimizer = with_loss_scaling(optimizer, cfg.train.precision, cfg.train.loss_scale)
        o_template = jax.eval_shape(optimizer.init, template)
    if with_opt_state:
        params, opt_state, state, _ = ckpt.restore_model(
            model, checkpoint, template, o_template, s_template
        )
    else:
        params = ckpt.load_model_params(model, checkpoint, template)
        if s_template is not None:
            state = ckpt.load_state(checkpoint, s_template)
    if ema:
        plan = plan_params(cfg.optimizer, model, template)
        prefix = ema_prefix(o_template)
        params = ema_params(params, checkpoint, where, plan.trainable(params), prefix)
    vocab = None
    if "vocab" in meta:
        try:
            vocab = json.loads(meta["vocab"])
        except json.JSONDecodeError:
            raise ConfigError(
                f"checkpoint {checkpoint}: its vocabulary is not valid JSON"
            ) from None
    tokenizer = None
    if "tokenizer" in meta:
        try:
            tokenizer = from_spec(meta["tokenizer"])
        except (ValueError, KeyError, TypeError) as e:
            if isinstance(e, ConfigError):
                raise ConfigError(f"checkpoint {checkpoint}: {e}") from None
            raise ConfigError(
                f"checkpoint {checkpoint}: its tokenizer metadata is not readable ({e})"
            ) from None
    step = int(meta.get("step", ckpt.step_of(checkpoint)))
    return LoadedRun(
        run_dir, cfg, model, params, step, checkpoint, opt_state, vocab, meta, state, tokenizer,
        _preprocess(cfg, meta, checkpoint),
    )  # fmt: skip


def _preprocess(cfg: Config, meta: dict, checkpoint: Path) -> dict | None:
    """The run's preprocessing: recorded in its checkpoint, or (older checkpoints) what its
    built-in data set does."""
    if "preprocess" not in meta:
        return recorded_preprocess(cfg.data.name)
    try:
        found = json.loads(meta["preprocess"])
        if not (isinstance(found, dict) and isinstance(found.get("scale"), int | float)):
            raise ValueError("expected {'scale': number}")
    except ValueError as e:
        raise ConfigError(
            f"checkpoint {checkpoint}: its preprocess metadata is bad ({e})"
        ) from None
    return found


def model_of(spec: ModelConfig) -> Model:
    """The model a resolved config section describes (every field given)."""
    try:
        return spec.cls(**spec.options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.name={spec.name}: {e}") from None


def _add_model_source(meta: dict) -> None:
    import sys

    source = meta.get(MODEL_SOURCE_KEY)
    if source and Path(source).is_dir() and source not in sys.path:
        sys.path.append(source)


def predict(
    model: Model, params, x: np.ndarray, batch_size: int = 1024, *, state=None
) -> np.ndarray:
    """``model(params, x)`` in batches of ``batch_size`` rows, as one numpy array (a
    stateful model: ``model(params, x, state=state)[0]``, eval mode)."""
    x = np.asarray(x)
    if len(x) == 0:
        raise ConfigError("no examples to predict (x is empty)")
    apply = _apply(model)
    state_args = _state_args(model, state)
    outs = []
    for i in range(0, len(x), batch_size):
        try:
            outs.append(np.asarray(apply(params, jnp.asarray(x[i : i + batch_size]), *state_args)))
        except (TypeError, ValueError) as e:  # a shape the model refuses, named by the layer
            raise ConfigError(str(e).splitlines()[0]) from None
    return np.concatenate(outs)


@functools.cache
def _apply(model: Model):
    """The jitted inference call of ``model`` (models are hashable: one per model, so
    predicting again, or in batches, compiles nothing new)."""
    if is_stateful(model):
        return nl.jit(lambda params, x, state: eval_call(model, params, x, state))
    return nl.jit(lambda params, x: call(model, params, x))  # chat rows: segment ids


def eval_call(model: Model, params, x, state):
    """A stateful model's output in eval mode (its running statistics)."""
    return call_stateful(model, params, x, state, train=False)[0]


def _state_args(model: Model, state) -> tuple:
    """``(state,)`` for a stateful model (which needs it), ``()`` for a stateless one."""
    if not is_stateful(model):
        return ()
    if state is None:
        raise ConfigError(
            f"{type(model).__name__} is stateful (it defines init_state): predicting needs "
            "its state, e.g. train.load_run(dir).state"
        )
    return (state,)


def generate(
    model: Model,
    params,
    prompt: list[int] | np.ndarray,
    n_tokens: int,
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    state=None,
) -> np.ndarray:
    """``prompt`` ids followed by ``n_tokens`` sampled ones, from a language model.

    A model with its own ``generate(params, prompt [1, T], n_tokens, key, temperature,
    top_k)`` (the GPT's key/value cache) runs that; any other causal language model runs
    :func:`generate_by_windows`: one compiled loop over a fixed ``context``-long window.
    ``temperature=0`` is greedy; ``top_k`` samples among the k most likely. A stateful
    model generates in eval mode with ``state`` (by windows).
    """
    if getattr(model, "task", None) != "language_model":
        raise ConfigError(f"{type(model).__name__} is not a language model; it cannot generate")
    context = model.context
    ids = np.asarray(prompt, np.int32).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ConfigError("the prompt is empty; give at least one token")
    if ids.shape[1] > context:
        raise ConfigError(
            f"the prompt is {ids.shape[1]} tokens, longer than the model's context of {context}"
        )
    if state is None and getattr(model, "generate_stream", None) is not None:
        # nl.hf models compile their own programs, one per prompt-length bucket: called as
        # they are (no jit around them), a new prompt length compiles nothing
        return np.asarray(model.generate(params, ids, n_tokens, key, temperature, top_k))[0]
    run = generator(model, state)
    return np.asarray(run(params, jnp.asarray(ids), n_tokens, key, temperature, top_k))[0]


def until_stop(out: np.ndarray, start: int, stop_ids) -> np.ndarray:
    """``out`` up to and including its first stop id at or after ``start`` (a model that
    stops, ``nl.hf``'s, pads the rest of a row after one)."""
    stops = {int(s) for s in stop_ids}
    hits = [i for i in range(start, len(out)) if int(out[i]) in stops]
    return out[: hits[0] + 1] if hits else out


class _Bound:
    """A stateful language model seen as a stateless one: ``(params, x) -> logits`` in eval
    mode with a fixed state (what :func:`generate_by_windows` calls)."""

    def __init__(self, model, call):
        self.context, self._call = model.context, call

    def __call__(self, params, x):
        return self._call(params, x)


def generator(
    model: Model,
    state=None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
):
    """The jitted ``(params, prompt [1, T], n_tokens, key, temperature, top_k) -> ids``
    of a language model: its own ``generate`` if it has one, else
    :func:`generate_by_windows` (``n_tokens`` and ``top_k`` are static). A stateful
    model generates by windows in eval mode with ``state`` (closed over). ``top_p`` and
    ``repetition_penalty`` need the model's own generate to take them (nl.hf models)."""
    if _state_args(model, state):
        bound = _Bound(model, functools.partial(eval_call, model, state=state))
        return nl.jit(lambda p, *a: generate_by_windows(bound, p, *a), static_argnums=(2, 5))
    fn = getattr(model, "generate", None)
    extra = {"top_p": top_p, "repetition_penalty": repetition_penalty}
    extra = {k: v for k, v in extra.items() if v is not None}
    for name in extra:  # options only some models' own generate takes (nl.hf)
        if fn is None or not accepts(fn, name):
            how = "samples by windows" if fn is None else "has a generate without it"
            raise ConfigError(
                f"{name} needs a model whose own generate takes it (nl.hf models); "
                f"{type(model).__name__} {how}"
            )
    if extra:
        fn = functools.partial(fn, **extra)
    if fn is None:
        fn = lambda *args: generate_by_windows(model, *args)  # noqa: E731
    return nl.jit(fn, static_argnums=(2, 5))


def generate_by_windows(model, params, prompt, n_tokens: int, key, temperature, top_k):
    """Generation for any causal language model: the text so far sits in a window of
    ``context`` tokens (right-padded until it is full, which a causal model never looks at),
    the logits at its last real position give the next token, and a full window slides
    by one. One compiled program; each token costs a forward pass over ``context``."""
    import importlib

    sample = importlib.import_module(f"{models.SHIPPED}.gpt").sample

    context, t0 = model.context, prompt.shape[1]
    window = jnp.zeros((1, context), jnp.int32).at[:, :t0].set(prompt)
    out = jnp.zeros((1, t0 + n_tokens), jnp.int32).at[:, :t0].set(prompt)

    def step(i, state):
        window, out, filled = state
        logits = model(params, window)[0]  # [context, vocab]
        last = jnp.minimum(filled, context) - 1
        nxt = sample(logits[last][None], jax.random.fold_in(key, i), temperature, top_k)[0]
        full = filled >= context
        slid = jnp.roll(window, -1, axis=1).at[0, -1].set(nxt)
        grown = window.at[0, jnp.minimum(filled, context - 1)].set(nxt)
        window = jnp.where(full, slid, grown)
        return window, out.at[0, t0 + i].set(nxt), filled + 1

    _, out, _ = jax.lax.fori_loop(0, n_tokens, step, (window, out, jnp.int32(t0)))
    return out
