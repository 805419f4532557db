"""The MLP's gradient modes: autodiff, composed hand rules, one fused hand-written pass.

The model is a chain of Linear layers ``h = act(h @ W + b)`` with no activation after the
last layer, then mean softmax cross-entropy against integer labels. Parameters are a
sequence of layers, each a ParamsDict (or dict) with ``W: [in, out]`` and ``b: [out]``, or
a ParamsDict that holds such a chain (``ffn`` + ``head``, or ``layers``; see
``mlp_layers``). Gradients come back with the same tree structure as the parameters.

``manual`` gradients for any model come from ``nl.manual_grads`` (every layer's hand rule);
the fused pass here is hand-optimised for this one model's shape, which is why it lives
with the model (``models/mlp.py`` uses it for ``loss.grad=fused``) and uses only nnlite's
public API.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import nnlite as nl
    >>> params = nl.FFN(4, (8,), 3).init(jax.random.key(0))
    >>> x, y = jnp.ones((2, 4)), jnp.array([0, 2])
    >>> loss, grads = jax.jit(fused_loss_and_grad)(params, x, y)
    >>> grads.layers[0].W.shape
    (4, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import nnlite as nl
from nnlite import rules as R

__all__ = [
    "GRAD_MODES",
    "HAND_ACTIVATIONS",
    "fused_grad_accum",
    "fused_loss_and_grad",
    "loss_and_grad",
    "mlp_layers",
    "mlp_logits",
    "mlp_loss",
]

#: The gradient modes of ``mlp_loss`` and ``loss_and_grad`` (the MLP's ``grad_modes``).
GRAD_MODES = ("autodiff", "manual", "fused")

# d act(z) / dz, from the pre-activation z and the output h = act(z). Every entry except
# gelu reads only h, which the next layer keeps anyway as its input: the fused backward
# pass then needs no extra residual for the activation.
_ACT_GRADS: dict[str, tuple[bool, Callable]] = {
    # name: (needs z, derivative(z, h))
    "relu": (False, lambda z, h: h > 0),
    "tanh": (False, lambda z, h: 1 - h * h),
    "sigmoid": (False, lambda z, h: h * (1 - h)),
    # softplus' = sigmoid(z) = 1 - exp(-softplus(z)); expm1 keeps it exact for tiny h.
    "softplus": (False, lambda z, h: -jnp.expm1(-h)),
    "identity": (False, lambda z, h: None),
    "gelu": (True, lambda z, h: R.gelu_grad(z)),
}

#: Activations the hand-derived modes (manual, fused) support; autodiff takes any.
HAND_ACTIVATIONS = tuple(_ACT_GRADS)


def _check_mode(mode: str, activation: Any) -> Any:
    """Validate ``mode`` and ``activation``; returns the activation's name when it has one
    (``nl.relu`` -> ``"relu"``), so the hand modes accept the functions too."""
    if mode not in GRAD_MODES:
        raise ValueError(f"unknown gradient mode {mode!r}; valid: {', '.join(GRAD_MODES)}")
    if callable(activation):
        activation = next((k for k, v in nl.ACTIVATIONS.items() if v is activation), activation)
    if mode != "autodiff" and activation not in _ACT_GRADS:
        raise ValueError(
            f"gradient mode {mode!r} supports activations {', '.join(HAND_ACTIVATIONS)}; got "
            f"{activation!r} (use mode='autodiff' for other activations)"
        )
    return activation


# --- parameters ---------------------------------------------------------------------------


def mlp_layers(params: Any) -> list:
    """The chain of ``{W, b}`` layers in ``params``, first to last.

    Accepts a sequence of layers; a ParamsDict with ``ffn`` (an ``FFN`` built with
    ``activate_final=True``) and ``head`` (a ``SoftmaxHead``), giving
    ``[*params.ffn.layers, params.head]``; or a ParamsDict with ``layers`` (an ``FFN``
    with ``activate_final=False``).

    Example:
        >>> import jax
        >>> import nnlite as nl
        >>> key = jax.random.key(0)
        >>> params = nl.ParamsDict(
        ...     ffn=nl.FFN(4, (8,), 8, activate_final=True).init(key),
        ...     head=nl.SoftmaxHead(8, 3).init(key))
        >>> [layer.W.shape for layer in mlp_layers(params)]
        [(4, 8), (8, 8), (8, 3)]
    """
    if isinstance(params, (list, tuple)):
        layers = list(params)
    elif "ffn" in params and "head" in params:
        layers = [*params["ffn"]["layers"], params["head"]]
    elif "layers" in params:
        layers = list(params["layers"])
    else:
        raise ValueError(
            "mlp_layers: expected a sequence of {W, b} layers or a ParamsDict with 'ffn' and "
            f"'head' or with 'layers'; got keys {list(params)}"
        )
    for i, layer in enumerate(layers):
        if set(layer) != {"W", "b"}:
            raise ValueError(f"mlp_layers: layer {i} must hold exactly W and b, got {list(layer)}")
    for i, (a, b) in enumerate(zip(layers[:-1], layers[1:], strict=True)):
        if a["W"].shape[1] != b["W"].shape[0]:
            raise ValueError(
                f"mlp_layers: layer {i} W {a['W'].shape} does not chain into layer {i + 1} W "
                f"{b['W'].shape}"
            )
    return layers


def _grads_like(params: Any, layers: list, grads: list[tuple]) -> Any:
    """Gradients ``[(dW, db), ...]`` in the tree structure of ``params``."""
    leaves, treedef = jax.tree.flatten(params)
    # Both dicts and ParamsDicts flatten keys sorted ('W' < 'b'), layers in chain order.
    expected = [leaf for layer in layers for leaf in (layer["W"], layer["b"])]
    same = len(leaves) == len(expected) and all(
        a is b for a, b in zip(leaves, expected, strict=True)
    )
    if not same:
        raise ValueError("mlp params must hold only the chain's W and b leaves (see mlp_layers)")
    return jax.tree.unflatten(treedef, [g for pair in grads for g in pair])


def _check_inputs(layers: list, x: jax.Array, labels: jax.Array) -> None:
    if x.ndim != 2 or x.shape[1] != layers[0]["W"].shape[0]:
        raise ValueError(
            f"mlp: expected x of shape [batch, {layers[0]['W'].shape[0]}], got {x.shape}"
        )
    if labels.shape != x.shape[:1] or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"mlp: expected integer labels of shape {x.shape[:1]}, got {labels.dtype}{labels.shape}"
        )


# --- autodiff and manual ------------------------------------------------------------------


def mlp_logits(params: Any, x: jax.Array, *, activation: str | Callable = "relu") -> jax.Array:
    """Logits of the MLP: ``act`` after every layer but the last. ``x: [batch, in]``."""
    layers = mlp_layers(params)
    act = nl.get_activation(activation)
    h = x
    for i, layer in enumerate(layers):
        h = h @ layer["W"] + layer["b"][None, :]
        if i < len(layers) - 1:
            h = act(h)
    return h


def _autodiff_loss(params, x, labels, activation):
    return nl.softmax_cross_entropy(
        mlp_logits(params, x, activation=activation), labels, reduction="mean"
    )


def _manual_loss(params, x, labels, activation):
    # Every op is a plugged rule: jax.grad of this runs only the rules.
    layers = mlp_layers(params)
    act = getattr(R.plugged, activation)
    h = x
    for i, layer in enumerate(layers):
        h = R.plugged.bias_add(R.plugged.mm(h, layer["W"]), layer["b"])
        if i < len(layers) - 1:
            h = act(h)
    return R.plugged.mean(R.plugged.softmax_cross_entropy_values(h, labels))


# --- fused --------------------------------------------------------------------------------


def _fused_forward(layers, x, labels, activation):
    """Loss and the residuals the fused backward pass reuses: inputs of each layer, the
    pre-activations (gelu only), the softmax probabilities."""
    needs_z, _ = _ACT_GRADS[activation]
    act = nl.get_activation(activation)
    hs, zs = [x], []
    h = x
    for i, layer in enumerate(layers):
        z = h @ layer["W"] + layer["b"][None, :]
        if i == len(layers) - 1:
            logits = z
            break
        h = act(z)
        hs.append(h)
        zs.append(z if needs_z else None)
    # Stable log-softmax, sharing exp(shifted) between the loss and the probabilities.
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(shifted)
    s = jnp.sum(e, axis=-1, keepdims=True)
    onehot = labels[:, None] == jnp.arange(logits.shape[-1], dtype=labels.dtype)[None, :]
    picked = jnp.sum(jnp.where(onehot, shifted, 0), axis=-1, keepdims=True)
    loss = jnp.mean(jnp.log(s) - picked)
    probs = e / s
    return loss, (hs, zs, probs, onehot)


def _fused_backward(layers, activation, residuals, g, grads_in=None, want_dx=False):
    """The whole chain's backward pass, by hand: returns ``[(dW, db), ...]`` and ``dx``.

    ``dz = (softmax - onehot) * g / batch`` at the top; then per layer ``dW = h^T dz`` (one
    matmul over the batch, accumulated into ``grads_in`` when given), ``db = sum(dz)``,
    ``dh = dz W^T`` and ``dz = dh * act'(...)`` from the saved activations.
    """
    hs, zs, probs, onehot = residuals
    _, act_grad = _ACT_GRADS[activation]
    dz = (probs - onehot.astype(probs.dtype)) * (g / probs.shape[0])
    grads = [None] * len(layers)
    dx = None
    for i in reversed(range(len(layers))):
        W = layers[i]["W"]
        if grads_in is None:
            dW, db = hs[i].T @ dz, jnp.sum(dz, axis=0)
        else:
            dW = R.xpyzt(grads_in[i][0], hs[i], dz)
            db = grads_in[i][1] + jnp.sum(dz, axis=0)
        grads[i] = (dW, db)
        if i > 0:
            dh = dz @ W.T
            d = act_grad(zs[i - 1], hs[i])
            dz = dh if d is None else (jnp.where(d, dh, 0) if d.dtype == bool else dh * d)
        elif want_dx:
            dx = dz @ W.T
    return grads, dx


def fused_loss_and_grad(
    params: Any, x: jax.Array, labels: jax.Array, *, activation: str = "relu"
) -> tuple[jax.Array, Any]:
    """Mean softmax cross-entropy of the MLP and its gradient, by one fused hand pass.

    No autodiff: the forward pass keeps each layer's input (and pre-activations for gelu),
    the backward pass is ``dz = softmax - onehot`` followed by plain matmuls.

    Args:
        params: the layers (see ``mlp_layers``).
        x: ``[batch, in]`` inputs.
        labels: ``[batch]`` integer class indices.
        activation: one of ``HAND_ACTIVATIONS``.

    Returns:
        ``(loss, grads)``, ``grads`` with the structure of ``params``.
    """
    activation = _check_mode("fused", activation)
    layers = mlp_layers(params)
    _check_inputs(layers, x, labels)
    loss, res = _fused_forward(layers, x, labels, activation)
    grads, _ = _fused_backward(layers, activation, res, jnp.ones((), loss.dtype))
    return loss, _grads_like(params, layers, grads)


def fused_grad_accum(
    params: Any, x: jax.Array, labels: jax.Array, grads_in: Any, *, activation: str = "relu"
) -> tuple[jax.Array, Any]:
    """``fused_loss_and_grad`` that adds into incoming gradient buffers.

    Returns ``(loss, grads_in + grads)``: the weight gradient is accumulated with ``xpyzt``
    (``dW_in + h^T dz``), so summing k microbatches costs no extra pass. Divide the sum by
    k for the mean over the k microbatches (each microbatch loss is a mean over its rows).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> params = nl.FFN(4, (8,), 3).init(jax.random.key(0))
        >>> x, y = jnp.ones((6, 4)), jnp.array([0, 1, 2, 0, 1, 2])
        >>> zeros = jax.tree.map(jnp.zeros_like, params)
        >>> accum = jax.jit(fused_grad_accum)
        >>> _, acc = accum(params, x[:3], y[:3], zeros)
        >>> _, acc = accum(params, x[3:], y[3:], acc)
        >>> _, full = jax.jit(fused_loss_and_grad)(params, x, y)
        >>> bool(jnp.allclose(acc.layers[0].W / 2, full.layers[0].W, atol=1e-6))
        True
    """
    activation = _check_mode("fused", activation)
    layers = mlp_layers(params)
    _check_inputs(layers, x, labels)
    if jax.tree.structure(grads_in) != jax.tree.structure(params):
        raise ValueError(
            f"fused_grad_accum: grads_in must have the structure of params; got "
            f"{jax.tree.structure(grads_in)}, params {jax.tree.structure(params)}"
        )
    g_layers = mlp_layers(grads_in)
    loss, res = _fused_forward(layers, x, labels, activation)
    acc = [(g["W"], g["b"]) for g in g_layers]
    grads, _ = _fused_backward(layers, activation, res, jnp.ones((), loss.dtype), grads_in=acc)
    return loss, _grads_like(params, layers, grads)


def _fused_loss_impl(params, x, labels, activation):
    return _fused_forward(mlp_layers(params), x, labels, activation)[0]


def _fused_loss_fwd(params, x, labels, activation):
    layers = mlp_layers(params)
    loss, res = _fused_forward(layers, x, labels, activation)
    return loss, (params, x, res)


def _fused_loss_bwd(activation, saved, g):
    params, x, res = saved
    layers = mlp_layers(params)
    grads, dx = _fused_backward(layers, activation, res, g, want_dx=True)
    dparams = jax.tree.map(nl.rules.match_primal, _grads_like(params, layers, grads), params)
    return dparams, nl.rules.match_primal(dx, x), None


_fused_loss = jax.custom_vjp(_fused_loss_impl, nondiff_argnums=(3,))
_fused_loss.defvjp(_fused_loss_fwd, _fused_loss_bwd)


# --- entry points -------------------------------------------------------------------------


def mlp_loss(
    params: Any,
    x: jax.Array,
    labels: jax.Array,
    *,
    activation: str | Callable = "relu",
    mode: str = "autodiff",
) -> jax.Array:
    """Mean softmax cross-entropy of the MLP, differentiable in gradient mode ``mode``.

    ``"autodiff"``: plain JAX ops. ``"manual"``: composed from ``nnlite.rules.plugged`` rules, so
    ``jax.grad`` runs only rules. ``"fused"``: a ``jax.custom_vjp`` whose backward
    pass is the fused hand pass of ``fused_loss_and_grad``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> params = nl.FFN(4, (8,), 3).init(jax.random.key(0))
        >>> x, y = jnp.ones((2, 4)), jnp.array([0, 2])
        >>> grad = jax.jit(jax.grad(mlp_loss), static_argnames="mode")
        >>> g1 = grad(params, x, y)
        >>> g2 = grad(params, x, y, mode="fused")
        >>> bool(jnp.allclose(g1.layers[1].W, g2.layers[1].W, atol=1e-6))
        True
    """
    activation = _check_mode(mode, activation)
    layers = mlp_layers(params)
    _check_inputs(layers, x, labels)
    if mode == "autodiff":
        return _autodiff_loss(params, x, labels, activation)
    if mode == "manual":
        return _manual_loss(params, x, labels, activation)
    return _fused_loss(params, x, labels, activation)


def loss_and_grad(
    mode: str,
    params: Any,
    x: jax.Array,
    labels: jax.Array,
    *,
    activation: str | Callable = "relu",
) -> tuple[jax.Array, Any]:
    """``(loss, grads)`` of the MLP's mean softmax cross-entropy in gradient mode ``mode``.

    Args:
        mode: ``"autodiff"`` (``jax.value_and_grad``), ``"manual"`` (``value_and_grad``
            of a loss composed of hand rules) or ``"fused"`` (``fused_loss_and_grad``).
        params: the layers (see ``mlp_layers``).
        x: ``[batch, in]`` inputs; labels: ``[batch]`` integer class indices.
        activation: a name from ``HAND_ACTIVATIONS`` (autodiff also takes any name in
            ``nnlite.ACTIVATIONS`` or a callable).

    Returns:
        ``(loss, grads)``, ``grads`` with the structure of ``params``.
    """
    activation = _check_mode(mode, activation)
    if mode == "fused":
        return fused_loss_and_grad(params, x, labels, activation=activation)
    return jax.value_and_grad(mlp_loss)(params, x, labels, activation=activation, mode=mode)
