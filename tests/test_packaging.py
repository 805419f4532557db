"""What the install puts on a user's path, and the import graph of the project."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what `import nnlite` may load: the design card's hard dependencies (and the stdlib)
OPTIONAL = (
    "yaml",
    "tqdm",
    "matplotlib",
    "safetensors",
    "sklearn",
    "mnist1d",
    "tensorboardX",
    "orbax",
    "flax",
    "tokenizers",
    "torch",
    "transformers",
    "wandb",
    "mlflow",
    "grain",
)


def _installed_names() -> set[str]:
    """Every package the install lays down, as its installed dotted name."""
    names = set()
    for top, installed in (
        ("nnlite", "nnlite"),
        ("train", "nnlite.train"),
        ("models", "nnlite.models"),
    ):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            names.add(".".join((installed, *rel)))
    return names


def test_the_install_lists_every_package_inside_nnlite_namespace():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _installed_names()
    assert all(p == "nnlite" or p.startswith("nnlite.") for p in setuptools["packages"])
    assert setuptools["package-dir"] == {"nnlite.train": "train", "nnlite.models": "models"}


_BLOCK = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {optional!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (simulated)", name=name)
sys.meta_path.insert(0, Absent())
"""


def test_import_nnlite_needs_only_the_hard_dependencies(tmp_path):
    code = _BLOCK.format(optional=set(OPTIONAL)) + (
        "import nnlite as nl, jax, jax.numpy as jnp\n"
        "p = nl.Linear(3, 2).init(jax.random.key(0))\n"
        "print(nl.Linear(3, 2)(p, jnp.ones((1, 3))).shape)\n"
        f"loaded = sorted({{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r}))\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["(1, 2)", "[]"]


def test_a_missing_extra_is_one_line_naming_the_install(tmp_path):
    code = _BLOCK.format(optional={"safetensors"}) + (
        "import nnlite as nl, jax.numpy as jnp\n"
        "try:\n"
        "    nl.save('x.safetensors', {'w': jnp.ones(2)})\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert "pip install safetensors" in out.stdout, out.stdout + out.stderr
    assert not (tmp_path / "x.safetensors").exists()


def _module_graph(top: str) -> dict[str, set[str]]:
    """Module -> modules of the same top package it imports (module- and function-level)."""
    files = {}
    for f in (ROOT / top).rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    graph = {}
    for name, (f, is_pkg) in files.items():
        pkg = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_library_or_the_trainer():
    for top in ("nnlite", "train", "models"):
        assert _circles(_module_graph(top)) == [], top


def test_the_library_never_imports_the_trainer_or_the_shipped_models():
    for f in (ROOT / "nnlite").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            else:
                continue
            assert not any(m.split(".")[0] in ("train", "models") for m in mods), f


def test_the_trainer_without_its_extra_is_one_line(tmp_path):
    code = _BLOCK.format(optional={"yaml"}) + (
        "import runpy, sys\n"
        f"sys.argv = ['train', '--config', {str(ROOT / 'configs' / 'digits_mlp.yaml')!r}]\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "runpy.run_module('train', run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        "error: the trainer needs PyYAML, which is not installed: pip install 'nnlite[train]'\n"
    )
    assert not any(tmp_path.iterdir())
