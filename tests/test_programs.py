"""The programs the trainer and ``nl.hf`` compile, read as programs (their jaxprs and
StableHLO, nothing run): no parameter is a compile-time constant, and the train step of
every strategy takes the params and optimizer state as donated buffers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import nnlite as nl

#: A constant bigger than this many elements is parameter-sized (the tiny models' rotary
#: tables and position ids are far below it; their params are compared by value).
BOUND = 1024


def _constants(closed) -> list:
    """Every constant of a closed jaxpr and of the jaxprs nested in it (jit, scan, while,
    cond, custom_vjp, shard_map)."""
    found = []

    def walk(jaxpr, consts=()):
        found.extend(consts)
        for eqn in jaxpr.eqns:
            for value in eqn.params.values():
                for sub in value if isinstance(value, list | tuple) else [value]:
                    if isinstance(sub, jcore.ClosedJaxpr):
                        walk(sub.jaxpr, sub.consts)
                    elif isinstance(sub, jcore.Jaxpr):
                        walk(sub)

    walk(closed.jaxpr, closed.consts)
    return found


def param_constants(traced, *trees) -> list[str]:
    """What in ``traced`` (a ``jax.jit(...).trace(...)``) is a parameter held as a constant:
    the path of each leaf of ``trees`` equal to one of its constants, and any constant of
    more than :data:`BOUND` elements (a constant of one value everywhere, a broadcast zero
    or one, is no parameter and is not compared)."""
    leaves = [
        (nl.format_path(path), np.asarray(v))
        for tree in trees
        for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    hits = []
    for c in _constants(traced.jaxpr):
        if not hasattr(c, "shape") or jax.dtypes.issubdtype(c.dtype, jax.dtypes.extended):
            continue
        c = np.asarray(c)
        if c.size == 0 or np.all(c == c.flat[0]):  # one value broadcast (zeros, ones)
            continue
        if c.size > BOUND:
            hits.append(f"a constant {c.dtype}{list(c.shape)}")
        hits += [p for p, v in leaves if v.shape == c.shape and np.array_equal(v, c)]
    return hits


def _llama(**kw):
    cfg = dict(vocab_size=40, context=16, n_layer=1, n_head=2, n_embd=8, hidden=12)
    return nl.hf.LlamaLM(**{**cfg, **kw})


def test_the_check_finds_params_closed_over():
    """What the 135M benchmark's LoRA step did (its frozen base closed over): the params
    become constants of the program, and the check names them."""
    model = _llama(tie_head=True)
    params = jax.jit(model.init)(jax.random.key(0))
    x = np.zeros((1, 5), np.int32)
    closed = jax.jit(lambda x: model(params, x)).trace(x)
    assert "/embed/W" in param_constants(closed, params)
    assert param_constants(jax.jit(model).trace(params, x), params) == []


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_forward_and_generate_hold_no_param(kind):
    if kind == "llama":
        model = _llama(tie_head=True)
    else:
        model = nl.hf.GPT2LM(vocab_size=40, context=16, n_layer=1, n_head=2, n_embd=8)
    params = jax.jit(model.init)(jax.random.key(0))
    prompt = jnp.zeros((1, 3), jnp.int32)
    forward = jax.jit(model).trace(params, prompt)
    generate = jax.jit(model.generate, static_argnums=2).trace(
        params, prompt, 4, jax.random.key(1), 0.0
    )
    assert param_constants(forward, params) == []
    assert param_constants(generate, params) == []


def _config(tmp_path, model: dict, strategy="none", **parallel):
    from train.config import config_from_dict

    (tmp_path / "t.txt").write_text("the king shall love o " * 60)
    return config_from_dict({
        "name": "programs",
        "model": model,
        "data": {"name": "text", "path": str(tmp_path / "t.txt"), "context": 8},
        "optimizer": {"name": "adamw", "learning_rate": 0.01},
        "train": {"batch_size": 8, "steps": 2},
        "parallel": {"strategy": strategy, **parallel},
        "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
    })  # fmt: skip


def _trainer_programs(cfg):
    """``(run, params, opt_state, {name: traced program})``: the trainer's init, step and
    evaluation of ``cfg``, traced as ``compile_run`` traces them, and its predict and
    generate programs (``train.inference``)."""
    from train.inference import _apply, generator
    from train.loop.build import build, init_program, make_stepper
    from train.step.step import build_split_eval

    r = build(cfg)
    init = init_program(r.model, r.optimizer).trace(np.int32(cfg.seed))
    params, opt = init.lower().compile()(np.int32(cfg.seed))
    p_leaves, p_def = jax.tree.flatten(params)
    o_leaves, o_def = jax.tree.flatten(opt)
    stepper = make_stepper(r, p_def, o_def, "stop", jax.tree.structure(None))
    args = (
        stepper.put_state(p_leaves),
        (stepper.put_state(o_leaves), []),
        stepper.put_data(r.data.x),
        stepper.put_data(r.data.y),
        stepper.put_indices(np.zeros((2, cfg.train.batch_size), np.int32), 0),
    )
    x_test = r.data.x_test[:2]
    programs = {
        "init": init,
        "step": stepper.compiled.trace(*args),
        "eval": build_split_eval(r.model, 2, ()).trace(params, x_test, r.data.y_test[:2]),
        "predict": _apply(r.model).trace(params, x_test),
        "generate": generator(r.model).trace(
            params, np.zeros((1, 3), np.int32), 2, jax.random.key(0), 0.0, None
        ),
    }
    return r, params, opt, programs


def test_trainer_programs_of_the_shipped_gpt_hold_no_param(tmp_path):
    model = {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 8}
    _, params, opt, programs = _trainer_programs(_config(tmp_path, model))
    for name, traced in programs.items():
        assert param_constants(traced, params, opt) == [], name


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_trainer_programs_of_a_pretrained_model_with_a_peft_adapter_hold_no_param(
    tmp_path, param_dtype
):
    """``model.name: hf:DIR`` with ``lora.path`` (a peft adapter), its base stored in
    ``param_dtype``: the base weights and the adapter's are read by host callbacks, never
    held as constants, by init, the step, the evaluation, prediction and generation."""
    base = _llama(tie_head=True)
    nl.hf.save_pretrained(tmp_path / "base", base, jax.jit(base.init)(jax.random.key(0)))
    lora = base.with_lora(["*/attn/q"], rank=2)
    lp = jax.jit(lora.init)(jax.random.key(1))
    lp.blocks[0].attn.q.lora_b = jnp.full_like(lp.blocks[0].attn.q.lora_b, 0.5)
    nl.hf.save_adapter(tmp_path / "adapter", lora, lp)
    model = {"name": f"hf:{tmp_path / 'base'}", "lora": {"path": str(tmp_path / "adapter")},
             "param_dtype": param_dtype}  # fmt: skip
    _, params, opt, programs = _trainer_programs(_config(tmp_path, model))
    np.testing.assert_array_equal(params.blocks[0].attn.q.lora_b, 0.5)  # the adapter's
    assert params.blocks[0].attn.q.W.dtype == param_dtype
    for name, traced in programs.items():
        assert param_constants(traced, params, opt) == [], name


def _donated(lowered_text: str, n: int) -> list[int]:
    """Which of the first ``n`` arguments of the lowered ``main`` are donated (aliased to
    an output, or a buffer donor)."""
    sig = re.search(r"func\.func public @main\((.*?)\) ->", lowered_text, re.S).group(1)
    args = re.split(r", (?=%arg\d+:)", sig)
    return [i for i, a in enumerate(args[:n]) if "tf.aliasing_output" in a or "buffer_donor" in a]


@pytest.mark.parametrize(
    "strategy, parallel",
    [("none", {}), ("pmap", {}), ("shard_map", {}), ("fsdp", {}), ("tensor", {"tensor": 2})],
)
def test_every_strategy_donates_params_and_optimizer_state(tmp_path, strategy, parallel):
    """The design's "donate params and optimizer state buffers to the step", read from each
    strategy's lowered step: every one of those leaves is an aliased or donated input."""
    from train.loop.build import build, init_program, make_stepper

    model = {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 8}
    r = build(_config(tmp_path, model, strategy, devices=2, **parallel))
    params, opt = jax.eval_shape(init_program(r.model, r.optimizer), np.int32(0))
    p_leaves, p_def = jax.tree.flatten(params)
    o_leaves, o_def = jax.tree.flatten(opt)
    stepper = make_stepper(r, p_def, o_def, "stop", jax.tree.structure(None))
    zeros = [np.zeros(a.shape, a.dtype) for a in p_leaves + o_leaves]
    placed_p = stepper.put_state(zeros[: len(p_leaves)])
    placed_o = stepper.put_state(zeros[len(p_leaves) :])
    idx = stepper.put_indices(np.zeros((1, 8), np.int32), 0)
    X, Y = stepper.put_data(r.data.x), stepper.put_data(r.data.y)
    text = stepper.compiled.lower(placed_p, (placed_o, []), X, Y, idx).as_text()
    n = len(zeros)
    assert _donated(text, n) == list(range(n))
