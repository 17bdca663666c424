"""Shared fixtures: paths to ../shared data and the oracle, with skips naming the reason; the tiny
trained ML-1M run (small preset, max_seq_len 50, the first USERS users, one epoch) trained once per
session, with its ratings, two independent Recommenders and its cold-start popularity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hstu.config import TrainConfig, model_config_from_preset
from hstu.generate.recommend import Recommender
from hstu.model.checkpoint import read_json
from hstu.serve.popularity import popularity_for_run

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DATA = SHARED / "data"
ML1M = DATA / "ml-1m"
TAOBAO = DATA / "taobao-userbehavior-head"
ORACLE = SHARED / "oracle" / "hstu_reference_tiny.npz"

USERS = 200  # users of the tiny run

torch.set_num_threads(min(2, torch.get_num_threads()))


TINY_MODEL = dict(max_seq_len=8, embedding_dim=8, d_qk=8, d_v=8, num_blocks=1, num_heads=1)  # the tiny CSV runs' model


def tiny_csv(d: Path) -> Path:
    """d/log.csv: 30 users x 8 events over 20 items (columns u, i, t; integer times), the tiny CSV runs' data."""
    rows = [f"{u},{(u * 3 + j) % 20 + 1},{1000 + j}" for u in range(1, 31) for j in range(8)]
    (d / "log.csv").write_text("u,i,t\n" + "\n".join(rows) + "\n")
    return d / "log.csv"


def tiny_csv_flags(d: Path, *, model: dict | None = None, train: dict | None = None) -> list[str]:
    """`hstu train` data and --config flags for :func:`tiny_csv` and d/tiny.toml: TINY_MODEL (+ ``model``),
    batch 8, 4 negatives, patience 99 (+ ``train``)."""
    base_train = {"batch_size": 8, "num_negatives": 4, "early_stopping_patience": 99}
    tables = {"model": {**TINY_MODEL, **(model or {})}, "train": {**base_train, **(train or {})}}
    (d / "tiny.toml").write_text("".join(f"[{t}]\n" + "".join(f"{k} = {v}\n" for k, v in f.items()) for t, f in tables.items()))
    return ["--dataset", "csv", "--data-dir", str(tiny_csv(d)), "--columns", "user=u,item=i,time=t", "--config", str(d / "tiny.toml")]


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent (shared data is provided beside the repo in CI and dev sessions)")
    return path


def untrained_items(ratings: pd.DataFrame) -> set[int]:
    """Original ids of the ML-1M catalogue that no training event of the users in ``ratings``
    (per user in time order) names: clean protocol, each user's last two events held out."""
    catalogue = set(pd.read_csv(ML1M / "ratings.dat", sep=":", header=None, usecols=[2], names=["item"]).item)
    train = ratings.groupby("user", group_keys=False).apply(lambda g: g.iloc[:-2])
    return catalogue - set(train.item)


@pytest.fixture
def ml1m_dir() -> Path:
    return need(ML1M / "ratings.dat").parent


@pytest.fixture
def taobao_csv() -> Path:
    return need(TAOBAO / "UserBehavior_head.csv")


@pytest.fixture
def oracle_path() -> Path:
    return need(ORACLE)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    if not (ML1M / "ratings.dat").exists():
        pytest.skip(f"{ML1M}/ratings.dat is absent (shared data is provided beside the repo in CI and dev sessions)")
    from hstu.data.prepare import DataSpec
    from hstu.train.loop import fit

    out = tmp_path_factory.mktemp("tiny") / "run"
    fit(
        out,
        model_config_from_preset("small", max_seq_len=50),
        TrainConfig(epochs=1),
        DataSpec("ml-1m", str(ML1M), max_users=USERS),
        progress=False,
    )
    return out


@pytest.fixture(scope="session")
def ratings(run_dir) -> pd.DataFrame:
    """ratings.dat of the first USERS users, per user in time order (stable: file order on ties)."""
    df = pd.read_csv(ML1M / "ratings.dat", sep=":", header=None, usecols=[0, 2, 6], names=["user", "item", "ts"], encoding="latin-1")
    users = np.sort(df.user.unique())[:USERS]
    df = df[df.user.isin(users)]
    return df.sort_values(["user", "ts"], kind="stable").reset_index(drop=True)


@pytest.fixture(scope="session")
def rec(run_dir) -> Recommender:
    return Recommender.from_run(run_dir)


@pytest.fixture(scope="session")
def ref(run_dir) -> Recommender:
    """A second, independent instance for the expected results."""
    return Recommender.from_run(run_dir)


@pytest.fixture(scope="session")
def popularity(run_dir, rec):
    return popularity_for_run(read_json(run_dir / "config.json"), rec.idmap)


def three_histories(t0: int = 978_300_000):
    """(ids, timestamps, lengths, request_time) of 3 padded histories of width 8 (lengths 5, 2, 8; 60 s, 5 s and 1 h
    apart; padding 0), for the model-level tests of the block options."""
    ids = torch.tensor([[5, 9, 1, 33, 2, 0, 0, 0], [7, 3, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]])
    lengths = torch.tensor([5, 2, 8])
    ts = torch.stack([t0 + torch.arange(8) * s for s in (60, 5, 3600)]) * (torch.arange(8) < lengths.view(-1, 1))
    return ids, ts, lengths, torch.tensor([t0 + 86400, t0 + 50, t0 + 10**6])
