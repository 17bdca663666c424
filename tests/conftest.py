"""Shared fixtures: paths to ../shared data and the oracle, with skips naming the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DATA = SHARED / "data"
ML1M = DATA / "ml-1m"
TAOBAO = DATA / "taobao-userbehavior-head"
ORACLE = SHARED / "oracle" / "hstu_reference_tiny.npz"

torch.set_num_threads(min(2, torch.get_num_threads()))


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent (shared data is provided beside the repo in CI and dev sessions)")
    return path


@pytest.fixture
def ml1m_dir() -> Path:
    return need(ML1M / "ratings.dat").parent


@pytest.fixture
def taobao_csv() -> Path:
    return need(TAOBAO / "UserBehavior_head.csv")


@pytest.fixture
def oracle_path() -> Path:
    return need(ORACLE)
