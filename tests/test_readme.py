"""The README's examples run, and its commands are the ones CI uses."""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(BLOCKS[index], f"README.md[python block {index}]", "exec"),
            {"__name__": "readme"},
        )
    # Every "# /path: ..." comment right after a print() in the block must be what was printed.
    printed = out.getvalue()
    for expected in re.findall(r"^# (/\S+: \S+)$", BLOCKS[index], flags=re.M):
        assert expected in printed, (expected, printed)


def test_readme_commands_match_ci():
    bash = re.findall(r"```bash\n(.*?)```", README, flags=re.S)[0].splitlines()
    assert bash[0].startswith("pip install -e '.[dev]'")
    assert "python -m train --config configs/digits_mlp.yaml" in bash[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert bash[1] in ci.splitlines()
