"""Distributed training: the item table sharded by TorchRec, the dense HSTU layers under DDP.

One process per device, started by ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; PyTorch docs, "torchrun (Elastic Launch)")::

    torchrun --nproc-per-node 2 -m hstu.train --dataset ml-1m --data-dir DIR --preset small \\
        --epochs 10 --out RUN [--sharding row_wise|column_wise|table_wise]

Without torchrun the same command runs as a world of one process. ``python -m hstu.train ARGS``
is ``hstu train --distributed ARGS``: the same parser, defaults, help and errors (:mod:`hstu.cli`),
and ``torchrun --nproc-per-node 2 --no-python hstu train --distributed ...`` the same job.

One recipe: :func:`hstu.train.loop.fit` runs the epochs, evaluation, checkpoints and early stopping
for both; :class:`DistributedStrategy` supplies what differs (the process group, the sharded
table and its fused optimizer, DDP, each rank's slice of a batch, all-reduced losses and metrics,
rank-0 writes). The loss is :func:`hstu.train.losses.training_loss` with the sharded table
supplying the item rows.

Layout of one step (R ranks, global batch of B sequences drawn exactly as the single-process
recipe draws it, :func:`hstu.train.loop.epoch_batches`, from the same seed):

    rank r takes the contiguous slice r of ``np.array_split(global batch, R)``;
    the negatives of the *global* batch are drawn on every rank from the same generator
    (same seed, same draws as :func:`hstu.train.losses.draw_negatives`), and each rank
    keeps the rows of its own sequences;
    each rank looks up all item ids it needs in ONE TorchRec lookup (batch ids + negatives,
    deduplicated; the whole table when the loss takes its dense-logits path), so the fused table
    optimizer applies one update per step;
    loss_r = (the single-process loss on rank r's p_r positions) * p_r * R / P, P = positions of
    the global batch, so sum_r loss_r / R is the single-process mean loss.

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
into the shards and dropped. Checkpoints are written by rank 0 through :mod:`hstu.runs` (the
run-directory layout of ``hstu train``) with the full table as ``item_emb.weight``, so ``hstu eval``
and ``hstu generate`` (and :func:`hstu.runs.load_run`) read them as any other run. Dropout masks
are drawn per rank (seed + 7919 r), so they are not the single-process ones even for R = 1.

FBGEMM needs every shard's width to be a multiple of 4; a table whose d is not (the small preset
has d = 50) is stored wider with zero columns (:func:`table_width`), invisible to the model.

Process group, device and backends: :mod:`hstu.train.dist_setup`; the sharded table, the batch
split and the loss: :mod:`hstu.train.dist_table`.

Symbols: R world size (ranks), r rank, B sequences in a global batch, b on this rank, P supervised
positions of the global batch (p on this rank), W padded width, M negatives, V = I + 1 table rows,
d width.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hstu.config import ModelConfig, TrainConfig
from hstu.data import EventLog, Split, train_batch
from hstu.data.prepare import DataSpec
from hstu.model.hstu import HSTUModel, build_hstu
from hstu.model.torchrec_tables import load_rows, require_torchrec
from hstu.runs import load_best_weights, load_train_state, save_best_weights
from hstu.train.dist_setup import (
    CPU_TABLE_OPTIMIZERS,
    DIST_BACKENDS,
    TABLE_DEFAULT_LR,
    TABLE_OPTIMIZERS,
    TORCHREC_DEVICE_TYPES,
    DistConfig,
    DistContext,
    init_distributed,
    shutdown,
)
from hstu.train.dist_table import (
    FBGEMM_DIM_MULTIPLE,
    BatchShard,
    TorchRecItemEmbedding,
    _check_same_everywhere,
    _ShardStep,
    draw_negatives,
    evaluate_distributed,
    export_model,
    gather_varlen,
    shard_batch,
    shard_model_table,
    table_fused_params,
    table_width,
)
from hstu.train.loop import LocalStrategy, dense_adamw, epoch_batches, fit, train_lengths

log = logging.getLogger(__name__)


class DistributedStrategy(LocalStrategy):
    """The hooks of :func:`hstu.train.loop.fit` for one rank of a torchrun job (module docstring).

    ``extra`` holds the run's "distributed" table (world size, backends, sharding, table
    optimizer and learning rate, table device), written to config.json, the checkpoint manifest
    and metrics.json. Raises ImportError without TorchRec (the message gives the install command)
    and ValueError for a bad :class:`DistConfig`.
    """

    packs = False  # its step shards padded rows (shard_batch): [train] packing "auto" resolves to "off", "pack" is refused

    def __init__(self, dcfg: DistConfig | None = None) -> None:
        require_torchrec()
        self.dcfg = dcfg or DistConfig()
        self.dcfg.validate()
        self.ctx: DistContext | None = None
        self._best: HSTUModel | None = None

    def start(self, device: str, tcfg: TrainConfig) -> None:
        self.ctx = ctx = init_distributed(device, timeout_s=self.dcfg.timeout_s)
        self.backend = ctx.backend
        d = self.dcfg
        try:
            table_fused_params(d, tcfg, ctx.table_device)  # a bad table optimizer fails before the data is read
        except ValueError:
            self.stop()
            raise
        info = {"world_size": ctx.world_size, "backend": ctx.dist_backend, "sharding": d.sharding, "table_optimizer": d.table_optimizer}
        self.extra = {"distributed": {**info, "table_learning_rate": d.learning_rate(tcfg), "table_device": ctx.table_device.type}}
        self.tcfg = tcfg

    def stop(self) -> None:
        if self.ctx is not None:
            shutdown(self.ctx)

    rank = property(lambda self: self.ctx.rank)
    world_size = property(lambda self: self.ctx.world_size)
    is_main = property(lambda self: self.ctx.is_main)

    def check_resume(self, run: Path, saved: dict) -> None:
        if "distributed" not in saved:
            raise ValueError(f"{run} holds a single-process run: resume it with `hstu train --resume`, not the distributed trainer")

    def check_setup(self, mcfg: ModelConfig, log_: EventLog, split: Split, tcfg: TrainConfig) -> None:
        """ValueError for a model this trainer cannot shard, or ranks that loaded different data."""
        if mcfg.architecture != "hstu" or mcfg.item_table != "dense":  # the TorchRec table is this trainer's item table
            raise ValueError(
                f"ModelConfig.architecture = {mcfg.architecture!r}, item_table = {mcfg.item_table!r}: --distributed trains "
                "architecture 'hstu' and shards its item table with TorchRec (train/dist_table.py); train a hashed table "
                "without --distributed, or set item_table = 'dense'"
            )
        nb = len(epoch_batches(log_, split, tcfg, mcfg.max_seq_len, 1))
        _check_same_everywhere(self.ctx, num_items=mcfg.num_items, users=log_.num_users, events=len(log_.items), batches=nb, seed=tcfg.seed)

    def prepare(self, model: HSTUModel, tcfg: TrainConfig) -> torch.optim.Optimizer:
        """Shard the item table (the single-process init, copied into the shards), seed dropout per
        rank, wrap the step in DDP; returns the AdamW of the dense parameters."""
        ctx = self.ctx
        shard_model_table(model, ctx, self.dcfg, tcfg)
        ctx.backend.manual_seed(tcfg.seed + 7919 * ctx.rank)  # independent dropout masks per rank
        self.ddp, opt = _dense_ddp(model, tcfg, ctx)
        return opt

    def train(self, model: HSTUModel) -> None:
        self.ddp.train()

    def step(self, model: HSTUModel, log_: EventLog, split: Split, ub: np.ndarray, tcfg: TrainConfig, gen) -> tuple[torch.Tensor, int]:
        """Rank r's slice of the global batch ``ub``; returns (its loss share, P of the global batch)."""
        cfg, R, ctx = model.cfg, self.ctx.world_size, self.ctx
        sh = shard_batch(ub, train_lengths(log_, split, cfg.max_seq_len)[ub], R, ctx.rank)
        b = train_batch(log_, split, sh.users, cfg.max_seq_len).to(ctx.device)
        # a stand-in shard (weight 0) is the batch's first sequence: its negatives exist
        neg, chunk = draw_negatives(sh, b.ids.shape[1], tcfg, cfg.num_items, gen, ctx.device)
        loss = self.ddp(b.ids, b.timestamps, b.lengths, b.actions, b.categories, neg, chunk, sh.weight * R / sh.positions)
        return loss, sh.positions  # backward: DDP all-reduces dense grads; the fused table optimizer updates its rows

    def global_loss(self, loss: torch.Tensor) -> float:
        glob = loss.detach().reshape(1).clone()
        dist.all_reduce(glob, group=self.ctx.dense_pg)
        return float(glob) / self.ctx.world_size

    def snapshot(self, model: HSTUModel) -> HSTUModel:
        """The plain model with the gathered table, on every rank (collective)."""
        return export_model(model, self.ctx)

    def evaluate(self, plain: HSTUModel, log_: EventLog, split: Split, which: str, tcfg: TrainConfig) -> dict:
        return evaluate_distributed(None, log_, split, which, self.ctx, batch_size=tcfg.eval_batch_size, plain=plain)

    def load_state(self, run: Path, model: HSTUModel, opt, gen: torch.Generator) -> tuple[dict, HSTUModel]:
        """last.* into the sharded model (dense weights, table rows), the dense AdamW and the RNGs; the
        table optimizer's state restarts from zero. Returns (manifest, the plain model loaded)."""
        return _load_state(run, model, opt, gen, self.ctx)

    def keep_best(self, run: Path, plain: HSTUModel) -> None:
        """Kept in memory on every rank for the final evaluation (RUN_DIR need only be visible to rank 0)."""
        self._best = plain
        if self.is_main:
            save_best_weights(run, plain)

    def best_model(self, run: Path, model: HSTUModel) -> HSTUModel:
        if self._best is None:  # resumed a finished run: nothing trained here
            self._best = build_hstu(model.cfg)
            load_best_weights(run, self._best)
        return self._best

    def barrier(self) -> None:
        dist.barrier(group=self.ctx.dense_pg)

    def machine(self) -> str:
        return f"{platform.machine()} {torch.get_num_threads()} threads x {self.ctx.world_size} ranks, {self.ctx.device}"


def fit_distributed(
    run_dir: str | Path, mcfg: ModelConfig, tcfg: TrainConfig, spec: DataSpec, dcfg: DistConfig | None = None, **options
) -> dict:
    """:func:`hstu.train.loop.fit` with :class:`DistributedStrategy` on all ranks of the job; rank 0 writes RUN_DIR.

    ``options``: fit's keywords (device, resume, overwrite, progress, use_features, on_step, data;
    ``data``: the (EventLog, Split) of ``spec`` if already loaded, every rank holding the same).
    The run directory has the layout of ``fit`` (config.json with an extra "distributed" table,
    model.safetensors with the full table as ``item_emb.weight``, idmap.json, metrics.json,
    history.json, last.*). ``resume`` restores the weights, the dense AdamW state and the negatives'
    generator; the table optimizer's state (AdaGrad sums) restarts from zero and dropout masks are
    drawn afresh (so with sgd and no dropout a resumed run is exact). Resuming reads RUN_DIR on every
    rank (a shared file system across machines).

    Returns the metrics.json object (on every rank).
    Raises:
        ValueError: bad configs (naming the field), ranks that loaded different data, resuming a
            single-process run; FileExistsError, FileNotFoundError, DataFormatError as ``fit``;
        ImportError: TorchRec is missing (message gives the install command).
    """
    return fit(run_dir, mcfg, tcfg, spec, strategy=DistributedStrategy(dcfg), **options)


def _dense_ddp(model: HSTUModel, tcfg: TrainConfig, ctx: DistContext) -> tuple[DDP, torch.optim.AdamW]:
    """The training step under DDP with the sharded table left out (as TorchRec's DistributedModelParallel
    does), and the AdamW of the dense parameters (every parameter but the table)."""
    step = _ShardStep(model, tcfg)
    ignore = [f"model.item_emb.{n}" for n, _ in model.item_emb.named_parameters()]
    ignore += [f"model.item_emb.{n}" for n, _ in model.item_emb.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(step, ignore)
    ddp = DDP(step, device_ids=ctx.backend.ddp_device_ids(), process_group=ctx.dense_pg)
    return ddp, dense_adamw([p for n, p in model.named_parameters() if not n.startswith("item_emb.")], tcfg)


def _load_state(run: Path, model: HSTUModel, opt, gen: torch.Generator, ctx: DistContext) -> tuple[dict, HSTUModel]:
    """Load last.* into the sharded model (dense weights, table rows), the dense AdamW and the RNGs."""
    plain = build_hstu(model.cfg)
    info = load_train_state(run, plain, opt, gen)
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
    log.info("table optimizer state restarts on resume")
    return info, plain


__all__ = [
    "DIST_BACKENDS",
    "TORCHREC_DEVICE_TYPES",
    "TABLE_OPTIMIZERS",
    "TABLE_DEFAULT_LR",
    "FBGEMM_DIM_MULTIPLE",
    "CPU_TABLE_OPTIMIZERS",
    "DistConfig",
    "DistContext",
    "DistributedStrategy",
    "init_distributed",
    "shutdown",
    "TorchRecItemEmbedding",
    "table_fused_params",
    "table_width",
    "shard_model_table",
    "BatchShard",
    "shard_batch",
    "draw_negatives",
    "epoch_batches",
    "export_model",
    "evaluate_distributed",
    "gather_varlen",
    "fit_distributed",
]
