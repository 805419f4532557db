"""show_jaxpr's rules for primitives that print as the public function making exactly them.

Linear algebra (``lax.linalg.eigh``, ``lu``, ``qr``, ``svd``, ``triangular_solve``,
``schur``, ``hessenberg``, ``tridiagonal``, ``eig``, ``householder_product``,
``tridiagonal_solve``, ``lu_pivots_to_permutation``), ``lax.fft``, the monoid windowed
reductions (``lax.reduce_window`` with ``lax.add`` / ``lax.max`` / ``lax.min`` and their
identity), ``lax.reduce_precision``, ``lax.approx_max_k`` / ``approx_min_k``,
``lax.split``, ``lax.optimization_barrier`` and ``lax.ragged_dot_general``. A rule
returns ``None`` when the equation's parameters are not what the function gives; the
printer then binds the primitive and says so. Registered into the printer on import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from ._exprs import Call, Rule, Tup, dtype_expr, pyval, scalar_expr
from ._printer import register

if TYPE_CHECKING:
    from ._printer import Printer as _Printer

__all__ = ["PUBLIC_RULES"]


def _kw(eqn, names) -> list:
    return [(k, pyval(eqn.params[k], k)) for k in names]


def _eigh(eqn, args, _mesh):
    p = eqn.params
    kw = [("lower", pyval(p["lower"])), ("symmetrize_input", "False"),
          ("sort_eigenvalues", pyval(p["sort_eigenvalues"]))]  # fmt: skip
    if p["subset_by_index"] is not None:
        kw.append(("subset_by_index", pyval(p["subset_by_index"])))
    if p["algorithm"] is not None:
        kw.append(("implementation", pyval(p["algorithm"])))
    return Call("lax.linalg.eigh", args, kw)


def _qr(eqn, args, _mesh):
    p = eqn.params
    kw = [("full_matrices", pyval(p["full_matrices"]))]
    if p["pivoting"]:
        kw.append(("pivoting", "True"))
    if p["use_magma"] is not None:
        kw.append(("use_magma", pyval(p["use_magma"])))
    return Call("lax.linalg.qr", args, kw)


def _triangular_solve(eqn, args, _mesh):
    a, b = (v.aval for v in eqn.invars)
    p = eqn.params
    complex_a = np.issubdtype(a.dtype, np.complexfloating)
    # the function adds a trailing axis to a vector b, and drops conjugate_a for real a
    if b.ndim != a.ndim or (p["conjugate_a"] and not complex_a):
        return None
    names = ("left_side", "lower", "transpose_a", "conjugate_a", "unit_diagonal")
    return Call("lax.linalg.triangular_solve", args, [(k, pyval(p[k])) for k in names if p[k]])


def _schur(eqn, args, _mesh):
    p = eqn.params
    if p["select_callable"] is not None:
        return None
    kw = _kw(eqn, ("compute_schur_vectors", "sort_eig_vals"))
    return Call("lax.linalg.schur", args, kw)


def _eig(eqn, args, _mesh):
    p = eqn.params
    kw = _kw(eqn, ("compute_left_eigenvectors", "compute_right_eigenvectors"))
    if p["enable_eigvec_derivs"]:
        kw.append(("enable_eigvec_derivs", "True"))
    if p["implementation"] is not None:
        kw.append(("implementation", pyval(p["implementation"])))
    return Call("lax.linalg.eig", args, kw)


def _plain(fn: str, *names: str) -> Rule:
    def rule(eqn, args, _mesh):
        return Call(fn, args, _kw(eqn, names))

    return rule


def _tridiagonal_solve(eqn, args, _mesh):
    kw = [("perturb_singular", "True")] if eqn.params["perturb_singular"] else []
    return Call("lax.linalg.tridiagonal_solve", args, kw)


def _lu_pivots(eqn, args, _mesh):
    return Call(
        "lax.linalg.lu_pivots_to_permutation",
        args,
        [("permutation_size", pyval(eqn.params["permutation_size"]))],
    )


def _fft(eqn, args, _mesh):
    return Call("lax.fft", args, _kw(eqn, ("fft_type", "fft_lengths")))


_WINDOW = ("window_dimensions", "window_strides", "padding", "base_dilation", "window_dilation")


def _monoid_window(op: str, identity) -> Rule:
    """``lax.reduce_window(x, identity, lax.op, ...)``: JAX recognises the monoid (the
    operation and its identity as a concrete scalar) and binds ``reduce_window_<op>``."""

    def rule(eqn, args, _mesh):
        dt = np.dtype(eqn.invars[0].aval.dtype)
        init = identity(dt)
        if init is None:
            return None
        kw = _kw(eqn, _WINDOW)
        return Call("lax.reduce_window", [args[0], scalar_expr(init, dt, False), op], kw)

    return rule


def _max_identity(dt):
    if dt == np.bool_:
        return False
    if np.issubdtype(dt, np.integer):
        return np.iinfo(dt).min
    return -np.inf if np.issubdtype(dt, np.floating) or dt.kind == "V" else None


def _min_identity(dt):
    if dt == np.bool_:
        return True
    if np.issubdtype(dt, np.integer):
        return np.iinfo(dt).max
    return np.inf if np.issubdtype(dt, np.floating) or dt.kind == "V" else None


def _zero(dt):
    return np.zeros((), dt)[()] if dt.kind != "V" else 0.0


def _approx_top_k(eqn, args, _mesh):
    p = eqn.params
    fn = "lax.approx_max_k" if p["is_max_k"] else "lax.approx_min_k"
    names = ("k", "reduction_dimension", "recall_target", "reduction_input_size_override",
             "aggregate_to_topk")  # fmt: skip
    return Call(fn, args, _kw(eqn, names))


def _split(eqn, args, _mesh):
    return Call("lax.split", args, _kw(eqn, ("sizes", "axis")))


def _optimization_barrier(eqn, args, _mesh):
    return Call("lax.optimization_barrier", [Tup(args)])


def _ragged_dot(eqn, args, _mesh):
    p = eqn.params
    if p["out_sharding"] is not None:
        return None
    dn = p["ragged_dot_dimension_numbers"]
    dn_expr = Call(
        "lax.RaggedDotDimensionNumbers",
        [],
        [(f, pyval(getattr(dn, f), f)) for f in
         ("dot_dimension_numbers", "lhs_ragged_dimensions", "rhs_group_dimensions")],
    )  # fmt: skip
    kw = [("ragged_dot_dimension_numbers", dn_expr)]
    if p["precision"] is not None:
        kw.append(("precision", pyval(p["precision"])))
    if p["preferred_element_type"] is not None:
        kw.append(("preferred_element_type", dtype_expr(p["preferred_element_type"])))
    if p["group_offset"] is not None:
        return None
    return Call("lax.ragged_dot_general", args, kw)


def _svd(pr: _Printer, eqn, args, env, scope, indent):
    """``u, s, vh = lax.linalg.svd(x)``: the primitive's outputs are ``(s, u, vh)``."""
    p = eqn.params
    kw = [("full_matrices", pyval(p["full_matrices"])), ("compute_uv", pyval(p["compute_uv"]))]
    if p["subset_by_index"] is not None:
        kw.append(("subset_by_index", pyval(p["subset_by_index"])))
    if p["algorithm"] is not None:
        kw.append(("algorithm", pyval(p["algorithm"])))
    outs = pr.bind_outs(eqn, env)
    target = outs[0] if len(outs) == 1 else f"{outs[1]}, {outs[0]}, {outs[2]}"
    pr.emit_expr(Call("lax.linalg.svd", args, kw), indent, f"{target} = ")


PUBLIC_RULES: dict[str, Rule] = {
    "eigh": _eigh,
    "lu": _plain("lax.linalg.lu"),
    "qr": _qr,
    "triangular_solve": _triangular_solve,
    "schur": _schur,
    "hessenberg": _plain("lax.linalg.hessenberg"),
    "tridiagonal": _plain("lax.linalg.tridiagonal", "lower"),
    "eig": _eig,
    "householder_product": _plain("lax.linalg.householder_product"),
    "tridiagonal_solve": _tridiagonal_solve,
    "lu_pivots_to_permutation": _lu_pivots,
    "reduce_window_sum": _monoid_window("lax.add", _zero),
    "reduce_window_max": _monoid_window("lax.max", _max_identity),
    "reduce_window_min": _monoid_window("lax.min", _min_identity),
    "reduce_precision": _plain("lax.reduce_precision", "exponent_bits", "mantissa_bits"),
    "approx_top_k": _approx_top_k,
    "split": _split,
    "optimization_barrier": _optimization_barrier,
    "ragged_dot_general": _ragged_dot,
    "igamma": _plain("lax.igamma"),
    "igammac": _plain("lax.igammac"),
    "igamma_grad_a": _plain("lax.igamma_grad_a"),
    "regularized_incomplete_beta": _plain("lax.betainc"),
    "bessel_i0e": _plain("lax.bessel_i0e"),
    "bessel_i1e": _plain("lax.bessel_i1e"),
    "zeta": _plain("lax.zeta"),
    "random_clone": _plain("jax.random.clone"),
    "polygamma": _plain("lax.polygamma"),
}

PUBLIC_RULES["fft"] = _fft  # re-traced, lax.fft adds its jit(fft) around it: same values

#: the cholesky primitive alone has no public function; jnp.linalg.cholesky's jit has it
#: between the symmetrisation and the triangle's mask
JITTED_BODIES = {
    "cholesky": [
        ("jnp.linalg.cholesky({0})", lambda a: jnp.linalg.cholesky(a)),
        ("jnp.linalg.cholesky({0}, upper=True)", lambda a: jnp.linalg.cholesky(a, upper=True)),
        ("jnp.linalg.cholesky({0}, symmetrize_input=False)",
         lambda a: jnp.linalg.cholesky(a, symmetrize_input=False)),
    ],
}  # fmt: skip

register(
    rules=PUBLIC_RULES,
    higher_order={"svd": _svd},
    jitted={"fft": ("fft", _fft)},
    jitted_bodies=JITTED_BODIES,
)
