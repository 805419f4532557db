"""Recurrent layers: GRUCell, LSTMCell (one step, PyTorch's gate order) and RNN (a cell
scanned over a sequence), each step and each scan with its hand rule.

A cell's step splits into the input projection ``x W + b`` (a Linear, batched over every
time step at once) and the recurrent update from ``h U``; the recurrent part's VJP
(``_gru_step_vjp``, ``_lstm_step_vjp``) is the heart of both rules. The one-step rule
(``gru_cell_vjp``) wraps it with the Linear's cotangents; the sequence rule
(``gru_scan_vjp``) recomputes the states with a forward ``lax.scan``, runs the step VJP in
a reverse ``lax.scan`` (backpropagation through time), and forms ``dW``, ``dU`` and the
biases' cotangents afterwards, each as one matmul over all time steps.

Why a rule for the whole scan rather than JAX transposing a scan of the cell's rule:
manual mode accepts a computation on the params only inside a hand rule (a
``custom_vjp``), and a ``lax.scan`` in the loss is itself a computation it would have to
look into; the scan's own rule keeps every step's backward pass hand-derived, and lets the
weight gradients be accumulated by one matmul each instead of one per step.

A rule returns one array (manual mode's plug-in takes one cotangent), so the LSTM's rules
stack ``h`` and ``c`` on an axis of 2 and the layers take them apart with ``subarray``, a
slice with its hand rule.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ._linear import rows_matmul
from ._names import get_initializer

__all__ = [
    "RNN",
    "GRUCell",
    "LSTMCell",
    "gru_cell",
    "gru_cell_vjp",
    "gru_scan",
    "gru_scan_vjp",
    "lstm_cell",
    "lstm_cell_vjp",
    "lstm_scan",
    "lstm_scan_vjp",
    "subarray",
    "subarray_vjp",
]


# --- helpers --------------------------------------------------------------------------------


def _bias(y: jax.Array, b: jax.Array | None) -> jax.Array:
    return y if b is None else y + jnp.broadcast_to(b, y.shape)


def _rows(a: jax.Array) -> jax.Array:
    """``a`` with every leading (batch, time) axis merged: ``[rows, last]``."""
    return a.reshape(-1, a.shape[-1])


def _outer(a: jax.Array, b: jax.Array) -> jax.Array:
    """``sum_rows a_r^T b_r``: a weight's cotangent over every batch and time axis."""
    return _rows(a).T @ _rows(b)


def _sum_rows(a: jax.Array) -> jax.Array:
    return jnp.sum(_rows(a), axis=0)


def _time_major(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, 0, 1)


def _state(s: jax.Array | None, x: jax.Array, U: jax.Array) -> jax.Array:
    """The state ``s``, or zeros ``[*x's batch axes, H]`` for ``None``: a fresh sequence's
    state made inside the rule (a constant, with no cotangent to return)."""
    return jnp.zeros((*x.shape[:-1], U.shape[0]), x.dtype) if s is None else s


def _given(ds: jax.Array, s: jax.Array | None) -> jax.Array | None:
    return None if s is None else ds


def subarray_vjp(y, dret, *, index):
    """Hand rule of ``subarray``: the cotangent put back in place, zeros elsewhere."""
    return jnp.zeros_like(y).at[index].set(dret)


@hand_rule(subarray_vjp)
def subarray(y: jax.Array, *, index: tuple) -> jax.Array:
    """``y[index]`` for a static basic index (ints, slices, ``...``): the LSTM's ``h`` and
    ``c``, or a sequence's last step, taken out of a rule's stacked result.

    Example:
        >>> import jax.numpy as jnp
        >>> subarray(jnp.arange(6.0).reshape(3, 2), index=(-1, slice(None))).tolist()
        [4.0, 5.0]
    """
    return y[index]


_H = (Ellipsis, 0, slice(None))  # [..., 2, H] -> h
_C = (Ellipsis, 1, slice(None))  # [..., 2, H] -> c


# --- GRU ------------------------------------------------------------------------------------
# PyTorch's GRU, gates (r, z, n), with gx = x W + b and hu = h U:
#   r = sigmoid(gx_r + hu_r), z = sigmoid(gx_z + hu_z), n = tanh(gx_n + r * (hu_n + b_n)),
#   h' = (1 - z) n + z h.
# b holds PyTorch's b_ih + b_hh for r and z and b_ih for n; b_n is b_hh for n (it sits
# inside r * (.), so it cannot merge into b).


def _gru_gates(gx, h, U, b_n):
    H = h.shape[-1]
    hu = h @ U
    hu_n = _bias(hu[..., 2 * H :], b_n)
    r = jax.nn.sigmoid(gx[..., :H] + hu[..., :H])
    z = jax.nn.sigmoid(gx[..., H : 2 * H] + hu[..., H : 2 * H])
    n = jnp.tanh(gx[..., 2 * H :] + r * hu_n)
    return r, z, n, hu_n


def _gru_step(gx, h, U, b_n):
    _, z, n, _ = _gru_gates(gx, h, U, b_n)
    return n + z * (h - n)


def _gru_step_vjp(gx, h, U, b_n, dh_new):
    """``(dgx, dh, dhu)``: cotangents of the input projection, the state, and ``h U`` (plus
    ``b_n`` on its n part), of one recurrent step."""
    r, z, n, hu_n = _gru_gates(gx, h, U, b_n)
    dn = dh_new * (1 - z)
    da_n = dn * (1 - n * n)  # through tanh
    da_r = da_n * hu_n * r * (1 - r)  # through r * hu_n, then sigmoid
    da_z = dh_new * (h - n) * z * (1 - z)
    dgx = jnp.concatenate([da_r, da_z, da_n], axis=-1)
    dhu = jnp.concatenate([da_r, da_z, da_n * r], axis=-1)
    dh = dh_new * z + dhu @ U.T
    return dgx, dh, dhu


def gru_cell_vjp(x, h, W, U, b=None, b_n=None, dret=None):
    """Hand rule of ``gru_cell``: ``(dx, dh, dW, dU, db, db_n)``: the recurrent step's rule,
    then the input projection's (a Linear's) cotangents."""
    H, h_in = U.shape[0], h
    h = _state(h, x, U)
    dgx, dh, dhu = _gru_step_vjp(_bias(x @ W, b), h, U, b_n, dret)
    db = None if b is None else _sum_rows(dgx)
    db_n = None if b_n is None else _sum_rows(dhu[..., 2 * H :])
    return dgx @ W.T, _given(dh, h_in), _outer(x, dgx), _outer(h, dhu), db, db_n


@hand_rule(gru_cell_vjp)
def gru_cell(x, h, W, U, b=None, b_n=None):
    """One GRU step: ``x: [..., in]``, ``h: [..., H]`` (``None``: zeros), ``W: [in, 3H]``,
    ``U: [H, 3H]``, ``b: [3H]``, ``b_n: [H]`` (or both None) -> the new ``h: [..., H]``."""
    return _gru_step(_bias(x @ W, b), _state(h, x, U), U, b_n)


def gru_scan_vjp(xs, h0, W, U, b=None, b_n=None, dret=None):
    """Hand rule of ``gru_scan``: backpropagation through time, the reverse scan of the
    step rule over states recomputed by a forward scan; ``(dxs, dh0, dW, dU, db, db_n)``."""
    H, h0_in = U.shape[0], h0
    h0 = _state(h0, xs[:, 0], U)
    gx = _time_major(_bias(rows_matmul(xs, W), b))  # [T, B, 3H]

    def forward(h, g):
        return _gru_step(g, h, U, b_n), h  # emit the state *before* the step

    _, h_prev = lax.scan(forward, h0, gx)

    def backward(dh, step):
        g, hp, dy = step
        dgx, dh_prev, dhu = _gru_step_vjp(g, hp, U, b_n, dh + dy)
        return dh_prev, (dgx, dhu)

    dh0, (dgx, dhu) = lax.scan(
        backward, jnp.zeros_like(h0), (gx, h_prev, _time_major(dret)), reverse=True
    )
    dgx_b = _time_major(dgx)
    db = None if b is None else _sum_rows(dgx)
    db_n = None if b_n is None else _sum_rows(dhu[..., 2 * H :])
    return dgx_b @ W.T, _given(dh0, h0_in), _outer(xs, dgx_b), _outer(h_prev, dhu), db, db_n


@hand_rule(gru_scan_vjp)
def gru_scan(xs, h0, W, U, b=None, b_n=None):
    """The GRU over a sequence: ``xs: [B, T, in]``, ``h0: [B, H]`` (``None``: zeros) ->
    every step's state ``[B, T, H]``. The input projection is one matmul for all steps;
    the scan does the recurrent part."""
    h0 = _state(h0, xs[:, 0], U)
    gx = _time_major(_bias(rows_matmul(xs, W), b))

    def step(h, g):
        h = _gru_step(g, h, U, b_n)
        return h, h

    return _time_major(lax.scan(step, h0, gx)[1])


# --- LSTM -----------------------------------------------------------------------------------
# PyTorch's LSTM, gates (i, f, g, o), with a = x W + b + h U (b = PyTorch's b_ih + b_hh):
#   i, f, o = sigmoid(a_i, a_f, a_o), g = tanh(a_g), c' = f c + i g, h' = o tanh(c').


def _lstm_gates(gx, h, U):
    H = h.shape[-1]
    a = gx + h @ U
    i = jax.nn.sigmoid(a[..., :H])
    f = jax.nn.sigmoid(a[..., H : 2 * H])
    g = jnp.tanh(a[..., 2 * H : 3 * H])
    o = jax.nn.sigmoid(a[..., 3 * H :])
    return i, f, g, o


def _lstm_step(gx, h, c, U):
    i, f, g, o = _lstm_gates(gx, h, U)
    c = f * c + i * g
    return o * jnp.tanh(c), c


def _lstm_step_vjp(gx, h, c, U, dh_new, dc_new):
    """``(da, dh, dc)``: cotangents of the gate pre-activations (of ``x W + b`` and of
    ``h U`` alike), the state ``h`` and the cell ``c``, of one recurrent step."""
    i, f, g, o = _lstm_gates(gx, h, U)
    tc = jnp.tanh(f * c + i * g)
    dc_total = dc_new + dh_new * o * (1 - tc * tc)
    da = jnp.concatenate(
        [
            dc_total * g * i * (1 - i),
            dc_total * c * f * (1 - f),
            dc_total * i * (1 - g * g),
            dh_new * tc * o * (1 - o),
        ],
        axis=-1,
    )
    return da, da @ U.T, dc_total * f


def _stack(h: jax.Array, c: jax.Array) -> jax.Array:
    return jnp.stack([h, c], axis=-2)


def lstm_cell_vjp(x, h, c, W, U, b=None, dret=None):
    """Hand rule of ``lstm_cell``: ``(dx, dh, dc, dW, dU, db)``: the recurrent step's rule
    on the stacked cotangent's ``h`` and ``c`` parts, then the input projection's."""
    h_in, c_in = h, c
    h, c = _state(h, x, U), _state(c, x, U)
    da, dh, dc = _lstm_step_vjp(_bias(x @ W, b), h, c, U, dret[_H], dret[_C])
    db = None if b is None else _sum_rows(da)
    dx, dW, dU = da @ W.T, _outer(x, da), _outer(h, da)
    return dx, _given(dh, h_in), _given(dc, c_in), dW, dU, db


@hand_rule(lstm_cell_vjp)
def lstm_cell(x, h, c, W, U, b=None):
    """One LSTM step: ``x: [..., in]``, ``h, c: [..., H]`` (``None``: zeros), ``W: [in,
    4H]``, ``U: [H, 4H]``, ``b: [4H]`` (or None) -> the new ``h`` and ``c`` stacked,
    ``[..., 2, H]``."""
    return _stack(*_lstm_step(_bias(x @ W, b), _state(h, x, U), _state(c, x, U), U))


def lstm_scan_vjp(xs, h0, c0, W, U, b=None, dret=None):
    """Hand rule of ``lstm_scan``: the reverse scan of the step rule over states recomputed
    by a forward scan; ``(dxs, dh0, dc0, dW, dU, db)``."""
    h0_in, c0_in = h0, c0
    h0, c0 = _state(h0, xs[:, 0], U), _state(c0, xs[:, 0], U)
    gx = _time_major(_bias(rows_matmul(xs, W), b))  # [T, B, 4H]

    def forward(hc, g):
        return _lstm_step(g, *hc, U), hc

    _, (h_prev, c_prev) = lax.scan(forward, (h0, c0), gx)

    def backward(dhc, step):
        g, hp, cp, dy = step
        da, dh, dc = _lstm_step_vjp(g, hp, cp, U, dhc[0] + dy[_H], dhc[1] + dy[_C])
        return (dh, dc), da

    zeros = (jnp.zeros_like(h0), jnp.zeros_like(c0))
    steps = (gx, h_prev, c_prev, _time_major(dret))
    (dh0, dc0), da = lax.scan(backward, zeros, steps, reverse=True)
    da_b = _time_major(da)
    db = None if b is None else _sum_rows(da)
    dxs, dW, dU = da_b @ W.T, _outer(xs, da_b), _outer(h_prev, da)
    return dxs, _given(dh0, h0_in), _given(dc0, c0_in), dW, dU, db


@hand_rule(lstm_scan_vjp)
def lstm_scan(xs, h0, c0, W, U, b=None):
    """The LSTM over a sequence: ``xs: [B, T, in]``, ``h0, c0: [B, H]`` (``None``: zeros)
    -> every step's ``h`` and ``c`` stacked, ``[B, T, 2, H]``."""
    h0, c0 = _state(h0, xs[:, 0], U), _state(c0, xs[:, 0], U)
    gx = _time_major(_bias(rows_matmul(xs, W), b))

    def step(hc, g):
        hc = _lstm_step(g, *hc, U)
        return hc, _stack(*hc)

    return _time_major(lax.scan(step, (h0, c0), gx)[1])


# --- the layers -----------------------------------------------------------------------------

_CELL_ARGS = """
    Args:
        in_features: size of the input's last axis.
        hidden_features: size of the state ``h`` (and ``c``).
        use_bias: whether to add the biases.
        w_init, u_init, b_init: initializer names (see ``nnlite.INITIALIZERS``) of the
            input weights, the recurrent weights (each gate's ``[H, H]`` block on its
            own) and the biases.
        param_dtype, dtype: parameter and compute dtypes, as in ``Linear``.
"""


class _Cell(Module):
    in_features: int
    hidden_features: int
    use_bias: bool = True
    w_init: str = "lecun_normal"
    u_init: str = "orthogonal"
    b_init: str = "zeros"
    param_dtype: str = "float32"
    dtype: str | None = None

    num_gates = 0  # a class constant, not a field

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("in_features", "hidden_features")
        self._check_dtypes()
        for name in (self.w_init, self.u_init, self.b_init):
            get_initializer(name)

    def _short_repr(self) -> str:
        return f"{type(self).__name__}({self.in_features}, {self.hidden_features})"

    _args_repr = _short_repr

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        H, G = self.hidden_features, self.num_gates
        shapes = {"W": (self.in_features, G * H), "U": (H, G * H)}
        if self.use_bias:
            shapes["b"] = (G * H,)
        return shapes

    def init(self, key: jax.Array) -> ParamsDict:
        H, G = self.hidden_features, self.num_gates
        k_w, k_u, k_b = jax.random.split(key, 3)
        shapes = self.param_shapes()
        p = ParamsDict(W=get_initializer(self.w_init)(k_w, shapes["W"], self.param_dtype))
        # One [H, H] block per gate, as Flax's cells (an orthogonal [H, G H] would only
        # have orthonormal rows).
        blocks = [
            get_initializer(self.u_init)(k, (H, H), self.param_dtype)
            for k in jax.random.split(k_u, G)
        ]
        p.U = jnp.concatenate(blocks, axis=1)
        biases = [name for name in shapes if name not in ("W", "U")]
        for i, name in enumerate(biases):
            b_key = jax.random.fold_in(k_b, i)
            p[name] = get_initializer(self.b_init)(b_key, shapes[name], self.param_dtype)
        return p

    def _arrays(self, params: ParamsDict) -> list[jax.Array | None]:
        self.check_params(params)
        biases = [n for n in self.param_shapes() if n not in ("W", "U")]
        return [params["W"], params["U"]] + (
            [params[n] for n in biases] if self.use_bias else [None] * self._num_biases
        )

    def _check_state(self, name: str, s: Any, batch: tuple[int, ...]) -> None:
        want = (*batch, self.hidden_features)
        if tuple(getattr(s, "shape", ())) != want:
            got = tuple(s.shape) if hasattr(s, "shape") else type(s).__name__
            raise ValueError(
                f"{self._short_repr()}: expected {name} of shape {want} (the input's batch "
                f"axes, then hidden_features), got {got}"
            )


class GRUCell(_Cell):
    __doc__ = (
        """One step of a gated recurrent unit, PyTorch's equations and gate order
    ``(r, z, n)`` (Flax ``nn.GRUCell``, Equinox ``eqx.nn.GRUCell``):
    with ``b = [b_r | b_z | b_in]``, ``r = sigmoid(x W_r + b_r + h U_r)``,
    ``z = sigmoid(x W_z + b_z + h U_z)``, ``n = tanh(x W_n + b_in + r * (h U_n + b_n))``,
    ``h' = (1 - z) n + z h``.

    Params: ``W: [in_features, 3H]`` (input weights, columns ``[r | z | n]``), ``U: [H, 3H]``
    (recurrent), ``b: [3H]`` and ``b_n: [H]`` (PyTorch's ``weight_ih.T``, ``weight_hh.T``,
    ``b_ih + b_hh`` with ``b_hh``'s n part in ``b_n``; Equinox's ``bias`` and ``bias_n``).
    Initialisers (as Flax): ``W`` LeCun normal, ``U`` orthogonal per gate, biases zeros.
"""
        + _CELL_ARGS
        + """
    ``__call__(params, x, h=None)``: ``x: [..., in_features]``, ``h: [..., H]`` (``None``:
    zeros) -> the new ``h``. ``RNN(GRUCell(...))`` runs it over a sequence.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> cell = GRUCell(3, 8)
        >>> p = jax.jit(cell.init)(jax.random.key(0))
        >>> p.print()
        /W: f32[3,24]
        /U: f32[8,24]
        /b: f32[24]
        /b_n: f32[8]
        >>> @jax.jit
        ... def two_steps(p, x):
        ...     h = cell(p, x)  # from h = 0
        ...     return cell(p, x, h)
        >>> two_steps(p, jnp.ones((4, 3))).shape
        (4, 8)
    """
    )

    num_gates = 3
    _num_biases = 2

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().param_shapes()
        if self.use_bias:
            shapes["b_n"] = (self.hidden_features,)
        return shapes

    def zero_carry(self, batch_shape: tuple[int, ...] = (), dtype: Any = None) -> jax.Array:
        """The initial state: zeros ``[*batch_shape, hidden_features]``."""
        return jnp.zeros((*batch_shape, self.hidden_features), dtype or self.param_dtype)

    def __call__(
        self, params: ParamsDict, x: jax.Array, h: jax.Array | None = None, *, key=None
    ) -> jax.Array:
        self.check_input(x, self.in_features)
        arrays = self._arrays(params)
        dtype = self.compute_dtype(x, *(a for a in arrays if a is not None))
        if h is not None:  # None: the rule starts from zeros itself
            self._check_state("h", h, x.shape[:-1])
            h = h.astype(dtype)
        return gru_cell(x.astype(dtype), h, *_cast(arrays, dtype))

    def scan(self, params: ParamsDict, xs: jax.Array, h0: jax.Array | None):
        """Over a sequence ``xs: [B, T, in_features]`` from ``h0: [B, H]`` (``None``:
        zeros): ``(h_T, hs)`` with ``hs: [B, T, H]`` every step's state (``RNN`` calls
        this)."""
        arrays = self._arrays(params)
        dtype = self.compute_dtype(xs, *(a for a in arrays if a is not None))
        h0 = None if h0 is None else h0.astype(dtype)
        hs = gru_scan(xs.astype(dtype), h0, *_cast(arrays, dtype))
        return subarray(hs, index=(slice(None), -1)), hs


class LSTMCell(_Cell):
    __doc__ = (
        """One step of a long short-term memory cell, PyTorch's equations and gate order
    ``(i, f, g, o)`` (Flax ``nn.LSTMCell``, Equinox ``eqx.nn.LSTMCell``): with
    ``a = x W + h U + b``, ``i, f, o = sigmoid(a_i, a_f, a_o)``, ``g = tanh(a_g)``,
    ``c' = f c + i g``, ``h' = o tanh(c')``. The carry is the pair ``(h, c)``.

    Params: ``W: [in_features, 4H]`` (columns ``[i | f | g | o]``), ``U: [H, 4H]``,
    ``b: [4H]`` (PyTorch's ``weight_ih.T``, ``weight_hh.T``, ``b_ih + b_hh``).
    Initialisers (as Flax): ``W`` LeCun normal, ``U`` orthogonal per gate, ``b`` zeros.
"""
        + _CELL_ARGS
        + """
    ``__call__(params, x, carry=None)``: ``x: [..., in_features]``, ``carry = (h, c)``, each
    ``[..., H]`` (``None``: zeros) -> the new ``(h, c)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> cell = LSTMCell(3, 8)
        >>> p = jax.jit(cell.init)(jax.random.key(0))
        >>> p.print()
        /W: f32[3,32]
        /U: f32[8,32]
        /b: f32[32]
        >>> @jax.jit
        ... def two_steps(p, x):
        ...     h, c = cell(p, x)  # from (h, c) = 0
        ...     return cell(p, x, (h, c))
        >>> h, c = two_steps(p, jnp.ones((4, 3)))
        >>> h.shape, c.shape
        ((4, 8), (4, 8))
    """
    )

    num_gates = 4
    _num_biases = 1

    def zero_carry(self, batch_shape: tuple[int, ...] = (), dtype: Any = None):
        """The initial ``(h, c)``: zeros ``[*batch_shape, hidden_features]`` each."""
        z = jnp.zeros((*batch_shape, self.hidden_features), dtype or self.param_dtype)
        return z, z

    def _check_carry(self, carry: Any, batch: tuple[int, ...]) -> None:
        if not (isinstance(carry, tuple | list) and len(carry) == 2):
            raise ValueError(
                f"{self._short_repr()}: the carry is the pair (h, c), got {type(carry).__name__}"
            )
        self._check_state("h", carry[0], batch)
        self._check_state("c", carry[1], batch)

    def __call__(self, params: ParamsDict, x: jax.Array, carry=None, *, key=None):
        self.check_input(x, self.in_features)
        arrays = self._arrays(params)
        dtype = self.compute_dtype(x, *(a for a in arrays if a is not None))
        h = c = None  # None: the rule starts from zeros itself
        if carry is not None:
            self._check_carry(carry, x.shape[:-1])
            h, c = (s.astype(dtype) for s in carry)
        hc = lstm_cell(x.astype(dtype), h, c, *_cast(arrays, dtype))
        return subarray(hc, index=_H), subarray(hc, index=_C)

    def scan(self, params: ParamsDict, xs: jax.Array, carry):
        """Over a sequence ``xs: [B, T, in_features]`` from ``carry = (h0, c0)``, each
        ``[B, H]`` (``None``: zeros): ``((h_T, c_T), hs)`` with ``hs: [B, T, H]`` (``RNN``
        calls this)."""
        arrays = self._arrays(params)
        dtype = self.compute_dtype(xs, *(a for a in arrays if a is not None))
        h0 = c0 = None
        if carry is not None:
            h0, c0 = (s.astype(dtype) for s in carry)
        hcs = lstm_scan(xs.astype(dtype), h0, c0, *_cast(arrays, dtype))
        last = (slice(None), -1, 0, slice(None)), (slice(None), -1, 1, slice(None))
        final = subarray(hcs, index=last[0]), subarray(hcs, index=last[1])
        return final, subarray(hcs, index=_H)


def _cast(arrays, dtype):
    return [None if a is None else a.astype(dtype) for a in arrays]


class RNN(Module):
    """A recurrent cell applied along a sequence with ``lax.scan`` (Flax ``nn.RNN``;
    Equinox: ``lax.scan`` over the cell by hand).

    ``RNN(GRUCell(in, H))`` maps ``x: [..., T, in]`` (any leading batch axes, or none) to
    every step's state ``[..., T, H]``; with ``return_carry=True`` it returns ``(carry,
    hs)``, the final carry first (as ``lax.scan`` and Flax), to continue a sequence or
    feed a decoder. The params are the cell's (``/W``, ``/U``, ...). The scan of a nnlite
    cell carries a hand rule (backpropagation through time by the cell's step rule), so
    manual-gradient mode covers it; another cell (any Module called as ``cell(params,
    x_t, carry)`` with a ``zero_carry``) is scanned plainly, for autodiff.

    Args:
        cell: the cell, e.g. ``GRUCell(in_features, hidden_features)`` or ``LSTMCell``.
        return_carry: also return the final carry.

    ``__call__(params, x, carry=None)``: ``carry`` the initial carry with the input's
    batch axes (``None``: the cell's zeros).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> rnn = RNN(LSTMCell(3, 8), return_carry=True)
        >>> p = jax.jit(rnn.init)(jax.random.key(0))
        >>> (h, c), hs = jax.jit(rnn)(p, jnp.ones((4, 10, 3)))  # batch 4, 10 steps
        >>> hs.shape, h.shape
        ((4, 10, 8), (4, 8))
        >>> bool(jnp.allclose(hs[:, -1], h))
        True
    """

    cell: Module
    return_carry: bool = False

    params_of = "cell"  # the params are the cell's: /W, /U, ...

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.cell, Module) or not hasattr(self.cell, "zero_carry"):
            raise TypeError(
                "RNN: cell must be an nnlite cell with zero_carry (GRUCell, LSTMCell, or "
                f"your own Module), got {type(self.cell).__name__}"
            )

    def _short_repr(self) -> str:
        cell = getattr(self.cell, "_short_repr", lambda: type(self.cell).__name__)()
        return f"RNN({cell})"

    _args_repr = _short_repr

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.cell.param_shapes()

    def __call__(self, params: ParamsDict, x: jax.Array, carry: Any = None, *, key=None):
        features = getattr(self.cell, "in_features", None)
        shape = getattr(x, "shape", None)
        if (
            shape is None
            or len(shape) < 2
            or shape[-2] < 1
            or (features is not None and shape[-1] != features)
        ):
            got = tuple(shape) if shape is not None else type(x).__name__
            raise ValueError(
                f"{self._short_repr()}: expected input [..., T >= 1, {features}] of rank "
                f">= 2, got shape {got}"
            )
        self.check_numeric(x)
        batch, (t, f) = x.shape[:-2], x.shape[-2:]
        xs = x.reshape(-1, t, f)
        if carry is not None:
            carry = self._flat_carry(carry, batch)
        with self.params_scope(""):
            if hasattr(self.cell, "scan"):  # None: the scan's rule starts from zeros
                carry, hs = self.cell.scan(params, xs, carry)
            else:
                if carry is None:
                    carry = self.cell.zero_carry((xs.shape[0],), xs.dtype)
                carry, hs = self._plain_scan(params, xs, carry)
        hs = hs.reshape(*batch, *hs.shape[1:])
        if not self.return_carry:
            return hs
        return jax.tree.map(lambda s: s.reshape(*batch, *s.shape[1:]), carry), hs

    def _flat_carry(self, carry: Any, batch: tuple[int, ...]) -> Any:
        want = jax.tree.structure(self.cell.zero_carry(batch))
        if jax.tree.structure(carry) != want:
            raise ValueError(
                f"{self._short_repr()}: the carry must have the structure of "
                f"cell.zero_carry(), {want}, got {jax.tree.structure(carry)}"
            )
        for s in jax.tree.leaves(carry):
            if tuple(s.shape[: len(batch)]) != tuple(batch) or s.ndim != len(batch) + 1:
                raise ValueError(
                    f"{self._short_repr()}: each carry array must be [*batch, hidden] with "
                    f"the input's batch axes {tuple(batch)}, got shape {tuple(s.shape)}"
                )
        return jax.tree.map(lambda s: s.reshape(-1, s.shape[-1]), carry)

    def _plain_scan(self, params: ParamsDict, xs: jax.Array, carry: Any):
        def step(carry, x_t):
            carry = self.cell(params, x_t, carry)
            h = carry[0] if isinstance(carry, tuple) else carry
            return carry, h

        carry, hs = lax.scan(step, carry, _time_major(xs))
        return carry, _time_major(hs)
