"""Distributed training (TorchRec-sharded item table + DDP) against a single-process run.

Two processes with gloo on 127.0.0.1 train the first 64 ML-1M users (max_seq_len 20, d 16, no
dropout) for one epoch of 4 global batches (21, 21, 21, 1 sequences: the last one leaves rank 1
with an empty slice). The reference is written here from the single-process pieces only
(``train_batch``, ``length_bucketed_batches``, ``sampled_softmax_loss``, ``nn.Embedding``): the
same global batches, the same init, AdamW on the dense weights and plain SGD on the table, which
is what the fused EXACT_SGD table optimizer does. Per-step losses and the final weights must match.

Needs the ``dist`` extra and torchrec; skipped with the install command otherwise.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from hstu.model.torchrec_tables import INSTALL_HINT

_MISSING = [m for m in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} missing: {INSTALL_HINT}"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

WORLD = 2
SHARDINGS = ("row_wise", "column_wise", "table_wise")
# (run name, sharding, negatives_chunk): every layout with runs of 4 positions sharing negatives
# (widths 18..20, so 5 runs per sequence), and per-position negatives (chunk 1) once
RUNS = [(s, s, 4) for s in SHARDINGS] + [("row_wise_chunk1", "row_wise", 1)]
TABLE_LR = 0.01  # SGD on the table; rows (init std 0.02) move by ~0.1 in the 4 steps, far above WEIGHT_ATOL
# float32 throughout. Differences come only from summation order: each rank sums its own
# positions, then the shares are all-reduced; the sub-batches are padded to their own width
# (the divisor N is fixed, so only the rounding of the GEMMs changes); the fused table update
# sums a row's gradients in another order. Each is ~1e-7 relative per step (a few float32 ulps).
# Measured (this test, 4 steps, torch 2.13 CPU): losses within 2.2e-7 relative (equal for
# chunk 4), weights within 1.5e-8 absolute (with a 200x larger table lr, an earlier run: losses
# within 1.1e-7, weights within 4.8e-7); the bounds leave room for other BLAS builds and threads.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-5


def _configs(data_dir: str):
    from hstu.config import TrainConfig, model_config_from_preset
    from hstu.data.prepare import DataSpec
    from hstu.train.distributed import DistConfig

    mcfg = model_config_from_preset("small", max_seq_len=20, embedding_dim=16, d_qk=16, d_v=16, dropout=0.0)
    # length_pool 50: the batches _reference cuts (length_bucketed_batches' default pool), pinned since the default became 1
    tcfg = TrainConfig(
        epochs=1, batch_size=21, num_negatives=16, negatives_chunk=4, length_pool=50, seed=3, eval_batch_size=64, learning_rate=1e-3
    )
    spec = DataSpec("ml-1m", data_dir, max_users=64)
    return mcfg, tcfg, spec, DistConfig(table_optimizer="sgd", table_learning_rate=TABLE_LR)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, data_dir: str, out: str) -> None:
    import torch.distributed as dist

    from hstu.data.prepare import prepare_data
    from hstu.train.distributed import fit_distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = {}
        data = prepare_data(_configs(data_dir)[2])
        for name, sharding, chunk in RUNS:
            mcfg, tcfg, spec, dcfg = _configs(data_dir)
            losses: list[float] = []
            metrics = fit_distributed(
                Path(out) / name,
                mcfg,
                replace(tcfg, negatives_chunk=chunk),
                spec,
                replace(dcfg, sharding=sharding),
                progress=False,
                on_step=lambda e, i, loss: losses.append(loss),
                data=data,
            )
            result[name] = {"losses": losses, "test": metrics["test"]}
        # --resume: epoch 2 of the row_wise run continued from its last.* vs two epochs in one go
        mcfg, tcfg, spec, dcfg = _configs(data_dir)
        for name, run, resume in (("resumed", "row_wise", True), ("straight", "straight", False)):
            losses = []
            fit_distributed(
                Path(out) / run,
                replace(mcfg),
                replace(tcfg, epochs=2),
                spec,
                dcfg,
                progress=False,
                resume=resume,
                on_step=lambda e, i, loss: losses.append((e, loss)),
                data=data,
            )
            result[name] = losses
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@functools.lru_cache(maxsize=1)
def _load(data_dir: str):
    """The test's data (64 users), loaded once per process."""
    from hstu.data.prepare import prepare_data

    return prepare_data(_configs(data_dir)[2])


def _reference(data_dir: str, chunk: int) -> tuple[list[float], torch.nn.Module, torch.Tensor]:
    """Single process, whole global batches: the recipe of hstu.train.loop.train_one_epoch with
    AdamW on the dense weights and SGD on the table. Returns (per-step losses, model, initial table)."""
    from hstu.data import train_batch
    from hstu.data.batching import length_bucketed_batches
    from hstu.data.prepare import model_config_for
    from hstu.model.hstu import build_hstu
    from hstu.train.losses import sampled_softmax_loss

    mcfg, tcfg, spec, _ = _configs(data_dir)
    tcfg = replace(tcfg, negatives_chunk=chunk)
    log_, split = _load(data_dir)
    cfg = model_config_for(log_, mcfg, True)
    torch.manual_seed(tcfg.seed)
    model = build_hstu(cfg)
    table0 = model.item_emb.weight.detach().clone()
    dense = [p for n, p in model.named_parameters() if n != "item_emb.weight"]
    adamw = torch.optim.AdamW(dense, lr=tcfg.learning_rate, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    sgd = torch.optim.SGD([model.item_emb.weight], lr=TABLE_LR)
    gen = torch.Generator().manual_seed(tcfg.seed)
    lengths = np.minimum(split.train_end - log_.offsets[:-1], cfg.max_seq_len)
    users = np.nonzero(lengths >= 2)[0]
    batches = [users[b] for b in length_bucketed_batches(lengths[users], tcfg.batch_size, np.random.default_rng(tcfg.seed * 1000 + 1))]
    assert [len(b) for b in sorted(batches, key=len, reverse=True)] == [21, 21, 21, 1]  # the case the test is built on
    losses = []
    model.train()
    for ub in batches:
        b = train_batch(log_, split, ub, cfg.max_seq_len)
        out = model.encode(b.ids, b.timestamps, b.lengths)
        loss, _ = sampled_softmax_loss(
            out,
            b.ids,
            b.lengths,
            model.item_emb,
            num_negatives=tcfg.num_negatives,
            temperature=cfg.temperature,
            chunk=tcfg.negatives_chunk,
            generator=gen,
            num_items=cfg.num_items,
        )
        adamw.zero_grad(set_to_none=True)
        sgd.zero_grad(set_to_none=True)
        loss.backward()
        adamw.step()
        sgd.step()
        losses.append(loss.item())
    return losses, model, table0


ML1M = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ml-1m"


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    if not (ML1M / "ratings.dat").exists():
        pytest.skip(f"{ML1M} is absent (shared data is provided beside the repo in CI and dev sessions)")
    ml1m_dir = ML1M
    out = tmp_path_factory.mktemp("dist")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    mp.spawn(_worker, args=(_free_port(), str(ml1m_dir), str(out)), nprocs=WORLD, join=True)
    return out


def test_losses_and_weights_match_single_process(dist_runs, ml1m_dir) -> None:
    from hstu.runs import load_run

    r0 = json.loads((dist_runs / "rank0.json").read_text())
    r1 = json.loads((dist_runs / "rank1.json").read_text())
    for chunk in sorted({r[2] for r in RUNS}):
        want, ref_model, table0 = _reference(str(ml1m_dir), chunk)
        ref_state = ref_model.state_dict()
        moved = float((ref_state["item_emb.weight"] - table0).abs().max())
        assert moved > 100 * WEIGHT_ATOL, f"the table barely moved ({moved}); the SGD comparison would prove nothing"
        for name, sharding, _ in [r for r in RUNS if r[2] == chunk]:
            got = r0[name]["losses"]
            assert got == r1[name]["losses"]  # every rank reports the all-reduced global loss
            np.testing.assert_allclose(got, want, rtol=LOSS_RTOL, atol=0, err_msg=name)
            # the run directory loads as any run; its weights are the reference's after the same 4 steps
            model, cfg, _ = load_run(dist_runs / name)
            assert cfg["distributed"]["sharding"] == sharding and cfg["distributed"]["world_size"] == WORLD
            for k, v in model.state_dict().items():
                torch.testing.assert_close(v, ref_state[k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m: f"{name} {k}: {m}")
            assert torch.equal(model.item_emb.weight[0], torch.zeros(model.cfg.embedding_dim))  # padding row stays 0
            assert r0[name]["test"] == r1[name]["test"]


def test_resume_continues_exactly(dist_runs) -> None:
    """Epoch 2 after --resume = epoch 2 of an uninterrupted run: the weights, AdamW moments and
    the negatives' generator are restored exactly, and sgd keeps no table state; with dropout 0
    nothing else is random, so the losses agree to the last bit (same ranks, same order)."""
    r0 = json.loads((dist_runs / "rank0.json").read_text())
    straight = r0["straight"]
    assert [e for e, _ in r0["resumed"]] == [2] * 4 and [e for e, _ in straight] == [1] * 4 + [2] * 4
    assert [x for _, x in straight[:4]] == r0["row_wise"]["losses"]
    assert [x for _, x in r0["resumed"]] == [x for _, x in straight[4:]]


def test_distributed_eval_equals_single_process_eval(dist_runs, ml1m_dir) -> None:
    """metrics.json (users split over 2 ranks, ranks gathered) = single-process evaluate of the saved run."""
    from hstu.data.prepare import DataSpec
    from hstu.model.checkpoint import read_json
    from hstu.runs import load_run
    from hstu.train.evaluate import evaluate

    run = dist_runs / "row_wise"
    model, cfg, _ = load_run(run)
    assert DataSpec(**cfg["data"]) == _configs(str(ml1m_dir))[2]
    log_, split = _load(str(ml1m_dir))
    want = evaluate(model, log_, split, "test", batch_size=64)
    got = read_json(run / "metrics.json")["test"]
    assert got["users"] == want["users"] == 64
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k  # integer ranks, so only the mean's rounding


def test_shard_batch_partitions_the_global_batch() -> None:
    from hstu.train.distributed import shard_batch

    ub = np.array([10, 11, 12, 13, 14])
    lengths = np.array([3, 2, 5, 4, 2])  # positions 2, 1, 4, 3, 1 -> P = 11
    parts = [shard_batch(ub, lengths, 2, r) for r in range(2)]
    assert parts[0].users.tolist() == [10, 11, 12] and parts[1].users.tolist() == [13, 14]
    assert parts[1].seq_offset == 3
    assert all(p.positions == 11 and p.width == 5 and p.batch_size == 5 and p.weight == 1.0 for p in parts)
    lone = [shard_batch(ub[:1], lengths[:1], 3, r) for r in range(3)]
    assert [p.weight for p in lone] == [1.0, 0.0, 0.0] and all(p.users.tolist() == [10] for p in lone)


def test_cli_under_torchrun(ml1m_dir, tmp_path) -> None:
    """``torchrun --nproc-per-node 2 -m hstu.train`` (small preset, d = 50: column_wise stores the table
    56 wide, FBGEMM needing a multiple of 4 per shard) writes a run that ``load_run`` / ``hstu eval`` read."""
    from hstu.data.prepare import DataSpec, prepare_data
    from hstu.runs import load_run
    from hstu.train.evaluate import evaluate

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "run"
    # --standalone: torchrun picks a free rendezvous port itself (no race with other jobs)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "hstu.train",
        "--dataset",
        "ml-1m",
        "--data-dir",
        str(ml1m_dir),
        "--preset",
        "small",
        "--epochs",
        "1",
        "--max-users",
        "16",
        "--batch-size",
        "8",
        "--num-negatives",
        "8",
        "--out",
        str(out),
        "--sharding",
        "column_wise",
        "--quiet",
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, "\n".join(l for l in p.stderr.splitlines() if "is_fx_tracing" not in l)[-6000:]
    metrics = json.loads(p.stdout[p.stdout.index("{") :])  # rank 0 prints metrics.json
    assert metrics == json.loads((out / "metrics.json").read_text())
    assert metrics["distributed"]["world_size"] == 2 and metrics["test"]["users"] == 16
    model, cfg, _ = load_run(out)
    assert model.item_emb.weight.shape == (model.cfg.num_items + 1, 50)
    log_, split = prepare_data(DataSpec(**cfg["data"]))
    assert evaluate(model, log_, split, "test")["NDCG@10"] == pytest.approx(metrics["test"]["NDCG@10"], abs=1e-12)


def test_table_options_are_checked() -> None:
    from hstu.config import TrainConfig
    from hstu.train.distributed import DistConfig, table_fused_params, table_width

    with pytest.raises(ValueError, match="no CPU kernel"):
        table_fused_params(DistConfig(table_optimizer="adam"), TrainConfig(), torch.device("cpu"))
    with pytest.raises(ValueError, match="sharding"):
        DistConfig(sharding="diagonal").validate()
    fp = table_fused_params(DistConfig(table_optimizer="sgd", table_learning_rate=0.5), TrainConfig(), torch.device("cpu"))
    assert fp["learning_rate"] == 0.5 and fp["optimizer"].name == "EXACT_SGD"
    assert [table_width(50, "row_wise", 2), table_width(50, "column_wise", 2), table_width(16, "column_wise", 4)] == [52, 56, 16]


def test_config_table_optimizer_reaches_the_distributed_recipe(tmp_path, capsys) -> None:
    """--distributed takes [train] table_optimizer / table_learning_rate from the --config file:
    flag > config file > the resumed run's > default; the config's rate only for the optimizer it
    names; "adamw" (no fused FBGEMM form) refused naming the file and field."""
    from types import SimpleNamespace

    from conftest import tiny_csv_flags

    from hstu.cli import main
    from hstu.train.cli import _distributed_strategy

    def dist(train: dict, saved: dict | None = None, **flags):
        (tmp_path / "c.toml").write_text("[train]\n" + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in train.items()))
        args = SimpleNamespace(config=str(tmp_path / "c.toml"), sharding=None, table_optimizer=None, table_learning_rate=None)
        d = _distributed_strategy(SimpleNamespace(**{**vars(args), **flags}), saved or {}).dcfg
        return d.table_optimizer, d.table_learning_rate

    rowwise = {"table_optimizer": "rowwise_adagrad", "table_learning_rate": 0.05}
    assert dist({}) == ("rowwise_adagrad", None)  # the default, FBGEMM's rate
    assert dist(rowwise) == ("rowwise_adagrad", 0.05)  # was ignored: FBGEMM's default 0.1
    assert dist({"table_learning_rate": 0.05}) == ("rowwise_adagrad", 0.05)
    assert dist(rowwise, table_optimizer="sgd") == ("sgd", None)  # flag first; the config's rate is rowwise_adagrad's
    assert dist(rowwise, table_learning_rate=0.2) == ("rowwise_adagrad", 0.2)
    saved = {"table_optimizer": "sgd", "table_learning_rate": 1.0}
    assert dist(rowwise, saved) == ("rowwise_adagrad", 0.05) and dist({}, saved) == ("sgd", 1.0)
    with pytest.raises(ValueError, match=r"c.toml \[train\] table_optimizer = 'adamw': .*FBGEMM's fused.*rowwise_adagrad"):
        dist({"table_optimizer": "adamw"})
    assert dist({"table_optimizer": "adamw"}, table_optimizer="adagrad") == ("adagrad", None)

    flags = tiny_csv_flags(tmp_path, train={"epochs": 1, "table_optimizer": '"adamw"'})
    capsys.readouterr()
    assert main(["train", *flags, "--distributed", "--out", str(tmp_path / "run"), "--quiet"]) == 2
    assert "[train] table_optimizer = 'adamw': the distributed recipe" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
