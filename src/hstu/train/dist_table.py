"""The TorchRec-sharded item table of distributed training, the batch split over ranks and each rank's step.

Layout, gradients and optimizers: see :mod:`hstu.train.distributed`. Symbols as there (R ranks, B
sequences of a global batch, P supervised positions, M negatives, V table rows, d width).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hstu import backend
from hstu.config import ModelConfig, TrainConfig
from hstu.data import EventLog, Split
from hstu.model.hstu import HSTUModel, build_hstu
from hstu.model.torchrec_tables import (
    FEATURE,
    build_item_collection,
    load_rows,
    local_shards,
    require_torchrec,
    shard_item_collection,
)
from hstu.train.dist_setup import CPU_TABLE_OPTIMIZERS, TABLE_OPTIMIZERS, DistConfig, DistContext
from hstu.train.evaluate import evaluate_ranks
from hstu.train.losses import draw_negatives as draw_negatives_global
from hstu.train.losses import training_loss, uses_dense_logits
from hstu.train.metrics import DEFAULT_KS, ranking_metrics

log = logging.getLogger(__name__)

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

    def __init__(
        self,
        sharded: nn.Module,
        num_embeddings: int,
        embedding_dim: int,
        *,
        table_dim: int | None = None,
        padding_idx: int | None = 0,
        table_device: torch.device,
        compute_device: torch.device,
        feature: str = FEATURE,
    ) -> None:
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
            full[r0 : r0 + n, c0 : c0 + w] = piece.to(self.compute_device, torch.float32)
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
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, table_dim={self.table_dim}, padding_idx={self.padding_idx}, "
            f"table on {self.table_device}"
        )


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
        raise ValueError(
            f"table optimizer {dcfg.table_optimizer!r} has no CPU kernel in FBGEMM; "
            f"with the table on the CPU use one of {', '.join(CPU_TABLE_OPTIMIZERS)}"
        )
    fp: dict[str, Any] = {
        "optimizer": getattr(EmbOptimType, TABLE_OPTIMIZERS[dcfg.table_optimizer]),
        "learning_rate": dcfg.learning_rate(tcfg),
    }
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
    sharded = shard_item_collection(
        build_item_collection(V, width),
        sharding=dcfg.sharding,
        pg=ctx.table_pg,
        device=ctx.table_device,
        fused_params=table_fused_params(dcfg, tcfg, ctx.table_device),
    )
    load_rows(sharded, lambda a, b: F.pad(dense[a:b], (0, width - d)).to(ctx.table_device))
    emb = TorchRecItemEmbedding(sharded, V, d, table_dim=width, padding_idx=0, table_device=ctx.table_device, compute_device=ctx.device)
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


def draw_negatives(
    shard: BatchShard, local_width: int, tcfg: TrainConfig, num_items: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, int]:
    """The negatives of the whole global batch, drawn exactly as one process draws them
    (:func:`hstu.train.losses.draw_negatives` for B sequences padded to the global width W_g), and
    this rank's share: every rank makes that draw from its copy of the generator (same seed, so the
    generators stay in step without communication) and keeps the runs of its own sequences that
    its (narrower or equal) width ``local_width`` reaches.

    Returns:
        (neg (b, nc_l, M) int64 in [1, I], nc_l = ceil((local_width - 1) / c); c).
    """
    neg, c = draw_negatives_global(
        shard.batch_size,
        shard.width,
        num_negatives=tcfg.num_negatives,
        chunk=tcfg.negatives_chunk,
        num_items=num_items,
        generator=gen,
        device=device,
    )  # (B, nc, M)
    nc_local = -(-(local_width - 1) // c)
    return neg[shard.seq_offset : shard.seq_offset + len(shard.users), :nc_local], c  # (b, nc_l, M)


class _ShardStep(nn.Module):
    """The module DDP wraps: one rank's forward of a step, returning its share of the global mean loss.

    The loss is the single-process one (:func:`hstu.train.losses.training_loss`) on the rank's
    sequences with its share of the global negatives: its mean over the rank's p positions,
    times ``scale`` * p (``scale`` = weight * R / P), so that summing the shares over the ranks
    and dividing by R (DDP's averaging) gives the mean over the P positions of the global batch.
    The item rows come from one prefetch of the step's ids (the whole table when the loss scores
    dense logits, :func:`hstu.train.losses.uses_dense_logits`).
    """

    def __init__(self, model: HSTUModel, tcfg: TrainConfig) -> None:
        super().__init__()
        self.model = model
        self.tcfg = tcfg

    def forward(
        self,
        ids: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        actions: torch.Tensor,
        categories: torch.Tensor,
        neg: torch.Tensor,
        chunk: int,
        scale: float,
    ) -> torch.Tensor:
        m = self.model
        p = int((lengths - 1).clamp(min=0).sum())
        if uses_dense_logits(p, chunk, m.cfg.num_items):
            m.item_emb.prefetch(torch.arange(m.cfg.num_items + 1, device=ids.device))
        else:
            m.item_emb.prefetch(ids, neg)  # the step's one collective lookup
        try:
            out = m.encode(ids, timestamps, lengths, actions=actions, categories=categories)  # (b, W, d)
            loss, n = training_loss(m, out, ids, lengths, actions, self.tcfg, neg=neg, chunk=chunk)
        finally:
            m.item_emb.release()
        return loss * (scale * n)


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


def evaluate_distributed(
    model: HSTUModel,
    log_: EventLog,
    split: Split,
    which: str,
    ctx: DistContext,
    *,
    batch_size: int = 256,
    ks=DEFAULT_KS,
    plain: HSTUModel | None = None,
) -> dict[str, float]:
    """Full-ranking metrics (as :func:`hstu.train.evaluate.evaluate`), users split over the ranks.

    Each rank ranks every R-th user (ordered by history length, for balance) with a plain copy of
    the model (``plain``, else :func:`export_model`); the ranks are gathered. Collective.
    """
    plain = plain if plain is not None else export_model(model, ctx)
    plain = plain.to(ctx.device)
    targets = split.targets(which)
    users = np.nonzero(targets >= 0)[0]
    users = users[np.argsort(targets[users] - log_.offsets[users], kind="stable")][ctx.rank :: ctx.world_size]
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
