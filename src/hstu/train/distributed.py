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

Process group, device and backends: :mod:`hstu.train.dist_setup`; the sharded table, the batch
split and the loss: :mod:`hstu.train.dist_table`.

Symbols: R world size (ranks), r rank, B sequences in a global batch, b on this rank, P supervised
positions of the global batch (p on this rank), W padded width, M negatives, V = I + 1 table rows,
d width.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

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
from hstu.model.hstu import HSTUModel, build_hstu
from hstu.model.torchrec_tables import (
    load_rows,
    require_torchrec,
)
from hstu.train.checkpoint import load_train_state, repair_run_files, save_train_state
from hstu.train.dist_setup import (
    CPU_TABLE_OPTIMIZERS,
    DIST_BACKENDS,
    TABLE_DEFAULT_LR,
    TABLE_OPTIMIZERS,
    TORCHREC_DEVICE_TYPES,
    DistConfig,
    DistContext,
    _default_data_dir,
    _env_int,
    add_distributed_arguments,
    add_train_arguments,
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
    sharded_sampled_softmax_loss,
    table_fused_params,
    table_width,
)
from hstu.train.loop import DataSpec, check_trainable, idmap, model_config_for, prepare_data, remove_run_files

log = logging.getLogger(__name__)

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


def train_one_epoch_distributed(
    step: nn.Module,
    model: HSTUModel,
    log_: EventLog,
    split: Split,
    tcfg: TrainConfig,
    opt,
    gen: torch.Generator,
    epoch: int,
    ctx: DistContext,
    progress: bool = True,
    on_step: Callable[[int, int, float], None] | None = None,
) -> dict:
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


def fit_distributed(
    run_dir: str | Path,
    mcfg: ModelConfig,
    tcfg: TrainConfig,
    spec: DataSpec,
    dcfg: DistConfig | None = None,
    *,
    device: str = "cpu",
    resume: bool = False,
    overwrite: bool = True,
    progress: bool = True,
    use_features: bool = True,
    on_step: Callable[[int, int, float], None] | None = None,
    data: tuple[EventLog, Split] | None = None,
) -> dict:
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
    if mcfg.item_table != "dense":  # the TorchRec table is this trainer's item table; a hashed one has its own shards
        raise ValueError(
            f"ModelConfig.item_table = {mcfg.item_table!r}: --distributed shards the item table with TorchRec "
            "(train/dist_table.py); train a hashed table without --distributed, or set item_table = 'dense'"
        )
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


def _fit(
    run: Path,
    mcfg: ModelConfig,
    tcfg: TrainConfig,
    spec: DataSpec,
    dcfg: DistConfig,
    ctx: DistContext,
    resume: bool,
    overwrite: bool,
    progress: bool,
    use_features: bool,
    on_step,
    data,
) -> dict:
    _prepare_run_dir(run, dcfg, tcfg, ctx, resume, overwrite)
    if tcfg.num_threads:
        torch.set_num_threads(tcfg.num_threads)
    log_, split = data if data is not None else prepare_data(spec)
    if resume:
        mcfg = ModelConfig(**read_json(run / "config.json")["model"])
    else:
        mcfg = model_config_for(log_, mcfg, use_features)
    check_trainable(log_, split, mcfg.max_seq_len)
    model = _build_model(mcfg, tcfg, ctx)
    _check_same_everywhere(
        ctx,
        num_items=mcfg.num_items,
        users=log_.num_users,
        events=len(log_.items),
        batches=len(epoch_batches(log_, split, tcfg, mcfg.max_seq_len, 1)),
        seed=tcfg.seed,
    )
    shard_model_table(model, ctx, dcfg, tcfg)
    ctx.backend.manual_seed(tcfg.seed + 7919 * ctx.rank)  # independent dropout masks per rank
    ddp, opt = _dense_ddp(model, tcfg, ctx)
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(tcfg.seed)
    dist_info = {
        "world_size": ctx.world_size,
        "backend": ctx.dist_backend,
        "sharding": dcfg.sharding,
        "table_optimizer": dcfg.table_optimizer,
        "table_learning_rate": dcfg.learning_rate(tcfg),
        "table_device": ctx.table_device.type,
    }
    state, history = _start_state(run, resume, model, opt, gen, ctx)
    if ctx.is_main:
        write_json(
            run / "config.json",
            {
                "model": asdict(mcfg),
                "train": asdict(tcfg),
                "data": asdict(spec),
                "distributed": dist_info,
                "hstu_version": hstu.__version__,
            },
        )
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
            log.info(
                "epoch %d: loss %.4f, %.0f seq/s, valid %s",
                epoch,
                stats["loss"],
                stats["sequences_per_s"],
                {k: round(v, 4) for k, v in entry.get("valid", {}).items() if k in ("HR@10", "NDCG@10")},
            )
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
        **_run_summary(state, history, paper, spec, ctx),
        "distributed": dist_info,
    }
    if ctx.is_main:
        write_json(run / "metrics.json", metrics)
    dist.barrier(group=ctx.dense_pg)
    return metrics


def _prepare_run_dir(run: Path, dcfg: DistConfig, tcfg: TrainConfig, ctx: DistContext, resume: bool, overwrite: bool) -> None:
    """Refuse a run directory that cannot be (re)used, check the table optimizer before the data is read,
    and (rank 0) create RUN_DIR, emptied of an old run's files unless resuming."""
    if (run / "last.json").exists() and not resume and not overwrite:
        raise FileExistsError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
    if resume and (run / "last.json").exists() and "distributed" not in read_json(run / "last.json"):
        raise ValueError(f"{run} holds a single-process run: resume it with `hstu train --resume`, not the distributed trainer")
    table_fused_params(dcfg, tcfg, ctx.table_device)  # a bad table optimizer fails before the data is read
    if ctx.is_main:
        run.mkdir(parents=True, exist_ok=True)
        if not resume:  # --overwrite: the old run's files go (hstu.train.loop.fit deletes them once its data is read)
            remove_run_files(run)


def _build_model(mcfg: ModelConfig, tcfg: TrainConfig, ctx: DistContext) -> HSTUModel:
    """The single-process initial model (same seed on every rank) on this rank's device.

    Raises:
        ValueError: an architecture other than 'hstu' with its own item table.
    """
    ctx.backend.manual_seed(tcfg.seed)  # same init on every rank = the single-process init
    model = build_hstu(mcfg)
    if not isinstance(model, HSTUModel) or not isinstance(model.item_emb, nn.Embedding):
        raise ValueError(f"the distributed trainer supports architecture 'hstu' with its own item table, got {mcfg.architecture!r}")
    return model.to(ctx.device)


def _dense_ddp(model: HSTUModel, tcfg: TrainConfig, ctx: DistContext) -> tuple[DDP, torch.optim.AdamW]:
    """The training step under DDP with the sharded table left out (as TorchRec's DistributedModelParallel
    does), and the AdamW of the dense parameters (every parameter but the table)."""
    step = _ShardStep(model, tcfg)
    ignore = [f"model.item_emb.{n}" for n, _ in model.item_emb.named_parameters()]
    ignore += [f"model.item_emb.{n}" for n, _ in model.item_emb.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(step, ignore)
    ddp = DDP(step, device_ids=ctx.backend.ddp_device_ids(), process_group=ctx.dense_pg)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("item_emb.")]
    opt = torch.optim.AdamW(dense_params, lr=tcfg.learning_rate, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    return ddp, opt


def _run_summary(state: dict, history: list[dict], paper: bool, spec: DataSpec, ctx: DistContext) -> dict:
    """metrics.json's fields besides the metrics: epochs, best epoch, training time and speed, protocol, machine."""
    return {
        "epochs": state["epoch"],
        "best_epoch": state["epoch"] if paper else state["best_epoch"],
        "train_seconds": round(state["train_seconds"], 2),
        "sequences_per_s": round(float(np.mean([h["sequences_per_s"] for h in history])) if history else math.nan, 1),
        "protocol": spec.protocol,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads x {ctx.world_size} ranks, {ctx.device}",
    }


def _start_state(run: Path, resume: bool, model: HSTUModel, opt, gen: torch.Generator, ctx: DistContext) -> tuple[dict, list[dict]]:
    """The loop state (epoch, best score and epoch, bad epochs, train seconds) and history: fresh, or
    the last checkpoint's when resuming (which also loads the model, the dense AdamW and the RNGs)."""
    state = {"epoch": 0, "best": -1.0, "best_epoch": 0, "bad_epochs": 0, "train_seconds": 0.0}
    if not (resume and (run / "last.json").exists()):
        return state, []
    state.update(_resume(run, model, opt, gen, ctx))
    history = state.pop("history")  # the manifest's (hstu.train.checkpoint), not a history.json a kill left behind
    log.info("resumed %s at epoch %d (table optimizer state restarts)", run, state["epoch"])
    return state, history


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
    p = argparse.ArgumentParser(
        prog="python -m hstu.train",
        description="Distributed HSTU training (run under torchrun; TorchRec-sharded item table, DDP dense layers).",
    )
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
    "TORCHREC_DEVICE_TYPES",
    "TABLE_OPTIMIZERS",
    "TABLE_DEFAULT_LR",
    "FBGEMM_DIM_MULTIPLE",
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
