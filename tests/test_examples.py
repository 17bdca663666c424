"""Every example config under examples/ loads (types and ranges checked as `--config` checks them) and
builds what it describes: the model tables build that model on a tiny catalogue, [serve] a valid
ServeConfig. A file that fails here fails the same way for a user who copies it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import REPO

from hstu.config import ServeConfig, load_config_file
from hstu.model.hstu import build_hstu

EXAMPLES = sorted((REPO / "examples").glob("*.toml"))


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"hstu-large-ml1m.toml", "sasrec-ml1m.toml", "hashed-item-table.toml", "serve.toml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_builds(path: Path) -> None:
    tables = load_config_file(path)
    assert tables, f"{path} has no table"
    if "model" in tables:
        cfg = dataclasses.replace(tables["model"], num_items=50)  # the catalogue comes from the data
        model = build_hstu(cfg)  # the one builder (SASRec too)
        assert type(model).__name__ == {"hstu": "HSTUModel", "sasrec": "SASRecModel"}[cfg.architecture]
        ids = torch.randint(1, 51, (2, 7))
        out = model.encode(ids, torch.arange(14).view(2, 7) * 60, torch.tensor([7, 4]))
        assert out.shape == (2, 7, cfg.embedding_dim) and torch.isfinite(out).all()
    if "serve" in tables:
        assert isinstance(tables["serve"], ServeConfig)


def test_the_hstu_large_example_trains_the_papers_block() -> None:
    """README: "--config examples/hstu-large-ml1m.toml for the paper's HSTU-large": it trained FuXi-alpha's
    multi-channel block (its [model] table goes over the small preset's, which has it on)."""
    import argparse

    from hstu.train.cli import _model_cfg

    mcfg, _ = _model_cfg(argparse.Namespace(config=str(REPO / "examples" / "hstu-large-ml1m.toml"), preset=None, arch=None))
    assert (mcfg.architecture, mcfg.multi_channel, mcfg.query_key_map, mcfg.num_blocks, mcfg.num_heads) == ("hstu", False, True, 8, 2)
