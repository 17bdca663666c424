"""Distributed training: the item table sharded by TorchRec, the dense HSTU layers under DDP.

One process per device, started by ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; PyTorch docs, "torchrun (Elastic Launch)")::

    torchrun --nproc-per-node 2 -m hstu.train --dataset ml-1m --data-dir DIR --preset small \\
        --epochs 10 --out RUN [--sharding row_wise|column_wise|table_wise]

Without torchrun the same command runs as a world of one process. ``hstu train --distributed``
is the same trainer (``torchrun --nproc-per-node 2 --no-python hstu train --distributed ...``).

Layout of one step (R ranks, global batch of B sequences drawn exactly as the single-process
recipe :func:`hstu.train.loop.train_one_epoch` draws it, from the same seed):

    rank r takes the contiguous slice r of ``np.array_split(global batch, R)``;
    the negatives of the *global* batch are drawn on every rank from the same generator
    (same seed, same draws as :func:`hstu.train.losses.sampled_softmax_loss`), and each rank
    keeps the rows of its own sequences;
    each rank looks up all item ids it needs in ONE TorchRec lookup (batch ids + negatives,
    deduplicated), so the fused table optimizer applies one update per step;
    loss_r = (sum of the cross-entropies of rank r's positions) * R / P, P = positions of the
    global batch, so sum_r loss_r / R is the single-process mean loss.

Gradients: DDP averages the dense gradients over ranks (PyTorch docs, DistributedDataParallel),
and TorchRec divides the embedding gradients it sends back through the all-to-all by R
(``torchrec.distributed.comm_ops`` GRADIENT_DIVISION, on by default and set explicitly here), so
both equal the gradient of the global mean loss: the same step as one process on the whole batch,
up to float32 summation order.

Optimizers: the dense parameters use AdamW exactly as the single-process recipe. The item table
uses an FBGEMM optimizer fused into the backward (the ``fused`` kernel, see
:mod:`hstu.model.torchrec_tables`), chosen with ``table_optimizer``: ``sgd`` (EXACT_SGD),
``adagrad`` (EXACT_ADAGRAD), ``rowwise_adagrad`` (EXACT_ROWWISE_ADAGRAD, the default: one state
value per row) run on CPU and CUDA; ``adam`` and ``partial_rowwise_adam`` only on CUDA (FBGEMM's
CPU kernels implement the first three only: ``SplitTableBatchedEmbeddingBagsCodegen``,
fbgemm-gpu 1.8.0). Fused optimizers update only the rows looked up in a step (sparse semantics),
unlike the dense AdamW of the single-process recipe, which also moves rows with zero gradient
through their momentum; with ``sgd`` the two recipes take the same step.

A rank whose slice of a global batch is empty (B < R) runs one of the batch's sequences with
weight 0, so that every rank joins every collective; its zero gradients leave the table unchanged
under sgd and (rowwise) adagrad.

Evaluation: the table is gathered (every rank, so it must fit each rank's memory once more),
each rank ranks a disjoint share of the users with a plain :class:`hstu.model.hstu.HSTUModel`
holding the gathered table, and the ranks are gathered to compute the metrics. The initial table
is likewise built whole on every rank (the single-process init, for the same start), then copied
into the shards and dropped. Checkpoints are written by rank 0 in the run-directory layout of
:mod:`hstu.model.checkpoint` with the full table as ``item_emb.weight``, so ``hstu eval`` and
``hstu generate`` (and :func:`hstu.model.checkpoint.load_run`) read them as any other run.

FBGEMM needs every shard's width to be a multiple of 4; a table whose d is not (the small preset
has d = 50) is stored wider with zero columns (:func:`table_width`), invisible to the model.

Backends: gloo on CPU, nccl on CUDA, hccl on Ascend NPU (PyTorch docs, torch.distributed
"Backends"; torch_npu for hccl). TorchRec's kernels exist for CPU and CUDA only, so on other
devices the table lives on the CPU with its own gloo group and its rows are moved to the device.

Symbols: R world size (ranks), r rank, B sequences in a global batch, b on this rank, P supervised
positions of the global batch (p on this rank), W padded width, M negatives, V = I + 1 table rows,
d width.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import hstu
from hstu import backend
from hstu.config import ModelConfig, TrainConfig, load_config_file, model_config_from_preset
from hstu.data import EventLog, Split, train_batch
from hstu.data.batching import length_bucketed_batches
from hstu.model.checkpoint import load_weights, read_json, save_weights, write_json
from hstu.model.hstu import HSTUModel, build_hstu, l2_normalize
from hstu.model.torchrec_tables import (
    FEATURE,
    SHARDING_TYPES,
    build_item_collection,
    load_rows,
    local_shards,
    require_torchrec,
    shard_item_collection,
)
from hstu.train.checkpoint import load_train_state, repair_run_files, save_train_state
from hstu.train.evaluate import evaluate_ranks
from hstu.train.loop import DataSpec, check_trainable, idmap, model_config_for, prepare_data, remove_run_files
from hstu.train.metrics import DEFAULT_KS, ranking_metrics

log = logging.getLogger(__name__)

# torch.distributed backend per device type (PyTorch docs, "Backends"): Backend.dist_backend (old name kept)
DIST_BACKENDS = {name: cls.dist_backend for name, cls in backend.BACKENDS.items()}
# device types FBGEMM / TorchRec have embedding kernels for (Backend.torchrec_kernels); elsewhere the table stays on the CPU
TORCHREC_DEVICE_TYPES = tuple(name for name, cls in backend.BACKENDS.items() if cls.torchrec_kernels)
# table optimizer name -> FBGEMM EmbOptimType member
TABLE_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adam": "ADAM",
    "partial_rowwise_adam": "PARTIAL_ROWWISE_ADAM",
}
CPU_TABLE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")  # FBGEMM's CPU kernels (fbgemm-gpu 1.8.0)
# Default table learning rates. Measured on ML-1M, first 1000 users, small preset with
# max_seq_len 50, 5 epochs, seed 1, 2 ranks, negatives_chunk 16 (torchrun --nproc-per-node 2 -m
# hstu.train --config C --max-users 1000 --table-learning-rate LR): valid NDCG@10 of
# rowwise_adagrad 0.076 / 0.073 / 0.065 at lr 0.03 / 0.1 / 0.3 (with per-sequence negatives:
# 0.060 / 0.074 / 0.077 / 0.071 at 0.01 / 0.05 / 0.1 / 0.2), sgd 0.072 at lr 1.0; the
# single-process recipe (AdamW lr 1e-3 on the table too) reaches 0.024 there. Differences
# under ~0.01 are within the noise of 1000 users.
TABLE_DEFAULT_LR = {"sgd": 1.0, "adagrad": 0.1, "rowwise_adagrad": 0.1}


@dataclass
class DistConfig:
    """Settings of the distributed recipe (the rest comes from ModelConfig and TrainConfig).

    sharding: TorchRec layout of the item table: "row_wise", "column_wise" (R equal
        column blocks) or "table_wise" (whole table on rank 0).
    table_optimizer: fused FBGEMM optimizer of the item table (see the module docstring).
    table_learning_rate: its learning rate; None = TABLE_DEFAULT_LR[table_optimizer] (the adam
        types: TrainConfig.learning_rate).
    table_eps: epsilon of the adagrad / adam table optimizers.
    timeout_s: collective timeout (a rank that dies makes the others fail after this long).
    """

    sharding: str = "row_wise"
    table_optimizer: str = "rowwise_adagrad"
    table_learning_rate: float | None = None
    table_eps: float = 1e-8
    timeout_s: float = 1800.0

    def validate(self) -> None:
        if self.sharding not in SHARDING_TYPES:
            raise ValueError(f"DistConfig.sharding: unknown {self.sharding!r}; valid: {', '.join(SHARDING_TYPES)}")
        if self.table_optimizer not in TABLE_OPTIMIZERS:
            raise ValueError(f"DistConfig.table_optimizer: unknown {self.table_optimizer!r}; valid: {', '.join(TABLE_OPTIMIZERS)}")
        if self.table_learning_rate is not None and not self.table_learning_rate > 0:
            raise ValueError(f"DistConfig.table_learning_rate must be > 0, got {self.table_learning_rate}")
        if not self.timeout_s > 0:
            raise ValueError(f"DistConfig.timeout_s must be > 0, got {self.timeout_s}")

    def learning_rate(self, tcfg: TrainConfig) -> float:
        if self.table_learning_rate is not None:
            return self.table_learning_rate
        return TABLE_DEFAULT_LR.get(self.table_optimizer, tcfg.learning_rate)


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------


@dataclass
class DistContext:
    """This process's place in the job.

    dense_pg: the default group (DDP, table gathers, metrics); table_pg: a second group used only
    by TorchRec's all-to-alls, so that they never interleave with DDP's asynchronous all-reduces
    on one connection. table_device: where the table's shards live.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: backend.Backend
    dist_backend: str
    table_device: torch.device
    dense_pg: Any
    table_pg: Any
    owns_group: bool

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer (set by torchrun)") from None


def init_distributed(device: str = "cpu", *, timeout_s: float = 1800.0) -> DistContext:
    """Join (or create) the process group and pick this rank's device.

    Reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK; without them (a plain ``python -m``) it
    starts a world of one on 127.0.0.1. If ``torch.distributed`` is already initialised (e.g.
    by a test's spawn), that group is used and not destroyed by :func:`shutdown`.

    Args:
        device: "auto" | "cpu" | "cuda" | "npu"; rank r uses index LOCAL_RANK of that kind.
    Raises:
        ValueError: malformed torchrun variables, unknown device.
        BackendUnavailableError: the device is not usable.
    """
    local_rank = _env_int("LOCAL_RANK", 0)
    dev = backend.select_local(device, local_rank)
    dev.set_current()  # nccl / hccl bind to the current device
    dist_backend = dev.dist_backend
    owns = not dist.is_initialized()
    if owns:
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        if "MASTER_ADDR" not in os.environ:
            if world > 1:
                raise ValueError("WORLD_SIZE > 1 but MASTER_ADDR is not set: start the job with torchrun")
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group(dist_backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    else:
        dist_backend = str(dist.get_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    host = backend.select("cpu")
    table_device = dev.device if dev.torchrec_kernels else host.device
    # a group of its own for TorchRec's all-to-alls (the host's, gloo, when the table stays on the CPU)
    table_pg = dist.new_group(backend=dist_backend if dev.torchrec_kernels else host.dist_backend,
                              timeout=timedelta(seconds=timeout_s))
    log.info("rank %d/%d on %s (%s); item table on %s", rank, world, dev.device, dist_backend, table_device)
    return DistContext(rank, world, local_rank, dev, dist_backend, table_device, dist.group.WORLD, table_pg, owns)


def shutdown(ctx: DistContext) -> None:
    """Destroy the table's group, and the default group if :func:`init_distributed` created it."""
    if not dist.is_initialized():
        return
    if ctx.owns_group:
        dist.destroy_process_group()  # all groups
    else:
        dist.destroy_process_group(ctx.table_pg)


# ---------------------------------------------------------------------------------------------
# The sharded item table as the model's item_embedding
# ---------------------------------------------------------------------------------------------


class TorchRecItemEmbedding(nn.Module):
    """The item table as a TorchRec ``ShardedEmbeddingCollection``: ids (…) int64 -> (…, d) rows.

    The sharded table may be wider than d (``table_dim``, see :func:`table_width`); the extra
    columns are zero, never read by the model, and so get zero gradients and stay zero.

    Every lookup is a collective (TorchRec input / output all-to-all): all ranks call it the same
    number of times, each with its own ids. Inside :meth:`prefetch` a step's ids are looked up
    once, deduplicated, and the calls of the model and the loss read from that block, so the fused
    optimizer sees one gradient per row and step. Row ``padding_idx`` reads as zeros (as
    ``nn.Embedding(padding_idx=0)``); its gradient is therefore 0 and the row never moves.
    """

    def __init__(self, sharded: nn.Module, num_embeddings: int, embedding_dim: int, *, table_dim: int | None = None,
                 padding_idx: int | None = 0, table_device: torch.device, compute_device: torch.device,
                 feature: str = FEATURE) -> None:
        super().__init__()
        self.sharded = sharded
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.table_dim = table_dim or embedding_dim  # >= d: the sharded table's width (zero columns past d)
        self.padding_idx = padding_idx
        self.table_device = table_device
        self.compute_device = compute_device
        self.feature = feature
        self._block: tuple[torch.Tensor, torch.Tensor] | None = None  # (unique ids (U,), rows (U, d))

    def _lookup(self, flat: torch.Tensor) -> torch.Tensor:
        """(n,) int64 -> (n, d) on the compute device; collective."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        ids = flat.to(self.table_device, torch.int64)
        lengths = torch.tensor([ids.numel()], dtype=torch.int64, device=self.table_device)
        out = self.sharded(KeyedJaggedTensor.from_lengths_sync(keys=[self.feature], values=ids, lengths=lengths))
        if hasattr(out, "wait"):
            out = out.wait()
        return out[self.feature].values()[:, : self.embedding_dim].to(self.compute_device)

    def prefetch(self, *ids: torch.Tensor) -> None:
        """Look up the union of ``ids`` (any shapes, int64) once; later calls read from it until :meth:`release`.

        Collective. Raises ValueError for ids outside [0, V) (FBGEMM does not bound-check on CPU).
        """
        parts = [t.reshape(-1).to(self.compute_device, torch.int64) for t in ids]
        if self.padding_idx is not None:  # padding may appear later (e.g. the loss pads its targets)
            parts.append(torch.tensor([self.padding_idx], dtype=torch.int64, device=self.compute_device))
        uniq = torch.unique(torch.cat(parts))  # (U,) sorted
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_embeddings):
            raise ValueError(f"item ids must lie in [0, {self.num_embeddings}), got {int(uniq[0])}..{int(uniq[-1])}")
        self._block = (uniq, self._lookup(uniq))

    def release(self) -> None:
        self._block = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(…) int64 -> (…, d) float32 rows; collective unless inside :meth:`prefetch`.

        Raises:
            KeyError: inside a prefetch, an id that was not prefetched.
        """
        shape = ids.shape
        flat = ids.reshape(-1).to(self.compute_device, torch.int64)
        if self._block is None:
            rows = self._lookup(flat)
        else:
            uniq, block = self._block
            pos = torch.searchsorted(uniq, flat).clamp_(max=max(uniq.numel() - 1, 0))
            if flat.numel() and not bool((uniq[pos] == flat).all()):
                raise KeyError("TorchRecItemEmbedding: an id was looked up that the step did not prefetch")
            rows = block[pos]  # (n, d)
        if self.padding_idx is not None:
            rows = rows * (flat != self.padding_idx).unsqueeze(1).to(rows.dtype)
        return rows.reshape(*shape, self.embedding_dim)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows of ids ``start .. end-1`` as (end - start, d). Collective: all ranks call it with the same range."""
        if not 0 <= start <= end <= self.num_embeddings:
            raise ValueError(f"rows({start}, {end}): need 0 <= start <= end <= {self.num_embeddings}")
        return self(torch.arange(start, end, device=self.compute_device))

    @torch.no_grad()
    def full_table(self, pg: Any = None, dst: int | None = None, out_device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Gather the whole (V, d) float32 table: on every rank (``dst=None``) or only on rank ``dst``.

        Each rank writes its shards into a zero table and the tables are summed (all-reduce, or
        reduce to ``dst``): shards are disjoint, and x + 0 = x exactly, so the gather is exact.
        Collective. Returns None on ranks other than ``dst``.
        Raises:
            RuntimeError: the shards do not cover the table exactly once.
        """
        full = torch.zeros(self.num_embeddings, self.table_dim, dtype=torch.float32, device=self.compute_device)
        covered = torch.zeros(1, dtype=torch.int64, device=self.compute_device)
        for (r0, c0), piece in local_shards(self.sharded):
            n, w = piece.shape
            full[r0:r0 + n, c0:c0 + w] = piece.to(self.compute_device, torch.float32)
            covered += n * w
        dist.all_reduce(covered, group=pg)
        if int(covered) != self.num_embeddings * self.table_dim:
            raise RuntimeError(f"table shards cover {int(covered)} values, expected {self.num_embeddings} x {self.table_dim}")
        if dst is None:
            dist.all_reduce(full, group=pg)
        else:
            dist.reduce(full, dst=dst, group=pg)
            if dist.get_rank() != dst:
                return None
        return full[:, : self.embedding_dim].to(out_device).contiguous()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table_dim={self.table_dim}, padding_idx={self.padding_idx}, "
                f"table on {self.table_device}")


FBGEMM_DIM_MULTIPLE = 4  # FBGEMM's split tables need each shard's width to be a multiple of 4 (construct_split_state)


def table_width(embedding_dim: int, sharding: str, world_size: int) -> int:
    """Width of the sharded table: d rounded up so every shard's width is a multiple of 4.

    FBGEMM asserts ``embedding_dim % 4 == 0`` per shard (fbgemm-gpu 1.8.0,
    ``construct_split_state``); the small preset has d = 50. column_wise splits the width into
    R equal blocks, so there the width is rounded up to a multiple of 4 R. The extra columns are
    zero and unused; the only visible effect is on ``rowwise_adagrad``, whose per-row state is
    the mean of g^2 over the (wider) row, which scales its step by sqrt(width / d).
    """
    m = FBGEMM_DIM_MULTIPLE * (world_size if sharding == "column_wise" else 1)
    return -(-embedding_dim // m) * m


def table_fused_params(dcfg: DistConfig, tcfg: TrainConfig, table_device: torch.device) -> dict[str, Any]:
    """FBGEMM fused-optimizer settings for the EmbeddingCollectionSharder.

    Raises:
        ValueError: an optimizer FBGEMM's CPU kernels lack, with the table on the CPU.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if backend.for_device(table_device).is_host and dcfg.table_optimizer not in CPU_TABLE_OPTIMIZERS:
        raise ValueError(f"table optimizer {dcfg.table_optimizer!r} has no CPU kernel in FBGEMM; "
                         f"with the table on the CPU use one of {', '.join(CPU_TABLE_OPTIMIZERS)}")
    fp: dict[str, Any] = {"optimizer": getattr(EmbOptimType, TABLE_OPTIMIZERS[dcfg.table_optimizer]),
                          "learning_rate": dcfg.learning_rate(tcfg)}
    if dcfg.table_optimizer != "sgd":
        fp["eps"] = dcfg.table_eps
    if "adam" in dcfg.table_optimizer:
        fp.update(beta1=tcfg.beta1, beta2=tcfg.beta2, weight_decay=tcfg.weight_decay)
    return fp


def shard_model_table(model: HSTUModel, ctx: DistContext, dcfg: DistConfig, tcfg: TrainConfig) -> TorchRecItemEmbedding:
    """Replace ``model.item_emb`` (an ``nn.Embedding``) by a TorchRec-sharded table holding the same rows.

    Collective. The dense table is copied shard by shard into the sharded module and then dropped.
    """
    require_torchrec()
    import torchrec.distributed.comm_ops as comm_ops

    comm_ops.set_gradient_division(True)  # embedding grads / R, matching DDP's averaging (module docstring)
    V, d = model.cfg.num_items + 1, model.cfg.embedding_dim
    width = table_width(d, dcfg.sharding, ctx.world_size)
    if width != d:
        log.info("item table stored %d wide (FBGEMM needs a multiple of 4 per shard); columns %d.. are zero", width, d)
    dense = model.item_emb.weight.detach()
    sharded = shard_item_collection(build_item_collection(V, width), sharding=dcfg.sharding, pg=ctx.table_pg,
                                    device=ctx.table_device, fused_params=table_fused_params(dcfg, tcfg, ctx.table_device))
    load_rows(sharded, lambda a, b: F.pad(dense[a:b], (0, width - d)).to(ctx.table_device))
    emb = TorchRecItemEmbedding(sharded, V, d, table_dim=width, padding_idx=0, table_device=ctx.table_device,
                                compute_device=ctx.device)
    model.item_emb = emb
    return emb


# ---------------------------------------------------------------------------------------------
# The step: slice of the global batch, negatives, loss
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchShard:
    """Rank r's part of a global batch.

    users: (b,) EventLog rows (b >= 1); seq_offset: index of its first sequence in the global
    batch; batch_size: B; positions: P of the global
    batch; width: the global batch's padded width (its longest sequence); weight: 1.0, or 0.0 when the rank's
    slice is empty and ``users`` is a stand-in.
    """

    users: np.ndarray
    seq_offset: int
    batch_size: int
    positions: int
    width: int
    weight: float


def shard_batch(ub: np.ndarray, lengths: np.ndarray, world: int, rank: int) -> BatchShard:
    """Rank ``rank``'s contiguous slice of the global batch ``ub`` (B,) of EventLog rows.

    ``lengths`` (B,) int: training lengths of ``ub`` (each >= 2); a sequence of length L has
    L - 1 supervised positions.
    """
    if len(ub) == 0:
        raise ValueError("shard_batch: empty global batch")
    pos = np.asarray(lengths, dtype=np.int64) - 1
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(len(ub)), world)])
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    total, width = int(pos.sum()), int(pos.max()) + 1
    if hi == lo:  # fewer sequences than ranks: a stand-in with weight 0
        return BatchShard(ub[:1], 0, len(ub), total, width, 0.0)
    return BatchShard(ub[lo:hi], lo, len(ub), total, width, 1.0)


def draw_negatives(shard: BatchShard, local_width: int, tcfg: TrainConfig, num_items: int, gen: torch.Generator,
                   device: torch.device) -> tuple[torch.Tensor, int]:
    """Draw the negatives of the whole global batch exactly as :func:`hstu.train.losses.sampled_softmax_loss`
    does on one process, and keep this rank's.

    On one process, with the global batch padded to width W_g, each run of c = min(chunk, W_g - 1)
    consecutive positions of a sequence shares M negatives: one (B * nc, M) draw, nc = ceil((W_g - 1) / c),
    sequence-major. Every rank makes that draw from its copy of the generator (same seed, so the
    generators stay in step without communication) and keeps the chunks of its own sequences
    that its (narrower or equal) width ``local_width`` reaches.

    Returns:
        (neg (b, nc_l, M) int64 in [1, I], nc_l = ceil((local_width - 1) / c); c).
    """
    M = tcfg.num_negatives
    T = shard.width - 1  # supervised slots of the global batch
    c = min(tcfg.negatives_chunk, max(T, 1))
    nc = -(-T // c)
    B = shard.batch_size
    neg = torch.randint(1, num_items + 1, (B * nc, M), device=device, generator=gen).view(B, nc, M)  # (B, nc, M)
    nc_local = -(-(local_width - 1) // c)
    return neg[shard.seq_offset:shard.seq_offset + len(shard.users), :nc_local], c  # (b, nc_l, M)


def sharded_sampled_softmax_loss(out: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, item_emb, neg: torch.Tensor, *,
                                 chunk: int, temperature: float, scale: float) -> tuple[torch.Tensor, int]:
    """This rank's share of the global batch's sampled-softmax loss (Zhai et al. 2024, §4.1.1).

    The same logits as :func:`hstu.train.losses.sampled_softmax_loss` (cosine / temperature of
    the L2-normalised row and item embeddings, the next item as positive, a run of ``chunk``
    positions sharing its negatives, clashing negatives masked to -inf), with the negatives drawn
    for the global batch (:func:`draw_negatives`).

    Args:
        out: (b, W, d) L2-normalised encoder rows; ids (b, W) int64; lengths (b,) int64.
        neg: (b, nc, M) int64, nc = ceil((W - 1) / chunk): the negatives of each run of positions.
        chunk: c, the run length the negatives were drawn for (the global batch's, not recomputed from W).
        scale: multiplies the summed cross-entropy (R / P for the global mean, times the shard weight).
    Returns:
        (scale * sum of this rank's cross-entropies, p = its supervised positions).
    Raises:
        ValueError: ``neg`` does not have (b, nc, M) rows of runs.
    """
    b, W, d = out.shape
    T, c = W - 1, chunk
    nc = -(-T // c)
    if neg.dim() != 3 or neg.shape[:2] != (b, nc):
        raise ValueError(f"negatives of shape {tuple(neg.shape)} do not match {b} sequences x {nc} runs of {c} positions")
    M = neg.shape[2]
    pad = nc * c - T
    q = F.pad(out[:, :-1], (0, 0, 0, pad))  # (b, nc*c, d)
    tgt = F.pad(ids[:, 1:], (0, pad))  # (b, nc*c)
    pos_logit = (q * l2_normalize(item_emb(tgt))).sum(-1, keepdim=True)  # (b, nc*c, 1)
    neg = neg.reshape(b * nc, M)  # (b*nc, M)
    neg_logit = torch.bmm(q.reshape(b * nc, c, d), l2_normalize(item_emb(neg)).transpose(1, 2))  # (b*nc, c, M)
    clash = tgt.reshape(b * nc, c, 1) == neg.unsqueeze(1)  # (b*nc, c, M)
    neg_logit = neg_logit.masked_fill(clash, float("-inf")).reshape(b, nc * c, M)  # (b, nc*c, M)
    mask = torch.arange(nc * c, device=ids.device).view(1, -1) < (lengths.view(-1, 1) - 1)  # (b, nc*c)
    logits = torch.cat([pos_logit, neg_logit], dim=-1)[mask]  # (p, 1+M)
    n = logits.shape[0]
    ce = F.cross_entropy(logits / temperature, torch.zeros(n, dtype=torch.long, device=ids.device), reduction="sum")
    return ce * scale, n


class _ShardStep(nn.Module):
    """The module DDP wraps: one rank's forward of a step, returning its loss share (a scalar)."""

    def __init__(self, model: HSTUModel, tcfg: TrainConfig) -> None:
        super().__init__()
        self.model = model
        self.tcfg = tcfg

    def forward(self, ids: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor, actions: torch.Tensor,
                categories: torch.Tensor, neg: torch.Tensor, chunk: int, scale: float) -> torch.Tensor:
        m, t = self.model, self.tcfg
        m.item_emb.prefetch(ids, neg)  # the step's one collective lookup
        try:
            out = m.encode(ids, timestamps, lengths, actions=actions, categories=categories)  # (b, W, d)
            loss, _ = sharded_sampled_softmax_loss(out, ids, lengths, m.item_emb, neg, chunk=chunk,
                                                   temperature=m.cfg.temperature, scale=scale)
            if m.action_head is not None:  # next-action cross-entropy, same positions (hstu.train.losses.next_action_loss)
                W = out.shape[1]
                mask = torch.arange(W - 1, device=out.device).view(1, -1) < (lengths.view(-1, 1) - 1)
                ce = F.cross_entropy(m.action_head(out[:, :-1][mask]), actions[:, 1:][mask], reduction="sum")
                loss = loss + t.action_loss_weight * ce * scale
        finally:
            m.item_emb.release()
        return loss


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------


def _train_lengths(log_: EventLog, split: Split, max_seq_len: int) -> np.ndarray:
    return np.minimum(split.train_end - log_.offsets[:-1], max_seq_len)


def epoch_batches(log_: EventLog, split: Split, tcfg: TrainConfig, max_seq_len: int, epoch: int) -> list[np.ndarray]:
    """The global batches of ``epoch``: the same as :func:`hstu.train.loop.train_one_epoch` draws."""
    lengths = _train_lengths(log_, split, max_seq_len)
    users = np.nonzero(lengths >= 2)[0]
    rng = np.random.default_rng(tcfg.seed * 1000 + epoch)
    return [users[b] for b in length_bucketed_batches(lengths[users], tcfg.batch_size, rng, pool=tcfg.length_pool)]


def train_one_epoch_distributed(step: nn.Module, model: HSTUModel, log_: EventLog, split: Split, tcfg: TrainConfig, opt,
                                gen: torch.Generator, epoch: int, ctx: DistContext, progress: bool = True,
                                on_step: Callable[[int, int, float], None] | None = None) -> dict:
    """One epoch over the global batches; returns the stats :func:`hstu.train.loop.train_one_epoch` returns.

    ``loss`` is the global mean loss per step (all-reduced), averaged over sequences as on one
    process; ``on_step(epoch, step, loss)`` sees every step's global loss (on every rank).
    """
    step.train()
    cfg, R = model.cfg, ctx.world_size
    lengths = _train_lengths(log_, split, cfg.max_seq_len)
    batches = epoch_batches(log_, split, tcfg, cfg.max_seq_len, epoch)
    t0, total, n_pos, n_seq = time.perf_counter(), 0.0, 0, 0
    bar = tqdm(batches, desc=f"epoch {epoch}", disable=not (progress and ctx.is_main), leave=False, mininterval=2.0)
    for i, ub in enumerate(bar):
        sh = shard_batch(ub, lengths[ub], R, ctx.rank)
        b = train_batch(log_, split, sh.users, cfg.max_seq_len).to(ctx.device)
        # a stand-in shard (weight 0) is the batch's first sequence: its negatives exist
        neg, chunk = draw_negatives(sh, b.ids.shape[1], tcfg, cfg.num_items, gen, ctx.device)
        loss = step(b.ids, b.timestamps, b.lengths, b.actions, b.categories, neg, chunk, sh.weight * R / sh.positions)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces dense grads; the fused table optimizer updates its rows here
        opt.step()
        glob = loss.detach().reshape(1).clone()
        dist.all_reduce(glob, group=ctx.dense_pg)
        gl = float(glob) / R
        if on_step is not None:
            on_step(epoch, i, gl)
        total += gl * len(ub)
        n_pos += sh.positions
        n_seq += len(ub)
        bar.set_postfix(loss=f"{gl:.4f}", seq_s=f"{n_seq / (time.perf_counter() - t0):.0f}")
    secs = time.perf_counter() - t0
    return {"loss": total / max(n_seq, 1), "seconds": secs, "sequences_per_s": n_seq / secs, "positions": n_pos}


def export_model(model: HSTUModel, ctx: DistContext, *, dst: int | None = None) -> HSTUModel | None:
    """A plain single-process HSTUModel (nn.Embedding table) with this job's weights, on the CPU.

    Collective (gathers the table: on every rank with ``dst=None``, else only on ``dst``; the
    other ranks get None).
    """
    emb: TorchRecItemEmbedding = model.item_emb
    table = emb.full_table(ctx.dense_pg, dst=dst)
    if table is None:
        return None
    plain = build_hstu(ModelConfig(**asdict(model.cfg)))
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.startswith("item_emb.")}
    state["item_emb.weight"] = table
    plain.load_state_dict(state, strict=True)
    return plain


def evaluate_distributed(model: HSTUModel, log_: EventLog, split: Split, which: str, ctx: DistContext, *, batch_size: int = 256,
                         ks=DEFAULT_KS, plain: HSTUModel | None = None) -> dict[str, float]:
    """Full-ranking metrics (as :func:`hstu.train.evaluate.evaluate`), users split over the ranks.

    Each rank ranks every R-th user (ordered by history length, for balance) with a plain copy of
    the model (``plain``, else :func:`export_model`); the ranks are gathered. Collective.
    """
    plain = plain if plain is not None else export_model(model, ctx)
    plain = plain.to(ctx.device)
    targets = split.targets(which)
    users = np.nonzero(targets >= 0)[0]
    users = users[np.argsort(targets[users] - log_.offsets[users], kind="stable")][ctx.rank::ctx.world_size]
    _, ranks = evaluate_ranks(plain, log_, split, which, batch_size=batch_size, device=ctx.device, users=users)
    all_ranks = gather_varlen(torch.from_numpy(ranks.astype(np.int64)).to(ctx.device), ctx.dense_pg)
    out = ranking_metrics(all_ranks.cpu().numpy(), ks)
    out["users"] = int(all_ranks.numel())
    return out


def gather_varlen(x: torch.Tensor, pg: Any = None) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from all ranks (rank order). Collective."""
    world = dist.get_world_size(pg)
    n = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    ns = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(ns, n, group=pg)
    cap = int(max(int(v) for v in ns))
    padded = torch.zeros(cap, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=pg)
    return torch.cat([p[: int(c)] for p, c in zip(parts, ns)])


def _check_same_everywhere(ctx: DistContext, **values: int) -> None:
    """Fail fast (ValueError naming the field) when ranks disagree, e.g. loaded different data."""
    mine = torch.tensor(list(values.values()), dtype=torch.int64, device=ctx.device)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=ctx.dense_pg)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=ctx.dense_pg)
    bad = [k for k, a, b in zip(values, lo.tolist(), hi.tolist()) if a != b]
    if bad:
        raise ValueError(f"ranks disagree on {', '.join(bad)} (rank {ctx.rank}: {values}): every rank must read the same data and config")


def fit_distributed(run_dir: str | Path, mcfg: ModelConfig, tcfg: TrainConfig, spec: DataSpec, dcfg: DistConfig | None = None, *,
                    device: str = "cpu", resume: bool = False, overwrite: bool = True, progress: bool = True,
                    use_features: bool = True, on_step: Callable[[int, int, float], None] | None = None,
                    data: tuple[EventLog, Split] | None = None) -> dict:
    """Train on all ranks of the job (see the module docstring); rank 0 writes RUN_DIR.

    The run directory has the layout of :func:`hstu.train.loop.fit` (config.json with an extra
    "distributed" table, model.safetensors with the full table as ``item_emb.weight``, idmap.json,
    metrics.json, history.json, last.*). ``data``: the (EventLog, Split) of ``spec`` if already
    loaded (every rank must hold the same). ``resume`` restores the weights, the dense AdamW state and
    the negatives' generator; the table optimizer's state (AdaGrad sums) restarts from zero and
    dropout masks are drawn afresh (so with sgd and no dropout a resumed run is exact). Resuming
    reads RUN_DIR on every rank (a shared file system across machines).

    Returns the metrics.json object (on every rank).
    Raises:
        ValueError: bad configs (naming the field), ranks that loaded different data, resuming a
            single-process run; FileExistsError, FileNotFoundError, DataFormatError as ``fit``;
        ImportError: TorchRec is missing (message gives the install command).
    """
    require_torchrec()
    dcfg = dcfg or DistConfig()
    dcfg.validate()
    tcfg.validate()
    run = Path(run_dir)
    ctx = init_distributed(device, timeout_s=dcfg.timeout_s)
    try:
        return _fit(run, mcfg, tcfg, spec, dcfg, ctx, resume, overwrite, progress, use_features, on_step, data)
    finally:
        shutdown(ctx)


def _fit(run: Path, mcfg: ModelConfig, tcfg: TrainConfig, spec: DataSpec, dcfg: DistConfig, ctx: DistContext, resume: bool,
         overwrite: bool, progress: bool, use_features: bool, on_step, data) -> dict:
    if (run / "last.json").exists() and not resume and not overwrite:
        raise FileExistsError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
    if resume and (run / "last.json").exists() and "distributed" not in read_json(run / "last.json"):
        raise ValueError(f"{run} holds a single-process run: resume it with `hstu train --resume`, not the distributed trainer")
    table_fused_params(dcfg, tcfg, ctx.table_device)  # a bad table optimizer fails before the data is read
    if ctx.is_main:
        run.mkdir(parents=True, exist_ok=True)
        if not resume:  # --overwrite: the old run's files go (hstu.train.loop.fit deletes them once its data is read)
            remove_run_files(run)
    if tcfg.num_threads:
        torch.set_num_threads(tcfg.num_threads)
    log_, split = data if data is not None else prepare_data(spec)
    if resume:
        mcfg = ModelConfig(**read_json(run / "config.json")["model"])
    else:
        mcfg = model_config_for(log_, mcfg, use_features)
    check_trainable(log_, split, mcfg.max_seq_len)
    ctx.backend.manual_seed(tcfg.seed)  # same init on every rank = the single-process init
    model = build_hstu(mcfg)
    if not isinstance(model, HSTUModel) or not isinstance(model.item_emb, nn.Embedding):
        raise ValueError(f"the distributed trainer supports architecture 'hstu' with its own item table, got {mcfg.architecture!r}")
    model.to(ctx.device)
    _check_same_everywhere(ctx, num_items=mcfg.num_items, users=log_.num_users, events=len(log_.items),
                           batches=len(epoch_batches(log_, split, tcfg, mcfg.max_seq_len, 1)), seed=tcfg.seed)
    shard_model_table(model, ctx, dcfg, tcfg)
    ctx.backend.manual_seed(tcfg.seed + 7919 * ctx.rank)  # independent dropout masks per rank
    step = _ShardStep(model, tcfg)
    ignore = [f"model.item_emb.{n}" for n, _ in model.item_emb.named_parameters()]
    ignore += [f"model.item_emb.{n}" for n, _ in model.item_emb.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(step, ignore)  # as TorchRec's DistributedModelParallel does
    ddp = DDP(step, device_ids=ctx.backend.ddp_device_ids(), process_group=ctx.dense_pg)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("item_emb.")]
    opt = torch.optim.AdamW(dense_params, lr=tcfg.learning_rate, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(tcfg.seed)
    dist_info = {"world_size": ctx.world_size, "backend": ctx.dist_backend, "sharding": dcfg.sharding,
                 "table_optimizer": dcfg.table_optimizer, "table_learning_rate": dcfg.learning_rate(tcfg),
                 "table_device": ctx.table_device.type}
    cfg_json = {"model": asdict(mcfg), "train": asdict(tcfg), "data": asdict(spec), "distributed": dist_info,
                "hstu_version": hstu.__version__}
    state = {"epoch": 0, "best": -1.0, "best_epoch": 0, "bad_epochs": 0, "train_seconds": 0.0}
    history: list[dict] = []
    if resume and (run / "last.json").exists():
        state.update(_resume(run, model, opt, gen, ctx))
        history = state.pop("history")  # the manifest's (hstu.train.checkpoint), not a history.json a kill left behind
        log.info("resumed %s at epoch %d (table optimizer state restarts)", run, state["epoch"])
    if ctx.is_main:
        write_json(run / "config.json", cfg_json)
        write_json(run / "idmap.json", idmap(log_, split))  # with item_train_counts, as hstu train writes
    paper = spec.protocol == "paper"
    best: HSTUModel | None = None
    while state["epoch"] < tcfg.epochs:
        epoch = state["epoch"] + 1
        stats = train_one_epoch_distributed(ddp, model, log_, split, tcfg, opt, gen, epoch, ctx, progress, on_step)
        state["train_seconds"] += stats["seconds"]
        entry = {"epoch": epoch, **stats}
        plain = export_model(model, ctx)
        if epoch % tcfg.eval_every == 0 or epoch == tcfg.epochs:
            entry["valid"] = evaluate_distributed(model, log_, split, "valid", ctx, batch_size=tcfg.eval_batch_size, plain=plain)
            if paper:
                entry["test"] = entry["valid"]
            score = entry["valid"]["NDCG@10"]
            if score > state["best"]:  # the same decision on every rank (metrics are gathered)
                state.update(best=score, best_epoch=epoch, bad_epochs=0)
                best = plain
                if ctx.is_main:
                    save_weights(run / "model.safetensors", plain)
            else:
                state["bad_epochs"] += 1
        if ctx.is_main:
            log.info("epoch %d: loss %.4f, %.0f seq/s, valid %s", epoch, stats["loss"], stats["sequences_per_s"],
                     {k: round(v, 4) for k, v in entry.get("valid", {}).items() if k in ("HR@10", "NDCG@10")})
        history.append(entry)
        state["epoch"] = epoch
        if ctx.is_main:
            # the dense AdamW holds every parameter but the table, in model order; the table's
            # optimizer state lives inside FBGEMM and is not saved
            save_train_state(run, plain, opt, gen, {**state, "distributed": dist_info}, history)
        if paper:
            best = plain
            if ctx.is_main:
                save_weights(run / "model.safetensors", plain)
        dist.barrier(group=ctx.dense_pg)
        if not paper and state["bad_epochs"] >= tcfg.early_stopping_patience:
            log.info("early stopping at epoch %d (best %d)", epoch, state["best_epoch"])
            break
    # final evaluation of the saved weights (best epoch; last under the paper protocol), as ``fit``;
    # kept in memory on every rank, so RUN_DIR need only be visible to rank 0
    if best is None:  # resumed a finished run: nothing trained here
        best = build_hstu(ModelConfig(**asdict(mcfg)))
        load_weights(run / "model.safetensors", best)
    metrics = {
        "valid": evaluate_distributed(model, log_, split, "valid", ctx, batch_size=tcfg.eval_batch_size, plain=best),
        "test": evaluate_distributed(model, log_, split, "test", ctx, batch_size=tcfg.eval_batch_size, plain=best),
        "epochs": state["epoch"],
        "best_epoch": state["epoch"] if paper else state["best_epoch"],
        "train_seconds": round(state["train_seconds"], 2),
        "sequences_per_s": round(float(np.mean([h["sequences_per_s"] for h in history])) if history else math.nan, 1),
        "protocol": spec.protocol,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads x {ctx.world_size} ranks, {ctx.device}",
        "distributed": dist_info,
    }
    if ctx.is_main:
        write_json(run / "metrics.json", metrics)
    dist.barrier(group=ctx.dense_pg)
    return metrics


def _resume(run: Path, model: HSTUModel, opt, gen: torch.Generator, ctx: DistContext) -> dict:
    """Load last.* into the sharded model (dense weights, table rows), the dense AdamW and the RNGs."""
    plain = build_hstu(ModelConfig(**asdict(model.cfg)))
    info = load_train_state(run, plain, opt, gen)
    if ctx.is_main:
        repair_run_files(run, info)
    src = plain.state_dict()
    with torch.no_grad():  # dense weights one by one: the sharded module's own load hooks want its keys
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not name.startswith("item_emb.") and name in src:
                t.copy_(src[name])
    table = plain.item_emb.weight.detach()
    pad = model.item_emb.table_dim - model.item_emb.embedding_dim
    load_rows(model.item_emb.sharded, lambda a, b: F.pad(table[a:b], (0, pad)).to(ctx.table_device))
    for p in opt.state.values():  # load_state_dict keeps tensors on the CPU; move them next to the params
        for k, v in list(p.items()):
            if torch.is_tensor(v) and k != "step":
                p[k] = v.to(ctx.device)
    ctx.backend.manual_seed(int(info.get("epoch", 0)) * 7919 + ctx.rank)
    return {k: v for k, v in info.items() if k not in ("param_groups", "distributed")}


# ---------------------------------------------------------------------------------------------
# Command line (``python -m hstu.train`` and ``hstu train --distributed``)
# ---------------------------------------------------------------------------------------------


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the distributed trainer on top of ``hstu train``'s."""
    p.add_argument("--sharding", default="row_wise", choices=list(SHARDING_TYPES), help="TorchRec layout of the item table")
    p.add_argument("--table-optimizer", default="rowwise_adagrad", choices=list(TABLE_OPTIMIZERS),
                   help="fused FBGEMM optimizer of the item table (CPU: sgd, adagrad, rowwise_adagrad)")
    p.add_argument("--table-learning-rate", type=float,
                   help="default 1.0 (sgd), 0.1 (adagrad types), --learning-rate (adam types)")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``hstu train``, same names and defaults, except that under torchrun
    ``--resume`` does not take unset data flags from the run nor refuse a contradicting
    ``--preset`` (``hstu train --resume`` does: hstu.cli._resume_defaults)."""
    p.add_argument("--dataset", default="ml-1m", help="ml-1m | taobao | retailrocket | csv")
    p.add_argument("--data-dir", help="data directory or file (default: $HSTU_DATA_DIR or ../shared/data/ml-1m)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default="small", choices=["small", "large", "prod"])
    g.add_argument("--config", help="TOML/JSON with [model] and [train] tables")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="global batch (split over the ranks)")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--num-negatives", type=int)
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--max-users", type=int, help="use only the first N users")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda | npu (rank r uses index LOCAL_RANK)")
    p.add_argument("--protocol", default="clean", choices=["clean", "paper"])
    p.add_argument("--skip-bad-rows", action="store_true")
    p.add_argument("--columns", help="csv column mapping, e.g. user=uid,item=iid,time=ts,action=event")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last epoch")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _default_data_dir() -> str | None:
    env = os.environ.get("HSTU_DATA_DIR")
    if env:
        return env
    for base in (Path.cwd(), Path(__file__).resolve().parents[3]):
        cand = base.parent / "shared" / "data" / "ml-1m"
        if (cand / "ratings.dat").exists():
            return str(cand)
    return None


def cmd_train_distributed(args: argparse.Namespace) -> int:
    """Handler of ``python -m hstu.train`` / ``hstu train --distributed``; rank 0 prints metrics.json.

    Ranks other than 0 log warnings only. A missing TorchRec prints the install command to
    stderr and returns 2; other errors propagate (the callers turn them into exit code 2).
    """
    rank = _env_int("RANK", 0)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)  # this process is one rank: quiet all its loggers
    data_dir = args.data_dir or _default_data_dir()
    if data_dir is None:
        raise FileNotFoundError("data directory not found: pass --data-dir (or set HSTU_DATA_DIR)")
    tcfg = None
    if getattr(args, "config", None):
        cfgs = load_config_file(args.config)
        mcfg, tcfg = cfgs.get("model") or model_config_from_preset(args.preset or "small"), cfgs.get("train")
    else:
        mcfg = model_config_from_preset(args.preset or "small")
    tcfg = tcfg or TrainConfig()
    for name in ("epochs", "seed", "batch_size", "learning_rate", "num_negatives"):
        v = getattr(args, name, None)
        if v is not None:
            setattr(tcfg, name, v)
    options = {"columns": args.columns} if getattr(args, "columns", None) else {}
    spec = DataSpec(args.dataset, str(data_dir), args.protocol, args.max_users, args.skip_bad_rows, options)
    dcfg = DistConfig(sharding=args.sharding, table_optimizer=args.table_optimizer, table_learning_rate=args.table_learning_rate)
    try:
        metrics = fit_distributed(args.out, mcfg, tcfg, spec, dcfg, device=args.device, resume=args.resume, progress=not args.quiet)
    except ImportError as exc:
        print(f"hstu train (rank {rank}): error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        print(json.dumps(metrics, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hstu.train``: errors a user can fix print one line to stderr and exit 2 (as ``hstu``)."""
    p = argparse.ArgumentParser(prog="python -m hstu.train",
                                description="Distributed HSTU training (run under torchrun; TorchRec-sharded item table, "
                                            "DDP dense layers).")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_train_arguments(p)
    add_distributed_arguments(p)
    args = p.parse_args(argv)
    rank = _env_int("RANK", 0)
    level = logging.DEBUG if args.verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    try:
        return cmd_train_distributed(args)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError, TypeError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hstu train (rank {rank}): error: {msg}", file=sys.stderr)
        return 2
    except backend.BackendUnavailableError as exc:
        print(f"hstu train (rank {rank}): error: {exc}", file=sys.stderr)
        return 2


__all__ = [
    "DIST_BACKENDS",
    "TABLE_OPTIMIZERS",
    "CPU_TABLE_OPTIMIZERS",
    "TABLE_DEFAULT_LR",
    "DistConfig",
    "DistContext",
    "init_distributed",
    "shutdown",
    "TorchRecItemEmbedding",
    "table_fused_params",
    "table_width",
    "shard_model_table",
    "BatchShard",
    "shard_batch",
    "draw_negatives",
    "sharded_sampled_softmax_loss",
    "epoch_batches",
    "train_one_epoch_distributed",
    "export_model",
    "evaluate_distributed",
    "gather_varlen",
    "fit_distributed",
    "add_train_arguments",
    "add_distributed_arguments",
    "cmd_train_distributed",
    "main",
]
