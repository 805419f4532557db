"""``loss.name: dpo``: direct preference optimisation (Rafailov et al. 2023) of a language
model on preference pairs (``data.name: chat`` with ``{"prompt", "chosen", "rejected"}``
lines, train/data/chat.py).

Each row is a pair ``x [2, 2, T]`` (chosen, rejected; tokens, segment ids) with targets
``y [2, T]`` on the completion's tokens only. ``pi_c``, ``pi_r`` are the model's summed
log-probabilities of the chosen and rejected completions, ``ref_c``, ``ref_r`` the reference
model's, and the loss is ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``,
averaged over the pairs. The reference is frozen: the base model with its LoRA adapters
left out (a LoRA run; no copy of the weights), the directory ``loss.reference`` names, or
else the model's own directory as it was before training (its weights read once and held
beside the step's as constants).

Logged beside the loss, as trl names them: ``rewards_chosen`` ``beta (pi_c - ref_c)``,
``rewards_rejected``, ``reward_margin`` (their difference), ``reward_accuracy`` (the share
of pairs whose chosen reward is higher), ``logp_chosen``, ``logp_rejected``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

import nnlite as nl

from ..errors import ConfigError
from .contract import call, masked_token_loss


def sequence_logp(logits: jax.Array, y: jax.Array) -> jax.Array:
    """``[batch]`` summed log-probabilities of the targets ``y >= 0`` (``y < 0``: none)."""
    ce, _ = masked_token_loss(logits, y)
    return -jnp.sum(ce, axis=-1)


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float) -> tuple[jax.Array, dict]:
    """Per-pair DPO loss ``-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))`` and its
    metrics (module docstring), each ``[batch]``."""
    chosen, rejected = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    # -log sigmoid(m) = softplus(-m), by nnlite's softplus: its hand rule is exact at m = 0
    # (where every run starts: the policy is its reference), where the manual rule of
    # jax.nn.log_sigmoid's logaddexp gives no gradient
    loss = nl.softplus(-(chosen - rejected))
    metrics = {
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "reward_margin": chosen - rejected,
        "reward_accuracy": (chosen > rejected).astype(loss.dtype),
        "logp_chosen": pi_c,
        "logp_rejected": pi_r,
    }
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}


@functools.lru_cache(maxsize=2)
def _directory(path: str):
    """A reference directory's model and weights, read once, as concrete arrays (read
    while a step is traced, they are its constants)."""
    with jax.ensure_compile_time_eval():
        return nl.hf.load_pretrained(path)


def _without_adapters(params):
    """The params with the LoRA adapters left out (the base weights only)."""
    return nl.ParamsDict.from_flat(nl.lora_split(params)[1])


@dataclasses.dataclass(frozen=True)
class DPO:
    """``model`` trained by DPO: its ``objective`` and ``loss`` are DPO's on pair rows;
    everything else is ``model``'s (init, params, export, sampling).

    Args:
        model: the language model trained (an ``nl.hf.Pretrained``, or any language model
            that takes ``segment_ids=``).
        beta: the strength of the KL regularisation towards the reference.
        reference: a Hugging Face directory (None: the model's base, see the module
            docstring).
    """

    model: Any
    beta: float = 0.1
    reference: str | None = None

    task = "language_model"

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("model", "beta", "reference"):
            raise AttributeError(name)
        return getattr(self.model, name)

    def init(self, key):
        return self.model.init(key)

    def __call__(self, params, x, **kw):
        return self.model(params, x, **kw)

    def _logits(self, model, params, x):
        """``[2B, T, vocab]`` logits of pair rows ``x [B, 2, 2, T]``."""
        out = call(model, params, x)
        return out.reshape(-1, *out.shape[2:])

    def _reference_logits(self, params, x):
        """The frozen reference's logits: the base without adapters, or a directory's."""
        path = self.reference
        if path is None and not getattr(self.model, "lora", None):
            path = getattr(self.model, "path", None)
        if path is None:  # a LoRA run: the same base weights, the adapters left out
            base = getattr(self.model, "base", self.model)
            frozen = _without_adapters(params)
            if callable(getattr(self.model, "computed", None)):  # a base kept in bfloat16
                frozen = self.model.computed(frozen)
            return self._logits(base, frozen, x)
        model, ref = _directory(str(path))
        return self._logits(model, ref, x)

    def loss(self, params, x, y):
        """Per-pair DPO loss and metrics of pair rows ``x [B, 2, 2, T]``, ``y [B, 2, T]``."""
        if getattr(x, "ndim", 0) != 4:
            raise ValueError(
                f"loss.name=dpo: expected preference pairs x [batch, 2, 2, T], got shape "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
        b, t = x.shape[0], x.shape[-1]
        flat_y = y.reshape(b * 2, t)
        pi = sequence_logp(self._logits(self.model, params, x), flat_y).reshape(b, 2)
        ref_logits = jax.lax.stop_gradient(self._reference_logits(params, x))
        ref = sequence_logp(ref_logits, flat_y).reshape(b, 2)
        return dpo_loss(pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], self.beta)

    def objective(self, params, x, y):
        loss, metrics = self.loss(params, x, y)
        return jnp.mean(loss), {k: jnp.mean(v) for k, v in metrics.items()}


def with_loss(loss_cfg, model, data, where: str = "loss.name"):
    """``model`` with the objective ``loss.name`` names: itself (``task``: its task's loss)
    or wrapped in :class:`DPO`; one line when the data does not fit the loss."""
    pairs = getattr(data, "token_rows", None) is not None and data.x.ndim == 4
    if loss_cfg.name == "dpo":
        if not pairs:
            raise ConfigError(
                f"{where}=dpo trains on preference pairs: data.name: chat with "
                '{"prompt", "chosen", "rejected"} lines; data.name=' + f"{data.name} has none"
            )
        return DPO(model, loss_cfg.beta, loss_cfg.reference)
    if pairs:
        raise ConfigError(
            f"data.name={data.name} holds preference pairs (prompt, chosen, rejected), which "
            "train with loss.name: dpo"
        )
    return model
