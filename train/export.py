"""``nnlite-train export --run DIR --out OUT [--adapter] [--best]``: a run of a Hugging
Face model (``model.name: "hf:DIR"``) written back for ``transformers`` and ``peft``.

Without ``--adapter``: a model directory ``transformers.AutoModelForCausalLM`` loads (LoRA
adapters merged into their weights; ``nl.hf.Pretrained.export``). With ``--adapter``: a
LoRA run's adapters only, in peft's format (``adapter_config.json`` +
``adapter_model.safetensors``; ``nl.hf.save_adapter``), which
``peft.PeftModel.from_pretrained(base, OUT)`` loads onto the run's base. Bad arguments (no
run, a run of another model, ``--adapter`` for a run without LoRA) print one line and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nnlite as nl

from . import faults
from .config import ArgumentParser
from .errors import ConfigError
from .inference import load_run


def parse_args(argv):
    ap = ArgumentParser(
        prog="nnlite-train export",
        description="Write a run of a Hugging Face model back as a model or a peft adapter.",
    )
    ap.add_argument("--run", required=True, help="run directory, e.g. runs/smollm_lora")
    ap.add_argument("--out", required=True, help="the directory to write")
    ap.add_argument(
        "--adapter", action="store_true", help="write the LoRA adapters only, in peft's format"
    )
    ap.add_argument("--best", action="store_true", help="the best checkpoint, not the newest")
    return ap.parse_args(argv)


def export(run_dir: Path, out: Path, adapter: bool, which: str = "latest") -> Path:
    """Write the run's model (or its adapters) to ``out``; ConfigError (one line) when the
    run cannot be written so."""
    run = load_run(run_dir, which)
    model = run.model
    if not isinstance(model, nl.hf.Pretrained):
        raise ConfigError(
            f"run {str(run_dir)!r}: model.name={run.cfg.model.name} is not a Hugging Face "
            'model ("hf:DIR"); only those export'
        )
    if not adapter:
        return model.export(out, run.params)
    if not model.lora:
        raise ConfigError(
            f"run {str(run_dir)!r} fine-tuned the whole model (no model.lora): it has no "
            "adapter; export it without --adapter"
        )
    return nl.hf.save_adapter(out, model, run.params)


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        out = export(
            Path(args.run), Path(args.out), args.adapter, "best" if args.best else "latest"
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
