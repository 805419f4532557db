"""Time to 97% test accuracy on digits: nnlite vs Equinox vs Flax NNX vs scikit-learn.

    python -m benchmarks.time_to_accuracy [--quick] [--repeats N] [--eval-every N] [--tiny]

The model, optimizer, batch size and data order are those of ``configs/digits_mlp.yaml``
(64 -> 128 relu -> 10, adam 3e-3 with a cosine schedule over train.steps, batch 128,
nnlite's seeded epoch permutations) and every JAX implementation starts from nnlite's
initial weights. Each one checks test accuracy every ``--eval-every`` steps and stops at
the first check with accuracy >= 97%.

Each run is a fresh process (so every implementation pays its own tracing and
compilation); the clock starts after imports, data loading and JAX backend start-up, and
stops when the target accuracy is seen. Implementations run in shuffled order, several
repeats, and we report medians. scikit-learn's ``MLPClassifier`` (same hidden size, its
defaults otherwise) is timed over its ``fit``; its accuracy is reported.

Every run compiles from scratch (JAX's persistent compilation cache is switched off),
except "nnlite warm": nnlite with that cache on, filled by one untimed run before the
repeats, i.e. what running the same config again costs.

``--tiny`` checks that every implementation runs (the test suite's smoke test): 4 steps,
an accuracy check every 2, each implementation once ("nnlite warm" is "nnlite" there), in
this process; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import _harness as h

CONFIG = "configs/digits_mlp.yaml"
TARGET = 0.97
IMPLS = ("nnlite", "nnlite K=1", "nnlite warm", "Equinox", "Flax NNX", "scikit-learn")
# "nnlite warm": the same run with JAX's persistent compilation cache, filled by one
# untimed run first: what a second run of the same config costs (a resume, a sweep).
WARM = "nnlite warm"


def cache_env(cache_dir: str | None) -> dict[str, str]:
    """Environment that turns JAX's persistent compilation cache on for every program in
    ``cache_dir``, or (None) off, whatever the caller's environment says."""
    if cache_dir is None:
        return {"JAX_ENABLE_COMPILATION_CACHE": "false"}
    return {
        "JAX_ENABLE_COMPILATION_CACHE": "true",
        "JAX_COMPILATION_CACHE_DIR": cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _overrides(steps: int | None = None) -> list[str]:
    return ["log.progress=false", "log.plot=false"] + ([f"train.steps={steps}"] if steps else [])


def write_inputs(path: Path, steps: int | None = None) -> None:
    """What every implementation starts from, as ``train.compile_fit`` builds the config's
    run (untimed, in the parent): nnlite's initial weights, the data set's splits, the
    data order (each step's batch indices) and the optimizer's settings."""
    import train

    c = train.compile_fit(None, CONFIG, overrides=_overrides(steps))
    cfg, data = c.run.cfg, c.run.data
    layers = [*c.params0.ffn.layers, c.params0.head]
    weights = {f"{n}{i}": np.asarray(lp[n]) for i, lp in enumerate(layers) for n in "Wb"}
    opt = cfg.optimizer
    if (opt.name, opt.schedule) != ("adam", "cosine") or opt.clip_norm or opt.weight_decay:
        raise SystemExit(f"{CONFIG}: the peers are written for adam with a cosine schedule")
    np.savez(
        path,
        **weights,
        x=data.x,
        y=data.y,
        x_test=data.x_test,
        y_test=data.y_test,
        order=c.indices(0, cfg.train.steps),
        adam=np.array([opt.learning_rate, opt.end_lr_fraction, opt.b1, opt.b2 or 0.999]),
        ints=np.array(
            [cfg.seed, cfg.train.steps, cfg.train.batch_size, *cfg.model.get("hidden_sizes")]
        ),
    )


class Inputs:
    """:func:`write_inputs`' file, read back in a worker (before its clock starts)."""

    def __init__(self, path: str):
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
        n_layers = sum(k.startswith("W") for k in arrays)
        self.weights = [(arrays[f"W{i}"], arrays[f"b{i}"]) for i in range(n_layers)]
        self.x, self.y, self.order = arrays["x"], arrays["y"], arrays["order"]
        self.x_test, self.y_test = arrays["x_test"], arrays["y_test"]
        self.adam = [float(v) for v in arrays["adam"]]
        self.seed, self.steps, self.batch, *self.hidden = (int(v) for v in arrays["ints"])

    def optimizer(self):
        """The config's optimizer in optax: adam, the rate cosine-decayed over the steps."""
        import optax

        lr, end, b1, b2 = self.adam
        return optax.adam(optax.cosine_decay_schedule(lr, self.steps, alpha=end), b1=b1, b2=b2)


def _nnlite(data: Inputs, eval_every: int, steps_per_call: int) -> dict:
    """nnlite's training loop as the trainer runs it: ``train.compile_fit`` (the config
    checked and built, init, step and eval compiled side by side), then its calls with an
    accuracy check at each eval."""
    import jax

    import train

    overrides = _overrides(data.steps) + [
        f"train.steps_per_call={steps_per_call}",
        f"train.eval_every={eval_every}",
    ]
    splits = {"train": (data.x, data.y), "test": (data.x_test, data.y_test)}
    c = train.compile_fit(None, CONFIG, overrides=overrides, data=splits)
    st = c.stepper
    p_leaves, o_leaves = (st.put_state(jax.tree.leaves(t)) for t in (c.params0, c.opt0))
    p_def = jax.tree.structure(c.params0)
    step, acc = 0, 0.0
    while step < data.steps:
        k = c.steps_in_call(step)
        idx = st.put_indices(c.indices(step, k), step)
        p_leaves, o_leaves, _, _ = st.run(p_leaves, o_leaves, [], c.X, c.Y, idx)
        step += k
        if step % eval_every == 0:
            params = jax.tree.unflatten(p_def, st.get_state(p_leaves))
            acc = float(c.evaluate(params, c.X_test, c.Y_test)["accuracy"])
            if acc >= TARGET:
                break
    return {"steps": step, "accuracy": acc}


def _equinox(data: Inputs, eval_every: int) -> dict:
    """The Equinox way: eqx.nn.MLP, filter_value_and_grad, filter_jit, numpy batches."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    weights = data.weights
    model = eqx.nn.MLP(64, 10, 128, 1, jax.nn.relu, key=jax.random.key(data.seed))
    model = eqx.tree_at(
        lambda m: [layer.weight for layer in m.layers] + [layer.bias for layer in m.layers],
        model,
        [jnp.asarray(W.T) for W, _ in weights] + [jnp.asarray(b) for _, b in weights],
    )
    tx = data.optimizer()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_value_and_grad
    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = loss_fn(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    @eqx.filter_jit
    def accuracy(model, x, y):
        return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y)

    acc = 0.0
    for step in range(data.steps):
        i = data.order[step]
        model, opt_state, _ = train_step(model, opt_state, data.x[i], data.y[i])
        if (step + 1) % eval_every == 0:
            acc = float(accuracy(model, data.x_test, data.y_test))
            if acc >= TARGET:
                break
    return {"steps": step + 1, "accuracy": acc}


def _flax_nnx(data: Inputs, eval_every: int) -> dict:
    """The Flax NNX way: nnx.Module, nnx.Optimizer(wrt=nnx.Param), nnx.jit, numpy batches."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(64, 128, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    model = MLP(nnx.Rngs(data.seed))
    for layer, (W, b) in zip((model.hidden, model.out), data.weights):
        layer.kernel.value, layer.bias.value = jnp.asarray(W), jnp.asarray(b)
    optimizer = nnx.Optimizer(model, data.optimizer(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def accuracy(model, x, y):
        return jnp.mean(jnp.argmax(model(x), axis=-1) == y)

    acc = 0.0
    for step in range(data.steps):
        i = data.order[step]
        train_step(model, optimizer, data.x[i], data.y[i])
        if (step + 1) % eval_every == 0:
            acc = float(accuracy(model, data.x_test, data.y_test))
            if acc >= TARGET:
                break
    return {"steps": step + 1, "accuracy": acc}


def _sklearn(data: Inputs) -> dict:
    from sklearn.neural_network import MLPClassifier

    # --tiny (train.steps below the config's): as many epochs as that, a smoke run
    iters = {} if data.steps >= 100 else {"max_iter": 2}
    clf = MLPClassifier(hidden_layer_sizes=tuple(data.hidden), random_state=data.seed, **iters)
    clf.fit(data.x, data.y)
    return {"steps": int(clf.n_iter_), "accuracy": float(clf.score(data.x_test, data.y_test))}


def worker(impl: str, inputs: str, eval_every: int) -> dict:
    """One timed run in this (fresh) process, from :func:`write_inputs`' file ``inputs``;
    returns wall seconds, steps and accuracy."""
    import warnings

    import jax

    data = Inputs(inputs)
    if impl in ("Equinox", "Flax NNX"):
        import equinox  # noqa: F401
        import flax.nnx  # noqa: F401
    if impl == "scikit-learn":
        import sklearn.neural_network  # noqa: F401
    if impl.startswith("nnlite"):
        import train

        train.compile_fit  # noqa: B018 - imports the trainer (its names load on first use)
    jax.devices()  # start the backend before the clock: every JAX program pays it once
    t0 = time.perf_counter()
    if impl in ("nnlite", WARM):
        out = _nnlite(data, eval_every, steps_per_call=eval_every)
    elif impl == "nnlite K=1":
        out = _nnlite(data, eval_every, steps_per_call=1)
    elif impl == "Equinox":
        out = _equinox(data, eval_every)
    elif impl == "Flax NNX":
        out = _flax_nnx(data, eval_every)
    elif impl == "scikit-learn":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ConvergenceWarning at max_iter is expected
            out = _sklearn(data)
    else:
        raise SystemExit(f"unknown implementation {impl!r}; valid: {', '.join(IMPLS)}")
    return {"impl": impl, "wall_s": time.perf_counter() - t0, **out}


def _tiny() -> int:
    """Every implementation once, 4 steps, in this process (``--tiny``). "nnlite warm"
    is "nnlite" here (the same call: only its process's cache environment differs), so it
    is not run twice."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "inputs.npz"
        write_inputs(inputs, steps=4)
        rows = []
        for impl in (i for i in IMPLS if i != WARM):
            out = worker(impl, str(inputs), eval_every=2)
            rows.append([impl, f"{out['wall_s']:.3f} s", out["steps"], f"{out['accuracy']:.4f}"])
    print(h.table(rows, ["implementation", "wall (tiny: meaningless)", "steps", "accuracy"]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.time_to_accuracy", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="one repeat")
    ap.add_argument("--repeats", type=int, default=5, help="fresh-process runs per implementation")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between accuracy checks")
    ap.add_argument("--tiny", action="store_true", help="4 steps, in this process: a smoke run")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.inputs, args.eval_every)))
        return 0
    if args.tiny:
        return _tiny()

    repeats = 1 if args.quick else args.repeats
    info = h.machine_info()
    print(f"machine: {info['cpu']}, {info['affinity']} usable cores; jax {info['versions']['jax']}")
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "inputs.npz"
        write_inputs(inputs)
        warm_env = cache_env(str(Path(tmp) / "jax_cache"))

        def run(impl: str) -> dict:
            argv = [
                "--worker",
                impl,
                "--inputs",
                str(inputs),
                "--eval-every",
                str(args.eval_every),
            ]
            env = warm_env if impl == WARM else cache_env(None)
            return h.run_module_json("benchmarks.time_to_accuracy", argv, env=env)

        run(WARM)  # untimed: fills the cache
        runs = h.repeat_shuffled({i: (lambda i=i: run(i)) for i in IMPLS}, repeats, digits=3)

    med = {i: h.median([x["wall_s"] for x in v]) for i, v in runs.items()}
    base = med["nnlite"]
    rows = []
    for i in IMPLS:
        last = runs[i][-1]
        steps = f"{last['steps']} epochs" if i == "scikit-learn" else str(last["steps"])
        rows.append(
            [i, f"{med[i]:.3f} s", f"{base / med[i]:.2f}", steps, f"{last['accuracy']:.4f}"]
        )
    print(
        f"\nTime to {TARGET:.0%} test accuracy on digits (eval every {args.eval_every} steps; "
        f"median of {repeats} fresh processes; nnlite = steps_per_call={args.eval_every})\n"
    )
    print(
        h.table(rows, ["implementation", "median wall", "nnlite / this", "steps", "test accuracy"])
    )
    path = h.write_json(
        "time_to_accuracy",
        {
            "machine": info,
            "eval_every": args.eval_every,
            "target": TARGET,
            "median_wall_s": med,
            "runs": runs,
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
