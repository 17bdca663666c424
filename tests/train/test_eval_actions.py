"""Next-action metrics in evaluation and ``hstu eval`` (issue 21, item 7): accuracy and macro-F1
of the target event's action when the model has an action head; ``hstu eval --slices``.

Hand cases: macro-F1 of small label arrays worked out on paper, and a model whose action head is
forced (bias) to always predict one action, so accuracy = that action's share of the targets and
macro-F1 = F1 of that class / the number of classes present.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TINY_MODEL

from hstu.cli import main
from hstu.config import ModelConfig
from hstu.data.sequences import EventLog, make_split
from hstu.model.hstu import build_hstu
from hstu.train.evaluate import evaluate
from hstu.train.metrics import action_metrics, macro_f1

ACTIONS = ["view", "cart", "buy"]


def test_action_metrics_by_hand():
    y, p = np.array([1, 1, 2, 3]), np.array([1, 2, 2, 2])
    # F1_1 = 2·1/(2+1), F1_2 = 2·1/(1+3), F1_3 = 0/(1+0)
    assert action_metrics(y, p) == pytest.approx({"action_accuracy": 0.5, "action_macro_F1": (2 / 3 + 1 / 2 + 0) / 3})
    assert macro_f1(np.array([2, 2]), np.array([2, 2])) == 1.0
    with pytest.raises(ValueError, match="non-empty"):
        action_metrics(np.zeros(0, np.int64), np.zeros(0, np.int64))


def action_log() -> EventLog:
    """6 users x 5 events over 8 items; the target (last) actions are buy, view, cart, buy, buy, view."""
    last = ["buy", "view", "cart", "buy", "buy", "view"]
    rows = []
    for u in range(6):
        for j in range(5):
            rows.append((u + 1, (u + 2 * j) % 8 + 1, 100 + j, last[u] if j == 4 else ACTIONS[j % 3]))
    df = pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp", "action"])
    return EventLog.from_frame(df, name="acts", action_names=ACTIONS)


@pytest.mark.parametrize("forced,acc,f1", [("buy", 3 / 6, (2 * 3 / (6 + 3)) / 3), ("cart", 1 / 6, (2 * 1 / (6 + 1)) / 3)])
def test_evaluate_reports_the_action_head_by_hand(forced, acc, f1):
    log_ = action_log()
    split = make_split(log_, "clean")
    model = build_hstu(ModelConfig(num_items=8, num_actions=3, **TINY_MODEL)).eval()
    with torch.no_grad():
        model.action_head.weight.zero_()
        model.action_head.bias.zero_()
        model.action_head.bias[ACTIONS.index(forced) + 1] = 5.0  # logits (B, A+1): the forced action always wins
    out = evaluate(model, log_, split, "test")
    assert out["action_accuracy"] == pytest.approx(acc) and out["action_macro_F1"] == pytest.approx(f1)
    no_head = build_hstu(ModelConfig(num_items=8, **TINY_MODEL)).eval()
    assert "action_accuracy" not in evaluate(no_head, log_, split, "test")


@pytest.fixture(scope="module")
def action_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("acts")
    rows = [f"{u},{(u * 3 + j) % 20 + 1},{1000 + j},{ACTIONS[(u + j) % 3]}" for u in range(1, 31) for j in range(8)]
    (d / "log.csv").write_text("u,i,t,a\n" + "\n".join(rows) + "\n")
    (d / "tiny.toml").write_text(
        "[model]\n" + "".join(f"{k} = {v}\n" for k, v in TINY_MODEL.items()) + "[train]\nbatch_size = 8\nnum_negatives = 4\n"
    )
    flags = ["--dataset", "csv", "--data-dir", str(d / "log.csv"), "--columns", "user=u,item=i,time=t,action=a"]
    assert main(["train", *flags, "--config", str(d / "tiny.toml"), "--epochs", "1", "--out", str(d / "run"), "--quiet"]) == 0
    return d / "run"


def test_hstu_eval_prints_action_metrics_and_slices(action_run, capsys):
    from hstu.cli import _run_data
    from hstu.runs import load_run

    model, cfg, _ = load_run(action_run)
    assert model.action_head is not None
    log_, split, _ = _run_data(cfg)
    want = evaluate(model, log_, split, "test")
    assert main(["eval", "--run", str(action_run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    for k in ("action_accuracy", "action_macro_F1"):
        assert got[k] == pytest.approx(want[k])
    metrics = json.loads((action_run / "metrics.json").read_text())
    assert "action_accuracy" in metrics["test"] and "action_macro_F1" in metrics["valid"]
    assert main(["eval", "--run", str(action_run), "--slices", "--resamples", "20", "--json"]) == 0
    sl = json.loads(capsys.readouterr().out)["slices"]
    assert sl["next_action"]["accuracy"]["value"] == pytest.approx(want["action_accuracy"])  # the same prediction
    assert sl["next_action"]["macro_f1"]["value"] == pytest.approx(want["action_macro_F1"])
    assert {"cold_start", "repeat", "purchase", "diversity"} <= set(sl)
    assert main(["eval", "--run", str(action_run), "--slices", "--resamples", "20"]) == 0
    text = capsys.readouterr().out
    assert "action_accuracy" in text and "HR@10, purchase targets:" in text and "HR@10, history cut to 1 event:" in text
