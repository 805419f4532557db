"""``loss.backward_policies``: per-layer backward policies chosen by path glob, read from the
config (no JAX here: the config is read before JAX imports).

Each entry is ``{layers: GLOB, stop: true | scale: S | clip: C | float32: true}``. A layer's
path is where it sits in the model, its parents' names for it (``blocks[2].attn``), written
with ``/`` (``blocks/2/attn``) or as printed; the glob is matched one path segment at a time
(``*`` within a segment, ``**`` any number of segments), so ``blocks/*/attn`` names each
block's attention and nothing inside it.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..schema import Where, as_list, choice

# auto resolves to one of the others at build time (train/model/gradmode.py); each model's
# grad_modes are a subset (tested)
GRAD_MODES = ("auto", "autodiff", "manual", "fused")


@dataclass(frozen=True)
class LossConfig:
    """The config's ``loss`` section: how gradients are computed and what is minimised."""

    # How gradients are computed: jax.value_and_grad (autodiff), every layer's hand rule
    # composed (manual: any model built from layers with hand rules), or a model's own
    # hand-written pass (fused: models that list it in grad_modes, the mlp). auto: manual
    # when hand rules cover the model's objective, else autodiff (resolved once, at build).
    grad: str = choice("auto", GRAD_MODES)
    # issue 34: per-layer backward policies by layer path glob, applied to the hand rules
    # (forward unchanged; needs manual gradients): a list of {layers: "blocks/*/attn",
    # stop: true | scale: S | clip: C | float32: true} (parse_policies below)
    backward_policies: tuple[dict, ...] = ()
    # issue 46: under manual (or auto -> manual) each hand rule of yours -- not nnlite's --
    # is checked against jax.vjp at the step's shapes before step 1, once per code
    # (train/step/checkgrads.py); false trains it unchecked (the banner says so)
    check_rules: bool = True
    # What training minimises: the model's task loss (task: cross-entropy, ...), or dpo
    # (direct preference optimisation on data.name: chat preference pairs, train/model/dpo.py)
    name: str = choice("task", ("task", "dpo"))
    beta: float = 0.1  # dpo: the strength of the pull towards the reference model
    # dpo: the frozen reference, a Hugging Face directory; null: the model's base (a LoRA
    # run: its weights without the adapters; else its directory as it was before training)
    reference: str | None = None

    def check(self, where: Where) -> None:
        if self.beta <= 0:
            raise where.bad("loss.beta", f"must be > 0, got {self.beta}")
        if self.reference is not None and self.name != "dpo":
            raise where.bad(
                "loss.reference", f"is the reference of loss.name: dpo, not {self.name}"
            )
        parse_policies(self.backward_policies, where.of("loss.backward_policies"))


#: The keys of one entry and what each does (the error for an unknown key lists them).
POLICY_KEYS = {
    "layers": "the path glob of the layers it applies to",
    "stop": "true: no gradient into the layers (nor into what feeds them)",
    "scale": "multiply the cotangent arriving at their output by this number",
    "clip": "clip that cotangent's global norm to this positive number",
    "float32": "true: compute their backward in float32 (under a bfloat16 forward)",
}


@dataclass(frozen=True)
class PolicySpec:
    """One ``loss.backward_policies`` entry, checked (see the module docstring)."""

    layers: str
    stop: bool = False
    scale: float | None = None
    clip: float | None = None
    float32: bool = False

    def matches(self, path: str) -> bool:
        """Whether the layer at ``path`` (``blocks[2].attn``) is one this entry names."""
        return _match(split_path(self.layers), split_path(path))

    def policy_kwargs(self) -> dict:
        """The keywords of ``nl.backward_policy`` this entry stands for."""
        out = {}
        if self.stop:
            out["stop"] = True
        if self.scale is not None:
            out["scale"] = self.scale
        if self.clip is not None:
            out["clip_norm"] = self.clip
        if self.float32:
            out["backward_dtype"] = "float32"
        return out

    def describe(self) -> str:
        what = ", ".join(f"{k}={v}" for k, v in self.policy_kwargs().items())
        return f"{self.layers}: {what}"


def split_path(path: str) -> list[str]:
    """``blocks[2].attn`` or ``blocks/2/attn`` -> ``["blocks", "2", "attn"]``."""
    text = re.sub(r"\[([^\]]*)\]", r"/\1", path.strip()).replace(".", "/")
    return [p for p in text.split("/") if p]


def slash_path(path: str) -> str:
    """A layer path with ``/`` between its names (``blocks/2/attn``)."""
    return "/".join(split_path(path))


def _match(glob: list[str], parts: list[str]) -> bool:
    if not glob:
        return not parts
    if glob[0] == "**":
        return any(_match(glob[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], glob[0]) and _match(glob[1:], parts[1:])


def parse_policies(raw, where: str) -> tuple[PolicySpec, ...]:
    """The checked entries of ``loss.backward_policies`` (``where``: the file or ``--set``
    that gave them); one ConfigError line for anything else."""
    form = "{layers: GLOB, stop/scale/clip/float32: ...}"
    out = []
    for i, entry in enumerate(as_list(raw, where, "loss.backward_policies", form)):
        at = f"{where}: loss.backward_policies[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: expected a mapping like {{layers: 'blocks/*/attn', "
                              f"clip: 1.0}}, got {entry!r}")  # fmt: skip
        unknown = [k for k in entry if k not in POLICY_KEYS]
        if unknown:
            raise ConfigError(
                f"{at}: unknown key '{unknown[0]}'; valid keys: {', '.join(POLICY_KEYS)}"
            )
        layers = entry.get("layers")
        if not isinstance(layers, str) or not split_path(layers):
            raise ConfigError(
                f"{at}.layers: expected a layer path glob such as 'blocks/*/attn', got {layers!r}"
            )
        for key in ("stop", "float32"):
            if not isinstance(entry.get(key, False), bool):
                raise ConfigError(f"{at}.{key}: expected true or false, got {entry[key]!r}")
        nums = {}
        for key in ("scale", "clip"):
            v = entry.get(key)
            if v is None:
                continue
            if isinstance(v, str):
                try:
                    v = float(v)  # YAML 1.1 reads 1e-3 as a string
                except ValueError:
                    pass
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ConfigError(f"{at}.{key}: expected a number, got {entry[key]!r}")
            if key == "clip" and v <= 0:
                raise ConfigError(f"{at}.clip: must be a positive norm, got {v}")
            nums[key] = float(v)
        spec = PolicySpec(layers, entry.get("stop", False), nums.get("scale"), nums.get("clip"),
                          entry.get("float32", False))  # fmt: skip
        if not spec.policy_kwargs():
            raise ConfigError(
                f"{at}: names layers {layers!r} but no policy; add stop: true, scale: S, "
                "clip: C or float32: true"
            )
        if spec.stop and (spec.scale is not None or spec.clip is not None or spec.float32):
            raise ConfigError(f"{at}: stop: true leaves nothing to scale, clip or compute in "
                              "float32; give those in an entry of their own")  # fmt: skip
        out.append(spec)
    return tuple(out)
