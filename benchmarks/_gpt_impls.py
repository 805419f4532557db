"""One GPT training step written several ways: raw JAX, Equinox, Flax NNX, nnlite (per step
and with several steps per compiled call), and a matmul-floor reference.

The model is nanoGPT's (token + learned position embeddings, pre-LN blocks of causal
multi-head attention and a 4x GELU MLP, final LayerNorm, head tied to the token
embedding, no dropout). Every implementation starts from the same float32 weights (a
canonical dict, copied into each framework's parameters), trains with the same AdamW on the
same windows, and computes the mean next-token cross-entropy.

Data: a random token stream; step ``s`` uses the windows starting at ``starts[s % n]``.
The peers take each step's ``(x, y)`` as device arrays made up front; nnlite does what its
training loop does: the stream lives on the device and each call sends window starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._impls import (
    Equinox,
    FlaxNNX,
    Impl,
    MatmulFloor,
    Nnlite,
    RawJax,
    compile_nnlite,
    peer_rows,
)


@dataclass(frozen=True)
class GPTSpec:
    name: str
    vocab: int
    context: int
    n_layer: int
    n_head: int
    n_embd: int
    batch: int

    def nnlite_model(self):
        from models.gpt import GPT

        return GPT(self.vocab, self.context, self.n_layer, self.n_head, self.n_embd)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.context

    def matmul_flops(self) -> int:
        """FLOPs of the matmuls one train step computes (forward, and the weight and input
        gradients of the backward pass): per layer the qkv, output, fc and proj
        projections, the two attention products, and the tied head."""
        b, t, c, v, nl_ = self.batch, self.context, self.n_embd, self.vocab, self.n_layer
        n = b * t
        proj = 2 * n * c * (3 * c + c + 4 * c + 4 * c)  # qkv, out, fc, proj
        attn = 2 * 2 * b * t * t * c  # q k^T and att v, summed over heads
        head = 2 * n * c * v
        fwd = nl_ * (proj + attn) + head
        # backward: two matmuls per forward matmul (input and weight gradients); the first
        # layer's qkv input gradient is still needed (the embeddings are trained)
        return 3 * fwd


GPT_SPECS = {
    "gpt_baby": GPTSpec("gpt_baby", 84, 64, 4, 4, 128, 12),
    "gpt_large": GPTSpec("gpt_large", 84, 256, 6, 6, 384, 64),
    # GPT-2 small's shape (nanoGPT's padded vocabulary), for an accelerator
    "gpt2_small": GPTSpec("gpt2_small", 50304, 1024, 12, 12, 768, 8),
}
GPT_TINY = GPTSpec("gpt_tiny", 11, 8, 1, 2, 16, 4)


def init_weights(spec: GPTSpec, seed: int = 0) -> dict:
    """Canonical host weights, GPT-2's init: matrices N(0, 0.02) (residual projections
    scaled by 1/sqrt(2 n_layer)), biases 0, LayerNorm scale 1 and offset 0."""
    rng = np.random.default_rng(seed)
    c = spec.n_embd
    f32 = np.float32

    def normal(*shape, std=0.02):
        return (std * rng.normal(size=shape)).astype(f32)

    def ln():
        return {"scale": np.ones(c, f32), "bias": np.zeros(c, f32)}

    proj_std = 0.02 / math.sqrt(2 * spec.n_layer)
    blocks = [
        {
            "ln1": ln(),
            "qkv": {"W": normal(c, 3 * c), "b": np.zeros(3 * c, f32)},
            "out": {"W": normal(c, c, std=proj_std), "b": np.zeros(c, f32)},
            "ln2": ln(),
            "fc": {"W": normal(c, 4 * c), "b": np.zeros(4 * c, f32)},
            "proj": {"W": normal(4 * c, c, std=proj_std), "b": np.zeros(c, f32)},
        }
        for _ in range(spec.n_layer)
    ]
    return {
        "wte": normal(spec.vocab, c),
        "wpe": normal(spec.context, c),
        "blocks": blocks,
        "ln_f": ln(),
    }


def make_data(spec: GPTSpec, n_batches: int, seed: int = 0):
    """A token stream ``[n]`` int32, and each step's window starts ``[n_batches, batch]``."""
    rng = np.random.default_rng(seed)
    n = spec.context * spec.batch * 4 + spec.context + 1
    stream = rng.integers(0, spec.vocab, size=n).astype(np.int32)
    starts = rng.integers(0, n - spec.context, size=(n_batches, spec.batch)).astype(np.int32)
    return stream, starts


def windows(stream: np.ndarray, starts: np.ndarray, t: int):
    pos = starts[:, None] + np.arange(t)
    return stream[pos], stream[pos + 1]


def optimizer(lr: float = 1e-3) -> optax.GradientTransformation:
    """The recipe's optimizer: clip 1.0, AdamW(b1 0.9, b2 0.99, weight decay 0.1 on
    matrices only)."""
    mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=0.1, mask=mask),
    )


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# -- raw JAX ------------------------------------------------------------------------------
def layer_norm(p, x, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def raw_forward(params, tokens, n_head: int):
    """Logits ``[B, T, V]`` of the canonical-weights GPT, written in plain jax.numpy."""
    b, t = tokens.shape
    x = params["wte"][tokens] + params["wpe"][:t]
    c = x.shape[-1]
    d = c // n_head
    causal = jnp.tril(jnp.ones((t, t), bool))
    for blk in params["blocks"]:
        h = layer_norm(blk["ln1"], x)
        qkv = (h @ blk["qkv"]["W"] + blk["qkv"]["b"]).reshape(b, t, 3, n_head, d)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        att = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
        o = jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, c)
        x = x + o @ blk["out"]["W"] + blk["out"]["b"]
        h = layer_norm(blk["ln2"], x)
        h = jax.nn.gelu(h @ blk["fc"]["W"] + blk["fc"]["b"], approximate=True)
        x = x + h @ blk["proj"]["W"] + blk["proj"]["b"]
    x = layer_norm(params["ln_f"], x)
    return x @ params["wte"].T


class Windows:
    """Mixed into the peers: each step's ``(x, y)`` are the token windows starting at the
    batch's starts, as device arrays. The step and the loop come from the MLP peers."""

    def batch(self, X, Y, i):
        return tuple(map(jax.device_put, windows(X, i, self.spec.context)))


class RawJaxGPT(Windows, RawJax):
    """Nested dicts of arrays and ``jax.jit`` with donated params/opt state."""

    def loss_fn(self, params, x, y):
        return xent(raw_forward(params, x, self.spec.n_head), y)

    def reset(self):
        self.params = jax.tree.map(jnp.asarray, self.weights)
        self.opt_state = self.tx.init(self.params)
        self.t = 0


def split_qkv(blk: dict, c: int):
    """The canonical fused ``qkv`` projection as three ``(W [c, c], b [c])`` pairs."""
    W, b = blk["qkv"]["W"], blk["qkv"]["b"]
    return [(W[:, i * c : (i + 1) * c], b[i * c : (i + 1) * c]) for i in range(3)]


class EquinoxGPT(Windows, Equinox):
    """``eqx.nn.Embedding``, ``eqx.nn.LayerNorm``, ``eqx.nn.MultiheadAttention`` (causal mask)
    and ``eqx.nn.Linear`` in an ``eqx.Module``; one sequence per call, ``jax.vmap`` over the
    batch, ``eqx.filter_value_and_grad`` and ``eqx.filter_jit``, as in Equinox's examples."""

    donate = "all-except-first"

    @cached_property
    def model_class(self):
        """The model class, defined once: a new class per reset would be a new pytree
        type, so every reset would recompile the step."""
        import equinox as eqx

        spec = self.spec
        c, h = spec.n_embd, spec.n_head

        class Block(eqx.Module):
            ln1: eqx.nn.LayerNorm
            attn: eqx.nn.MultiheadAttention
            ln2: eqx.nn.LayerNorm
            fc: eqx.nn.Linear
            proj: eqx.nn.Linear

            def __init__(self, key):
                k1, k2, k3 = jax.random.split(key, 3)
                self.ln1, self.ln2 = eqx.nn.LayerNorm(c), eqx.nn.LayerNorm(c)
                self.attn = eqx.nn.MultiheadAttention(
                    h,
                    c,
                    use_query_bias=True,
                    use_key_bias=True,
                    use_value_bias=True,
                    use_output_bias=True,
                    key=k1,
                )
                self.fc = eqx.nn.Linear(c, 4 * c, key=k2)
                self.proj = eqx.nn.Linear(4 * c, c, key=k3)

            def __call__(self, x, mask):
                hx = jax.vmap(self.ln1)(x)
                x = x + self.attn(hx, hx, hx, mask=mask)
                hx = jax.vmap(self.ln2)(x)
                return x + jax.vmap(self.proj)(jax.nn.gelu(jax.vmap(self.fc)(hx), approximate=True))

        class GPT(eqx.Module):
            wte: eqx.nn.Embedding
            wpe: eqx.nn.Embedding
            blocks: list
            ln_f: eqx.nn.LayerNorm

            def __init__(self, key):
                keys = jax.random.split(key, spec.n_layer + 2)
                self.wte = eqx.nn.Embedding(spec.vocab, c, key=keys[0])
                self.wpe = eqx.nn.Embedding(spec.context, c, key=keys[1])
                self.blocks = [Block(k) for k in keys[2:]]
                self.ln_f = eqx.nn.LayerNorm(c)

            def __call__(self, tokens):  # [T] -> [T, vocab]
                t = tokens.shape[0]
                x = self.wte.weight[tokens] + self.wpe.weight[:t]
                mask = jnp.tril(jnp.ones((t, t), bool))
                for blk in self.blocks:
                    x = blk(x, mask)
                return jax.vmap(self.ln_f)(x) @ self.wte.weight.T

        return GPT

    def reset(self):
        import equinox as eqx

        spec, w = self.spec, self.weights
        c = spec.n_embd

        model = self.model_class(jax.random.key(0))
        a = jnp.asarray
        where, values = [], []

        def put(get, value):
            where.append(get)
            values.append(a(value))

        put(lambda m: m.wte.weight, w["wte"])
        put(lambda m: m.wpe.weight, w["wpe"])
        put(lambda m: m.ln_f.weight, w["ln_f"]["scale"])
        put(lambda m: m.ln_f.bias, w["ln_f"]["bias"])
        for i, blk in enumerate(w["blocks"]):
            (Wq, bq), (Wk, bk), (Wv, bv) = split_qkv(blk, c)
            for name, lnp in (("ln1", blk["ln1"]), ("ln2", blk["ln2"])):
                put(lambda m, i=i, n=name: getattr(m.blocks[i], n).weight, lnp["scale"])
                put(lambda m, i=i, n=name: getattr(m.blocks[i], n).bias, lnp["bias"])
            for proj, (Wx, bx) in (
                ("query_proj", (Wq, bq)),
                ("key_proj", (Wk, bk)),
                ("value_proj", (Wv, bv)),
                ("output_proj", (blk["out"]["W"], blk["out"]["b"])),
            ):
                put(lambda m, i=i, p=proj: getattr(m.blocks[i].attn, p).weight, Wx.T)
                put(lambda m, i=i, p=proj: getattr(m.blocks[i].attn, p).bias, bx)
            for lin in ("fc", "proj"):
                put(lambda m, i=i, n=lin: getattr(m.blocks[i], n).weight, blk[lin]["W"].T)
                put(lambda m, i=i, n=lin: getattr(m.blocks[i], n).bias, blk[lin]["b"])
        model = eqx.tree_at(lambda m: [g(m) for g in where], model, values)
        self.model = model
        self.opt_state = self.tx.init(eqx.filter(model, eqx.is_array))
        self.t = 0


class FlaxNNXGPT(Windows, FlaxNNX):
    """``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.MultiHeadAttention`` (causal mask) and
    ``nnx.Linear`` in an ``nnx.Module``; ``nnx.Optimizer``, ``nnx.value_and_grad`` and
    ``nnx.jit``, as in the Flax NNX docs."""

    @cached_property
    def model_class(self):
        """The model class, defined once: a new class per reset would be a new pytree
        type, so every reset would recompile the step."""
        from flax import nnx

        spec = self.spec
        c, h = spec.n_embd, spec.n_head

        class Block(nnx.Module):
            def __init__(self, rngs):
                self.ln1 = nnx.LayerNorm(c, epsilon=1e-5, rngs=rngs)
                self.attn = nnx.MultiHeadAttention(h, c, decode=False, rngs=rngs)
                self.ln2 = nnx.LayerNorm(c, epsilon=1e-5, rngs=rngs)
                self.fc = nnx.Linear(c, 4 * c, rngs=rngs)
                self.proj = nnx.Linear(4 * c, c, rngs=rngs)

            def __call__(self, x, mask):
                x = x + self.attn(self.ln1(x), mask=mask)
                return x + self.proj(nnx.gelu(self.fc(self.ln2(x)), approximate=True))

        class GPT(nnx.Module):
            def __init__(self, rngs):
                self.wte = nnx.Embed(spec.vocab, c, rngs=rngs)
                self.wpe = nnx.Embed(spec.context, c, rngs=rngs)
                self.blocks = nnx.List([Block(rngs) for _ in range(spec.n_layer)])
                self.ln_f = nnx.LayerNorm(c, epsilon=1e-5, rngs=rngs)

            def __call__(self, tokens):  # [B, T] -> [B, T, vocab]
                t = tokens.shape[-1]
                x = self.wte(tokens) + self.wpe.embedding[...][:t]
                mask = nnx.make_causal_mask(tokens)
                for blk in self.blocks:
                    x = blk(x, mask)
                return self.wte.attend(self.ln_f(x))

        return GPT

    def reset(self):
        from flax import nnx

        spec, w = self.spec, self.weights
        c, h = spec.n_embd, spec.n_head
        d = c // h

        model = self.model_class(nnx.Rngs(0))
        a = jnp.asarray
        model.wte.embedding.value = a(w["wte"])
        model.wpe.embedding.value = a(w["wpe"])
        model.ln_f.scale.value, model.ln_f.bias.value = a(w["ln_f"]["scale"]), a(w["ln_f"]["bias"])
        for blk_m, blk in zip(model.blocks, w["blocks"]):
            for ln_m, lnp in ((blk_m.ln1, blk["ln1"]), (blk_m.ln2, blk["ln2"])):
                ln_m.scale.value, ln_m.bias.value = a(lnp["scale"]), a(lnp["bias"])
            for lin, (Wx, bx) in zip(
                (blk_m.attn.query, blk_m.attn.key, blk_m.attn.value), split_qkv(blk, c)
            ):
                lin.kernel.value = a(Wx.reshape(c, h, d))
                lin.bias.value = a(bx.reshape(h, d))
            blk_m.attn.out.kernel.value = a(blk["out"]["W"].reshape(h, d, c))
            blk_m.attn.out.bias.value = a(blk["out"]["b"])
            for lin_m, name in ((blk_m.fc, "fc"), (blk_m.proj, "proj")):
                lin_m.kernel.value, lin_m.bias.value = a(blk[name]["W"]), a(blk[name]["b"])
        self.model = model
        self.optimizer = nnx.Optimizer(model, self.tx, wrt=nnx.Param)
        self.t = 0


def nnlite_params(weights: dict):
    """The canonical weights as ``models.gpt.GPT``'s ParamsDict (the same layout: fused
    qkv with columns ``[q | k | v]``, heads contiguous)."""
    import nnlite as nl

    a = jnp.asarray
    lin = lambda d: nl.ParamsDict(W=a(d["W"]), b=a(d["b"]))
    ln = lambda d: nl.ParamsDict(scale=a(d["scale"]), bias=a(d["bias"]))
    blocks = [
        nl.ParamsDict(
            ln1=ln(b["ln1"]),
            attn=nl.ParamsDict(qkv=lin(b["qkv"]), out=lin(b["out"])),
            ln2=ln(b["ln2"]),
            mlp=nl.ParamsDict(fc=lin(b["fc"]), proj=lin(b["proj"])),
        )
        for b in weights["blocks"]
    ]
    return nl.ParamsDict(
        wte=nl.ParamsDict(W=a(weights["wte"])),
        wpe=nl.ParamsDict(W=a(weights["wpe"])),
        blocks=blocks,
        ln_f=ln(weights["ln_f"]),
    )


class NnliteGPT(Nnlite):
    """nnlite's training machinery: ``models.gpt.GPT`` and the trainer's compiled step
    (``train.compile_fit``); the token stream on the device, window starts sent per call,
    K steps a call."""

    def compile(self, X, Y, batch: int):
        """Windows of the stream ``X``, their next tokens as targets, as the text data sets'."""
        return compile_nnlite(
            self.model, self.tx, batch, grad=self.grad, steps_per_call=self.steps_per_call, tokens=X
        )

    def params_from_weights(self):
        return nnlite_params(self.weights)


class MatmulFloorGPT(MatmulFloor):
    """Not a trainer: only the matmuls of a GPT train step, to bound what any implementation
    can reach. Per step: the forward projections (qkv, out, fc, proj), the two attention
    products and the tied head, with nothing between them (no LayerNorm, softmax, GELU,
    residual, loss or Adam), then their input and weight gradients by ``jax.vjp``, then
    ``W -= 1e-6 dW`` so each step depends on the last. Weights are scaled ``1/sqrt(fan_in)``
    so values stay near 1 (no denormals). ``steps_per_call`` steps run in one ``lax.scan``."""

    def setup(self, X, Y, idx):
        spec = self.spec
        b, t, c, h = spec.batch, spec.context, spec.n_embd, spec.n_head
        d = c // h
        rng = np.random.default_rng(1)
        self.block = jnp.asarray(rng.normal(size=(self.steps_per_call, b, t, c)).astype(np.float32))

        def matmuls(Ws, x):
            for blk in Ws["blocks"]:
                q, k, v = jnp.split((x @ blk["qkv"]).reshape(b, t, 3 * h, d), 3, axis=2)
                att = jnp.einsum("bthd,bshd->bhts", q, k) * (1 / math.sqrt(d * t))
                o = jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, c)
                x = ((o @ blk["out"]) @ blk["fc"]) @ blk["proj"]
            return x @ Ws["wte"].T

        def one(Ws, x):
            out, vjp = jax.vjp(matmuls, Ws, x)
            dWs, _ = vjp(out)
            return jax.tree.map(lambda W, dW: W - 1e-6 * dW, Ws, dWs)

        self.step = self.scanned(one)

    def reset(self):
        rng = np.random.default_rng(2)
        c, v = self.spec.n_embd, self.spec.vocab

        def mat(i, o):
            return jnp.asarray((rng.normal(size=(i, o)) / math.sqrt(i)).astype(np.float32))

        self.Ws = {
            "wte": mat(v, c) * math.sqrt(v / c),
            "blocks": [
                {"qkv": mat(c, 3 * c), "out": mat(c, c), "fc": mat(c, 4 * c), "proj": mat(4 * c, c)}
                for _ in range(self.spec.n_layer)
            ],
        }
        self.t = 0


class TorchGPT(Impl):
    """Optional (only when ``torch`` is importable): nanoGPT's model in PyTorch, as its
    ``model.py`` writes it (fused ``c_attn``, ``F.scaled_dot_product_attention`` with
    ``is_causal=True``, tied head), GELU with the tanh approximation to match the others,
    ``torch.optim.AdamW`` (decay 0.1 on matrices only) and ``clip_grad_norm_(1.0)``; eager
    mode. On a CPU: ``fused`` off, PyTorch's default thread count. With CUDA, as nanoGPT's
    ``train.py`` sets it up: the model and batches on the GPU, TF32 matmuls allowed (XLA's
    default for float32 dots on the GPU too), fused AdamW; ``autocast`` (the ``PyTorch
    bf16 autocast`` row) is nanoGPT's default ``dtype='bfloat16'``."""

    name = "PyTorch"

    def __init__(self, *args, autocast: bool = False, **kwargs):
        self.autocast = autocast
        if autocast:
            self.name = "PyTorch bf16 autocast"
        super().__init__(*args, **kwargs)

    def setup(self, X, Y, idx):
        import torch

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        t = self.spec.context
        self.batches = [
            tuple(torch.from_numpy(a.astype(np.int64)).to(self.device) for a in windows(X, i, t))
            for i in idx
        ]

    @cached_property
    def model_class(self):
        """The model class, defined once: a new class per reset would be a new pytree
        type, so every reset would recompile the step."""
        torch = self.torch
        nn, F = torch.nn, torch.nn.functional
        spec = self.spec
        c, h = spec.n_embd, spec.n_head

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
                self.c_attn, self.c_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
                self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

            def forward(self, x):
                b, t, _ = x.shape
                q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
                q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
                return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

        class GPT(nn.Module):
            def __init__(self):
                super().__init__()
                self.wte, self.wpe = nn.Embedding(spec.vocab, c), nn.Embedding(spec.context, c)
                self.h = nn.ModuleList([Block() for _ in range(spec.n_layer)])
                self.ln_f = nn.LayerNorm(c)

            def forward(self, idx, targets):
                x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
                for blk in self.h:
                    x = blk(x)
                logits = self.ln_f(x) @ self.wte.weight.T  # the tied head
                return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

        return GPT

    def reset(self):
        torch = self.torch
        w = self.weights

        model = self.model_class()
        T = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        with torch.no_grad():
            model.wte.weight.copy_(T(w["wte"]))
            model.wpe.weight.copy_(T(w["wpe"]))
            model.ln_f.weight.copy_(T(w["ln_f"]["scale"]))
            model.ln_f.bias.copy_(T(w["ln_f"]["bias"]))
            for m, blk in zip(model.h, w["blocks"]):
                for ln_m, name in ((m.ln_1, "ln1"), (m.ln_2, "ln2")):
                    ln_m.weight.copy_(T(blk[name]["scale"]))
                    ln_m.bias.copy_(T(blk[name]["bias"]))
                for lin, name in (
                    (m.c_attn, "qkv"),
                    (m.c_proj, "out"),
                    (m.c_fc, "fc"),
                    (m.mlp_proj, "proj"),
                ):
                    lin.weight.copy_(T(blk[name]["W"].T))  # torch stores [out, in]
                    lin.bias.copy_(T(blk[name]["b"]))
        self.model = model.to(self.device)
        groups = [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = self.device == "cuda"
        self.opt = torch.optim.AdamW(
            groups, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, fused=fused or None
        )
        self.t = 0

    def run(self, n):
        torch, model, opt = self.torch, self.model, self.opt
        for s in range(self.t, self.t + n):
            x, y = self.batches[s % len(self.batches)]
            with torch.autocast(self.device, torch.bfloat16, enabled=self.autocast):
                loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        self.t += n
        return float(loss.detach())


def torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def build_all_gpt(
    spec: GPTSpec,
    *,
    n_batches: int = 10,
    steps_per_call: int = 10,
    matmul_floor: bool = False,
    pytorch: bool = False,
):
    """Every GPT implementation on the same weights, windows and optimizer; with
    ``pytorch`` (and torch installed), :class:`TorchGPT` too; with ``matmul_floor``, the
    :class:`MatmulFloorGPT` reference last."""
    weights = init_weights(spec)
    X, idx = make_data(spec, n_batches)
    tx = optimizer()
    peers = (RawJaxGPT, EquinoxGPT, FlaxNNXGPT, NnliteGPT)
    impls = peer_rows(peers, (spec, weights, X, None, idx, tx), steps_per_call)
    # every layer's hand-derived VJP (``loss.grad: manual``), and the trainer's default
    # (``auto``, manual for the GPT), side by side
    for grad in ("manual", "auto"):
        impls.append(
            NnliteGPT(spec, weights, X, None, idx, tx, steps_per_call=steps_per_call, grad=grad)
        )
    if pytorch and torch_available():
        impls.append(TorchGPT(spec, weights, X, None, idx, None))
        if pytorch == "autocast":
            impls.append(TorchGPT(spec, weights, X, None, idx, None, autocast=True))
    if matmul_floor:
        impls.append(
            MatmulFloorGPT(spec, weights, X, None, idx, None, steps_per_call=steps_per_call)
        )
    return impls
