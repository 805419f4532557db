"""from_equinox: an Equinox GRUCell scanned over MNIST-1D inside an nnlite model trains,
and its gradients equal Equinox's own."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32

import nnlite as nl

HIDDEN = 16


class GRUClassifier(nl.Module):
    """An Equinox GRUCell run over the sequence with lax.scan, then an nnlite Linear head."""

    cell: nl.EquinoxLayer
    num_classes: int = 10

    @property
    def head(self):
        return nl.Linear(HIDDEN, self.num_classes)

    def init(self, key):
        return nl.ParamsDict(cell=self.cell.init(key), head=self.head.init(key))

    def init_fast(self, seed):
        """init() with the head drawn by numpy: eager jax.random compiles per shape (slow)."""
        rng = np.random.default_rng(seed)
        W = rng.normal(0, HIDDEN**-0.5, (HIDDEN, self.num_classes)).astype(np.float32)
        head = nl.ParamsDict(W=W, b=np.zeros(self.num_classes, np.float32))
        return nl.ParamsDict(cell=self.cell.init(None), head=head)

    def __call__(self, params, x, *, key=None):
        """x: [batch, T] -> logits [batch, classes]."""

        def one(seq):
            def step(h, x_t):
                return self.cell(params.cell, x_t[None], h), None

            h, _ = jax.lax.scan(step, jnp.zeros(HIDDEN), seq)
            return h

        return self.head(params.head, jax.vmap(one)(x))


def _mnist1d(n):
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = n
    state = np.random.get_state()
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(state)
    return d["x"].astype(np.float32), d["y"].astype(np.int32)


@pytest.fixture(scope="module")
def data():
    x, y = _mnist1d(100)
    assert x.shape[1] == 40  # MNIST-1D's 40-step sequence
    return x[:64], y[:64]


def test_gru_cell_in_an_nnlite_model_trains(data):
    x, y = map(jnp.asarray, data)
    model = GRUClassifier(nl.from_equinox(eqx.nn.GRUCell(1, HIDDEN, key=jax.random.key(0))))
    params = model.init_fast(1)
    assert [p for p, _ in params.items()] == [
        "/cell/weight_ih",
        "/cell/weight_hh",
        "/cell/bias",
        "/cell/bias_n",
        "/head/W",
        "/head/b",
    ]
    opt = optax.adam(3e-2)
    state = opt.init(params)
    # A small subset, full batch: the loss must fall within a few dozen steps.

    def loss_fn(p):
        return jnp.mean(nl.softmax_cross_entropy(model(p, x), y))

    @jax.jit
    def train(params, state):
        def step(carry, _):
            params, state = carry
            loss, g = jax.value_and_grad(loss_fn)(params)
            updates, state = opt.update(g, state, params)
            return (optax.apply_updates(params, updates), state), loss

        (params, state), losses = jax.lax.scan(step, (params, state), None, length=30)
        return params, losses, loss_fn(params)

    params, losses, final = train(params, state)
    assert float(final) < 0.8 * float(losses[0]), losses
    assert isinstance(params.cell, nl.ParamsDict)


def test_gradients_equal_equinox_filter_grad(data):
    x, y = data
    x, y = x[:32], y[:32]
    cell = eqx.nn.GRUCell(1, HIDDEN, key=jax.random.key(2))
    model = GRUClassifier(nl.from_equinox(cell))
    params = model.init_fast(3)
    head = params.head

    def eqx_loss(cell):
        def one(seq):
            h, _ = jax.lax.scan(lambda h, xt: (cell(xt[None], h), None), jnp.zeros(HIDDEN), seq)
            return h

        logits = nl.linear(jax.vmap(one)(x), head.W, head.b)
        return jnp.mean(nl.softmax_cross_entropy(logits, y))

    def nl_loss(p):
        return jnp.mean(nl.softmax_cross_entropy(model(p, x), y))

    want = eqx.filter_jit(eqx.filter_grad(eqx_loss))(cell)
    got = jax.jit(jax.grad(nl_loss))(params)
    # float32 rounding of each leaf's scale along the path: 40 GRU steps, the head, the loss
    names = ("weight_ih", "weight_hh", "bias", "bias_n")
    assert_close_f32(
        {n: got.cell[n] for n in names},
        {n: getattr(want, n) for n in names},
        ops=ROUNDINGS_PER_LAYER * (x.shape[1] + 2),
    )
    # The same weights: the nnlite layer starts from the Equinox module's own arrays.
    np.testing.assert_array_equal(params.cell.weight_hh, cell.weight_hh)


def test_nested_modules_keys_vmap_and_static_hashing():
    mlp = eqx.nn.MLP(3, 2, 8, depth=2, key=jax.random.key(0))
    layer = nl.from_equinox(mlp)
    p = layer.init(None)
    assert [k for k, _ in p.items()] == [
        "/layers[0]/weight",
        "/layers[0]/bias",
        "/layers[1]/weight",
        "/layers[1]/bias",
        "/layers[2]/weight",
        "/layers[2]/bias",
    ]
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    got = jax.jit(jax.vmap(layer, in_axes=(None, 0)))(p, x)
    np.testing.assert_allclose(got, jax.vmap(mlp)(x), rtol=1e-6)
    # Equal layers hash equal (one jit cache entry); different hyperparameters do not.
    again = nl.from_equinox(eqx.nn.MLP(3, 2, 8, depth=2, key=jax.random.key(5)))
    assert layer == again and hash(layer) == hash(again)
    assert layer != nl.from_equinox(
        eqx.nn.MLP(3, 2, 8, depth=2, activation=jnp.tanh, key=jax.random.key(0))
    )
    f = jax.jit(lambda m, p, x: m(p, x), static_argnums=0)
    np.testing.assert_allclose(f(again, p, x[0]), mlp(x[0]), rtol=1e-6)
    # Sequential with a parameter-free element: the gap is an empty ParamsDict.
    seq = nl.from_equinox(
        eqx.nn.Sequential(
            [
                eqx.nn.Linear(3, 4, key=jax.random.key(0)),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(4, 1, key=jax.random.key(1)),
            ]
        )
    )
    sp = seq.init(None)
    assert [k for k, _ in sp.items()][-1] == "/layers[2]/bias"
    assert seq(sp, jnp.ones(3)).shape == (1,)


def test_key_is_passed_to_modules_that_take_one():
    drop = nl.from_equinox(eqx.nn.Dropout(0.5))
    assert drop.init(None) == nl.ParamsDict()
    x = jnp.ones(100)
    y = drop(nl.ParamsDict(), x, key=jax.random.key(0))
    assert 0 < int((y == 0).sum()) < 100
    # Linear takes no key in the way Dropout does, but accepts one: passing it is harmless.
    lin = nl.from_equinox(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    lin(lin.init(None), jnp.ones(2), key=jax.random.key(0))


def test_errors():
    with pytest.raises(TypeError, match="from_equinox: expected an equinox.Module, got Linear"):
        nl.from_equinox(nl.Linear(2, 3))
    layer = nl.from_equinox(eqx.nn.Linear(2, 3, key=jax.random.key(0)))
    p = layer.init(None)
    p.weight = jnp.ones((3, 5))
    with pytest.raises(
        ValueError,
        match=re.escape("EquinoxLayer(Linear): params /weight has shape (3, 5), expected (3, 2)"),
    ):
        layer(p, jnp.ones(2))
    del p["bias"]
    p.weight = jnp.ones((3, 2))
    with pytest.raises(
        ValueError, match=re.escape("EquinoxLayer(Linear): params /bias is missing")
    ):
        layer(p, jnp.ones(2))
