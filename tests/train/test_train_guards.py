"""Training guards found by a fresh-user trial: an fp16 hashed table under AdamW is refused before the data is read
(it trained to a nan loss and a run marked completed), a diverged epoch (non-finite loss) stops the run
with nothing of that epoch written, ``hstu.fit`` never replaces a run unless asked, the run records an
absolute data path, and Ctrl-C / an abbreviated flag give one line."""

from __future__ import annotations

import json
import os

import pytest
from conftest import TINY_MODEL, tiny_csv

from hstu.cli import main
from hstu.config import ModelConfig, TrainConfig
from hstu.data.prepare import DataSpec
from hstu.runs import read_history
from hstu.train import loop

CFG = TINY_MODEL


def _log(d):
    return DataSpec("csv", str(tiny_csv(d)), options={"columns": "user=u,item=i,time=t"})


def _fit(run, spec, epochs=1, **kw):
    mcfg = ModelConfig(**CFG, **kw.pop("model", {}))
    return loop.fit(run, mcfg, TrainConfig(epochs=epochs, batch_size=8, num_negatives=4), spec, progress=False, **kw)


def test_fp16_hashed_table_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "prepare_data", lambda *_: pytest.fail("the data was read before the refusal"))
    with pytest.raises(ValueError, match=r"item_table_dtype = 'fp16' cannot be trained.*bf16"):
        _fit(tmp_path / "run", DataSpec("csv", "x.csv"), model={"item_table": "hashed", "item_table_dtype": "fp16"})
    assert not (tmp_path / "run").exists()


def test_bf16_hashed_table_trains_to_a_finite_loss(tmp_path):
    m = _fit(tmp_path / "run", _log(tmp_path), model={"item_table": "hashed", "item_table_shards": 2, "item_table_dtype": "bf16"})
    assert all(abs(v) < float("inf") for k, v in m["test"].items() if k != "users")
    assert all(0 < e["loss"] < float("inf") for e in read_history(tmp_path / "run"))


def test_a_diverged_epoch_stops_the_run_and_writes_nothing_of_it(tmp_path, monkeypatch):
    spec, run = _log(tmp_path), tmp_path / "run"
    _fit(run, spec, epochs=1)
    files = lambda: {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "config.json"}  # noqa: E731
    before = files()  # config.json takes the resumed run's epochs = 2 at the start
    real = loop.train_one_epoch
    monkeypatch.setattr(loop, "train_one_epoch", lambda *a, **k: {**real(*a, **k), "loss": float("nan")})
    with pytest.raises(FloatingPointError, match="epoch 2: the training loss is nan"):
        _fit(run, spec, epochs=2, resume=True)
    assert files() == before  # epoch 1 intact, nothing of epoch 2
    assert [e["epoch"] for e in read_history(run)] == [1]


def test_fit_does_not_replace_a_run_unless_asked(tmp_path):
    spec, run = _log(tmp_path), tmp_path / "run"
    _fit(run, spec)
    with pytest.raises(FileExistsError, match="already holds a run"):
        _fit(run, spec)
    _fit(run, spec, overwrite=True)


def test_cli_run_records_an_absolute_data_path(tmp_path, monkeypatch, capsys):
    _log(tmp_path)
    model = "\n".join(f"{k} = {v}" for k, v in CFG.items())
    (tmp_path / "t.toml").write_text(f"[model]\n{model}\n[train]\nbatch_size = 8\nnum_negatives = 4\n")
    monkeypatch.chdir(tmp_path)
    flags = ["--dataset", "csv", "--data-dir", "log.csv", "--columns", "user=u,item=i,time=t", "--config", "t.toml", "--epochs", "1"]
    assert main(["train", *flags, "--out", "run", "--quiet"]) == 0
    data_dir = json.loads((tmp_path / "run" / "config.json").read_text())["data"]["data_dir"]
    assert os.path.isabs(data_dir) and os.path.samefile(data_dir, tmp_path / "log.csv")


def test_abbreviated_flags_and_ctrl_c_are_one_line(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--epoch", "1", "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and "unrecognized arguments: --epoch" in capsys.readouterr().err

    def interrupted(args):
        raise KeyboardInterrupt

    import hstu.train.cli as tcli

    real_add = tcli.add_train_parser

    def add(sub):
        real_add(sub)
        sub.choices["train"].set_defaults(func=interrupted)

    monkeypatch.setattr(tcli, "add_train_parser", add)
    assert main(["train", "--out", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hstu train: interrupted; the run keeps its last committed epoch: continue with --resume"]
