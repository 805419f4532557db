"""The README and the pages in docs/ stay true: every code block is tested, and no
reference to a file, a page or a heading dangles.

- ```python blocks run. A ``# /path: ...`` line after a ``print()`` must be what was
  printed, and so must the text of a ``# prints: TEXT`` comment; a ```text block right
  after the marker ``<!-- output of the block above -->`` must be the block's whole
  output (source locations such as ``file.py:31`` aside).
- ```bash blocks are checked, not run (they train): every ``nnlite-train`` (the same
  command as a checkout's ``python -m train``) names a config that exists, uses only flags
  that ``nnlite-train --help`` lists, and its ``--set`` overrides load
  (``train.config.load_config``: real keys, valid values); every ``nnlite-train COMMAND``
  is a command of it and uses flags that command defines; every other
  ``python -m MODULE`` names a module that exists and flags it defines;
  every ``pip install -e '.[extra]'`` names an extra of pyproject.toml.
- ```yaml blocks are valid (partial) configs, and one that names a shipped config
  (``name: digits_mlp``) agrees with that file.
- ```console blocks run their ``$ python -m MODULE ...`` commands in-process (through
  the module's ``main(argv)``) and compare the output shown (``...``: the rest is
  elided) and the ``exit status``.
- ```text blocks are listings (outputs, command synopses) and do not run.
- Every doc file path cited in the repository's .py, .md, .yaml and .toml files exists,
  every relative Markdown link and ``#anchor`` in the docs resolves, and every file of
  the repository that the docs name exists.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
DOC_FILES = [README, *DOCS]
OUTPUT_MARKER = "<!-- output of the block above -->"
LANGUAGES = ("python", "bash", "yaml", "console", "text")


class Block(NamedTuple):
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    is_output: bool  # a ```text block right after OUTPUT_MARKER

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).strip()
        i += 1
        body = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: unclosed code block")
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = prev.strip() == OUTPUT_MARKER
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker))
        i += 1
    return blocks


BLOCKS = [b for p in DOC_FILES for b in parse_blocks(p)]


def of(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang]


def ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def without_code(text: str) -> str:
    """Markdown prose only: fenced blocks and inline code removed."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def test_docs_exist_and_are_indexed():
    names = {p.name for p in DOCS}
    assert "index.md" in names
    index = (ROOT / "docs" / "index.md").read_text()
    readme = README.read_text()
    for page in names - {"index.md"}:
        assert f"]({page})" in index, f"docs/index.md does not link {page}"
        assert f"](docs/{page})" in readme, f"README.md does not link docs/{page}"
    assert len(readme.splitlines()) <= 410, "keep the README short: move topics to docs/"


def test_every_block_has_a_known_language():
    bad = [f"{b.where}: ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"fence languages must be one of {LANGUAGES}: {bad}"
    bad = [b.where for b in BLOCKS if b.is_output and b.lang != "text"]
    assert not bad, f"an output listing is a ```text block: {bad}"


# -- python ---------------------------------------------------------------------------------
def _normalise_output(text: str) -> str:
    text = re.sub(r"\S+\.py:\d+", "FILE:LINE", text)  # source locations move with edits
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


@pytest.mark.parametrize("block", of("python"), ids=ids(of("python")))
def test_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.text, block.where, "exec", dont_inherit=True), {"__name__": "docs"})
    printed = out.getvalue()
    for expected in re.findall(r"^# (/\S+: \S+)$", block.text, flags=re.M):
        assert expected in printed, (expected, printed)
    for expected in re.findall(r"# prints: (.+)$", block.text, flags=re.M):
        assert expected.strip() in printed, (expected, printed)
    following = BLOCKS[BLOCKS.index(block) + 1 :]
    if following and following[0].is_output and following[0].path == block.path:
        assert _normalise_output(printed) == _normalise_output(following[0].text)


def test_output_listings_follow_a_python_block():
    for i, b in enumerate(BLOCKS):
        if b.is_output:
            assert i > 0 and BLOCKS[i - 1].lang == "python", b.where


# -- bash -------------------------------------------------------------------------------------
class Command(NamedTuple):
    where: str
    argv: list[str]  # without leading VAR=value assignments


def commands(block: Block) -> list[Command]:
    text = block.text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0] == "export":
            continue
        argv: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "||", ";", "|"):
                while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(Command(block.where, as_module(argv)))
                argv = []
            else:
                argv.append(w)
    return out


def as_module(argv: list[str]) -> list[str]:
    """``nnlite-train [COMMAND] ARGS`` as the module it runs, ``python -m train[.COMMAND]
    ARGS`` (the checkout's spelling of the same command); other commands as they are.
    A command that ``nnlite-train`` does not have keeps its name (and fails below)."""
    from train.__main__ import COMMANDS

    if argv[0] != "nnlite-train":
        return argv
    if len(argv) > 1 and not argv[1].startswith("-"):
        name = argv[1]
        module = COMMANDS[name][0].lstrip(".") if name in COMMANDS else f"<{name}>"
        return ["python", "-m", f"train.{module}", *argv[2:]]
    return ["python", "-m", "train", *argv[1:]]


COMMANDS = [c for b in of("bash") for c in commands(b)]
TRAIN = [c for c in COMMANDS if c.argv[:3] == ["python", "-m", "train"]]
OTHER_MODULES = [c for c in COMMANDS if c.argv[:2] == ["python", "-m"] and c.argv[2] != "train"]


@pytest.fixture(scope="module")
def train_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout


def _flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """``(--flag, value or None)`` pairs of a command line."""
    out = []
    for i, a in enumerate(argv):
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            if not eq:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                value = None if nxt is None or nxt.startswith("--") else nxt
            out.append((flag, value))
    return out


def test_bash_blocks_show_commands():
    assert TRAIN and OTHER_MODULES


@pytest.mark.parametrize("cmd", TRAIN, ids=[c.where for c in TRAIN])
def test_train_command_is_valid(cmd, train_help):
    from train.config import load_config

    flags = _flags(cmd.argv[3:])
    known = set(re.findall(r"(--[a-z][a-z-]*)", train_help))
    for flag, value in flags:
        assert flag in known, f"{cmd.where}: {flag} is not a flag of nnlite-train"
        choices = re.search(rf"{flag} \{{([\w,]+)\}}", train_help)
        if choices:
            assert value in choices.group(1).split(","), (cmd.where, flag, value)
    config = dict(flags).get("--config")
    assert config, f"{cmd.where}: no --config"
    assert (ROOT / config).is_file(), f"{cmd.where}: {config} does not exist"
    overrides = [v for f, v in flags if f == "--set"]
    load_config(ROOT / config, overrides)  # unknown keys and bad values raise ConfigError


def _module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin, f"no module {name}"
    origin = Path(spec.origin)
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        origin = origin.with_name("__main__.py")
    assert origin.is_file(), f"python -m {name}: {origin} does not exist"
    return origin.read_text()


@pytest.mark.parametrize("cmd", OTHER_MODULES, ids=[c.where for c in OTHER_MODULES])
def test_other_module_command_is_valid(cmd):
    module = cmd.argv[2]
    if module == "pytest":
        return
    source = _module_source(module)
    for flag, _ in _flags(cmd.argv[3:]):
        assert re.search(rf"[\"']{flag}[\"']", source), f"{cmd.where}: {module} has no {flag}"


def test_pip_extras_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for cmd in COMMANDS:
        if cmd.argv[:2] == ["pip", "install"]:
            for arg in cmd.argv[2:]:
                if m := re.fullmatch(r"\.\[(.*)\]", arg):
                    for extra in m.group(1).split(","):
                        assert extra in extras, f"{cmd.where}: no extra {extra!r}"


def test_readme_commands_match_ci():
    bash = of("bash")[0]
    assert bash.path == README
    lines = bash.text.splitlines()
    assert lines[0].startswith("pip install -e '.[dev]'")
    assert "nnlite-train --config configs/digits_mlp.yaml" in lines[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert lines[1] in ci.splitlines()


def test_readme_own_data_recipe(tmp_path, monkeypatch):
    """The README's npz recipe writes a file the CLI accepts for the model it names."""
    from train.config import load_config
    from train.data.builtin import load_dataset
    from train.loop.build import make_model

    readme = README.read_text()
    section = readme[readme.index("## Your own data") :]
    section = section[: section.index("\n## ")]
    python = next(b for b in of("python") if b.path == README and b.text in section)
    (cmd,) = [c for c in TRAIN if any(b.text in section for b in of("bash") if b.where == c.where)]
    monkeypatch.chdir(tmp_path)
    exec(compile(python.text, python.where, "exec", dont_inherit=True), {"__name__": "docs"})
    flags = _flags(cmd.argv[3:])
    cfg = load_config(ROOT / dict(flags)["--config"], [v for f, v in flags if f == "--set"])
    data = load_dataset(cfg.data)
    model, _ = make_model(cfg, data)
    assert (cfg.data.name, model.task, data.task) == ("npz", "classification", "classification")


# -- yaml ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", of("yaml"), ids=ids(of("yaml")))
def test_yaml_block_is_a_valid_config(block, tmp_path):
    from train.config import load_config

    raw = yaml.safe_load(block.text)
    found = [
        p
        for p in (*ROOT.glob("configs/*.yaml"), *ROOT.glob("examples/**/*.yaml"))
        if p.stem == raw.get("name")
    ]
    shipped = found[0] if found else ROOT / "configs" / f"{raw.get('name')}.yaml"
    path = tmp_path / "block.yaml"
    path.write_text(block.text)
    # (an excerpt of an example beside its own model module loads from its directory; the
    # files a block names, data/my_text, are the reader's: their paths are not looked up)
    load_config(shipped if "examples" in shipped.parts else path, resolve_paths=False)
    if shipped.is_file():  # an excerpt of a shipped config must agree with it
        full = yaml.safe_load(shipped.read_text())
        for section, value in raw.items():
            if isinstance(value, dict):
                for key, v in value.items():
                    assert full[section][key] == v, (block.where, f"{section}.{key}")
            else:
                assert full[section] == value, (block.where, section)


def test_config_reference_lists_every_key_with_its_default():
    from train.config import Config, to_dict

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    defaults = dict(flat(to_dict(Config())))
    text = (ROOT / "docs" / "training.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)`", text, flags=re.M)
    rows = [(k, v) for k, v in rows if "." in k or k in defaults]
    documented = {k: yaml.safe_load(v) for k, v in rows}
    assert len(documented) == len(rows), "a key is listed twice"
    assert set(documented) == set(defaults), (
        f"missing: {sorted(set(defaults) - set(documented))}, "
        f"not config keys: {sorted(set(documented) - set(defaults))}"
    )
    wrong = {k: (v, defaults[k]) for k, v in documented.items() if v != defaults[k]}
    assert not wrong, f"documented default != train/config.py default: {wrong}"


# -- console ----------------------------------------------------------------------------------
def _squash(text: str) -> str:
    return " ".join(text.split())  # argparse wraps its usage to the terminal's width


@pytest.mark.parametrize("block", of("console"), ids=ids(of("console")))
def test_console_block_output(block):
    sessions = re.split(r"^\$ ", block.text, flags=re.M)[1:]
    assert sessions, f"{block.where}: no '$ command' line"
    for session in sessions:
        command, _, shown = session.partition("\n")
        argv = shlex.split(command)
        assert argv[:2] == ["python", "-m"], f"{block.where}: only python -m MODULE runs here"
        status = 0
        if m := re.search(r"^exit status: (\d+)\n?\Z", shown, flags=re.M):
            status, shown = int(m.group(1)), shown[: m.start()]
        main = importlib.import_module(argv[2]).main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv[3:])
            except SystemExit as e:
                code = e.code
        assert (code or 0) == status, (block.where, command, out.getvalue())
        if shown.rstrip().endswith("..."):
            prefix = _squash(shown.rstrip()[:-3])
            assert _squash(out.getvalue()).startswith(prefix), (block.where, out.getvalue())
        else:
            assert _squash(out.getvalue()) == _squash(shown), (block.where, out.getvalue())


# -- references -----------------------------------------------------------------------------
SKIP_DIRS = {".git", "runs", "build", "results", "__pycache__", "node_modules"}


def repo_files(*suffixes: str) -> list[Path]:
    out = []
    for p in sorted(ROOT.rglob("*")):
        rel = p.relative_to(ROOT).parts
        if any(part in SKIP_DIRS or part.startswith(".") or part.endswith(".egg-info")
               for part in rel[:-1]):  # fmt: skip
            continue
        if p.is_file() and p.suffix in suffixes:
            out.append(p)
    return out


# A Markdown file named in text: `docs/faults.md`, benchmarks/README.md, DESIGN.md ...
# (not a piece of a longer path or URL).
MD_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def test_every_cited_doc_file_exists():
    dangling = []
    for f in repo_files(".py", ".md", ".yaml", ".toml"):
        if f == Path(__file__).resolve():  # this file's examples of what the regex finds
            continue
        for m in MD_PATH.finditer(f.read_text()):
            cited = m.group(1)
            if not ((ROOT / cited).is_file() or (f.parent / cited).is_file()):
                line = f.read_text()[: m.start()].count("\n") + 1
                dangling.append(f"{f.relative_to(ROOT)}:{line}: {cited}")
    assert not dangling, f"cited doc files that do not exist: {dangling}"


def github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", repo_files(".md"), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: broken links {broken}"


# A file of this repository named in the docs: configs/digits_mlp.yaml, tests/test_seed.py
REPO_PATH = re.compile(
    r"(?<![\w./~$-])((?:nnlite|models|train|benchmarks|configs|tests|docs|\.ci)/[\w.-][\w./-]*)"
)


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_named_in_the_docs_exist(path):
    # Output listings show what ran somewhere else (a traceback's file names): skip them.
    text = path.read_text()
    for b in parse_blocks(path):
        if b.lang == "text":
            text = text.replace(b.text, "")
    missing = []
    for cited in REPO_PATH.findall(text):
        cited = cited.rstrip(".")
        if "." in cited.rsplit("/", 1)[-1] and not (ROOT / cited).exists():
            missing.append(cited)
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_reference_checks_catch_mistakes(tmp_path):
    """The regexes above find what they should (a check that finds nothing passes)."""
    assert MD_PATH.findall("see docs/distributed.md, DESIGN.md and https://x.org/a/b.md") == [
        "docs/distributed.md",
        "DESIGN.md",
    ]
    assert REPO_PATH.findall("`train/config.py`, ~/.cache/nnlite/jax, a/nnlite/x.py") == [
        "train/config.py"
    ]
    assert github_slug("The watchdog: `train.step_timeout`") == "the-watchdog-trainstep_timeout"
    assert _flags(["--config", "c.yaml", "--set", "a.b=1", "--fresh"]) == [
        ("--config", "c.yaml"),
        ("--set", "a.b=1"),
        ("--fresh", None),
    ]
    block = Block(README, 1, "bash", "A=1 python -m train --x && pip install y  # c\n", False)
    assert [c.argv for c in commands(block)] == [
        ["python", "-m", "train", "--x"],
        ["pip", "install", "y"],
    ]
    text = "nnlite-train --config c.yaml\nnnlite-train lr-find --steps 3\nnnlite-train foo\n"
    assert [c.argv for c in commands(Block(README, 1, "bash", text, False))] == [
        ["python", "-m", "train", "--config", "c.yaml"],
        ["python", "-m", "train.lr_find", "--steps", "3"],
        ["python", "-m", "train.<foo>"],
    ]


def test_shipped_model_tables_list_each_models_fields_and_defaults():
    import dataclasses

    from train.config import to_dict
    from train.model import registry as models
    from train.model.contract import DATA_FIELDS, fields

    text = (ROOT / "docs" / "training.md").read_text()
    for name in models.MODELS:
        start = text.index(f"`{name}` (`models/")
        para = text[start : text.index("\n\n", text.index("\n\n", start) + 2)]
        rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)`", para, flags=re.M))
        cls = models.resolve(name)
        own = {
            k: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for k, f in fields(cls).items()
            if k not in DATA_FIELDS
        }
        documented = {k: yaml.safe_load(v) for k, v in rows.items()}
        assert documented == to_dict({"m": own})["m"], name


def test_readme_model_class_is_the_example_file():
    """The README's "Train it from the command line" class is examples/residual's, verbatim."""
    readme = README.read_text()
    section = readme[readme.index("### Train it from the command line") :]
    block = next(b for b in of("python") if b.path == README and b.text in section)
    assert block.text in (ROOT / "examples/residual/mymodels.py").read_text()
