"""The learning-rate decay on a validation plateau (issue 20; hstu.train.recipe.decay_on_plateau):
the rule by hand, its validation, old runs keep a constant lr, and a tiny `hstu train` whose saved
optimizer rates follow the valid NDCG@10 history it wrote."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import tiny_csv_flags

from hstu.config import TrainConfig, train_config_from_dict
from hstu.train.recipe import decay_on_plateau, recipe


def _groups() -> list[dict]:
    return [{"lr": 1e-3}, {"lr": 4e-3}]


def test_decay_halves_every_rate_at_each_patience_multiple() -> None:
    tcfg, groups = TrainConfig(lr_decay_patience=3, lr_decay_factor=0.5), _groups()
    seen = []
    for bad in (1, 2, 3, 4, 5, 6, 0, 1):
        seen.append((decay_on_plateau(groups, tcfg, bad, epoch=bad), groups[0]["lr"], groups[1]["lr"]))
    assert [s[0] for s in seen] == [False, False, True, False, False, True, False, False]
    assert seen[2][1:] == pytest.approx((5e-4, 2e-3)) and seen[5][1:] == pytest.approx((2.5e-4, 1e-3))
    assert seen[-1][1:] == pytest.approx((2.5e-4, 1e-3))  # a better epoch (bad 0) and one bad after it: unchanged


def test_patience_zero_is_a_constant_rate() -> None:
    groups = _groups()
    assert not any(decay_on_plateau(groups, TrainConfig(lr_decay_patience=0), bad, bad) for bad in range(1, 20))
    assert [g["lr"] for g in groups] == [1e-3, 4e-3]
    assert recipe(TrainConfig(lr_decay_patience=0))["lr_decay"] == "off"
    scope = recipe(TrainConfig(), {"table_optimizer": "rowwise_adagrad", "table_learning_rate": 0.01})["lr_decay"]["scope"]
    assert scope.startswith("dense layers")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lr_decay_patience", -1, "must be >= 0"),
        ("lr_decay_factor", 0.0, "must be in (0, 1), got 0.0"),
        ("lr_decay_factor", 1.0, "must be in (0, 1), got 1.0"),
    ],
)
def test_bad_decay_settings_are_refused(field, value, message) -> None:
    with pytest.raises(ValueError, match=re.escape(f"TrainConfig.{field} {message}")):
        TrainConfig(**{field: value}).validate()


def test_runs_saved_before_the_decay_keep_a_constant_rate() -> None:
    assert train_config_from_dict({"epochs": 3}, saved=True).lr_decay_patience == 0
    assert train_config_from_dict({"epochs": 3}).lr_decay_patience == 3  # a [train] table: today's default
    assert train_config_from_dict({"lr_decay_patience": 2}, saved=True).lr_decay_patience == 2


def _train(flags: list[str], out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hstu", "train", *flags, "--threads", "1", "--out", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def _expected_lr(lr0: float, history: list[dict], factor: float) -> float:
    """Patience 1: one decay per epoch whose valid NDCG@10 is not above the best before it."""
    best, lr = -1.0, lr0
    for h in history:
        score = h["valid"]["NDCG@10"]
        best, lr = (score, lr) if score > best else (best, lr * factor)
    return lr


def test_hstu_train_decays_the_saved_rates_and_resume_keeps_them(tmp_path) -> None:
    """A rate of 1e-12 leaves the ranking as it is, so valid NDCG@10 never improves after epoch 1.
    Patience 1: every epoch without a better valid NDCG@10 multiplies the rate by the factor; the
    checkpoint's param_groups hold the decayed rates (derived from the run's own valid history) and
    --resume goes on from them."""
    flags = tiny_csv_flags(tmp_path, train={"epochs": 3, "learning_rate": 1e-12}) + [
        "--lr-decay-patience",
        "1",
        "--lr-decay-factor",
        "0.25",
    ]
    out = tmp_path / "run"
    r = _train(flags, out)
    assert json.loads((out / "config.json").read_text())["train"]["lr_decay_patience"] == 1
    assert json.loads((out / "metrics.json").read_text())["recipe"]["lr_decay"] == {
        "patience": 1,
        "factor": 0.25,
        "scope": "all parameters",
    }
    assert "lr x 0.25 after 1 epochs without a better valid NDCG@10" in r.stderr
    last = json.loads((out / "last.json").read_text())
    want = _expected_lr(1e-12, last["history"], 0.25)
    assert want == pytest.approx(1e-12 * 0.25**2, rel=1e-9, abs=0)  # epochs 2 and 3 decayed
    assert [g["lr"] for g in last["param_groups"]] == pytest.approx([want], rel=1e-9, abs=0)
    _train(["--resume", "--epochs", "5"], out)
    last = json.loads((out / "last.json").read_text())
    assert len(last["history"]) == 5
    assert [g["lr"] for g in last["param_groups"]] == pytest.approx([1e-12 * 0.25**4], rel=1e-9, abs=0)
    assert _expected_lr(1e-12, last["history"], 0.25) == pytest.approx(1e-12 * 0.25**4, rel=1e-9, abs=0)


def test_paper_protocol_states_its_constant_rate(tmp_path) -> None:
    """Under --protocol paper the decay is not applied (its valid split is the test item): config.json, the recipe and
    the log say a constant lr, even with --lr-decay-patience given; the flag's factor must lie in (0, 1)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hstu", "train", *tiny_csv_flags(tmp_path, train={"epochs": 2}), "--protocol", "paper"]
    r = subprocess.run([*cmd, "--lr-decay-patience", "1", "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "lr_decay_patience = 1 is not applied under --protocol paper" in r.stderr and "constant lr" in r.stderr
    assert json.loads((out / "config.json").read_text())["train"]["lr_decay_patience"] == 0
    assert json.loads((out / "metrics.json").read_text())["recipe"]["lr_decay"] == "off"
    bad = subprocess.run([*cmd, "--lr-decay-factor", "1", "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "argument --lr-decay-factor: must be in (0, 1), got 1" in bad.stderr
