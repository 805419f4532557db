"""A user's module with one hand rule in every form the rule contract accepts (imported by
tests/test_grad_contract.py, also run as ``__main__`` there). Not a test file itself."""

import jax
import jax.numpy as jnp

import nnlite as nl
from nnlite import hand_rule
from nnlite.rules import index, index_vjp

SCALE = 0.1  # a module constant a rule reads


def cube_vjp(x, dret):  # a bare cotangent
    return 3 * SCALE * x * x * dret


@nl.hand_rule(cube_vjp)
def cube(x):
    return SCALE * x**3


def sq_vjp(x, dret):  # a one-tuple
    return (2 * x * dret,)


@hand_rule(sq_vjp)
def sq(x):
    return x * x


def scale_vjp(x, s, dret):  # one cotangent per argument
    return dret * jnp.broadcast_to(s, x.shape), jnp.sum(dret * x, axis=tuple(range(x.ndim - 1)))


@hand_rule(scale_vjp)
def scale(x, s):
    return x * jnp.broadcast_to(s, x.shape)


def pick_vjp(x, i, dret):  # the short form: a Python int index has no cotangent
    return jnp.zeros_like(x).at[..., i].add(dret)


@hand_rule(pick_vjp)
def pick(x, i):
    return x[..., i]


def take_vjp(x, idx, dret):  # the short form with an integer array
    return jnp.zeros_like(x).at[..., idx].add(dret)


@hand_rule(take_vjp)
def take(x, idx):
    return x[..., idx]


def masked_vjp(x, m, dret):  # None for a bool array, as a list
    return [jnp.where(m, dret, 0.0), None]


@hand_rule(masked_vjp)
def masked(x, m):
    return jnp.where(m, x, 0.0)


def two_vjp(x, d_double, d_sin):  # a tuple result: one cotangent per output
    return 2 * d_double + d_sin * jnp.cos(x)


@hand_rule(two_vjp)
def two(x):
    return 2 * x, jnp.sin(x)


def shift_vjp(x, dret, *, c):  # a keyword hyperparameter
    return dret


@hand_rule(shift_vjp)
def shift(x, *, c=1.0):
    return x + c


def weigh_vjp(x, w, dret):  # None (zero) for a float argument that is data
    return dret * w, None


@hand_rule(weigh_vjp)
def weigh(x, w):
    return x * w


def softsign(x):
    return x / (1 + jnp.abs(x))


def softsign_vjp(x, dret):
    return dret / (1 + jnp.abs(x)) ** 2


hand_softsign = nl.rules.custom_vjp(softsign, softsign_vjp)  # a plug-in, not hand_rule


def arcsinh_vjp(x, dret):
    return dret / jnp.sqrt(x * x + 1)


@nl.rules.with_vjp(arcsinh_vjp)
def arcsinh(x):
    return jnp.arcsinh(x)


seed_index = nl.hand_rule(index_vjp)(index)  # the seed's index_vjp(x, i, dret) -> dx

PAIRS = [
    (cube, 1),
    (sq, 1),
    (scale, 2),
    (pick, 2),
    (take, 2),
    (masked, 2),
    (two, 1),
    (weigh, 2),
]


def loss(p, x):
    """x: [B, 3] or [B, T, 3]; every rule form above, and nnlite's own rules."""
    h = x @ p["W"]  # [..., 4]
    h = cube(h) + sq(h)
    h = scale(h, p["s"])
    a, b = two(h)
    h = shift(a + b, c=0.5)
    h = hand_softsign(h) + arcsinh(h)
    h = weigh(h, jnp.broadcast_to(x[..., :1], h.shape))
    v = pick(h, 1) + jnp.sum(take(h, jnp.array([0, 2, 2])), -1)
    v = v + masked(h, jnp.concatenate([x, x[..., :1]], -1) > 0) @ jnp.ones((4,))
    v = v + seed_index(jnp.sum(h, axis=tuple(range(h.ndim - 1))), 2)
    r = nl.rules.plugged.relu(h) + nl.relu(h) + nl.rules.plugged.index(h, (Ellipsis, 3))[..., None]
    return jnp.mean(v) + nl.rules.mean(r) + nl.rules.plugged.dotall(h, h) / h.size


def params(key=0):
    k = jax.random.split(jax.random.key(key), 2)
    return nl.ParamsDict(W=jax.random.normal(k[0], (3, 4)) / 2, s=jnp.array([1.0, -0.5, 0.7, 1.2]))


def batch(n, seq=None, key=1):
    shape = (n, 3) if seq is None else (n, seq, 3)
    return jax.random.normal(jax.random.key(key), shape)


def check_show_grad(seq=None, sizes=(2, 5)):
    """show_grad at batch 3, its code run at other sizes against jax.grad: max error."""
    p = params()
    src = nl.show_grad(loss, p, batch(3, seq))
    ns: dict = {}
    exec(src, ns)
    printed, manual = jax.jit(ns["grad"]), jax.jit(jax.grad(nl.manual_grads(loss)))
    worst = 0.0
    for n in (3, *sizes):
        x = batch(n, seq, key=n)
        want = jax.jit(jax.grad(loss))(p, x)
        for got in (printed(p, x), manual(p, x)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                worst = max(worst, float(jnp.max(jnp.abs(a - b))))
    return src, worst


if __name__ == "__main__":
    for seq in (None, 4):
        src, worst = check_show_grad(seq, sizes=(5,))
        assert "import nl" not in src and "nnlite.grad" not in src, src
        print("worst", worst)
        if seq is None:
            print(src)
