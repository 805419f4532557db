"""Your data: map-style sources, iterables and Grain through ``train.fit(data=...)`` and
``data.name: module:function`` (train/data/source.py, train/data/registry.py)."""

import json
import shutil
import textwrap
import warnings

import jax
import numpy as np
import pytest
import yaml

import train
from train.__main__ import main
from train.checkpoint.rundir import TIMING_KEYS
from train.config import config_from_dict
from train.data.registry import DATA_SETS
from train.data.source import DataError, ResumeNotExactWarning
from train.data.user import to_dataset
from train.errors import ConfigError, UserCodeError

N, FEATURES = 320, 6


def arrays(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64) + 2 * (x[:, 2] > 0)
    return x, y


class Rows:
    """A map-style source: counts its reads and the rows it was asked for."""

    def __init__(self, n=N, seed=0):
        self.x, self.y = arrays(n, seed)
        self.asked = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        self.asked.append(np.array(indices))
        return self.x[indices], self.y[indices]


class Batches:
    """An iterable of 24-row batches (not train.batch_size) with state_dict, cycling."""

    def __init__(self, stateful=True):
        self.x, self.y = arrays()
        self.pos = 0
        if not stateful:
            self.state_dict = self.load_state_dict = None

    def __iter__(self):
        return self

    def __next__(self):
        i = self.pos % (N // 24)
        self.pos += 1
        return self.x[i * 24 : (i + 1) * 24], self.y[i * 24 : (i + 1) * 24]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def cfg(tmp_path, name="run", **sections):
    base = {
        "name": name,
        "model": {"name": "mlp", "hidden_sizes": [16]},
        "train": {"steps": 20, "batch_size": 32, "log_every": 5, "eval_every": 10},
        "log": {"dir": str(tmp_path), "plot": False, "progress": False},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return base


def fit(tmp_path, data, name="run", resume="fresh", **sections):
    return train.fit(None, cfg(tmp_path, name, **sections), data=data, resume=resume, echo=quiet)


def quiet(*_):
    pass


def metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    # flops_per_step is the compiled program's (streamed or not, how many devices), not the run's
    skip = (*TIMING_KEYS, "flops_per_step")
    return [{k: v for k, v in json.loads(ln).items() if k not in skip} for ln in lines]


def leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    """A map-style source trained with the default settings, and the source: the streamed
    run of the device-arrays test, and the plain rows the Grain dataset must equal."""
    src = Rows()
    return fit(tmp_path_factory.mktemp("host"), src, "host"), src


def same_record(a, b, **tol):
    """Two metrics records agree: numbers within `tol`, strings (the split's name) equal."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], str) or isinstance(b[k], str):
            assert a[k] == b[k], k
        else:
            assert a[k] == pytest.approx(b[k], **tol), k


@pytest.fixture(scope="module")
def one_device_64(tmp_path_factory):
    """A map source on one device, batch 64: the reference of every 8-device strategy."""
    return fit(tmp_path_factory.mktemp("one"), Rows(), "one", train={"batch_size": 64})


def test_a_map_source_trains_streamed_as_arrays_train_on_the_device(tmp_path, host_run):
    host, src = host_run
    assert host.data.streamed and host.data.num_classes == 4 and host.model.in_features == 6
    # each step asked for one batch of its (seed, step) rows, never the whole source
    assert max(len(a) for a in src.asked) <= 4096 and any(len(a) == 32 for a in src.asked)
    dev = fit(tmp_path, arrays(), "device")  # (x, y) arrays: the built-ins' device path
    assert not dev.data.streamed
    for a, b in zip(metrics(host.run_dir), metrics(dev.run_dir), strict=True):
        same_record(a, b, rel=1e-5)
    saved = yaml.safe_load((host.run_dir / "config.yaml").read_text())
    assert saved["data"]["name"] == "<test_data_source.Rows>"  # what train.fit(data=...) was given


def test_data_name_module_function_from_a_config_in_a_tmp_dir(tmp_path, monkeypatch, capsys):
    (tmp_path / "mydata.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            class Source:
                num_classes = 3

                def __init__(self, n, features):
                    rng = np.random.default_rng(1)
                    self.x = rng.normal(size=(n, features)).astype(np.float32)
                    self.y = rng.integers(0, 3, n)

                def __len__(self):
                    return len(self.x)

                def __getitem__(self, idx):
                    return self.x[idx], self.y[idx]

            def make(n, features=4):
                return Source(n, features)

            def broken(n=50):
                source = Source(n, 4)
                source.__class__.__getitem__ = lambda self, idx: self.x[idx]
                return source
            """
        )
    )
    c = cfg(tmp_path / "runs", data={"name": "mydata:make", "options": {"n": 200}})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(c))
    monkeypatch.chdir(tmp_path)
    assert main(["--config", "cfg.yaml"]) == 0
    out = capsys.readouterr().out
    assert "data: mydata:make (160 train / 40 test, streamed)" in out
    saved = yaml.safe_load((tmp_path / "runs" / "run" / "config.yaml").read_text())
    assert saved["data"]["name"] == "mydata:make" and saved["data"]["options"] == {"n": 200}
    assert saved["model"]["num_classes"] == 3 and saved["model"]["in_features"] == 4
    # options checked against the factory's signature, one line, exit 2, nothing written
    assert main(["--config", "cfg.yaml", "--set", "data.options={m: 3}", "--set", "name=b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.options ['m'] do not fit mydata:make(n, features=4)" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "runs" / "b").exists()
    # a source that breaks the protocol: one line naming it, exit 2, nothing written
    bad = ["--set", "data.name=mydata:broken", "--set", "data.options={}", "--set", "name=c"]
    assert main(["--config", "cfg.yaml", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert "data source mydata:broken: __getitem__ of 2 indices returned an array" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "runs" / "c").exists()


def test_data_name_is_checked_against_the_registry():
    assert set(DATA_SETS.names) >= {"digits", "mnist1d", "linreg", "npz", "text", "tokens"}
    with pytest.raises(ConfigError, match=r"data.name=digitz is not a built-in data set \(digits"):
        config_from_dict({"data": {"name": "digitz"}})
    with pytest.raises(ConfigError, match="data.name=digits takes none"):
        config_from_dict({"data": {"name": "digits", "options": {"n": 1}}})
    with pytest.raises(ConfigError, match="no module named 'no_such_module'"):
        config_from_dict({"data": {"name": "no_such_module:make"}})


def test_a_map_source_resumes_bit_identically(tmp_path):
    keys = dict(
        train={"steps": 40, "log_every": 5, "eval_every": 10},
        checkpoint={"every": 10, "keep": 10},
    )
    full = fit(tmp_path, Rows(), "full", **keys)
    # a kill right after step 20: the later checkpoints never happened
    shutil.copytree(full.run_dir, tmp_path / "part")
    for p in sorted((tmp_path / "part" / "checkpoints").iterdir())[2:]:
        p.unlink()
    src = Rows()
    resumed = fit(tmp_path, src, "part", resume="require", **keys)
    assert resumed.step == 40 and len(src.asked) < 40  # it read steps 20..39 only
    for a, b in zip(
        leaves((full.params, full.opt_state)), leaves((resumed.params, resumed.opt_state))
    ):
        np.testing.assert_array_equal(a, b)
    assert metrics(full.run_dir) == metrics(resumed.run_dir)


def test_each_process_asks_a_map_source_only_for_its_share(monkeypatch):
    from train.data.dataset import make_sampler
    from train.data.feed import call_batch

    src = Rows()
    data = to_dataset(src, config_from_dict({"data": {"placement": "host"}}).data)
    sampler = make_sampler(0, data, 32)
    everything = sampler.batches(4, 2)  # [2 steps, 32]
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    src.asked.clear()
    x, y = call_batch(data, sampler, 4, 2)
    assert x.shape == (2, 8, FEATURES) and len(src.asked) == 1 and len(src.asked[0]) == 16
    train_rows = data.x.pair_reader.source.indices  # the split's rows of the source
    np.testing.assert_array_equal(src.asked[0], train_rows[everything[:, 16:24].reshape(-1)])
    np.testing.assert_array_equal(x.reshape(16, -1), src.x[src.asked[0]])


@pytest.mark.parametrize("strategy", ["shard_map", "fsdp"])
def test_a_map_source_under_8_devices_equals_one_device(tmp_path, strategy, one_device_64):
    one = one_device_64
    many = fit(
        tmp_path, Rows(), strategy, train={"batch_size": 64}, parallel={"strategy": strategy}
    )
    assert len(many.devices) == 8 and many.data.streamed
    for a, b in zip(metrics(one.run_dir), metrics(many.run_dir), strict=True):
        same_record(a, b, rel=1e-4, abs=1e-6)
    for a, b in zip(leaves(one.params), leaves(many.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_an_iterable_trains_and_warns_that_resume_is_not_exact(tmp_path):
    def batches():
        x, y = arrays()
        while True:
            for i in range(0, N, 40):
                yield x[i : i + 40], y[i : i + 40]

    with pytest.warns(ResumeNotExactWarning, match=r"generator is an iterable without state_dict"):
        run = fit(tmp_path, batches())
    assert run.step == 20 and "test_accuracy" in run.summary
    assert len(run.data.x_test) == 40  # no test split given: the first batch is held out
    with pytest.warns(ResumeNotExactWarning) as caught:
        fit(tmp_path, batches(), resume="auto", train={"steps": 30})
    assert any("resuming at step 20" in str(w.message) for w in caught)


def test_an_iterable_with_state_dict_resumes_bit_identically(tmp_path):
    keys = dict(
        train={"steps": 30, "log_every": 5, "eval_every": 10},
        checkpoint={"every": 10, "keep": 10},
    )
    test = arrays(64, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stateful iterable does not warn
        full = fit(tmp_path, {"train": Batches(), "test": test}, "full", **keys)
    shutil.copytree(full.run_dir, tmp_path / "part")
    for p in sorted((tmp_path / "part" / "checkpoints").iterdir())[1:]:
        p.unlink()  # resume at step 10: 320 rows in, 8 of the 14th 24-row batch used
    resumed = fit(tmp_path, {"train": Batches(), "test": test}, "part", resume="require", **keys)
    for a, b in zip(leaves(full.params), leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert metrics(full.run_dir) == metrics(resumed.run_dir)


class Bad(Rows):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def __getitem__(self, idx):
        x, y = self.x[idx], self.y[idx]
        calls = len(self.asked)
        self.asked.append(idx)
        if self.mode == "single":
            return x
        if self.mode == "rows":
            return x[:-1], y
        if self.mode == "strings":
            return x, np.array(["a"] * len(idx))
        if self.mode == "changes" and calls > 0:
            return x[:, :3], y
        if self.mode == "raises":
            raise KeyError(int(idx[0]))
        return x, y


@pytest.mark.parametrize(
    "mode, message",
    [
        ("single", r"data source .*Bad: __getitem__ of 2 indices returned an array of shape"),
        ("rows", r"returned x of shape \(1, 6\) for 2 rows; expected \(x, y\) arrays of 2 rows"),
        ("strings", r"returned y as an array of shape \(2,\) \(<U1\), not a numeric array"),
        ("changes", r"unlike its first batch; expected x \[\d+, 6\] floats and y \[\d+\] integers"),
        (
            "raises",  # the user's code raised: its file and line (train/errors.py)
            r"data source .*test_data_source.py:\d+ in __getitem__: KeyError: 0 \(.*Bad, "
            r"__getitem__ of 2 indices\)",
        ),
    ],
)
def test_a_bad_source_is_one_line_naming_it(mode, message):
    with pytest.raises(DataError if mode != "raises" else UserCodeError, match=message) as e:
        to_dataset(Bad(mode), config_from_dict({}).data)
    assert "\n" not in str(e.value)


class Records:
    """A Grain RandomAccessDataSource: one record per int index."""

    def __init__(self):
        self.x, self.y = arrays()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}

    def __repr__(self):  # Grain checks a resumed loader's source by its repr
        return "Records()"


def test_grain_map_datasets_and_data_loaders_plug_in(tmp_path, host_run):
    grain = pytest.importorskip("grain", reason="Grain is optional: pip install 'nnlite[grain]'")
    x, y = arrays()
    records = grain.MapDataset.source(list(range(N))).map(lambda i: {"x": x[i], "y": y[i]})
    mapped = fit(tmp_path, records, "map")
    plain = host_run[0]  # the same settings, the plain Rows source
    assert metrics(mapped.run_dir) == metrics(plain.run_dir)  # the same rows, the same order

    def loader():  # 20-row batches, shuffled by Grain; its state is bytes
        sampler = grain.samplers.IndexSampler(
            N, shuffle=True, seed=1, num_epochs=None, shard_options=grain.sharding.NoSharding()
        )
        ops = [grain.transforms.Batch(20)]
        loader = grain.DataLoader(
            data_source=Records(), sampler=sampler, operations=ops, worker_count=0
        )
        return {"train": loader, "test": arrays(64, 1)}

    keys = dict(train={"steps": 20}, checkpoint={"every": 10, "keep": 10})
    full = fit(tmp_path, loader(), "full", **keys)
    assert full.data.stream.stateful and full.data.name == "grain.DataLoader"
    shutil.copytree(full.run_dir, tmp_path / "part")
    for p in sorted((tmp_path / "part" / "checkpoints").iterdir())[1:]:
        p.unlink()
    resumed = fit(tmp_path, loader(), "part", resume="require", **keys)
    for a, b in zip(leaves(full.params), leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
