"""nnlite's trainer: ``nnlite-train --config FILE`` (in a checkout, ``python -m train``),
and the same from Python (``import nnlite.train as train``).

- ``train.fit(model, config)``: train a model (yours or a shipped one) as the CLI does;
- ``train.load_run(run_dir)``: a run's model, params, config and vocabulary, back;
- ``train.generate(model, params, prompt_ids, n_tokens, key)``: text from a language model.
- ``train.compile_fit(model, config)``: what ``train.fit`` would train with, built and
  compiled, before step 1 (its compiled step, for benchmarks: docs/benchmarks.md).
- ``train.Callback``: your code at the loop's events (``train.fit(..., callbacks=[...])``
  or ``callbacks:`` in a config); ``train.EarlyStopping`` is one.
- ``train.Logger``: where records go (``train.fit(..., loggers=[...])`` or ``log.loggers:``
  in a config): metrics.jsonl, TensorBoard, CSV, W&B, MLflow or yours.

The names load on first use, so ``nnlite-train`` starts without importing JAX early.
"""

_LAZY = {
    "fit": ".loop.fitting",
    "compile_fit": ".loop.compiled",
    "CompiledFit": ".loop.compiled",
    "load_run": ".inference",
    "LoadedRun": ".inference",
    "generate": ".inference",
    "ConfigError": ".errors",
    "Callback": ".callbacks",
    "LoopState": ".callbacks",
    "EarlyStopping": ".callbacks",
    "Registry": ".registry",
    "Logger": ".report.loggers",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
