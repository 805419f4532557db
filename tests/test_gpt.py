"""The GPT model: key/value-cache decoding equals the full forward pass, sampling, the
training run on text (parallel equality, resume with dropout, a checkpoint of the unrolled
blocks resumed scanned) and the sampling CLI."""

import json
import shutil
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import TINY_GPT
from _tolerance import (
    ROUNDINGS_PER_LAYER,
    SAME_PROGRAMS,
    assert_close_f32,
    assert_same_trajectory,
    first_step_grads,
    max_abs_diff,
)

import nnlite as nl
from models.gpt import GPT
from train import Callback, load_run
from train import sample as sample_cli
from train.config import load_config
from train.loop.trainer import train
from train.model.contract import objective_fn

ROOT = Path(__file__).resolve().parents[1]
TINY = GPT(vocab_size=11, context=8, n_layer=2, n_head=2, n_embd=16)


FORWARD = jax.jit(TINY.__call__)
GENERATE = jax.jit(TINY.generate, static_argnames=("n_tokens", "top_k"))


@pytest.fixture(scope="module")
def tiny_params():
    return jax.jit(TINY.init)(jax.random.key(0))


def test_kv_cache_decode_equals_the_full_forward(tiny_params):
    tokens = jax.random.randint(jax.random.key(1), (3, TINY.context), 0, TINY.vocab_size)
    full = FORWARD(tiny_params, tokens)
    step = jax.jit(TINY.decode_step)
    cache = TINY.empty_cache(3)
    for pos in range(TINY.context):
        logits, cache = step(tiny_params, cache, tokens[:, pos], jnp.int32(pos))
        # float32 rounding of the logits' scale along 2 blocks of 12 layers (see
        # tests/test_hand_vjp.py), the embeddings, the final norm and the head
        assert_close_f32(logits, full[:, pos], ops=ROUNDINGS_PER_LAYER * 28)


def naive_generate(model, params, prompt, n, pick):
    """The recompute-everything reference with the same sliding window as ``generate``.
    The window is padded to the context (causal: padding after the last token changes
    nothing before it), so one compiled forward serves every length."""
    seq, start = list(prompt), 0
    for _ in range(n):
        last = len(seq) - 1  # the token fed now
        if last - start == model.context:  # the window is full: it slides by half
            start = last - model.context // 2
        window = seq[start:] + [0] * (model.context - (len(seq) - start))
        logits = FORWARD(params, jnp.asarray([window]))[0, last - start]
        seq.append(pick(logits))
    return seq


def test_greedy_generation_matches_the_naive_loop_past_the_context(tiny_params):
    prompt = [1, 2, 3]
    n = 2 * TINY.context + 3  # slides twice
    gen = GENERATE
    out = gen(tiny_params, jnp.asarray([prompt]), n, jax.random.key(0), 0.0)
    want = naive_generate(TINY, tiny_params, prompt, n, lambda lg: int(jnp.argmax(lg)))
    assert out.shape == (1, len(prompt) + n)
    assert out[0].tolist() == want
    # top-k 1 at any temperature is greedy too
    top1 = gen(tiny_params, jnp.asarray([prompt]), n, jax.random.key(5), 1.3, top_k=1)
    assert top1[0].tolist() == want


def test_sampling_is_a_function_of_the_key(tiny_params):
    gen = GENERATE
    prompt = jnp.asarray([[4, 5]])
    a = gen(tiny_params, prompt, 20, jax.random.key(1), 1.0, top_k=5)
    b = gen(tiny_params, prompt, 20, jax.random.key(1), 1.0, top_k=5)
    c = gen(tiny_params, prompt, 20, jax.random.key(2), 1.0, top_k=5)
    assert (a == b).all() and not (a == c).all()
    assert a[0, :2].tolist() == [4, 5]
    # top-k restricts every draw to the k most likely next tokens (checked within the
    # first context, before the window slides)
    logits = FORWARD(tiny_params, a[:, : TINY.context])
    for i in range(2, TINY.context):
        top5 = np.argsort(np.asarray(logits[0, i - 1]))[-5:].tolist()
        assert int(a[0, i]) in top5


def test_loss_is_nats_per_char_and_bits(tiny_params):
    x = jnp.zeros((2, 8), jnp.int32)
    loss, metrics = jax.jit(objective_fn(TINY))(tiny_params, x, x)
    assert float(metrics["bits_per_char"]) == pytest.approx(float(loss) / np.log(2))
    # at init the head is near uniform: about ln(vocab)
    assert float(loss) == pytest.approx(np.log(TINY.vocab_size), rel=0.05)


# -- training on text ----------------------------------------------------------------------
TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
) * 6


def text_file(tmp_path) -> str:
    p = tmp_path / "tiny.txt"
    if not p.exists():
        p.write_text(TEXT)
    return str(p)


def tiny_run(tmp_path, *overrides, name="g", resume="fresh", callbacks=()):
    cfg = load_config(
        ROOT / "configs/shakespeare_gpt.yaml",
        [
            f"log.dir={tmp_path}",
            "log.progress=false",
            "log.plot=false",
            f"name={name}",
            *TINY_GPT,
            f"data.path={text_file(tmp_path)}",
            "data.eval_windows=16",
            "train.steps=12",
            "train.steps_per_call=3",  # every call 3 steps: one compiled size
            "train.eval_every=6",
            "train.log_every=3",
            "optimizer.warmup_steps=2",
            "checkpoint.every=6",
            *overrides,
        ],
    )
    return train(cfg, resume=resume, echo=lambda *_: None, callbacks=callbacks)


# One trained run (dropout on) for the learning, resume and sampling CLI tests
TRAINED = ["train.steps=24", "optimizer.learning_rate=0.003", "model.dropout=0.1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("trained"), *TRAINED, name="g")


def test_gpt_trains_and_logs_val_loss_in_nats_and_bits(trained):
    r = trained
    records = [json.loads(ln) for ln in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in records if x["split"] == "val"]
    assert [x["step"] for x in val] == [6, 12, 18, 24]
    assert all(x["bits_per_char"] == pytest.approx(x["loss"] / np.log(2)) for x in val)
    # it learns: below the uniform guess ln(vocab) and falling
    assert val[-1]["loss"] < np.log(r.data.num_classes) - 0.25
    assert val[-1]["loss"] < val[0]["loss"] - 0.1
    assert r.summary["val_loss"] == val[-1]["loss"]


class FirstStep(Callback):
    """Keeps the optimizer state after step 1 (a boundary: one step a call, logged)."""

    opt_state = None

    def on_step_end(self, loop, step, metrics):
        if step == 1:
            self.opt_state = loop.opt_state()


def six_steps(*overrides):
    """The overrides of a 6-step run whose first step's gradient is read (SAME_PROGRAMS,
    tests/_tolerance.py; a boundary after every step)."""
    return [*overrides, *SAME_PROGRAMS, "train.steps=6", "train.log_every=1"]


def grads_and_trajectory(tmp_path, *overrides, name):
    """The first step's gradient and the 6-step run: one run, read after its first step
    (under SAME_PROGRAMS that step is the one a 1-step run takes)."""
    first = FirstStep()
    r = tiny_run(tmp_path, *six_steps(*overrides), name=name, callbacks=[first])
    assert first.opt_state is not None, "no boundary after step 1"
    one = types.SimpleNamespace(cfg=r.cfg, step=1, opt_state=first.opt_state)
    return first_step_grads(one), r


#: the one-device reference: unrolled blocks; checkpoints at 3 and 6 for the layout test
REF = ["parallel.strategy=none", "checkpoint.every=3"]


@pytest.fixture(scope="module")
def one_device_ref(tmp_path_factory):
    """One device's gradient and run, trained once for both strategies' tests and the
    checkpoint layout test."""
    ref = grads_and_trajectory(tmp_path_factory.mktemp("ref"), *REF, name="ref")
    init = ref[1].model.init(jax.random.key(ref[1].cfg.seed))
    assert max_abs_diff(ref[1].params, init) > 1e-3
    return ref


@pytest.mark.parametrize(
    "strategy, options",
    [
        ("pmap", []),
        # the stack's hand rule inside shard_map: the scanned, rematted blocks' gradients
        # summed over the devices as one device computes the unrolled blocks'
        ("shard_map", ["model.scan_layers=true", "model.remat=block"]),
    ],
)
def test_gpt_parallel_equals_one_device(tmp_path, strategy, options, one_device_ref):
    ref = one_device_ref
    got = grads_and_trajectory(
        tmp_path, f"parallel.strategy={strategy}", "parallel.devices=2", *options, name=strategy
    )
    # back in the unrolled layout (a no-op for the unrolled model)
    layout = ref[1].model.convert_params
    # 16 layers: embeddings, norm, attention's 5 steps, residual, norm, MLP's 3, residual,
    # final norm, tied head, loss
    assert_close_f32(layout(got[0]), ref[0], ops=ROUNDINGS_PER_LAYER * 16)
    assert_same_trajectory(
        layout(got[1].params), ref[1].params, lr=ref[1].cfg.optimizer.learning_rate
    )


# -- checkpoints of the other block layout (nl.Stack: tests/test_deep.py) ------------------------
def test_a_checkpoint_of_one_layout_resumes_and_loads_in_the_other(one_device_ref):
    whole = one_device_ref[1]  # 1 block, unrolled: a list of 1; 6 steps, checkpoints at 3, 6
    split = whole.run_dir.parent / "split"
    shutil.copytree(whole.run_dir, split)
    (split / "checkpoints" / "ckpt_00000006.safetensors").unlink()
    # resumed from the unrolled step-3 checkpoint with the blocks scanned
    sets = six_steps(*REF, "model.scan_layers=true")
    resumed = tiny_run(whole.run_dir.parent, *sets, name="split", resume="require")
    assert resumed.step == 6
    assert resumed.params.blocks.attn.qkv.W.shape[0] == 1
    lr = whole.cfg.optimizer.learning_rate
    assert_same_trajectory(whole.model.convert_params(resumed.params), whole.params, lr=lr)
    # the unrolled run's directory, loaded with the scanned run's checkpoint (and optimizer
    # state): converted into the unrolled layout
    ckpt = split / "checkpoints" / "ckpt_00000006.safetensors"
    loaded = load_run(whole.run_dir, checkpoint=ckpt, with_opt_state=True)
    assert isinstance(loaded.params.blocks, list)
    np.testing.assert_array_equal(
        loaded.params.blocks[0].mlp.fc.W, resumed.params.blocks.mlp.fc.W[0]
    )
    mu = loaded.opt_state
    assert any(
        isinstance(getattr(s, "mu", None), nl.ParamsDict) and isinstance(s.mu.blocks, list)
        for s in jax.tree.leaves(mu, is_leaf=lambda s: hasattr(s, "mu"))
    )


def test_gpt_resume_with_dropout_is_bit_identical(trained):
    # Simulate a crash right after the step-18 checkpoint: a copy of the trained run
    # without the later checkpoint, resumed.
    whole = trained
    split = whole.run_dir.parent / "split"
    shutil.copytree(whole.run_dir, split)
    (split / "checkpoints" / "ckpt_00000024.safetensors").unlink()
    resumed = tiny_run(whole.run_dir.parent, *TRAINED, name="split", resume="require")
    assert resumed.step == 24 and max_abs_diff(whole.params, resumed.params) == 0.0


def test_gpt_dropout_is_on_with_a_key(tiny_params):
    model = GPT(vocab_size=11, context=8, n_layer=2, n_head=2, n_embd=16, dropout=0.5)
    assert model.uses_key and not TINY.uses_key
    x = jnp.zeros((2, 8), jnp.int32)
    loss = jax.jit(lambda p, x, k: objective_fn(model)(p, x, x, key=k)[0])
    k0 = jax.random.key(0)
    assert float(loss(tiny_params, x, k0)) != float(loss(tiny_params, x, None))
    assert float(loss(tiny_params, x, k0)) == float(loss(tiny_params, x, k0))


# -- the sampling CLI ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(trained):
    return trained.run_dir


def test_sample_cli_prints_text_and_is_deterministic(trained_run, capsys):
    argv = ["--run", str(trained_run), "--prompt", "To be", "--tokens", "40", "--seed", "3"]
    assert sample_cli.main(argv) == 0
    out1, err = capsys.readouterr()
    assert out1.startswith("To be") and len(out1) == len("To be") + 40 + 1
    assert "tokens/s" in err
    assert sample_cli.main(argv) == 0
    assert capsys.readouterr().out == out1
    assert sample_cli.main([*argv[:-1], "4"]) == 0
    assert capsys.readouterr().out != out1


@pytest.mark.parametrize(
    "args, match",
    [
        (["--run", "{tmp}/nope"], "no such run directory"),
        (["--run", "{tmp}"], "no config.yaml"),
        (["--run", "{run}", "--prompt", "Zebra\u00e9"], "outside the model's vocabulary"),
        (["--run", "{run}", "--prompt", "To be " * 5], "longer than the model's context of 16"),
        (["--run", "{run}", "--tokens", "0"], "--tokens must be >= 1"),
        (["--run", "{run}", "--tokens", "many"], "invalid int value: 'many'"),
        (["--run", "{run}", "--temperature", "-1"], "--temperature must be a finite number"),
        (["--run", "{run}", "--top-k", "-2"], "--top-k must be >= 0"),
        (["--prompt", "x"], "the following arguments are required: --run"),
        (["--run", "{run}", "--stream"], "--stream needs a model that decodes step by step"),
        (["--run", "{run}", "--repetition-penalty", "1.2"], "repetition_penalty needs a model"),
        (["--run", "{run}", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    ],
    ids=[
        "no_run",
        "no_config",
        "unknown_chars",
        "long_prompt",
        "tokens0",
        "tokens_text",
        "temperature",
        "top_k",
        "missing_run",
        "stream",
        "repetition_penalty",
        "repetition_penalty_0",
    ],
)
def test_sample_cli_bad_arguments_exit_2(trained_run, tmp_path, capsys, args, match):
    argv = [a.format(tmp=tmp_path, run=trained_run) for a in args]
    assert sample_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err


def test_sample_cli_no_checkpoint(trained_run, tmp_path, capsys):
    empty = tmp_path / "run"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    assert sample_cli.main(["--run", str(empty)]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
