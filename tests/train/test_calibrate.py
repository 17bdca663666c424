"""Calibration of the next-action head on validation (hstu.train.calibrate): the fit recovers a known
temperature and offsets, the head is changed exactly by them, the test split is never read, and a
trained run saves and reports the calibrated head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstu.config import TrainConfig, model_config_from_preset
from hstu.data.prepare import DataSpec, prepare_data
from hstu.model.checkpoint import load_run, read_json
from hstu.train.calibrate import action_logits, calibrate_action_head, fit_temperature_and_offsets
from hstu.train.loop import fit
from hstu.train.metrics import action_metrics


def test_fit_recovers_a_known_temperature_and_offsets():
    """Labels drawn from softmax(z / 2 + δ): the maximum-likelihood fit finds T = 2 and δ within
    sampling error (20,000 draws), and its cross-entropy is below the uncalibrated one."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20000, 4, generator=g, dtype=torch.float64) * 3
    delta = torch.tensor([0.6, -0.3, 0.1, -0.4], dtype=torch.float64)  # sums to 0
    y = torch.multinomial(torch.softmax(z / 2 + delta, dim=1), 1, generator=g).view(-1) + 1
    T, d = fit_temperature_and_offsets(z.numpy(), y.numpy())
    assert T == pytest.approx(2.0, rel=0.05)
    assert np.abs(d - delta.numpy()).max() < 0.06 and abs(d.sum()) < 1e-9


class _ValidOnly:
    """A split that refuses to hand out the test targets."""

    def __init__(self, split):
        self.split = split

    def targets(self, which):
        assert which == "valid", f"calibration read the {which} split"
        return self.split.targets(which)


@pytest.fixture
def taobao_run(taobao_csv, tmp_path):
    run = tmp_path / "tb"
    cfg = model_config_from_preset("small", max_seq_len=50, embedding_dim=16, d_qk=16, d_v=16)
    tcfg = TrainConfig(epochs=2, batch_size=32, learning_rate=5e-3, seed=0, early_stopping_patience=100)
    spec = DataSpec("taobao", str(taobao_csv.parent), max_users=150)
    fit(run, cfg, tcfg, spec, progress=False)
    return run, spec


def test_trained_run_saves_the_calibrated_head(taobao_run):
    """metrics.json reports the calibration; the saved head's validation accuracy is the reported one,
    and equals the run's validation action accuracy."""
    run, spec = taobao_run
    metrics = read_json(run / "metrics.json")
    cal = metrics["action_head_calibration"]
    assert cal["temperature"] > 0 and set(cal["offsets"]) == {"pv", "cart", "fav", "buy"}
    assert cal["valid_after"]["cross_entropy"] <= cal["valid_before"]["cross_entropy"] + 1e-12
    model, _, _ = load_run(run, "cpu")
    log_, split = prepare_data(spec)
    z, y = action_logits(model, log_, split, "valid")
    got = action_metrics(y, z.argmax(axis=1) + 1)["action_accuracy"]
    assert got == pytest.approx(cal["valid_after"]["accuracy"]) == pytest.approx(metrics["valid"]["action_accuracy"])


def test_calibration_folds_exactly_into_the_head_and_reads_no_test(taobao_run):
    """Calibrating (again) changes the real-action logits to z / T + δ exactly, leaves the "none" row
    alone, never lowers the validation likelihood, and only reads the validation targets."""
    run, spec = taobao_run
    model, _, _ = load_run(run, "cpu")
    log_, split = prepare_data(spec)
    z, _ = action_logits(model, log_, split, "valid")
    w0, b0 = model.action_head.weight[0].clone(), model.action_head.bias[0].clone()
    cal = calibrate_action_head(model, log_, _ValidOnly(split))
    z2, _ = action_logits(model, log_, split, "valid")
    delta = np.array(list(cal["offsets"].values()))
    np.testing.assert_allclose(z2, z / cal["temperature"] + delta, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.action_head.weight[0], w0) and torch.equal(model.action_head.bias[0], b0)
    assert cal["valid_after"]["cross_entropy"] <= cal["valid_before"]["cross_entropy"] + 1e-12


def test_a_resumed_run_keeps_its_calibration_record(taobao_run):
    """Resuming without a new best epoch reports the calibration that made the saved head (calibrating the
    calibrated head again recorded T = 1 and zero offsets: a fresh-user finding)."""
    run, spec = taobao_run
    before = read_json(run / "metrics.json")
    cfg = model_config_from_preset("small", max_seq_len=50, embedding_dim=16, d_qk=16, d_v=16)
    tcfg = TrainConfig(epochs=2, batch_size=32, learning_rate=5e-3, seed=0, early_stopping_patience=100)
    fit(run, cfg, tcfg, spec, resume=True, progress=False)
    after = read_json(run / "metrics.json")
    assert after["best_epoch"] == before["best_epoch"]
    assert after["action_head_calibration"] == before["action_head_calibration"]
    assert after["valid"]["action_accuracy"] == before["valid"]["action_accuracy"]


def test_a_resume_of_a_finished_run_keeps_its_calibrated_weights(taobao_csv, tmp_path):
    """A resume that trains nothing, of a run whose last epoch is its best: model.safetensors stays the
    calibrated file (it was rewritten from last.safetensors, the uncalibrated head, while the calibration
    record was kept: test action accuracy .83 -> .06 on a fresh-user run)."""
    run = tmp_path / "one"
    cfg = model_config_from_preset("small", max_seq_len=50, embedding_dim=16, d_qk=16, d_v=16)
    tcfg = TrainConfig(epochs=1, batch_size=32, learning_rate=5e-3, seed=0)
    spec = DataSpec("taobao", str(taobao_csv.parent), max_users=150)
    fit(run, cfg, tcfg, spec, progress=False)
    before, weights = read_json(run / "metrics.json"), (run / "model.safetensors").read_bytes()
    assert before["best_epoch"] == before["epochs"] == 1 and "action_head_calibration" in before
    fit(run, cfg, tcfg, spec, resume=True, progress=False)
    after = read_json(run / "metrics.json")
    assert (run / "model.safetensors").read_bytes() == weights
    assert after["test"]["action_accuracy"] == before["test"]["action_accuracy"]
    assert after["action_head_calibration"] == before["action_head_calibration"]
