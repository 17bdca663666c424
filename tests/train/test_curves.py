"""Issue 23 item 3: training curves. metrics.csv equals history.json after a run and after a kill
and --resume (each epoch once); the one-line epoch logs; no progress bar off a terminal (a few
rate-limited lines instead); TensorBoard scalars; --max-minutes stops early and resumes; --arch
sasrec with a size preset."""

from __future__ import annotations

import functools
import io
import itertools
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch
from conftest import tiny_csv_flags

from hstu.cli import main
from hstu.model.checkpoint import KILL_AT_ENV
from hstu.train import logs, loop


def _flags(d):
    """A 30-user CSV data set and a tiny model (3 epochs, validation at epochs 2 and 3)."""
    return tiny_csv_flags(d, train={"epochs": 3, "eval_every": 2})


def _history(run):
    return json.loads((run / "history.json").read_text())


def check_csv_is_history(run):
    """metrics.csv read by pandas (an independent reader) equals history.json cell by cell: the same
    epochs once each, loss / seconds / throughput / positions and every validation metric (empty
    where an epoch was not evaluated)."""
    hist = _history(run)
    df = pd.read_csv(run / "metrics.csv")
    assert df["epoch"].tolist() == [h["epoch"] for h in hist] == list(range(1, len(hist) + 1))
    for row, h in zip(df.to_dict("records"), hist):
        for k in ("loss", "seconds", "sequences_per_s", "positions"):
            assert row[k] == h[k], (k, row[k], h[k])
        metrics = {m for m in df.columns if m.startswith("valid_")}
        assert metrics == {f"valid_{m}" for e in hist for m in e.get("valid", {})}
        for m in metrics:
            want = h.get("valid", {}).get(m.removeprefix("valid_"))
            assert (math.isnan(row[m]) and want is None) or row[m] == want, (h["epoch"], m, row[m], want)


def _killed_train(flags, run, point: str, *extra: str) -> subprocess.CompletedProcess:
    """`hstu train FLAGS --out RUN EXTRA` in a subprocess SIGKILLed just before the rename ``point`` (KILL_AT_ENV)."""
    env = {**os.environ, KILL_AT_ENV: point, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, "-m", "hstu", "train", *flags, *extra, "--out", str(run), "--quiet"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    return p


def test_csv_equals_history_after_a_run(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *_flags(tmp_path), "--out", str(run), "--quiet"]) == 0
    hist = _history(run)
    assert [("valid" in h) for h in hist] == [False, True, True]  # eval_every 2, and the last epoch
    check_csv_is_history(run)


@pytest.mark.parametrize("point", ["metrics.csv.tmp:2", "last.safetensors.tmp:2"])
def test_csv_after_kill_and_resume_has_each_epoch_once(tmp_path, point):
    """A real SIGKILL just before epoch 2's metrics.csv (epoch 2 committed, the CSV one behind) or
    its last.safetensors (epoch 2 lost, retrained) is renamed into place; --resume leaves a CSV
    equal to history.json with epochs 1, 2, 3 once each."""
    flags = _flags(tmp_path)
    run = tmp_path / "run"
    _killed_train(flags, run, point)
    assert pd.read_csv(run / "metrics.csv")["epoch"].tolist() == [1]  # the kill left the CSV at epoch 1
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    check_csv_is_history(run)
    assert [h["epoch"] for h in _history(run)] == [1, 2, 3]


def test_epoch_line():
    entry = {
        "epoch": 3,
        "loss": 5.81204,
        "seconds": 41.21,
        "sequences_per_s": 312.4,
        "positions": 9,
        "valid": {"HR@10": 0.20114, "NDCG@10": 0.10931},
    }
    assert logs.epoch_line(entry, 10, best=True) == "epoch 3/10  loss 5.8120  valid HR@10 .2011  NDCG@10 .1093  312 seq/s  41.2 s  (best)"
    del entry["valid"]
    assert logs.epoch_line(entry, 10, best=False) == "epoch 3/10  loss 5.8120  312 seq/s  41.2 s"


VALID = r"(  valid HR@10 \.\d{4}  NDCG@10 \.\d{4}  exclude_history=off)?"
LINE = re.compile(r"^epoch (\d)/3  loss \d+\.\d{4}" + VALID + r"  \d+ seq/s  \d+\.\d s(  \(best\))?$")


def test_training_logs_one_readable_line_per_epoch(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="hstu.train.loop"):
        assert main(["train", *_flags(tmp_path), "--out", str(run), "--quiet"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "hstu.train.loop" and r.getMessage().startswith("epoch ")]
    assert len(lines) == 3 and all(LINE.match(m) for m in lines), lines
    hist = _history(run)
    for m, h in zip(lines, hist):
        assert f"loss {h['loss']:.4f}" in m
        assert ("valid" in h) == ("valid HR@10" in m)
        if "valid" in h:
            assert f"NDCG@10 {h['valid']['NDCG@10']:.4f}".replace(" 0.", " .") in m
    best, flags = -1.0, []
    for h in hist:  # (best): the validation NDCG@10 beats every earlier epoch's
        flags.append("valid" in h and h["valid"]["NDCG@10"] > best)
        best = max(best, h.get("valid", {}).get("NDCG@10", best))
    assert [m.endswith("(best)") for m in lines] == flags and flags[1]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal(caplog):
    off = io.StringIO()
    for _, _, bar in logs.progress(list(range(5)), "epoch 1", True, stream=off):
        bar.set_postfix(loss="1.0")
    assert off.getvalue() == ""
    on = _Tty()
    for _, _, bar in logs.progress(list(range(5)), "epoch 1", True, stream=on):
        bar.set_postfix(loss="1.0")
    assert "epoch 1" in on.getvalue() and "\r" in on.getvalue()
    quiet = _Tty()
    list(logs.progress(list(range(5)), "epoch 1", False, stream=quiet))
    assert quiet.getvalue() == ""


def test_progress_off_a_terminal_is_a_few_rate_limited_lines(caplog):
    """Off a terminal: a line at 25 / 50 / 75 % of the steps when 30 s have passed since the last
    one (never at 100 %: the epoch line follows); none when the epoch is quick."""
    for step_s, want in ((40.0, 3), (1.0, 0), (10.0, 1)):
        clock = functools.partial(lambda t, s: next(t) * s, itertools.count(), step_s)  # a fake clock: step_s per reading
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hstu.train.loop"):
            for _, _, bar in logs.progress(list(range(8)), "epoch 2", True, stream=io.StringIO(), clock=clock):
                bar.set_postfix(loss="2.5")
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == want, (step_s, msgs)
        assert all(m.startswith("epoch 2: ") and "loss=2.5" in m for m in msgs)
    # 10 s per reading: the quarters read 10, 20, 30 s; only the third is 30 s after the start
    assert msgs[0].startswith("epoch 2: 6/8 steps (75%)")


def test_tensorboard_scalars_equal_history(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, board = tmp_path / "run", tmp_path / "tb"
    assert main(["train", *_flags(tmp_path), "--out", str(run), "--quiet", "--tensorboard", str(board)]) == 0
    acc = EventAccumulator(str(board))
    acc.Reload()
    hist = _history(run)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([h["loss"] for h in hist], rel=1e-6)  # float32 in the event file
    ndcg = acc.Scalars("valid/NDCG@10")
    assert [(e.step, pytest.approx(e.value, abs=1e-7)) for e in ndcg] == [(h["epoch"], h["valid"]["NDCG@10"]) for h in hist if "valid" in h]


def test_tensorboard_without_the_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    run = tmp_path / "run"
    assert main(["train", *_flags(tmp_path), "--out", str(run), "--quiet", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "hstu train: error: --tensorboard needs the optional package 'tensorboard': pip install 'hstu[tensorboard]'"
    assert not (run / "config.json").exists()  # refused before anything was written


def test_max_minutes_stops_after_the_epoch_and_resumes(tmp_path, monkeypatch):
    """A fake clock at 40 s per reading: after epoch 1 40 s have passed (< 1 min), after epoch 2 80 s:
    the run stops there, committed, metrics.json saying why; --resume trains epoch 3 and completes."""
    t = iter(range(10_000))
    monkeypatch.setattr(loop, "clock", lambda: 40.0 * next(t))
    flags, run = _flags(tmp_path), tmp_path / "run"
    assert main(["train", *flags, "--out", str(run), "--quiet", "--max-minutes", "1"]) == 0
    m = json.loads((run / "metrics.json").read_text())
    assert m["epochs"] == 2 and [h["epoch"] for h in _history(run)] == [1, 2]
    assert m["status"].startswith("stopped by --max-minutes 1 after epoch 2 of 3") and "--resume" in m["status"]
    check_csv_is_history(run)
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    m = json.loads((run / "metrics.json").read_text())
    assert m["epochs"] == 3 and m["status"] == "completed"
    check_csv_is_history(run)


def test_max_minutes_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *_flags(tmp_path), "--out", str(tmp_path / "run"), "--max-minutes", "0"])
    assert exc.value.code == 2 and "argument --max-minutes: must be > 0, got 0" in capsys.readouterr().err


def test_arch_sasrec_with_the_large_preset(tmp_path):
    from hstu.config import PRESETS
    from hstu.model.sasrec import SASRecModel
    from hstu.runs import load_float_run

    run = tmp_path / "run"
    flags = [f for f in _flags(tmp_path) if not f.endswith(".toml") and f != "--config"]
    assert main(["train", *flags, "--arch", "sasrec", "--preset", "large", "--epochs", "1", "--out", str(run), "--quiet"]) == 0
    model, cfg, _ = load_float_run(run)
    assert isinstance(model, SASRecModel) and cfg["model"]["architecture"] == "sasrec"
    block = {"multi_channel": False, "query_key_map": True}  # the preset's HSTU block options are not SASRec's
    for k, v in PRESETS["large"].items():  # the preset's sizes
        assert cfg["model"][k] == block.get(k, v), k
    assert len(model.layers) == PRESETS["large"]["num_blocks"]


def test_another_arch_is_refused_with_resume(tmp_path, capsys):
    from hstu.config import model_config_from_preset, to_dict

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": to_dict(model_config_from_preset("small"))}))
    assert main(["train", "--resume", "--arch", "sasrec", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert 'the flags give architecture = "sasrec" (the run: "hstu"); drop --arch sasrec' in err, err


def test_a_resume_killed_before_its_report_leaves_the_old_report_marked_stale(tmp_path):
    """A trial's finding: a resume interrupted in its final evaluation left metrics.json saying "completed" for epoch 1
    beside 3 committed epochs (and model.safetensors holding a newer best), and `hstu report` showed it. Each epoch a
    resume commits marks the old report stale until the resume writes its own."""
    flags = tiny_csv_flags(tmp_path, train={"epochs": 1})
    run = tmp_path / "run"
    assert main(["train", *flags, "--out", str(run), "--quiet"]) == 0
    before = json.loads((run / "metrics.json").read_text())
    assert before["status"] == "completed" and before["epochs"] == 1
    _killed_train(flags, run, "metrics.json.tmp:3", "--resume", "--epochs", "3")  # epochs 2, 3 mark it; killed before its report
    stale = json.loads((run / "metrics.json").read_text())
    assert stale["status"] == "stale: epochs up to 3 committed since this report of epoch 1; hstu train --resume reports them"
    assert {k: v for k, v in stale.items() if k != "status"} == {k: v for k, v in before.items() if k != "status"}
    assert main(["train", *flags, "--resume", "--epochs", "3", "--out", str(run), "--quiet"]) == 0
    done = json.loads((run / "metrics.json").read_text())
    assert done["status"] == "completed" and done["epochs"] == 3


def test_a_resume_killed_before_its_first_commit_leaves_the_runs_record(tmp_path):
    """A resume with other flags wrote config.json (epochs, seed, recipe_changes) before it trained anything, so a
    later resume went on with a recipe no epoch had used: config.json is written at the resume's first commit."""
    flags = tiny_csv_flags(tmp_path, train={"epochs": 1})
    run = tmp_path / "run"
    assert main(["train", *flags, "--out", str(run), "--quiet"]) == 0
    cfg = (run / "config.json").read_text()
    _killed_train(flags, run, "last.safetensors.tmp:1", "--resume", "--epochs", "3", "--seed", "5")
    assert (run / "config.json").read_text() == cfg  # epochs 1, seed 42, no recipe_changes
    assert main(["train", *flags, "--resume", "--epochs", "2", "--seed", "5", "--out", str(run), "--quiet"]) == 0
    now = json.loads((run / "config.json").read_text())
    assert now["train"]["epochs"] == 2 and now["recipe_changes"] == [{"from_epoch": 2, "changed": {"seed": [42, 5]}}]
