"""The rule contract, one reading for every tool: ``hand_rule``/``manual_grads``,
``custom_vjp``, ``check_rule`` and ``show_grad`` accept the same rule forms, give the same
gradient, and refuse the same broken rules with the same line. ``show_grad``'s printed code
equals ``jax.grad`` for every form, wherever the rule is defined, at other batch sizes.
"""

import os
import subprocess
import sys

import _rule_forms as forms
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl
from nnlite.rules import check_rule, index, index_vjp

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(src: str, *args):
    ns: dict = {}
    exec(src, ns)
    return ns["grad"](*args)


# --- the three show_grad defects -------------------------------------------------


def test_seed_index_vjp_under_hand_rule_prints_dx_alone():
    """``index_vjp(x, i, dret) -> dx`` once printed as ``d, _ = index_vjp(...)``: with two
    elements silently wrong ([0, 0] for [0, 3])."""
    hand_index = nl.hand_rule(index_vjp)(index)
    p = nl.ParamsDict(w=jnp.array([2.0, 3.0]))
    x = jnp.array([[3.0], [3.0]])

    def loss(p, x):
        return jnp.sum(hand_index(p.w * 1.0, 1) * x[0])

    src = nl.show_grad(loss, p, x)
    assert "= index_vjp(" in src and ", _ = index_vjp(" not in src
    np.testing.assert_array_equal(_run(src, p, x).w, [0.0, 3.0])
    np.testing.assert_array_equal(jax.grad(loss)(p, x).w, [0.0, 3.0])
    np.testing.assert_array_equal(jax.grad(nl.manual_grads(loss))(p, x).w, [0.0, 3.0])


def test_one_argument_rule_returning_a_one_tuple_works_in_every_tool():
    def sq_vjp(x, dret):
        return (2 * x * dret,)

    @nl.hand_rule(sq_vjp)
    def sq(x):
        return x * x

    p = nl.ParamsDict(w=jnp.array([1.0, -2.0]))
    x = jnp.ones((3, 2))

    def loss(p, x):
        return jnp.sum(sq(p.w)[None] * x)

    check_rule(sq.f, sq.f_vjp, p.w)  # once rejected by check_rule
    src = nl.show_grad(loss, p, x)  # once printed code that crashed
    assert "(d_p_w,) = sq_vjp(" in src
    want = jax.grad(loss)(p, x).w
    np.testing.assert_allclose(_run(src, p, x).w, want)
    np.testing.assert_allclose(jax.grad(nl.manual_grads(loss))(p, x).w, want)
    np.testing.assert_allclose(jax.grad(nl.rules.custom_vjp(sq.f, sq.f_vjp))(jnp.float32(3.0)), 6.0)


def test_nnlite_rules_print_through_public_imports_and_hand_functions_are_accepted():
    p = nl.ParamsDict(w=jnp.array([[0.5, -1.0], [2.0, 0.1]]))
    x = jnp.array([[1.0, 2.0], [-1.0, 0.5], [0.3, 0.3]])

    def loss(p, x):
        h = x @ p.w
        # decorated inside nnlite (mean), ready-made plug-ins (hand.*), the seed's names,
        # and a primitive rule
        r = nl.vjp.hand.relu(h) + nl.vjp.hand.exp(h / 4) + jnp.sin(h)
        return nl.rules.mean(r) + nl.vjp.hand.dotall(h, h) + jnp.sum(nl.vjp.softmax(h))

    src = nl.show_grad(loss, p, x)
    assert "nnlite.grad" not in src and "_small_rules" not in src  # public paths only
    assert "hand_rule" not in src  # no decorator copied into the code
    # the seed's names are nnlite.rules' objects: every rule imported from the one home
    assert "from nnlite.vjp import" not in src and "from nnlite.rules import" in src
    x5 = jnp.ones((5, 2)) * 0.7
    np.testing.assert_allclose(_run(src, p, x5).w, jax.grad(loss)(p, x5).w, rtol=1e-5)


# --- the generated corpus: every form, module / __main__, two shapes, other batches --------


@pytest.mark.parametrize("seq", [None, 4])
def test_show_grad_corpus_rules_in_a_user_module(seq):
    # one other batch size each: smaller for the 2-d corpus, larger for the sequences (and
    # in __main__ below)
    src, worst = forms.check_show_grad(seq, sizes=(2,) if seq is None else (5,))
    assert worst < 1e-5, worst
    assert "from _rule_forms import" in src and "def " not in src.split("def grad")[0]
    for form in ("(d_dot_general_v,) = sq_vjp(", "= pick_vjp(", "= take_vjp(", ", _ = masked_vjp("):
        assert form in src, form


def test_show_grad_corpus_rules_defined_in_main():
    """The same module run as a script: its rules (decorated, plug-ins, with module
    constants) are defined in the printed code, without decorators."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "_rule_forms.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(HERE),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    worst = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("worst")]
    assert len(worst) == 2 and max(worst) < 1e-5, out.stdout[-2000:]
    assert "SCALE = 0.1" in out.stdout and "\ndef cube_vjp(x, dret):" in out.stdout
    assert "@" not in out.stdout.split("def grad")[0]  # decorators left out


@pytest.mark.parametrize("f, nargs", forms.PAIRS, ids=[f.__name__ for f, _ in forms.PAIRS])
def test_every_corpus_rule_passes_check_vjp(f, nargs):
    x = jax.random.normal(jax.random.key(0), (3, 4))
    extra = {
        "scale": [jnp.array([1.0, 2.0, -1.0, 0.5])],
        "pick": [2],
        "take": [jnp.array([0, 3, 3])],
        "masked": [x > 0],
        "weigh": [x * 2],
    }.get(f.__name__, [])
    if f.__name__ == "weigh":  # None for a float argument: zero, so check its cotangent only
        check_rule(lambda x: f.f(x, extra[0]), lambda x, d: f.f_vjp(x, extra[0], d)[0], x)
        return
    check_rule(f.f, f.f_vjp, x, *extra)


# --- broken rules: refused once, the same way by every tool --------------------------------


def test_a_rule_that_cannot_take_the_call_is_refused_at_decoration():
    def f(x, y):
        return x * y

    with pytest.raises(nl.RuleContractError, match=r"takes 2 positional arguments \(x, dret\)"):
        nl.hand_rule(lambda x, dret: dret)(f)
    with pytest.raises(nl.RuleContractError, match="takes 2 positional arguments"):
        nl.rules.custom_vjp(f, lambda x, dret: dret)

    def g(x, *, eps=1.0):
        return x + eps

    with pytest.raises(nl.RuleContractError, match="the rule does not take eps"):
        nl.hand_rule(lambda x, dret: dret)(g)
    with pytest.raises(nl.RuleContractError, match="must be a function"):
        nl.hand_rule("not a rule")(g)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda x, y, dret: (dret, dret, dret), r"tuple of 2 here; got a tuple of 3"),
        (lambda x, y, dret: (dret[None], dret), r"argument 0 has shape \(1, 3\), expected \(3,\)"),
        (lambda x, y, dret: ((dret,), dret), r"argument 0 must be an array of shape \(3,\)"),
    ],
    ids=["count", "shape", "nested"],
)
def test_a_rule_result_outside_the_contract_is_refused_alike_by_every_tool(bad, message):
    bad.__name__ = "bad_vjp"

    def mul(x, y):
        return x * y

    hand = nl.hand_rule(bad)(mul)
    plug = nl.rules.custom_vjp(mul, bad)
    x = jnp.array([1.0, 2.0, 3.0])
    p = nl.ParamsDict(w=x)

    def loss(p, x):
        return jnp.sum(hand(p.w, x))

    tools = {
        "manual_grads": lambda: jax.grad(nl.manual_grads(loss))(p, x),
        "custom_vjp": lambda: jax.grad(lambda w: jnp.sum(plug(w, x)))(x),
        "check_rule": lambda: check_rule(mul, bad, x, x),
        "show_grad": lambda: nl.show_grad(loss, p, x[None].repeat(2, 0)[0]),
    }
    for name, run in tools.items():
        with pytest.raises(nl.RuleContractError, match=message):
            run()
        assert name  # every tool raised the same error class and line


def test_an_unknown_primitive_parameter_is_refused_by_name(monkeypatch):
    """A parameter a newer JAX adds (simulated: one the rules are told not to know) makes
    the rule refuse, naming it, rather than compute a gradient it was not written for; the
    trainer's ``auto`` then falls back to autodiff with that line."""
    from nnlite.grad import _structural

    monkeypatch.setattr(_structural, "IGNORED_PARAMS", _structural.IGNORED_PARAMS - {"out_dtype"})
    p = {"w": jnp.ones(3)}

    def loss(p):
        return jnp.sum(p["w"] * p["w"])

    with pytest.raises(
        nl.ManualGradError, match=r"`mul` .*parameter\(s\) out_dtype, unknown to"
    ) as e:
        nl.check_manual(loss, p)
    assert "jax>=0.10,<0.11" in str(e.value) and "out_dtype" in e.value.primitive
