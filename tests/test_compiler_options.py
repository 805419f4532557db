"""nl.compiler_options and nl.jit: XLA's own dot on the CPU, for nnlite's programs and the
user's, at the top level and nested."""

import jax
import jax.numpy as jnp
import numpy as np

import nnlite as nl

YNN = "xla_cpu_experimental_ynn_fusion_type"


def test_options_per_backend_and_the_users_xla_flags_win(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert nl.compiler_options("cpu") == {YNN: ""}
    assert nl.compiler_options("gpu") == {} and nl.compiler_options("tpu") == {}
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 --{YNN}=dot")
    assert nl.compiler_options("cpu") == {}


def _matmul(a, b):
    return jnp.tanh(a @ b)


def test_jit_compiles_the_cpu_dot_without_ynnpack():
    a = jnp.ones((256, 256))
    text = nl.jit(_matmul).lower(a, a).compile().as_text()
    assert "__ynn_fusion" not in text and " dot(" in text
    assert np.array_equal(nl.jit(_matmul)(a, a), jax.jit(_matmul)(a, a))


def test_jit_works_nested_under_every_transformation():
    """JAX takes compiler_options only at the top level: nested, nl.jit is plain jax.jit."""
    f = nl.jit(_matmul)
    a = jax.random.normal(jax.random.key(0), (32, 32))
    want = _matmul(a, a)
    np.testing.assert_allclose(jax.jit(lambda x: f(x, x))(a), want, rtol=1e-6)
    assert "pjit" in str(jax.make_jaxpr(f)(a, a)) or "jit" in str(jax.make_jaxpr(f)(a, a))
    grad = jax.grad(lambda x: f(x, x).sum())(a)
    np.testing.assert_allclose(grad, jax.grad(lambda x: _matmul(x, x).sum())(a), rtol=1e-5)
    np.testing.assert_allclose(jax.vmap(f)(a[None], a[None])[0], want, rtol=1e-6)


def test_jit_takes_jax_jits_arguments_and_decorates_methods():
    @nl.jit(static_argnames="n")
    def power(x, n):
        return x**n

    assert power(jnp.full(3, 2.0), n=3).tolist() == [8.0, 8.0, 8.0]

    class Scaled:
        def __init__(self, by):
            self.by = by

        @nl.jit(static_argnums=0)  # self static, as with jax.jit
        def __call__(self, x):
            return self.by * x

    assert Scaled(2.0)(jnp.ones(2)).tolist() == [2.0, 2.0]
    donated = nl.jit(lambda x: x + 1, donate_argnums=0)
    assert donated(jnp.zeros(2)).tolist() == [1.0, 1.0]


def test_the_trainers_step_is_compiled_with_the_options():
    from train.parallel.single import Single

    def multi_step(p, o, X, Y, batch):
        return p @ o, o, X

    step = Single(jax.devices()[:1]).compile(multi_step, keyed=False)
    a = jnp.ones((128, 128))
    assert "__ynn_fusion" not in step.lower(a, a, a, a, a).compile().as_text()
