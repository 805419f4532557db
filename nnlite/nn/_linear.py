"""Dense layers and composition: Linear, FFN, SoftmaxHead, Activation, Sequential."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..core._axes import Axes
from ..core._gemm import matmul, on_mkl
from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ..grad._small_rules import log_softmax, softmax
from ._names import get_activation, get_initializer

__all__ = [
    "Activation",
    "FFN",
    "Linear",
    "Sequential",
    "SoftmaxHead",
    "linear",
    "linear_axes",
    "linear_vjp",
]


def rows_matmul(x: jax.Array, W: jax.Array, *, transpose_w: bool = False) -> jax.Array:
    """``x @ W`` (``x @ W.T`` where ``transpose_w``) for ``x: [..., in]``, as one 2-D product
    over the rows ``x.reshape(-1, in)``, through ``nl.matmul`` (MKL on the CPU where it is
    installed). The same numbers as ``x @ W``; what changes is autodiff's transpose: ``dW``
    becomes ``x2^T dy2``, a 2-D product, where through a 3-D ``x`` it contracts two axes at
    once, which XLA:CPU lowered by writing ``dy`` transposed in the fusion that produced it
    (the 135M Llama's ``jax.grad`` step: 7.34 -> 6.53 s, benchmarks/README.md)."""
    if x.ndim < 2:
        return x @ (W.T if transpose_w else W)
    return matmul(x, W, transpose_b=transpose_w)


def linear_vjp(x: jax.Array, W: jax.Array, b: jax.Array | None, dret: jax.Array):
    """Hand rule of ``linear``: ``(dx, dW, db) = (dy W^T, x^T dy, sum dy)``, the weight and
    bias cotangents contracted over every leading (batch) axis in one matmul."""
    dx = rows_matmul(dret, W, transpose_w=True)
    dy2 = dret.reshape(-1, W.shape[1])
    x2 = x.reshape(-1, W.shape[0])
    if b is None:
        return dx, matmul(x2, dy2, transpose_a=True), None
    dW, db = weight_and_bias_grads(x2, dy2)
    return dx, dW, db.astype(b.dtype)


def weight_and_bias_grads(x2: jax.Array, dy2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x2^T dy2, sum(dy2, rows))`` for ``x2: [rows, in]``, ``dy2: [rows, out]``.

    Where MKL runs the product and ``out > in``, both come from one product: ``[x2, 1]^T
    dy2``, ``x2`` with a column of ones appended, whose last row is the bias's. Its price
    is a copy of ``x2``; what it saves is XLA's separate reduction over the rows of the
    wider ``dy2``, which XLA:CPU runs beside the products that read the same ``dy2``,
    slowing them (the 6x6x384 GPT's MLP: its two backward products and the reduction took
    252 ms a layer, PyTorch's 140; benchmarks/README.md, session 17)."""
    if dy2.shape[1] > x2.shape[1] and on_mkl(x2, dy2, transpose_a=True):
        ones = jnp.ones((x2.shape[0], 1), x2.dtype)
        both = matmul(jnp.concatenate([x2, ones], axis=1), dy2, transpose_a=True)
        return both[:-1], both[-1]
    return matmul(x2, dy2, transpose_a=True), jnp.sum(dy2, axis=0)


@hand_rule(linear_vjp)
def linear(x: jax.Array, W: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ W + b`` for ``x: [..., in]``, ``W: [in, out]``, ``b: [out]`` (or None)."""
    y = rows_matmul(x, W)
    if b is None:
        return y
    # Broadcast explicitly: y + b is a rank promotion, an error under the strict
    # jax_numpy_rank_promotion="raise" the project runs with.
    return y + jnp.broadcast_to(b, y.shape)


class Linear(Module):
    """``y = x @ W + b`` with ``W: [in_features, out_features]`` (Equinox ``eqx.nn.Linear``,
    Flax ``nn.Dense``).

    Initialisers (as Flax): ``W`` LeCun normal (variance ``1 / in_features``), ``b`` zeros.

    Args:
        in_features: size of the input's last axis.
        out_features: size of the output's last axis.
        use_bias: whether to add ``b: [out_features]``.
        w_init, b_init: initializer names (see ``nnlite.INITIALIZERS``).
        param_dtype: dtype of ``W`` and ``b``.
        dtype: compute dtype; ``None`` computes in the dtype input and params promote to.
            ``"bfloat16"`` with float32 params casts both to bf16 inside the call.

    ``__call__(params, x)``: ``x: [..., in_features]`` (any leading axes, or none) ->
    ``[..., out_features]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> layer = Linear(5, 7)
        >>> p = layer.init(jax.random.key(0))
        >>> p.print()
        /W: f32[5,7]
        /b: f32[7]
        >>> layer(p, jnp.ones((3, 5))).shape
        (3, 7)
    """

    in_features: int
    out_features: int
    use_bias: bool = True
    w_init: str = "lecun_normal"
    b_init: str = "zeros"
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("in_features", "out_features")
        self._check_dtypes()
        get_initializer(self.w_init)
        get_initializer(self.b_init)

    def init(self, key: jax.Array) -> ParamsDict:
        p = ParamsDict()
        shape = (self.in_features, self.out_features)
        p.W = get_initializer(self.w_init)(key, shape, self.param_dtype)
        if self.use_bias:
            # A key of its own: with the same key, b would repeat W's first row up to scale.
            b_key = jax.random.fold_in(key, 1)
            p.b = get_initializer(self.b_init)(b_key, (self.out_features,), self.param_dtype)
        return p

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"W": (self.in_features, self.out_features)}
        if self.use_bias:
            shapes["b"] = (self.out_features,)
        return shapes

    def param_axes(self) -> ParamsDict:
        """``W: ("in", "out")``, ``b: ("out",)``; a parent layer that knows this Linear's
        role renames them (:func:`linear_axes`)."""
        return linear_axes(self, "in", "out")

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        self.check_input(x, self.in_features)
        self.check_params(params)
        arrays = [params["W"], params["b"]] if self.use_bias else [params["W"]]
        dtype = self.compute_dtype(x, *arrays)
        return linear(x.astype(dtype), *(a.astype(dtype) for a in arrays))


def linear_axes(layer: Linear, in_name: str | None, out_name: str | None) -> ParamsDict:
    """The logical axes of ``layer``'s params with its input and output dimensions named
    ``in_name`` and ``out_name``: ``W: (in, out)``, ``b: (out,)``. Megatron's
    column-parallel Linear is ``linear_axes(l, "embed", "mlp")``, row-parallel
    ``linear_axes(l, "mlp", "embed")``."""
    p = ParamsDict(W=Axes((in_name, out_name)))
    if layer.use_bias:
        p.b = Axes((out_name,))
    return p


class Activation(Module):
    """An activation function as a parameter-free module, for ``Sequential`` (Equinox:
    ``eqx.nn.Lambda``).

    Args:
        name: activation name (see ``nnlite.ACTIVATIONS``: relu, gelu, tanh, ...).

    ``__call__(x)``: any ``x`` -> same shape. No params.

    Example:
        >>> import jax.numpy as jnp
        >>> Activation("relu")(jnp.array([-1.0, 2.0])).tolist()
        [0.0, 2.0]
    """

    name: str = "relu"

    has_params = False

    def __post_init__(self):
        super().__post_init__()
        get_activation(self.name)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None):
        return get_activation(self.name)(x)


class FFN(Module):
    """Multi-layer perceptron: Linear layers with ``activation`` between them.

    ``FFN(64, (32, 16), 10)`` is ``Linear(64,32) -> act -> Linear(32,16) -> act -> Linear(16,10)``.
    Its parameters are ``/layers[i]/W`` and ``/layers[i]/b``.

    Args:
        in_features: input size.
        hidden_sizes: sizes of the hidden layers (may be empty: then one Linear).
        out_features: output size.
        activation: name of the activation between layers (see ``nnlite.ACTIVATIONS``).
        activate_final: also apply the activation after the last layer.
        w_init: initializer of every weight; ``None`` picks ``he_normal`` for relu-like
            activations and ``lecun_normal`` otherwise. Biases start at zero.
        param_dtype, dtype: parameter and compute dtypes, as in ``Linear``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> ffn = FFN(4, (8,), 2)
        >>> p = ffn.init(jax.random.key(0))
        >>> p.print()
        /layers[0]/W: f32[4,8]
        /layers[0]/b: f32[8]
        /layers[1]/W: f32[8,2]
        /layers[1]/b: f32[2]
        >>> ffn(p, jnp.ones((3, 4))).shape
        (3, 2)
    """

    in_features: int
    hidden_sizes: tuple[int, ...]
    out_features: int
    activation: str = "relu"
    activate_final: bool = False
    w_init: str | None = None
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.hidden_sizes, int):
            object.__setattr__(self, "hidden_sizes", (self.hidden_sizes,))
        self._check_positive_ints("in_features", "out_features")
        if self.hidden_sizes:
            self._check_positive_ints("hidden_sizes")
        self._check_dtypes()
        get_activation(self.activation)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.in_features, *self.hidden_sizes, self.out_features)

    def setup(self):  # the children: init is derived from them (key split per layer)
        relu_like = self.activation in ("relu", "gelu", "silu", "leaky_relu", "elu")
        w_init = self.w_init or ("he_normal" if relu_like else "lecun_normal")
        s = self.sizes
        pairs = zip(s[:-1], s[1:], strict=True)
        dtypes = {"param_dtype": self.param_dtype, "dtype": self.dtype}
        self.layers = tuple(Linear(a, b, w_init=w_init, **dtypes) for a, b in pairs)

    def param_axes(self) -> ParamsDict:
        """Megatron's pairs: even layers column-parallel (``("embed", "mlp")``), odd layers
        row-parallel (``("mlp", "embed")``), so a hidden activation is split across the
        tensor axis between the two layers of a pair and whole after it."""
        names = ("embed", "mlp")
        return ParamsDict(
            layers=[
                linear_axes(layer, *(names if i % 2 == 0 else names[::-1]))
                for i, layer in enumerate(self.layers)
            ]
        )

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        self.check_input(x, self.in_features)
        act = get_activation(self.activation)
        layers = self.layers
        layer_params = self.child(params, "layers")
        if len(layer_params) != len(layers):
            raise ValueError(
                f"{self._short_repr()}: params have {len(layer_params)} layers, "
                f"the module has {len(layers)} (sizes {self.sizes})"
            )
        for i, (layer, p) in enumerate(zip(layers, layer_params, strict=True)):
            with self.params_scope(f"/layers[{i}]"):
                x = layer(p, x)
            if i < len(layers) - 1 or self.activate_final:
                x = act(x)
        return x


_HEAD_OUTPUTS: dict[str, Callable] = {
    # Both carry their rule (nnlite.rules.log_softmax_vjp, softmax_vjp).
    "log_softmax": log_softmax,
    "softmax": functools.partial(softmax, axis=-1),
    "logits": lambda z: z,
}


class SoftmaxHead(Module):
    """Classification head: a Linear layer to ``num_classes`` logits, then (log-)softmax.

    Args:
        in_features: input size.
        num_classes: number of classes.
        output: ``"log_softmax"`` (default), ``"softmax"`` or ``"logits"``.
        w_init: initializer of ``W`` (``b`` starts at zero).
        param_dtype, dtype: parameter and compute dtypes, as in ``Linear``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> head = SoftmaxHead(4, 3, output="softmax")
        >>> p = head.init(jax.random.key(0))
        >>> float(head(p, jnp.ones((2, 4))).sum())
        2.0
    """

    in_features: int
    num_classes: int
    output: str = "log_softmax"
    w_init: str = "lecun_normal"
    param_dtype: str = "float32"
    dtype: str | None = None

    params_of = "linear"  # the head's params are its Linear's: /W, /b

    def __post_init__(self):
        super().__post_init__()
        if self.output not in _HEAD_OUTPUTS:
            raise ValueError(
                f"SoftmaxHead: unknown output {self.output!r}; valid: {', '.join(_HEAD_OUTPUTS)}"
            )

    def setup(self):  # the child (building it checks the sizes, dtypes and initializer)
        dtypes = {"param_dtype": self.param_dtype, "dtype": self.dtype}
        self.linear = Linear(self.in_features, self.num_classes, w_init=self.w_init, **dtypes)

    def logits(self, params: ParamsDict, x: jax.Array) -> jax.Array:
        """The pre-softmax scores, ``[..., num_classes]``."""
        self.check_input(x, self.in_features)
        with self.params_scope(""):
            return self.linear(params, x)

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        return _HEAD_OUTPUTS[self.output](self.logits(params, x))


class Sequential(Module):
    """Apply ``layers`` in order (Equinox ``eqx.nn.Sequential``, Flax ``nn.Sequential``);
    parameters are ``/layers[i]/...`` (a parameter-free layer holds an empty ParamsDict).

    Args:
        layers: nnlite modules, each called as ``layer(params, x, key=k)``.

    ``__call__(params, x, *, key=None)``: the output of the last layer. With a key, it is
    split once per layer (``jax.random.split``), so dropout layers get independent masks;
    ``key=None`` passes ``None`` to every layer (inference).

    With a ``BatchNorm`` among the layers it is stateful: ``init_state()`` is derived
    (``/layers[i]/mean``, ...) and ``y, state = net(params, x, state=state, train=True)``
    hands each stateful layer its state.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> net = Sequential((Linear(4, 8), Activation("tanh"), SoftmaxHead(8, 3)))
        >>> p = net.init(jax.random.key(0))
        >>> net(p, jnp.ones((2, 4))).shape
        (2, 3)
    """

    layers: tuple[Module, ...]

    def __post_init__(self):
        super().__post_init__()
        if not self.layers:
            raise ValueError("Sequential: layers is empty; give at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, Module):
                raise TypeError(
                    f"Sequential: layers[{i}] must be an nnlite Module, got {type(layer).__name__}"
                )

    def _args_repr(self) -> str:
        return f"Sequential({len(self.layers)} layers)"

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        if not any(layer.has_params for layer in self.layers) and "layers" not in (params or {}):
            params = ParamsDict(layers=[ParamsDict()] * len(self.layers))  # nothing to nest
        layer_params = self.child(params, "layers")
        if len(layer_params) != len(self.layers):
            raise ValueError(
                f"Sequential: params have {len(layer_params)} layers, "
                f"the module has {len(self.layers)}"
            )
        n = len(self.layers)
        keys = [None] * n if key is None else list(jax.random.split(key, n))
        for i, (layer, p, k) in enumerate(zip(self.layers, layer_params, keys, strict=True)):
            with self.params_scope(f"/layers[{i}]"):
                x = layer(p, x, key=k)
        return x
