"""A newcomer adds a data set, an optimizer, a logger and a callback, each as one file and
one line in a config: the four files are the ones docs/ shows (docs/data.md,
docs/optimizers.md, docs/loggers.md, docs/callbacks.md), written into a fresh directory, and a tiny run trains with all
four."""

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

import train

ROOT = Path(__file__).resolve().parents[1]
#: module name -> the doc page whose ```python block starting ``# <module>.py`` is the file
FILES = {
    "my_data": "docs/data.md",
    "my_optim": "docs/optimizers.md",
    "my_logger": "docs/loggers.md",
    "my_callback": "docs/callbacks.md",
}


def doc_file(module: str) -> str:
    """The complete file ``module``.py as its doc page shows it."""
    text = (ROOT / FILES[module]).read_text()
    blocks = re.findall(r"^```python\n(# " + module + r"\.py.*?)^```$", text, re.M | re.S)
    assert len(blocks) == 1, f"{FILES[module]}: one ```python block '# {module}.py'"
    return blocks[0]


@pytest.fixture
def project(tmp_path):
    for module in FILES:
        (tmp_path / f"{module}.py").write_text(doc_file(module))
    yield tmp_path
    for module in FILES:
        sys.modules.pop(module, None)


def test_the_docs_four_files_each_plug_in_with_one_config_line(project):
    config = {
        "name": "newcomer",
        "model": {"name": "mlp", "hidden_sizes": [8]},
        "data": {"name": "my_data:blobs", "options": {"n": 600}},
        "optimizer": {"name": "my_optim:nesterov", "learning_rate": 0.05, "momentum": 0.9},
        "log": {
            "dir": str(project / "runs"),
            "progress": False,
            "plot": False,
            "loggers": ["jsonl", {"name": "my_logger:LastRecord", "filename": "last.json"}],
        },
        "callbacks": [{"name": "my_callback:CountEvals", "every": 1}],
        "train": {"steps": 20, "batch_size": 32, "eval_every": 10, "log_every": 10},
    }
    path = project / "newcomer.yaml"
    path.write_text(yaml.safe_dump(config))
    run = train.fit(None, path, echo=lambda line: None)
    assert run.model.in_features == 4 and run.model.num_classes == 2  # the data's shape
    assert run.data.describe().startswith("480 train / 120 test")
    last = json.loads((run.run_dir / "last.json").read_text())  # the logger's file
    assert last["train"]["step"] == last["test"]["step"] == 20
    assert (run.run_dir / "evals.txt").read_text() == "2\n"  # the callback's
    assert run.summary["test_accuracy"] > 0.9  # blobs 2 apart: the optimizer trained
    # the run's config.yaml names the four by their import paths and reads back
    written = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert written["optimizer"] == config["optimizer"]
    assert (
        written["data"]["name"] == "my_data:blobs" and written["callbacks"] == config["callbacks"]
    )
