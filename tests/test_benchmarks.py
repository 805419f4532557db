"""The train-step benchmark's implementations compute the same training (correctness only)."""

from pathlib import Path

import jax
import pytest
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32

from benchmarks._impls import TINY, Spec, losses_after


def assert_losses_agree(impls, n_steps, layers):
    """Every row's loss: in the first step (the same weights: forward rounding only, to
    8 roundings per layer) and after ``n_steps`` Adam steps, where rounding drifts the
    rows apart by a few roundings (measured: 1) and a wrong gradient by about what a step
    changes the loss, ~0.5%: within 1e-4 (~800 roundings) of raw JAX's."""
    one_step = [i for i in impls if "K=" not in i.name]  # a K=2 row takes 2 steps a call
    first = losses_after(one_step, 1)
    for name, value in first.items():
        assert_close_f32(value, first["raw JAX"], ops=ROUNDINGS_PER_LAYER * layers, what=name)
    losses = losses_after(impls, n_steps)
    ref = losses["raw JAX"]
    for name, value in losses.items():
        assert value == pytest.approx(ref, rel=1e-4), name
    # Training moved: the loss differs from the untrained loss.
    assert first["raw JAX"] != pytest.approx(ref, rel=1e-3)


def test_matmul_flops_counts_what_autodiff_computes():
    spec = Spec("t", 4, (8,), 2, 3)
    fwd = 2 * 3 * (4 * 8 + 8 * 2)
    # Weight gradients for both layers, the input gradient only for the second.
    assert spec.matmul_flops() == 2 * fwd + 2 * 3 * 8 * 2


def test_matmul_floor_does_the_steps_matmuls():
    import numpy as np

    from benchmarks._impls import MatmulFloor, init_weights, make_data

    weights, (X, Y, idx) = init_weights(TINY), make_data(TINY, 3)
    floor = MatmulFloor(TINY, weights, X, Y, idx, None, steps_per_call=2)
    floor.run(4)  # two calls of K=2 steps, each step on the same block of 2 batches
    Ws = [np.asarray(W, np.float64) for W, _ in weights]
    for step in range(4):
        hs = [X[idx[step % 2]].astype(np.float64)]
        for W in Ws:
            hs.append(hs[-1] @ W)
        dz, dWs = hs[-1], [None] * len(Ws)
        for i in reversed(range(len(Ws))):
            dWs[i] = hs[i].T @ dz
            dz = dz @ Ws[i].T
        Ws = [W - 1e-6 * dW for W, dW in zip(Ws, dWs)]
    for got, want in zip(floor.Ws, Ws):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="not a multiple of K=2"):
        floor.run(3)


PEERS = ["raw JAX", "Equinox", "Flax NNX", "nnlite", "nnlite K=2"]


def _gpt_names():
    from benchmarks._gpt_impls import torch_available

    # loss.grad manual and the trainer's default, auto (manual for the GPT), K=2 steps a
    # call; nanoGPT's PyTorch model is a row only where torch is installed (an optional
    # extra); the matmul floor is a timing reference that trains nothing
    hand = ["nnlite manual K=2", "nnlite auto K=2"]
    torch = ["PyTorch"] if torch_available() else []
    return [*PEERS, *hand, *torch, "matmul floor"]


@jax.numpy_rank_promotion("allow")
def test_cnn_implementations_agree_on_loss():
    """The CNN's rows (the MLP's and the GPT's are checked on the ``train_step --sizes
    small`` and ``gpt_baby`` smoke runs' own implementations, below)."""
    pytest.importorskip("flax")  # the Flax NNX row (the bench extra)
    from benchmarks._impls_cnn import CNN_TINY, build_all_cnn

    # loss.grad manual and the trainer's default, auto (manual here: the same program, so
    # the compile cache has it), one step per call as the CNN's config trains
    impls = build_all_cnn(CNN_TINY, n_batches=3, steps_per_call=2)
    assert [i.name for i in impls] == [*PEERS, "nnlite manual", "nnlite auto"]
    # whole K=2 calls: one compiled program per nnlite row; 2 x (conv, relu), flatten,
    # linear, loss
    assert_losses_agree(impls, 4, layers=7)


def _check_rows(monkeypatch, names, n_steps, layers) -> list:
    """Before a ``train_step`` smoke run's own same-loss check (which exits on a mismatch),
    its implementations checked as the CNN's above: every row named (``names``), the first
    step's losses to rounding and ``n_steps`` steps' within 1e-4. Returns a list that holds
    the checked names once the check ran."""
    import benchmarks.train_step as train_step

    own, checked = train_step.check_losses, []

    def check(impls, *args, **kwargs):
        assert [i.name for i in impls] == names
        assert_losses_agree(impls, n_steps, layers=layers)
        checked.append([i.name for i in impls])
        return own(impls, *args, **kwargs)

    monkeypatch.setattr(train_step, "check_losses", check)
    return checked


def test_cli_wall_times_the_command_phase_by_phase(tmp_path, monkeypatch, capsys):
    """``python -m benchmarks.cli_wall --tiny`` (its README smoke run, below) runs one real
    ``python -m train --timings`` sample and prints its table; the phases partition the
    sample's wall time."""
    import contextlib
    import json
    import types

    import benchmarks.cli_wall as cli_wall

    # the samples' run directory kept (the command deletes its temporary directory)
    keep = types.SimpleNamespace(TemporaryDirectory=lambda **_: contextlib.nullcontext(tmp_path))
    monkeypatch.setattr(cli_wall, "tempfile", keep)
    monkeypatch.setenv("NNLITE_BENCH_RESULTS", str(tmp_path / "results"))
    module, argv = SMOKE[CLI_WALL]
    assert cli_wall.main(argv) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) >= 3, out  # it printed its table
    result = json.loads((tmp_path / "results" / "cli_wall-tiny-latest.json").read_text())
    (sample,) = result["samples"]["digits_mlp cold"]
    phases = sample["phases"]
    assert {
        "interpreter",
        "imports",
        "compile",
        "train",
        "eval",
        "checkpoint",
        "plot",
        "exit",
    } <= set(phases)
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(sample["wall_s"], abs=0.05)
    assert sample["cpu_s"] > 0  # the process tree's CPU time, from getrusage
    assert (tmp_path / "runs" / "digits_mlp" / "curves.png").is_file()
    rows, med = cli_wall.summarize({"digits_mlp cold": [sample]})
    assert len(rows[0]) == 4 + len(cli_wall.COLUMNS)
    assert med["digits_mlp cold"]["wall_s"] == sample["wall_s"]


# -- every command of benchmarks/README.md runs, at a tiny size --------------------------------
GPT_STEP = "python -m benchmarks.train_step --sizes gpt_baby,gpt_large"
MLP_STEP = "python -m benchmarks.train_step"
README = Path(__file__).resolve().parents[1] / "benchmarks" / "README.md"
# command (as benchmarks/README.md lists it) -> the module and the arguments of its smoke run
SMOKE = {
    # its MLP rows' losses checked as the CNN's (the CNN's implementations are checked
    # above at the same tiny size)
    MLP_STEP: ("train_step", ["--tiny", "--sizes", "small"]),
    "python -m benchmarks.time_to_accuracy": ("time_to_accuracy", ["--tiny"]),
    "python -m benchmarks.first_step": ("first_step", ["--tiny"]),
    # with the PyTorch row where torch is installed; its rows' losses checked as the CNN's
    GPT_STEP: ("train_step", ["--tiny", "--sizes", "gpt_baby"]),
    "python -m benchmarks.sample": ("sample", ["--tiny"]),
    "python -m benchmarks.cli_wall": ("cli_wall", ["--tiny"]),
    "python -m benchmarks.data steps": ("data", ["steps", "--tiny"]),
    "python -m benchmarks.data rss": ("data", ["rss", "--tiny"]),
    "python -m benchmarks.deep": ("deep", ["--tiny", "--parts", "compile,remat"]),
    "python -m benchmarks.sharding": ("sharding", ["--tiny"]),
    "python -m benchmarks.checkpoint": ("checkpoint", ["--tiny"]),
    "python -m benchmarks.params_step frozen": ("params_step", ["frozen", "--tiny"]),
    "python -m benchmarks.params_step extras": ("params_step", ["extras", "--tiny"]),
    "python -m benchmarks.grad_modes": ("grad_modes", ["--tiny"]),
    "python -m benchmarks.pytree": ("pytree", ["--tiny"]),
    # its steps part is train_step's GPT rows and its trainer part python -m train, both
    # covered at tiny sizes elsewhere: the smoke run is the precision table it adds
    "python -m benchmarks.gpu": ("gpu", ["--tiny", "--parts", "precision"]),
    "python -m benchmarks.precision": (
        "precision",
        ["--tiny", "--train-steps", "0", "--grad", "autodiff"],
    ),
    # the GPT row only: each row is a fresh process with its HLO dumped
    "python -m benchmarks.op_profile": ("op_profile", ["--tiny", "--rows", "gpt_large"]),
    "python -m benchmarks.pretrained --precision": ("pretrained", ["--tiny", "--precision"]),
    # the GPT layer's attention: the steps are the other rows' models, smoked above
    "python -m benchmarks.kernels": ("kernels", ["--tiny", "--rows", "layer"]),
    # with one XLA flag set: the matmul in a fresh process
    "python -m benchmarks.real_size": (
        "real_size",
        ["--tiny", "--flags", "--flag-sets", "default"],
    ),
}


# run (and its table checked) by test_cli_wall_times_the_command_phase_by_phase above
CLI_WALL = "python -m benchmarks.cli_wall"
# run (its rows, machine line and ratios checked) by test_real_size_* below
REAL_SIZE = "python -m benchmarks.real_size"


def readme_commands() -> set[str]:
    """The commands of the README's first code block (arguments after ``#`` dropped)."""
    block = README.read_text().split("```")[1]
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    return {line for line in lines if line.startswith("python -m benchmarks.")}


def test_every_readme_command_has_a_smoke_run():
    assert readme_commands() | {"python -m benchmarks.grad_modes", "python -m benchmarks.pytree"} == set(SMOKE)  # fmt: skip


@jax.numpy_rank_promotion("allow")  # the peers are written as their users write them
@pytest.mark.parametrize("command", [c for c in SMOKE if c not in (CLI_WALL, REAL_SIZE)])
def test_benchmark_command_runs_at_a_tiny_size(command, tmp_path, monkeypatch, capsys):
    import importlib

    pytest.importorskip("flax")  # the peers' rows (the bench extra)
    module, argv = SMOKE[command]
    monkeypatch.setenv("NNLITE_BENCH_RESULTS", str(tmp_path))
    main = importlib.import_module(f"benchmarks.{module}").main
    checked = None
    if command == GPT_STEP:  # the PyTorch row where torch is installed; 1 block of 12 (see
        # tests/test_hand_vjp.py), embeddings, final norm, head, the loss
        checked = _check_rows(monkeypatch, _gpt_names(), 4, layers=16)
    elif command == MLP_STEP:  # 5 steps: nnlite K=2 also takes a shorter last call; 3
        # linear, 2 relu, the loss
        checked = _check_rows(monkeypatch, [*PEERS, "matmul floor"], 5, layers=6)
    rc = main(argv)
    if checked is not None:
        assert len(checked) == 1  # the rows' check ran (its names asserted), once
    assert rc in (0, None) or isinstance(rc, dict)
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) >= 3, out  # it printed its table


# -- benchmarks.real_size: issue #43's table in one run ----------------------------------------
def test_real_size_prints_every_row_the_machine_and_finite_ratios(tmp_path, monkeypatch, capsys):
    """``--tiny`` (every row at a tiny size, one round; the matmul rows also under one XLA
    flag set in a fresh process): the machine line first, a table line per row, a finite
    positive ratio for each (no timing asserted), the load average after."""
    import json
    import math

    pytest.importorskip("transformers")  # the Llama rows' reference (torch comes with it)
    from benchmarks import real_size

    monkeypatch.setenv("NNLITE_BENCH_RESULTS", str(tmp_path))
    module, argv = SMOKE[REAL_SIZE]
    assert real_size.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    machine = lines[0]
    assert machine.startswith("machine: ") and "threads " in machine, machine
    assert "host memory: " in machine, machine  # kept or not (in-process: JAX started)
    for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "jaxlib", "torch"):
        assert f"{flag} " in machine, (flag, machine)
    result = json.loads((tmp_path / "real_size-tiny-latest.json").read_text())
    assert list(result["rows"]) == list(real_size.ROWS)
    for row, r in result["rows"].items():
        (line,) = [s for s in lines if s.startswith(f"| {row} ")]
        if r is None:  # the LoRA row without peft installed: said, not measured
            assert row == "llama_lora" and "peft not installed" in line
            continue
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, (row, r["ratio"])
        assert f"{r['ratio']:.2f}x" in line
    # the --flags column and table: the matmul of each dtype in a fresh process
    (run,) = result["flags"].values()
    assert set(run) == {"float32", "bfloat16"}, run
    assert all("dot" in v["kernels"] and v["gflops"] > 0 for v in run.values()), run
    assert any(s.startswith("| default ") for s in lines)
    assert any(s.startswith("load average: ") for s in lines)


def test_real_size_kernels_reads_the_optimised_hlo():
    """What XLA made of a dot: library fusions with their result type, then the dots."""
    from benchmarks._matmul import kernels

    # jaxlib 0.10.2 on an AVX-512 CPU without bf16 hardware: a bf16 matmul (abridged)
    upcast = """
%fused_computation (param_0: f32[64,64], param_1: f32[64,64]) -> f32[64,64] {
  ROOT %dot_general.0 = f32[64,64]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}
ENTRY %main.4 (x.1: bf16[64,64], y.1: bf16[64,64]) -> bf16[64,64] {
  %ynn_fusion = f32[64,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation, backend_config={"fusion_config":{"kind":"__ynn_fusion"},"outer_dimension_partitions":[]}
  ROOT %wrapped_convert.2 = bf16[64,64]{1,0} fusion(%ynn_fusion), kind=kLoop
}"""  # noqa: E501
    assert kernels(upcast) == "__ynn_fusion -> f32; dot f32"
    onednn = (
        '%custom-call = bf16[64,64]{1,0} custom-call(%x, %y), custom_call_target="__onednn$matmul"'
    )
    assert kernels(onednn) == "__onednn$matmul -> bf16"
    assert kernels("ROOT %d = f32[8,8]{1,0} dot(%x, %y)") == "dot f32"
    assert kernels("ROOT %a = f32[8]{0} add(%x, %y)") == "no dot"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "gpt_huge"], "--rows: unknown ['gpt_huge']; choose from gpt_large"),
        (["--flag-sets", "fast"], "--flag-sets: unknown ['fast']; choose from default"),
        (["--rounds", "2"], "--rounds 2: medians need at least 3 rounds"),
        (["--threads", "0"], "--threads 0: expected 1 to"),
    ],
)
def test_real_size_bad_arguments_are_one_line(argv, message, capsys):
    from benchmarks import real_size

    with pytest.raises(SystemExit) as exc:
        real_size.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# -- train.compile_fit: the public seam the benchmarks time the trainer's step through ---------
def test_compile_fit_steps_as_train_fit_trains(tmp_path):
    """``train.compile_fit``'s compiled step, run on its own data order, ends where
    ``train.fit`` of the same config ends (the same build, init, step and batches)."""
    import numpy as np

    import train

    config = {
        "model": {"name": "mlp", "hidden_sizes": [8]},
        "train": {"batch_size": 16, "steps": 6, "steps_per_call": 2, "eval_every": 6},
        "checkpoint": {"every": 0},
        "log": {"dir": str(tmp_path), "progress": False, "plot": False},
    }
    c = train.compile_fit(None, config)
    st = c.stepper
    p, o = st.put_state(jax.tree.leaves(c.params0)), st.put_state(jax.tree.leaves(c.opt0))
    step = 0
    while step < 6:
        k = c.steps_in_call(step)
        p, o, _, metrics = st.run(p, o, [], c.X, c.Y, st.put_indices(c.indices(step, k), step))
        step += k
    assert k == 2 and metrics["loss"].shape == (2,)
    ours = jax.tree.unflatten(jax.tree.structure(c.params0), st.get_state(p))
    run = train.fit(None, config, echo=lambda *_: None)
    assert run.step == 6
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(run.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert not np.allclose(ours.head.W, c.params0.head.W)  # it trained
    flops, _ = c.flops_and_peak()
    assert flops is not None and flops > 0


def test_compile_fit_trains_a_language_model_on_a_token_stream():
    """``tokens=``: windows of ``model.context`` of one stream, an index a window's start
    (the text data sets' layout); the loss starts near ln(vocab)."""
    import math

    import numpy as np
    import optax

    import train
    from models.gpt import GPT

    model = GPT(vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=16)
    tokens = np.random.default_rng(0).integers(0, 11, 200)
    c = train.compile_fit(
        model,
        {"train": {"batch_size": 4}, "loss": {"grad": "autodiff"}},
        optimizer=optax.adam(1e-3),
        tokens=tokens,
    )
    assert c.run.cfg.model.get("context") == 8 and c.run.data.window == 8
    np.testing.assert_array_equal(np.asarray(c.X), tokens[:-1])
    np.testing.assert_array_equal(np.asarray(c.Y), tokens[1:])
    st = c.stepper
    p, o = st.put_state(jax.tree.leaves(c.params0)), st.put_state(jax.tree.leaves(c.opt0))
    _, _, _, metrics = st.run(p, o, [], c.X, c.Y, st.put_indices(c.indices(0, 1), 0))
    assert abs(float(metrics["loss"][0]) - math.log(11)) < 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tokens": [[1, 2], [3, 4]]}, "tokens must be a 1-D int array, got int64[2, 2]"),
        ({"tokens": [1, 2, 3]}, "tokens need a language model with context and vocab_size"),
        ({"tokens": [1, 2], "data": ([[0.0]], [0])}, "give data or tokens, not both"),
    ],
)
def test_compile_fit_refuses_bad_tokens_in_one_line(kwargs, message):
    import numpy as np

    import train

    kwargs = {k: v if k == "data" else np.asarray(v) for k, v in kwargs.items()}
    with pytest.raises(train.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        train.compile_fit(None, None, **kwargs)


# -- benchmarks.op_profile: trace events joined with the optimised HLO ------------------------
def test_op_profile_names_each_ops_family_from_the_optimised_hlo():
    import jax.numpy as jnp

    import nnlite as nl
    from benchmarks.op_profile import classify, parse_hlo

    def f(a, b, q, k):  # two outputs: XLA folds a sum of a product into another product
        return jnp.tanh(a @ b), jnp.einsum("bhtd,bhsd->bhts", q, k)

    a, q = jnp.ones((64, 32)), jnp.ones((2, 3, 8, 4))
    text = jax.jit(f).lower(a, a.T, q, q).compile().as_text()
    comps, inst = parse_hlo(text)
    kinds = {classify(name, comps, inst) for name in inst if inst[name][1] in ("fusion", "dot")}
    families = {family for family, _ in kinds}
    assert "GEMMs" in families and "attention: batched products" in families, kinds
    gemms = [what for family, what in kinds if family == "GEMMs"]
    assert any(
        "[64,32] x [32,64]" in g and "-> [64,64]" in g and g.endswith("forward") for g in gemms
    ), gemms
    assert classify("no_such_op", comps, inst) == ("other", "no_such_op")
    if nl.gemm_info().startswith("MKL"):  # nnlite's products: custom calls, named GEMMs
        m = jnp.ones((256, 128))
        text = nl.jit(lambda a, b: nl.matmul(a, b, transpose_b=True)).lower(m, m).compile()
        comps, inst = parse_hlo(text.as_text())
        (call,) = [n for n in inst if 'custom_call_target="nnlite_gemm"' in inst[n][2]]
        assert classify(call, comps, inst) == (
            "GEMMs", "MKL [256,128] x [256,128] -> [256,256], forward"
        )  # fmt: skip
