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
