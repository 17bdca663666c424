"""benchmarks/ablate_ml1m.py --report-only rescores each run on the users it was trained on (its
recorded max_users), not on every user (a smoke run of 30 users was rescored on 6040)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import ML1M, REPO, need


@pytest.fixture
def ablate(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import ablate_ml1m

    yield ablate_ml1m
    for name in ("ablate_ml1m", "reproduce_ml1m", "_quality"):
        sys.modules.pop(name, None)


def test_report_only_rescores_the_runs_own_users(ablate, tmp_path: Path) -> None:
    need(ML1M / "ratings.dat")
    common = [
        "--data-dir",
        str(ML1M),
        "--ablations",
        "base,seed-7",
        "--runs",
        str(tmp_path / "runs"),
        "--resamples",
        "20",
        "--threads",
        str(torch.get_num_threads()),
    ]
    assert ablate.main([*common, "--epochs", "1", "--max-users", "30", "--out", str(tmp_path / "trained")]) == 0
    assert ablate.main([*common, "--report-only", "--out", str(tmp_path / "report")]) == 0  # no --max-users
    for out in ("report", "trained"):
        report = json.loads((tmp_path / out / "ml1m_ablations.json").read_text())
        for name, r in report["runs"].items():
            # the saved model rescored per user equals the run's own last-epoch test metrics (paper protocol)
            for k in ("HR@10", "NDCG@10"):
                assert r["final_rescored"][k] == pytest.approx(r["test"]["1"][k], abs=1e-6), (out, name, k)
            assert r["max_users"] == 30, (out, name)
        assert len(report["runs"]["seed-7"]["final_minus_base_ci95"]["HR@10"]) == 2
