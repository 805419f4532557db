"""``Pretrained``: a Hugging Face model directory as a model whose ``init`` is its weights.

A trainer builds a model from hyperparameters and asks it for ``init(key)``, often inside
``jax.jit`` with output shardings, and traces ``init`` with ``jax.eval_shape`` to plan
memory. ``Pretrained(path)`` fits that contract: its ``init`` reads each weight through a
host callback (``jax.pure_callback``), so tracing reads nothing, a jitted init with
shardings places the weights where the strategy wants them, and the same seed always
gives the same params (the weights, plus LoRA adapters drawn from ``key``).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._module import Module
from ..core._params import ParamsDict
from ..core._precision import precision_dtype
from ..nn._dropout import check_rate
from ..nn._lora import freeze_base, lora_mask
from ._adapter import read_adapter
from ._config import HFConfigError
from ._convert import build_model, family_of, hf_name, plan_weights
from ._generate import generate, generate_stream
from ._gpt2 import GPT2LM
from ._models import LlamaLM
from ._safetensors import SafetensorsDir
from ._tokenizer import check_tokenizer
from ._tokenizer import stop_ids as read_stop_ids

__all__ = ["Pretrained"]

_LORA_KEYS = ("rank", "alpha", "targets", "dropout", "path")
_STORED = ("float32", "bfloat16", "float16")  # the dtypes a frozen base may be kept in


def _base(path: str, ignore_keys: tuple) -> GPT2LM | LlamaLM:
    """The directory's model, its files checked (again whenever one of them changed)."""
    try:
        stamp = tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size)
                             for f in Path(path).iterdir()))  # fmt: skip
    except OSError:
        stamp = ()
    return _checked(path, ignore_keys, stamp)


@functools.lru_cache(maxsize=8)
def _checked(path: str, ignore_keys: tuple, stamp: tuple) -> GPT2LM | LlamaLM:
    """``config.json``, every weight file's header against the model it builds, and a
    ``tokenizer.json`` against its embedding: a broken file is one HFConfigError naming it
    here, not a failure inside ``init``'s host callbacks."""
    model = build_model(path, ignore_keys=ignore_keys)
    plan_weights(path, model, SafetensorsDir(path, HFConfigError))
    check_tokenizer(path, model.vocab_size)
    return model


@functools.lru_cache(maxsize=8)
def _stop_ids(path: str) -> tuple[int, ...]:
    return read_stop_ids(path, HFConfigError)


@functools.lru_cache(maxsize=4)
def _adapter(path: str, base: GPT2LM | LlamaLM) -> dict:
    return read_adapter(path, base)


def _lora_pairs(lora: Any) -> tuple | None:
    """``lora`` as sorted ``(key, value)`` pairs (hashable), from a dict or pairs; None (no
    LoRA) from None or an empty dict, list or tuple: a run's config.yaml writes None back
    as ``null``, which it reads as None."""
    if lora is None or (isinstance(lora, dict | list | tuple) and not lora):
        return None
    items = dict(lora) if not isinstance(lora, dict) else lora
    unknown = sorted(set(items) - set(_LORA_KEYS))
    if unknown:
        raise ValueError(f"lora: unknown key {unknown[0]!r}; keys: {', '.join(_LORA_KEYS)}")
    dropout = items.get("dropout", 0.0)
    check_rate("lora", "dropout", dropout)
    if "path" in items:  # a peft adapter: its config gives rank, alpha and targets
        given = [k for k in ("rank", "alpha", "targets") if k in items]
        if given:
            raise ValueError(
                f"lora: path {items['path']!r} is a peft adapter directory whose "
                f"adapter_config.json gives rank, alpha and targets; leave out {given}"
            )
        if not isinstance(items["path"], str | os.PathLike):
            raise ValueError(f"lora: path must be a directory name, got {items['path']!r}")
        pairs = (("path", str(items["path"])),)
        return ((("dropout", float(dropout)),) if "dropout" in items else ()) + pairs
    targets = items.get("targets")
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f"lora: targets must be a non-empty list of globs over param paths "
            f"(e.g. ['*/attn/q', '*/attn/v']), got {targets!r}"
        )
    rank = items.get("rank", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora: rank must be a positive int, got {rank!r}")
    alpha = items.get("alpha", 16.0)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"lora: alpha must be a number, got {alpha!r}")
    pairs = (("alpha", float(alpha)), ("dropout", float(dropout)), ("rank", rank))
    return pairs + (("targets", tuple(targets)),)


_HASHED = ("config.json", "*.safetensors", "model.safetensors.index.json")


@functools.lru_cache(maxsize=8)
def _hash_files(files: tuple) -> str:
    h = hashlib.sha256()
    for name, path, _size, _mtime in files:
        h.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def content_hash(directory: str | os.PathLike) -> str:
    """sha256 of a model directory's ``config.json`` and weight files (names and bytes): what
    a LoRA checkpoint records of its base. Cached per file size and modification time, so
    a run hashes its base once."""
    d = Path(directory)
    found = sorted({p for pattern in _HASHED for p in d.glob(pattern) if p.is_file()})
    files = tuple((p.name, str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in found)
    return _hash_files(files)


def _read_adapter(adapter: str, base, lpath: str, i: int, pair) -> jax.Array:
    """Adapter weight ``i`` (0: A, 1: B) of projection ``lpath`` read by a host callback, as
    the base weights are: a value closed over in ``init`` would become a constant of every
    program that traces it (and XLA would fold it at each compile)."""
    shape = tuple(pair[i].shape)

    def host():
        return np.asarray(_adapter(adapter, base)["tensors"][lpath][i], np.float32)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(shape, jnp.float32))


class Pretrained(Module):
    """The model of a Hugging Face directory, for a trainer: ``init(key)`` gives its
    pretrained weights (and, with ``lora``, fresh adapters drawn from ``key``).

    Everything else is the underlying ``nl.hf.GPT2LM`` / ``nl.hf.LlamaLM`` (:attr:`model`):
    ``__call__``, ``param_axes``, ``generate``, ``decode_step``.

    Args:
        path: the model directory.
        lora: ``{"rank": 8, "alpha": 16, "targets": [globs], "dropout": 0.05}`` (dropout
            optional), or ``{"path": DIR}``: start from the peft adapter in ``DIR`` (its
            rank, alpha, targets and dropout; ``dropout`` may override); or None (or empty:
            full fine-tuning). With LoRA, a checkpoint holds the adapters only
            (:meth:`checkpointed`), and names the base by path and content hash.
        vocab_size: the data's vocabulary size, at most the model's (a trainer fills it).
        context: the training window, at most the model's positions (a trainer fills it).
        ignore_keys: config keys to pass over (see ``load_pretrained``).
        param_dtype: the dtype the frozen base weights are kept in: ``"float32"`` (the
            default), or with ``lora`` ``"bfloat16"`` / ``"float16"``, which halves the
            base's memory. The adapters stay float32. The model computes in float32 from
            the stored weights (each cast up inside the compiled program), or in the run's
            ``train.precision``.

    Example:
        >>> import tempfile, jax, nnlite as nl
        >>> d = tempfile.mkdtemp()
        >>> base = nl.hf.GPT2LM(vocab_size=20, context=8, n_layer=1, n_head=2, n_embd=4)
        >>> _ = nl.hf.save_pretrained(d, base, jax.jit(base.init)(jax.random.key(0)))
        >>> m = Pretrained(d, lora={"rank": 2, "targets": ["*/attn/qkv"]})
        >>> p = jax.jit(m.init)(jax.random.key(1))
        >>> p.blocks[0].attn.qkv.lora_a.shape
        (4, 2)
    """

    path: str
    lora: Any = None
    vocab_size: int | None = None
    context: int | None = None
    ignore_keys: tuple[str, ...] = ()
    param_dtype: str = "float32"

    task = "language_model"

    def __post_init__(self):
        object.__setattr__(self, "lora", _lora_pairs(self.lora))
        object.__setattr__(self, "path", str(self.path))
        if not isinstance(self.param_dtype, str) or self.param_dtype not in _STORED:
            raise ValueError(
                f"param_dtype={self.param_dtype!r}: expected one of {', '.join(_STORED)}"
            )
        if self.param_dtype != "float32" and not self.lora:
            raise ValueError(
                f"param_dtype={self.param_dtype!r} keeps the frozen base of a LoRA run in "
                "that dtype, but this model has no lora: full fine-tuning updates every "
                "weight, so they stay float32 (for a lower compute dtype: train.precision)"
            )
        super().__post_init__()
        model = self.model  # reads config.json: refuses what it cannot build
        if self.vocab_size is not None and not 0 < self.vocab_size <= model.vocab_size:
            raise ValueError(
                f"vocab_size={self.vocab_size}: the data's vocabulary must fit the model's "
                f"{model.vocab_size} tokens (prepare the text with the model's tokenizer)"
            )
        if self.context is not None and not 0 < self.context <= model.context:
            raise ValueError(
                f"context={self.context}: at most the model's {model.context} positions"
            )

    @property
    def base(self) -> GPT2LM | LlamaLM:
        """The directory's model without adapters."""
        return _base(self.path, tuple(self.ignore_keys))

    @property
    def model(self) -> GPT2LM | LlamaLM:
        """The model trained: the base with LoRA on the targets when ``lora`` is set."""
        if not self.lora:
            return self.base
        lora = dict(self.lora)
        if "path" in lora:
            ad = _adapter(lora["path"], self.base)
            dropout = lora.get("dropout", ad["dropout"])
            return self.base.with_lora(ad["targets"], ad["rank"], ad["alpha"], dropout)
        return self.base.with_lora(lora["targets"], lora["rank"], lora["alpha"], lora["dropout"])

    @property
    def uses_key(self) -> bool:
        return self.model.uses_key  # LoRA dropout

    @property
    def max_positions(self) -> int:
        """The model's positions (``context`` is the training window within them)."""
        return self.model.context

    def init(self, key: jax.Array) -> ParamsDict:
        """The directory's weights (in ``param_dtype``), each read by a host callback, plus
        fresh LoRA adapters (float32) from ``key``."""
        base = self.base
        family = family_of(base)
        like = jax.eval_shape(base.init, jax.random.key(0))
        path, stored = self.path, jnp.dtype(self.param_dtype)

        def read(name: str, transposed: bool, shape: tuple):
            def host():
                a = SafetensorsDir(path, ValueError).tensor(name)
                a = np.asarray(a.T if transposed else a, np.float32)
                if a.shape != shape:
                    raise ValueError(f"{path}: tensor {name!r} has shape {a.shape}, not {shape}")
                return a.astype(stored, copy=False)  # float32: no second copy

            return jax.pure_callback(host, jax.ShapeDtypeStruct(shape, stored))

        names = set(SafetensorsDir(path, ValueError).names())
        flat = {}
        for p, aval in like.items():
            name, transposed = hf_name(family, p)
            if name not in names and name.removeprefix("transformer.") in names:
                name = name.removeprefix("transformer.")
            flat[p] = read(name, transposed, tuple(aval.shape))
        params = ParamsDict.from_flat(flat)
        if not self.lora:
            return params
        model = self.model
        flat = dict(params.to_flat())
        if "path" in dict(self.lora):  # the peft adapter's weights, read as the base's are
            adapter = dict(self.lora)["path"]
            found = _adapter(adapter, self.base)["tensors"]
            for lpath, pair in found.items():
                for i, name in enumerate(("lora_a", "lora_b")):
                    flat[f"{lpath}/{name}"] = _read_adapter(adapter, self.base, lpath, i, pair)
            return ParamsDict.from_flat(flat)
        paths = sorted(model.lora_paths)
        for lpath, k in zip(paths, jax.random.split(key, len(paths)), strict=True):
            i = int(lpath.split("]")[0].split("[")[1])
            owner, child = lpath.split("/")[-2:]
            ad = getattr(model.block_at(i), owner).children[child].adapters(k)
            flat[lpath + "/lora_a"], flat[lpath + "/lora_b"] = ad.lora_a, ad.lora_b
        return ParamsDict.from_flat(flat)

    def param_axes(self) -> ParamsDict:
        return self.model.param_axes()

    def computed(self, params: ParamsDict) -> ParamsDict:
        """``params`` as the model computes with them: a base kept in a lower
        ``param_dtype`` cast up to float32. Unchanged in ``nl.precision``'s scope (a run's
        ``train.precision``), whose policy has cast every param to its compute dtype
        already."""
        low = jnp.dtype(self.param_dtype)
        if low == jnp.float32 or precision_dtype() is not None:
            return params
        return jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == low else a, params)

    def trainable(self, params):
        """Which params training updates: with ``lora`` the adapters only (``nl.lora_mask``;
        the trainer then neither differentiates nor keeps optimizer state for the rest),
        else None (all of them)."""
        return lora_mask(params) if self.lora else None

    def wrap_optimizer(self, optimizer):
        """With ``lora``: ``optimizer`` on the adapters only (``nl.freeze_base``), the base
        weights frozen with no optimizer state; without, ``optimizer`` itself."""
        return freeze_base(optimizer) if self.lora else optimizer

    def __call__(
        self,
        params: ParamsDict,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        key: jax.Array | None = None,
    ):
        return self.model(self.computed(params), tokens, segment_ids=segment_ids, key=key)

    def token_log_probs(
        self, params: ParamsDict, tokens, labels, *, segment_ids=None, key=None, chunk=None
    ):
        """The labels' log-probabilities, the head in chunks (the decoder's
        ``token_log_probs``; ``segment_ids``: packed documents): what the trainer's loss
        differentiates."""
        return self.model.token_log_probs(
            self.computed(params), tokens, labels, segment_ids=segment_ids, key=key, chunk=chunk
        )

    # -- checkpoints of a LoRA run: the adapters, and the base named by path and hash ---------
    def checkpointed(self, params):
        """Which params a checkpoint holds (a tree of bools; None: all): with ``lora`` the
        adapters only; the base is read again from :attr:`path` when the run is loaded."""
        return lora_mask(params) if self.lora else None

    def checkpoint_metadata(self) -> dict[str, str]:
        """What a LoRA checkpoint records of its base: its directory and content hash."""
        if not self.lora:
            return {}
        return {"base_model": self.path, "base_sha256": content_hash(self.path)}

    def check_checkpoint(self, meta: dict[str, str], where: str) -> None:
        """Refuse (one line) a LoRA checkpoint whose base has changed since it was written."""
        saved = meta.get("base_sha256")
        if not self.lora or saved is None:
            return
        now = content_hash(self.path)
        if now != saved:
            raise ValueError(
                f"{where}: its adapters were trained on the base model {meta.get('base_model')} "
                f"with content hash {saved[:12]}..., but {self.path} now hashes to {now[:12]}...; "
                "the base changed: restore the original base directory"
            )

    def decode_step(self, params, cache, tokens, pos, **kw):
        return self.model.decode_step(self.computed(params), cache, tokens, pos, **kw)

    def empty_cache(self, batch: int, length: int, dtype: Any = jnp.float32):
        return self.model.empty_cache(batch, length, dtype)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The directory's end-of-text ids (``nl.hf.stop_ids``): ``generate`` stops there."""
        return _stop_ids(self.path)

    def generate(
        self, params, prompt, n_tokens: int, key, temperature=1.0, top_k=None, top_p=None, **kw
    ):
        """``prompt [batch, P]`` and ``n_tokens`` sampled tokens (``nl.hf.generate``),
        stopping at the directory's end-of-text ids unless ``stop_ids`` says otherwise."""
        kw.setdefault("stop_ids", self.stop_ids)
        model, params = self.model, self.computed(params)  # load_pretrained's programs
        return generate(model, params, prompt, n_tokens, key, temperature, top_k, top_p, **kw)

    def generate_stream(self, params, prompt, n_tokens: int, key, *args, **kw):
        """``nl.hf.generate_stream``: the new tokens ``[batch]`` of each step as they come."""
        kw.setdefault("stop_ids", self.stop_ids)
        params = self.computed(params)
        return generate_stream(self.model, params, prompt, n_tokens, key, *args, **kw)

    def export(self, directory, params: ParamsDict, tokenizer: Any = None, **kwargs):
        """``nl.hf.save_pretrained`` of the trained params (adapters merged), with this
        directory's token ids."""
        from ._convert import save_pretrained

        kwargs.setdefault("source", self.path)
        return save_pretrained(directory, self.model, self.computed(params), tokenizer, **kwargs)
