"""One training recipe (issue 18, target 5): single-process and distributed training share the loop
(hstu.train.loop.fit with a strategy), the loss (hstu.train.losses.training_loss) and the parser
(``python -m hstu.train`` is ``hstu train --distributed``).

The distributed parts need the ``dist`` extra (torchrec, fbgemm_gpu) and are skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_csv_flags

from hstu.model.torchrec_tables import INSTALL_HINT

_MISSING = [m for m in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(m) is None]
needs_torchrec = pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} missing: {INSTALL_HINT}")
TABLE_LR = 0.01


def _py(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_python_dash_m_hstu_train_has_the_train_parser() -> None:
    """Same help text and the same one-line errors as ``hstu train`` (one parser in hstu.train.cli)."""
    a, b = _py("-m", "hstu.train", "--help"), _py("-m", "hstu", "train", "--help")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout
    for flag in ("--overwrite", "--distributed", "--sharding", "--table-optimizer", "--table-learning-rate"):
        assert flag in a.stdout
    assert "\ndistributed:\n" in a.stdout  # the distributed-only flags are the parser's argument group
    bad = ["--out", "x", "--epochs", "0"]
    a, b = _py("-m", "hstu.train", *bad), _py("-m", "hstu", "train", *bad)
    assert a.returncode == b.returncode == 2
    assert a.stderr.splitlines()[-1] == b.stderr.splitlines()[-1] == "hstu train: error: argument --epochs: must be >= 1, got 0"


@pytest.mark.parametrize("chunk", [4, 1])
def test_rank_shares_of_the_loss_add_up_to_the_single_process_loss(chunk) -> None:
    """The distributed step's loss (training_loss on each rank's slice with its share of the global
    negatives, times p_r * R / P) summed over R ranks and divided by R is the single-process loss on
    the whole batch with the same generator; chunk 1 takes the dense-logits path, 4 the gathered one.
    float64, so only summation order differs."""
    from hstu.config import TrainConfig
    from hstu.train.dist_table import BatchShard, draw_negatives, shard_batch
    from hstu.train.losses import training_loss

    torch.manual_seed(0)
    B, W, d, I, R = 5, 9, 6, 30, 2
    tcfg = TrainConfig(num_negatives=7, negatives_chunk=chunk)
    model = torch.nn.Module()
    model.item_emb = torch.nn.Embedding(I + 1, d, padding_idx=0).double()
    model.repeat = model.action_head = None
    model.cfg = type("Cfg", (), {"num_items": I, "temperature": 0.05})()
    lengths = np.array([9, 3, 7, 2, 5])
    ids = torch.randint(1, I + 1, (B, W)) * (torch.arange(W) < torch.from_numpy(lengths).view(B, 1))
    out = torch.nn.functional.normalize(torch.randn(B, W, d, dtype=torch.float64), dim=-1)
    want, P = training_loss(model, out, ids, torch.from_numpy(lengths), None, tcfg, generator=torch.Generator().manual_seed(5))
    assert P == int((lengths - 1).sum())
    total = 0.0
    for r in range(R):
        sh: BatchShard = shard_batch(np.arange(B), lengths, R, r)
        rows = slice(sh.seq_offset, sh.seq_offset + len(sh.users))
        w = int(lengths[rows].max())  # the rank's batch is padded to its own longest sequence
        neg, c = draw_negatives(sh, w, tcfg, I, torch.Generator().manual_seed(5), torch.device("cpu"))
        share, p = training_loss(model, out[rows, :w], ids[rows, :w], torch.from_numpy(lengths[rows]), None, tcfg, neg=neg, chunk=c)
        total += float(share.detach()) * p * R / sh.positions
    assert total / R == pytest.approx(float(want.detach()), rel=1e-12)


def _tiny(data_dir):
    from hstu.config import TrainConfig, model_config_from_preset
    from hstu.data.prepare import DataSpec

    mcfg = model_config_from_preset("small", max_seq_len=20, embedding_dim=16, d_qk=16, d_v=16, dropout=0.0)
    # packing "off": the distributed trainer does not pack (its "auto" resolves to "off", the single process's to "pack")
    tcfg = TrainConfig(
        epochs=2, batch_size=21, num_negatives=16, negatives_chunk=4, packing="off", seed=3, eval_batch_size=64, early_stopping_patience=99
    )
    return mcfg, tcfg, DataSpec("ml-1m", str(data_dir), max_users=64)


class _Pair:
    """AdamW on the dense weights and plain SGD on the item table: the optimizers of the distributed
    recipe with table_optimizer = "sgd" (FBGEMM EXACT_SGD), as one optimizer for the loop."""

    def __init__(self, adamw, sgd) -> None:
        self.adamw, self.sgd = adamw, sgd

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.sgd.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.adamw.step()
        self.sgd.step()

    def state_dict(self) -> dict:  # the table's SGD keeps no state
        return self.adamw.state_dict()

    @property
    def param_groups(self) -> list[dict]:  # the plateau decay's groups: the dense ones, as under torchrun
        return self.adamw.param_groups


@needs_torchrec
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_world_of_one_runs_the_single_process_recipe(ml1m_dir, tmp_path) -> None:
    """A distributed world of one (gloo, TorchRec table, DDP) and the single-process loop on the same
    data and seed give the same history.json and metrics.json, when the single-process strategy is
    given the distributed recipe's optimizers (the one real difference: the table's fused FBGEMM
    optimizer instead of AdamW; with AdamW on the table the numbers differ from step 2 on). Dropout 0:
    the ranks' dropout masks are seeded per rank."""
    from hstu.runs import read_history
    from hstu.train.distributed import DistConfig, fit_distributed
    from hstu.train.loop import LocalStrategy, dense_adamw, fit

    class SgdTable(LocalStrategy):
        def prepare(self, model, tcfg):
            dense = [p for n, p in model.named_parameters() if n != "item_emb.weight"]
            return _Pair(dense_adamw(dense, tcfg), torch.optim.SGD([model.item_emb.weight], lr=TABLE_LR))

    mcfg, tcfg, spec = _tiny(ml1m_dir)
    local = fit(tmp_path / "local", mcfg, tcfg, spec, progress=False, strategy=SgdTable())
    dist = fit_distributed(
        tmp_path / "dist", mcfg, tcfg, spec, DistConfig(table_optimizer="sgd", table_learning_rate=TABLE_LR), progress=False
    )
    hl, hd = read_history(tmp_path / "local"), read_history(tmp_path / "dist")
    assert [h["epoch"] for h in hl] == [h["epoch"] for h in hd] == [1, 2]
    assert hl[1]["loss"] < hl[0]["loss"]  # it trained
    for a, b in zip(hl, hd):
        assert a["positions"] == b["positions"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["valid"] == pytest.approx(a["valid"], abs=1e-9)
    for part in ("valid", "test"):
        assert dist[part] == pytest.approx(local[part], abs=1e-9)
    assert dist["distributed"]["world_size"] == 1 and "distributed" not in local
    assert (dist["recipe"]["table_optimizer"], dist["recipe"]["table_learning_rate"]) == ("sgd", TABLE_LR)  # the strategy's own
    assert (local["recipe"]["table_optimizer"], local["recipe"]["table_learning_rate"]) == ("adamw", tcfg.learning_rate)
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == sorted(p.name for p in (tmp_path / "local").iterdir())


@needs_torchrec
def test_killed_distributed_run_resumes_to_the_uninterrupted_one(tmp_path) -> None:
    """``python -m hstu.train`` (a world of one) SIGKILLed after epoch 1's commit but before its best
    weights were renamed into place, then ``--resume``: it continues at epoch 2, rewrites the missing
    model.safetensors, and ends as the uninterrupted run (sgd table, no dropout: exact)."""
    from safetensors.torch import load_file

    from hstu.model.checkpoint import KILL_AT_ENV

    flags = tiny_csv_flags(tmp_path, model={"dropout": 0.0}, train={"epochs": 2}) + ["--table-optimizer", "sgd", "--quiet"]
    ref = _py("-m", "hstu.train", *flags, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _py("-m", "hstu.train", *flags, "--out", str(tmp_path / "run"), env={KILL_AT_ENV: "model.safetensors.tmp:1"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "run" / "model.safetensors").exists()
    resumed = _py("-m", "hstu.train", "--resume", "--out", str(tmp_path / "run"), "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 1" in resumed.stderr  # continued, not retrained from scratch
    run, ref = tmp_path / "run", tmp_path / "ref"
    h, hr = (json.loads((d / "history.json").read_text()) for d in (run, ref))
    assert [e["epoch"] for e in h] == [1, 2] and [e["loss"] for e in h] == [e["loss"] for e in hr]
    for f in ("model.safetensors", "last.safetensors"):
        a, b = load_file(str(run / f)), load_file(str(ref / f))
        assert a.keys() == b.keys()
        for k in a:
            if not k.startswith("rng."):
                assert torch.equal(a[k], b[k]), f"{f} {k}"
    got = json.loads((run / "metrics.json").read_text())
    assert got["test"] == json.loads((ref / "metrics.json").read_text())["test"]
