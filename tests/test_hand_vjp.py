"""Every nnlite layer's and loss's hand-derived VJP against jax.vjp, and manual mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _check_many import case, check_many, rule_case
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32

import nnlite as nl
from nnlite.nn import _conv, _dropout, _embedding, _linear, _losses, _pool
from nnlite.nn import _normalisation as norm
from train.model.contract import objective_fn

DTYPES = ["float32", "float64"]


# Each test checks its cases in one check_rule (tests/_check_many.py: one compile, not one per
# case; a failure names its rule), once per dtype (the rand fixture).


def test_linear_and_activations(rand):
    check_many(
        [
            rule_case(_linear.linear, rand(3, 4, 5), rand(5, 6), rand(6)),
            rule_case(_linear.linear, rand(5), rand(5, 6), None),
            *(
                rule_case(nl.ACTIVATIONS[name], rand(4, 5))
                for name in ["relu", "gelu", "tanh", "sigmoid", "softplus", "identity"]
            ),
        ]
    )


CONV_CASES = [  # kernel, strides, padding, dilation, groups
    ((1,), (1,), "VALID", (1,), 1),  # kernel 1
    ((3,), (2,), "SAME", (1,), 1),  # stride > 1, SAME
    ((3,), (2,), ((1, 2),), (2,), 2),  # explicit padding, dilation, groups
    ((2,), (3,), "VALID", (1,), 1),  # stride > kernel: inputs no window reads
    ((3, 2), (2, 1), "SAME", (1, 1), 1),  # 2-d
]


def test_conv(rand):
    cases = []
    for kernel, strides, padding, dilation, groups in CONV_CASES:
        n = len(kernel)
        x = rand(2, *(11, 8)[:n], 4)
        w = rand(*kernel, 4 // groups, 6)
        static = dict(strides=strides, padding=padding, dilation=dilation, groups=groups)
        cases.append(rule_case(_conv.conv, x, w, rand(6), **static))
        cases.append(rule_case(_conv.conv, x, w, None, **static))
    check_many(cases)


def test_pools(rand):
    cases = []
    for window, strides, padding in [
        ((2,), (2,), "VALID"),
        ((3,), (2,), "SAME"),
        ((1,), (1,), "VALID"),
    ]:
        x = rand(2, 9, 3)
        static = dict(window=window, strides=strides, padding=padding)
        cases += [
            rule_case(_pool.max_pool, x, **static),
            # ties: the first maximum gets it
            rule_case(_pool.max_pool, jax.device_put(np.maximum(np.asarray(x), 0)), **static),
            rule_case(_pool.avg_pool, x, **static),
            rule_case(_pool.avg_pool, x, **static, count_include_pad=False),
        ]
    cases += [
        rule_case(_pool.avg_pool, rand(2, 6, 7, 3), window=(2, 3), strides=(1, 2), padding="SAME"),
        rule_case(_pool.flatten, rand(2, 3, 4), num_axes=2),
    ]
    check_many(cases)


def test_normalisation_embedding_dropout_and_losses(rand):
    gn = dict(num_groups=2, num_spatial_axes=1, eps=1e-5)
    ids = jnp.array([[1, 2, 9], [0, 0, 3]])  # a repeated id: its rows' cotangents add up
    key = jax.random.key(3)

    def drop(x):
        return _dropout.dropout.f(x, key, 0.3)

    def drop_vjp(x, dret):
        return _dropout.dropout_vjp(x, key, 0.3, dret)[0]

    labels = jnp.array([0, 1, 4, 2])
    check_many(
        [
            rule_case(norm.layer_norm, rand(3, 5, 8), rand(8), rand(8), eps=1e-5),
            rule_case(norm.layer_norm, rand(3, 8), None, None, eps=1e-5),
            rule_case(norm.rms_norm, rand(3, 5, 8), rand(8), eps=1e-6),
            rule_case(norm.group_norm, rand(3, 5, 8), rand(8), rand(8), **gn),
            rule_case(norm.group_norm, rand(3, 8), rand(8), None, **{**gn, "num_groups": 8}),
            rule_case(_embedding.embed, rand(10, 4), ids),
            rule_case(_embedding.embed_attend, rand(10, 4), rand(2, 3, 4)),
            case(drop, drop_vjp, rand(4, 5)),
            rule_case(nl.rules.softmax_cross_entropy_values, rand(4, 5), labels),
            rule_case(
                nl.rules.softmax_cross_entropy_values,
                rand(2, 3, 5),
                jax.device_put(np.repeat(np.array([[0], [4]]), 3, 1)),
            ),
            rule_case(_losses.nll_values, rand(4, 5), labels),
            rule_case(_losses.squared_error_values, rand(4, 5), rand(4, 5)),
            rule_case(_losses.squared_error_values, rand(4), rand(4)),
            rule_case(nl.rules.mean, rand(4, 5)),
            rule_case(nl.rules.reduce_sum, rand(4, 5)),
        ]
    )


def _both(loss, *args):
    """jax.grad and the manual gradient of ``loss`` in one compiled program."""
    return jax.jit(lambda *a: (jax.grad(loss)(*a), jax.grad(nl.manual_grads(loss))(*a)))(*args)


def _close(a, b, layers):
    """Float32 rounding of each leaf's scale along ``layers`` layers (tests/_tolerance.py)."""
    assert_close_f32(a, b, ops=ROUNDINGS_PER_LAYER * layers)


def test_manual_grads_equal_autodiff_through_every_layer(key):
    net = nl.Sequential(
        (
            nl.Conv(1, 4, 3, strides=2, padding="SAME"),
            nl.Activation("relu"),
            nl.MaxPool(2, strides=2),
            nl.LayerNorm(4),
            nl.AvgPool(1),
            nl.Flatten(2),
            nl.Dropout(0.2),
            nl.Linear(20, 8),
            nl.Activation("gelu"),
            nl.RMSNorm(8),
            nl.SoftmaxHead(8, 3, output="logits"),
        )
    )
    p = jax.jit(net.init)(key)  # one compile, not one per random op
    x = jax.device_put(
        np.asarray(np.random.default_rng(0).standard_normal((6, 20, 1)), jnp.float32)
    )
    y = jnp.array([0, 1, 2, 0, 1, 2])

    def loss(p, x, y):
        logits = net(p, x, key=jax.random.key(5))
        return nl.softmax_cross_entropy(logits, y, reduction="mean")

    auto, hand = _both(loss, p, x, y)
    _close(auto, hand, layers=12)  # the 11 layers and the loss


def test_a_layer_without_rules_is_refused_by_name(key):
    class Solve(nl.Module):
        features: int

        def init(self, key):
            return nl.ParamsDict(s=jnp.ones(self.features))

        def __call__(self, params, x, *, key=None):
            a = jnp.diag(params.s) + x.T @ x
            return x @ jnp.linalg.inv(a)  # a matrix inverse: no rule

    net = nl.Sequential((nl.Linear(3, 4), Solve(4)))
    p = net.init(key)

    def loss(p, x):
        return nl.mse(net(p, x), jnp.zeros((2, 4)), reduction="mean")

    with pytest.raises(
        nl.ManualGradError, match=r" at tests/test_hand_vjp.py:\d+ .*, in layer Solve, "
    ) as e:
        jax.grad(nl.manual_grads(loss))(p, jnp.ones((2, 3)))
    msg = str(e.value)
    assert "@nl.hand_rule(f_vjp)" in msg and "jax.grad, without nl.manual_grads" in msg
    assert "loss.grad" not in msg  # a library error, not CLI advice


def test_a_layer_with_its_own_rule_passes(key):
    def scale_vjp(x, s, dret):
        return dret * jnp.broadcast_to(s, dret.shape), jnp.sum(dret * x, axis=0)

    @nl.hand_rule(scale_vjp)
    def scale(x, s):
        return x * jnp.broadcast_to(s, x.shape)

    class Scale(nl.Module):
        def init(self, key):
            return nl.ParamsDict(s=jnp.full(4, 2.0))

        def __call__(self, params, x, *, key=None):
            return scale(x, params.s)

    net = nl.Sequential((nl.Linear(3, 4), Scale()))
    p = net.init(key)

    def loss(p, x):
        return nl.mse(net(p, x), jnp.zeros((2, 4)), reduction="sum")

    x = jax.device_put(np.asarray(np.random.default_rng(0).standard_normal((2, 3)), jnp.float32))
    auto, hand = _both(loss, p, x)  # one compile instead of op-by-op dispatch
    _close(auto, hand, layers=3)


# Two heads: the rules treat the heads axis as a batch axis of their contractions, one
# code path whatever its size; 2 (not 1) keeps a wrong transpose or sum over it visible.
@pytest.mark.parametrize("heads", [2])
def test_attention(rand, heads):
    from nnlite.nn import _attention

    q, k, v = rand(2, 5, heads, 4), rand(2, 5, heads, 4), rand(2, 5, heads, 4)
    causal = jax.device_put(np.tril(np.ones((5, 5), bool)))
    assert np.array_equal(causal, _attention.causal_mask(5, 5))
    padded = jax.device_put(
        np.arange(5)[None, None, None, :] < np.array([3, 5])[:, None, None, None]
    )
    attn = _attention.dot_product_attention
    check_many(
        [
            rule_case(attn, q, k, v, None),
            rule_case(attn, q, k, v, causal),  # masked positions
            rule_case(attn, q, k, v, padded, key=jax.random.key(1), dropout_rate=0.25),
            rule_case(_attention.slot, rand(2, 5, 3 * heads, 4), start=heads, size=heads),
        ]
    )


def test_manual_transformer_block_equals_autodiff(key):
    """Without and with dropout: both blocks, both passes, in one compiled program."""
    emb = nl.Embedding(11, 8)
    blocks = [nl.TransformerBlock(8, 2, dropout_rate=dropout) for dropout in (0.0, 0.1)]
    p = jax.jit(  # one compile, not one per random op (the blocks' params are alike)
        lambda key: nl.ParamsDict(
            emb=emb.init(key), block=blocks[0].init(jax.random.fold_in(key, 1))
        )
    )(key)
    ids = jax.device_put(np.asarray(np.random.default_rng(0).integers(0, 11, (3, 6)), jnp.int32))

    def loss_of(block):
        def loss(p, ids):
            h = block(p.block, emb(p.emb, ids), key=jax.random.key(2))
            return nl.softmax_cross_entropy(emb.attend(p.emb, h), ids, reduction="mean")

        return loss

    losses = [loss_of(block) for block in blocks]
    both = jax.jit(
        lambda p, ids: [(jax.grad(f)(p, ids), jax.grad(nl.manual_grads(f))(p, ids)) for f in losses]
    )
    for auto, hand in both(p, ids):
        # embedding, the block's 12 (2 norms, attention's 5, 2 residuals, MLP's 3), head, loss
        _close(auto, hand, 15)


def _show_grad_matches(layers, loss, params, *batch):
    src = nl.show_grad(loss, params, *batch)
    namespace: dict = {}
    exec(src, namespace)  # noqa: S102 -- the point: the printed code runs
    # Both sides in one jitted program instead of hundreds of op-by-op dispatches.
    got, auto = jax.jit(lambda *a: (namespace["grad"](*a), jax.grad(loss)(*a)))(params, *batch)
    _close(auto, got, layers)
    return src


def test_show_grad_mlp_cnn_gpt_print_code_that_gives_jax_grad(key):
    from models.cnn import CNN
    from models.gpt import GPT
    from models.mlp import MLP

    mlp = MLP(6, 3, (5, 4), "tanh")
    x, y = jax.random.normal(key, (4, 6)), jnp.array([0, 1, 2, 0])
    loss = lambda p, x, y: objective_fn(mlp)(p, x, y)[0]
    # inits jitted: one compile each rather than one per random op
    src = _show_grad_matches(6, loss, jax.jit(mlp.init)(key), x, y)  # 3 linear, 2 tanh, loss
    assert "d_linear_ffn_layers_1 = tanh_vjp(linear_ffn_layers_1, d_tanh_out2)" in src
    assert "d_tanh_out2, d_p_head_W, d_p_head_b = linear_vjp(tanh_out2, p.head.W, p.head.b" in src

    cnn = CNN((12,), 3, (3, 4), (3, 1), (2, 1), (1, "SAME"))  # stride 2, kernel 1
    loss = lambda p, x, y: objective_fn(cnn)(p, x, y)[0]  # 2 conv, 2 relu, flatten, linear, loss
    src = _show_grad_matches(7, loss, jax.jit(cnn.init)(key), jax.random.normal(key, (4, 12)), y)
    assert "conv_vjp(" in src and "flatten_vjp(" in src

    # one block: the MLP above already repeats a layer (names stay apart)
    gpt = GPT(vocab_size=7, context=6, n_layer=1, n_head=2, n_embd=8, dropout=0.1)
    ids = jax.random.randint(key, (2, 6), 0, 7)
    dkey = jax.random.key(1)
    loss = lambda p, x, y: objective_fn(gpt)(p, x, y, key=dkey)[0]
    # a block of 12 (see the transformer block's test), embeddings, final norm, head, loss
    src = _show_grad_matches(16, loss, jax.jit(gpt.init)(key), ids, jnp.roll(ids, 1))
    assert "dot_product_attention_vjp(" in src and "jnp.tril(" in src


def test_show_grad_cli(capsys):
    from train.__main__ import main

    rc = main(
        [
            "--config",
            "configs/digits_mlp.yaml",
            "--set",
            "model.hidden_sizes=[8]",
            "--show-jaxpr",
            "grad",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "= linear_vjp(" in out and "def grad(params, x, y):" in out


def test_equinox_layers_use_autodiff_and_say_so_once(caplog):
    import equinox as eqx

    from nnlite.nn import _equinox

    _equinox._told.clear()
    lin = nl.from_equinox(eqx.nn.Linear(3, 4, key=jax.random.key(0)))
    head = nl.Linear(4, 2)
    p = nl.ParamsDict(a=lin.init(jax.random.key(1)), b=head.init(jax.random.key(2)))
    x, y = jnp.ones((5, 3)), jnp.zeros(5, jnp.int32)

    def loss(p, x, y):
        h = jax.vmap(lambda xi: lin(p.a, xi))(x)
        return nl.softmax_cross_entropy(head(p.b, nl.tanh(h)), y, reduction="mean")

    with caplog.at_level("WARNING", logger="nnlite"):
        auto, hand = _both(loss, p, x, y)  # one compile, not op-by-op dispatch
        jax.make_jaxpr(jax.grad(nl.manual_grads(loss)))(p, x, y)  # a second differentiation
    _close(auto, hand, layers=4)
    said = [r for r in caplog.records if "EquinoxLayer(Linear)" in r.getMessage()]
    assert len(said) == 1 and "autodiff" in said[0].getMessage()


def test_fused_on_another_model_is_a_config_error_naming_the_models_with_it():
    from pathlib import Path

    from train.config import ConfigError, load_config
    from train.loop.build import build

    root = Path(__file__).resolve().parents[1]
    sets = ["data.name=digits", "model.channels=[4]", "model.kernel_size=3", "loss.grad=fused"]
    cfg = load_config(root / "configs/mnist1d_cnn.yaml", sets)
    with pytest.raises(
        ConfigError, match=r"loss.grad=fused is not available for model.name=cnn.*mlp"
    ):
        build(cfg)
