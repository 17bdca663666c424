"""benchmarks/datasets.py: every supported layout is found by its files (and nothing else is), and
a run writes one row per data set whose figures are the trained runs' own test metrics."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO


@pytest.fixture
def datasets(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import datasets

    yield datasets
    for name in ("datasets", "_quality"):
        sys.modules.pop(name, None)


def _touch(d: Path, *names: str) -> None:
    d.mkdir(parents=True)
    for n in names:
        (d / n).write_bytes(gzip.compress(b"") if n.endswith(".gz") else b"")


def test_discover_matches_each_layout_by_its_files(datasets, tmp_path: Path) -> None:
    _touch(tmp_path / "ml-100k", "u.data", "u.item", "README")
    _touch(tmp_path / "ml-1m", "ratings.dat", "movies.dat", "users.dat")
    _touch(tmp_path / "ml-10M100K", "ratings.dat", "movies.dat", "tags.dat")
    _touch(tmp_path / "ml-latest-small", "ratings.csv", "movies.csv", "links.csv")
    _touch(tmp_path / "ml-25m", "ratings.csv", "movies.csv")
    _touch(tmp_path / "tb", "UserBehavior.csv")
    _touch(tmp_path / "rr", "events.csv", "item_properties_part1.csv")
    _touch(tmp_path / "beauty", "reviews_Beauty_5.json.gz", "meta_Beauty.json.gz")
    _touch(tmp_path / "seqs", "Beauty.txt", "README.txt")
    _touch(tmp_path / "notes", "plan.md")
    _touch(tmp_path / "two-reviews", "ratings_A.csv", "ratings_B.csv")  # ambiguous: not guessed
    found, skipped = datasets.discover(tmp_path)
    got = {f.path.name: (f.label, f.dataset) for f in found}
    assert got == {
        "ml-100k": ("ml-100k", "ml-100k"),
        "ml-1m": ("ml-1m", "ml-1m"),
        "ml-10M100K": ("ml-10m", "ml-10m"),
        "ml-latest-small": ("ml-latest-small", "ml-latest-small"),
        "ml-25m": ("ml-25m", "ml-25m"),
        "tb": ("taobao", "taobao"),
        "rr": ("retailrocket", "retailrocket"),
        "beauty": ("amazon-beauty", "amazon"),
        "seqs": ("sequences-seqs", "sequences"),
    }
    assert sorted(p.name for p in skipped) == ["notes", "two-reviews"]
    with pytest.raises(FileNotFoundError, match="not a directory"):
        datasets.discover(tmp_path / "missing")


def test_a_run_reports_each_models_own_test_metrics(datasets, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    root = tmp_path / "data"
    (root / "seqs").mkdir(parents=True)
    lines = [" ".join([f"u{u}", *(f"i{x}" for x in rng.integers(0, 40, 12))]) for u in range(40)]
    (root / "seqs" / "log.txt").write_text("\n".join(lines) + "\n")
    (root / "broken").mkdir()
    (root / "broken" / "one.txt").write_text("lonely\n")  # a user without items: a clear error, the others still run
    out = tmp_path / "out"
    argv = ["--data-root", str(root), "--epochs", "1", "--max-seq-len", "16", "--runs", str(tmp_path / "runs"), "--out", str(out)]
    assert datasets.main([*argv, "--threads", "1"]) == 0
    res = json.loads((out / "datasets.json").read_text())
    rows = {r["data_set"]: r for r in res["rows"]}
    assert "no items" in rows["sequences-broken"]["error"]
    row = rows["sequences-seqs"]
    assert (row["users"], row["exclude_history"]) == (40, True)
    for arch in ("hstu", "sasrec"):
        metrics = json.loads((tmp_path / "runs" / f"sequences-seqs-{arch}" / "metrics.json").read_text())
        assert row["models"][arch]["test"]["HR@10"] == metrics["test"]["HR@10"]
    assert 0.0 <= row["models"]["most-popular"]["test"]["HR@10"] <= 1.0
    table = (out / "datasets.md").read_text()
    hr = row["models"]["hstu"]["test"]["HR@10"]
    assert f"{hr:.4f}" in table.splitlines()[2 + [r["data_set"] for r in res["rows"]].index("sequences-seqs")]
    assert res["command"].startswith("python ") and res["budget"]["epochs_max"] == 1
