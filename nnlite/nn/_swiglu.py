"""The MLPs of the transformer block: the plain one, ``proj(act(fc(x)))`` (GPT-2), and the
gated ones (Shazeer 2020), SwiGLU (Llama, Mistral, Qwen) ``down(silu(gate(x)) * up(x))`` and
GeGLU (Gemma) with GELU's tanh form in silu's place, with the gating products' hand rules;
and the projections inside a bigger layer (these and the attention's), LoRA-wrapped where
its ``lora`` names them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ..grad._small_rules import gelu_grad
from ._dropout import dropout
from ._linear import Linear
from ._lora import LoRA, adapter_axes, split_key, wrap
from ._names import get_activation

__all__ = ["MLP", "SwiGLU", "geglu", "geglu_vjp", "projection", "swiglu", "swiglu_vjp"]


def projection(owner: Module, name: str, n_in: int, n_out: int, use_bias: bool) -> Linear | LoRA:
    """The projection ``name`` of a bigger layer (an MLP's, the attention's): a ``Linear``
    with ``owner``'s ``w_init`` and dtypes, in ``nl.LoRA`` when ``owner.lora`` names it."""
    lin = Linear(
        n_in,
        n_out,
        use_bias=use_bias,
        w_init=owner.w_init,
        param_dtype=owner.param_dtype,
        dtype=owner.dtype,
    )
    return wrap(lin, name in owner.lora, owner.lora_rank, owner.lora_alpha, owner.lora_dropout)


def project(owner: Module, params, name: str, x: jax.Array, key=None) -> jax.Array:
    """``owner``'s projection ``name`` on ``x`` (a ``key``: LoRA dropout in training); a
    params mismatch is reported with its path inside ``owner``."""
    layer, p = owner.children[name], owner.child(params, name)
    with owner.params_scope(f"/{name}"):
        return layer(p, x) if key is None else layer(p, x, key=key)


def swiglu_vjp(gate, up, dret):
    """Hand rule of ``swiglu``: ``d gate = dy * up * silu'(gate)``, ``d up = dy * silu(gate)``,
    with ``silu'(g) = s (1 + g (1 - s))`` and ``s = sigmoid(g)``."""
    s = jax.nn.sigmoid(gate)
    return dret * up * s * (1 + gate * (1 - s)), dret * gate * s


@hand_rule(swiglu_vjp)
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, elementwise (same shapes).

    Example:
        >>> import jax.numpy as jnp
        >>> [round(v, 4) for v in swiglu(jnp.array([0.0, 2.0]), jnp.array([3.0, 1.0])).tolist()]
        [0.0, 1.7616]
    """
    return jax.nn.silu(gate) * up


def geglu_vjp(gate, up, dret):
    """Hand rule of ``geglu``: ``d gate = dy * up * gelu'(gate)``, ``d up = dy * gelu(gate)``
    (GELU's tanh form and its derivative, as ``nl.rules.gelu``)."""
    return dret * up * gelu_grad(gate), dret * jax.nn.gelu(gate, approximate=True)


@hand_rule(geglu_vjp)
def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``gelu(gate) * up`` elementwise, GELU's tanh approximation (``gelu_pytorch_tanh``).

    Example:
        >>> import jax.numpy as jnp
        >>> [round(v, 4) for v in geglu(jnp.array([0.0, 2.0]), jnp.array([3.0, 1.0])).tolist()]
        [0.0, 1.9546]
    """
    return jax.nn.gelu(gate, approximate=True) * up


class MLP(Module):
    """The plain MLP: ``fc`` (``features -> hidden``), activation, ``proj`` (``hidden ->
    features``), dropout (as nanoGPT). Params ``/fc/{W,b}``, ``/proj/{W,b}``; ``lora`` names
    the projections wrapped in ``nl.LoRA`` (``"fc"``, ``"proj"``)."""

    features: int
    hidden: int
    activation: str = "gelu"
    dropout_rate: float = 0.0
    use_bias: bool = True
    w_init: str = "lecun_normal"
    param_dtype: str = "float32"
    dtype: str | None = None
    lora: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        for name in self.lora:
            if name not in ("fc", "proj"):
                raise ValueError(
                    f"MLP: lora names {name!r}, not a projection of this layer; valid: fc, proj"
                )

    def setup(self):
        self.fc = projection(self, "fc", self.features, self.hidden, self.use_bias)
        self.proj = projection(self, "proj", self.hidden, self.features, self.use_bias)

    @property
    def uses_key(self) -> bool:
        """A key turns dropout on: the MLP's, or a LoRA adapter's."""
        return self.dropout_rate > 0 or super().uses_key

    @property
    def children(self) -> dict[str, Linear | LoRA]:
        """The projections by param name."""
        return {"fc": self.fc, "proj": self.proj}

    def param_axes(self) -> ParamsDict:
        """Megatron's MLP: ``fc`` column-parallel, ``proj`` row-parallel."""
        return ParamsDict(
            fc=adapter_axes(self.fc, "embed", "mlp"), proj=adapter_axes(self.proj, "mlp", "embed")
        )

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        lora_keys = self.lora and self.lora_dropout > 0
        k_fc, k_proj = split_key(key if lora_keys else None, 2)  # LoRA dropout in training
        h = get_activation(self.activation)(project(self, params, "fc", x, k_fc))
        return dropout(project(self, params, "proj", h, k_proj), key, self.dropout_rate)


#: ``activation`` -> the gating product: silu is SwiGLU, gelu (tanh form) GeGLU.
_GATES = {"silu": swiglu, "gelu": geglu}


class SwiGLU(Module):
    """Gated MLP: ``down(silu(gate(x)) * up(x))`` (the feed-forward of Llama, Mistral, Qwen2,
    SmolLM; Flax and Equinox have none), ``gate`` and ``up`` ``features -> hidden``, ``down``
    ``hidden -> features``; with ``activation="gelu"`` GeGLU, Gemma's, ``gelu(gate(x)) *
    up(x)`` (GELU's tanh form).

    Args:
        features: model width.
        hidden: the gated hidden width (``intermediate_size``).
        use_bias: biases on the three projections (Llama's ``mlp_bias``).
        activation: the gate's activation, ``"silu"`` (SwiGLU) or ``"gelu"`` (GeGLU).
        lora: projections wrapped in ``nl.LoRA`` (``"gate"``, ``"up"``, ``"down"``), with
            ``lora_rank``, ``lora_alpha`` and ``lora_dropout``.
        w_init, param_dtype, dtype: as ``nl.Linear``.

    Params: ``/gate``, ``/up``, ``/down``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mlp = SwiGLU(8, 24)
        >>> p = jax.jit(mlp.init)(jax.random.key(0))
        >>> [(k, v.shape) for k, v in p.items()]
        [('/gate/W', (8, 24)), ('/up/W', (8, 24)), ('/down/W', (24, 8))]
        >>> jax.jit(mlp)(p, jnp.ones((2, 3, 8))).shape
        (2, 3, 8)
    """

    features: int
    hidden: int
    use_bias: bool = False
    activation: str = "silu"
    lora: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    w_init: str = "lecun_normal"
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("features", "hidden")
        if self.activation not in _GATES:
            raise ValueError(
                f"SwiGLU: activation {self.activation!r} is not one of {', '.join(_GATES)}"
            )
        for name in self.lora:
            if name not in ("gate", "up", "down"):
                raise ValueError(
                    f"SwiGLU: lora names {name!r}, not a projection of this layer; valid: "
                    "gate, up, down"
                )

    def setup(self):
        self.gate = projection(self, "gate", self.features, self.hidden, self.use_bias)
        self.up = projection(self, "up", self.features, self.hidden, self.use_bias)
        self.down = projection(self, "down", self.hidden, self.features, self.use_bias)

    @property
    def children(self) -> dict[str, Linear | LoRA]:
        """The projections by param name."""
        return {"gate": self.gate, "up": self.up, "down": self.down}

    def param_axes(self) -> ParamsDict:
        """Megatron's MLP: ``gate`` and ``up`` column-parallel, ``down`` row-parallel."""
        return ParamsDict(
            gate=adapter_axes(self.gate, "embed", "mlp"),
            up=adapter_axes(self.up, "embed", "mlp"),
            down=adapter_axes(self.down, "mlp", "embed"),
        )

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        self.check_input(x, self.features)
        k_gate, k_up, k_down = split_key(key, 3)
        gate, up = project(self, params, "gate", x, k_gate), project(self, params, "up", x, k_up)
        gated = _GATES[self.activation](gate, up).astype(jnp.result_type(up))
        return project(self, params, "down", gated, k_down)
