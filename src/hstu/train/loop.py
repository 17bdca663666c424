"""Training recipe: setup → epochs (sampled softmax, AdamW) → validation / early stopping →
checkpoint every epoch → final evaluation of the best weights.

One recipe for one process and for torchrun: :func:`fit` runs the epochs, evaluation, checkpoints
and early stopping and calls a strategy's hooks for what differs (the PyTorch Lightning "strategy"
idea): :class:`LocalStrategy` here (one device, the whole batch, AdamW, or row-wise AdaGrad on the item
table: ``[train] table_optimizer``) and :class:`hstu.train.distributed.DistributedStrategy` (TorchRec-sharded
item table with its fused optimizer, DDP, each rank's slice of the global batch, all-reduced metrics, rank-0
writes). Both draw the same batches (:func:`epoch_batches`) and compute the same loss (:func:`training_loss`).

Features: deterministic with a seed; length-bucketed or packed batches (``[train] packing``); progress and one
line per epoch (:mod:`hstu.train.logs`); metrics.csv with each epoch's commit (:mod:`hstu.model.curves`);
``resume`` continues from RUN_DIR/last.*; ``max_minutes`` stops after the epoch in which that much wall time
has passed (committed, resumable; metrics.json ``status`` says so).

Raises: FileNotFoundError / DataFormatError from the loaders; ValueError for bad configs; BackendUnavailableError for a
missing device; FileExistsError when RUN_DIR holds a run and neither ``resume`` nor ``overwrite`` (:mod:`.replace`) is set."""

from __future__ import annotations

import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

import hstu.train.recipe as recipes
from hstu import backend
from hstu.config import ModelConfig, TrainConfig, model_config_from_dict, train_config_from_dict
from hstu.data import EventLog, Split, train_batch
from hstu.data.batching import length_bucketed_batches, packed_train_batch
from hstu.data.prepare import (  # noqa: F401
    PROTOCOL_NEEDS,
    DataSpec,
    check_trainable,
    model_config_for,
    prepare_data,
    subset_users,
    train_item_counts,
    with_options,
)
from hstu.model.checkpoint import read_json  # noqa: F401 (re-exported)
from hstu.model.hstu import HSTUModel, build_hstu
from hstu.runs import (  # noqa: F401
    CONFIG,
    RESUME_DATA_FIELDS,
    RUN_FILES,
    check_resume_data,
    check_resume_items,
    config_json,
    has_train_state,
    is_quantized,
    load_best_weights,
    load_train_state,
    read_config,
    remove_run_files,  # noqa: F401 (hstu.train.loop.remove_run_files, as before)
    repair_run_files,
    save_best_weights,
    save_train_state,
    write_config,
    write_idmap,
    write_metrics,
)
from hstu.runs import load_float_run as load_run  # noqa: F401 (the old hstu.train.loop.load_run)
from hstu.runs import make_idmap as idmap  # noqa: F401 (the old hstu.train.loop.idmap)
from hstu.train.calibrate import REPEAT_SCALES, action_head_calibration, calibrate_action_head, calibrate_repeat_scale  # noqa: F401
from hstu.train.evaluate import evaluate
from hstu.train.logs import TensorBoardCurves, epoch_line, progress
from hstu.train.losses import resolve_packing, training_loss
from hstu.train.recipe import check_recipe, decay_on_plateau, model_text, recipe, recipe_text, recipe_warnings, warmed_up
from hstu.train.replace import drop, last_commit, put_back, resumed_commit, said_restored, set_aside
from hstu.train.sparse_optim import TableAndDenseOptimizer, check_table_trainable, table_learning_rate

# Re-exported above (noqa: F401) for the old import paths (issue 18): data in hstu.data.prepare, the run in hstu.runs.

log = logging.getLogger(__name__)
clock = time.monotonic  # the wall clock of --max-minutes (a test seam)


def repeat_share(log_: EventLog, split: Split, window: int, max_seq_len: int) -> float:
    """Share of training targets (next events within each user's training part, over the
    positions the model sees) whose item occurs in the ``window`` events before them."""
    hits = total = 0
    for u in range(log_.num_users):
        s, e = int(log_.offsets[u]), int(split.train_end[u])
        items = log_.items[max(s, e - max_seq_len) : e]
        last: dict[int, int] = {}
        for t, it in enumerate(items.tolist()):
            if t > 0:
                total += 1
                hits += int(it in last and t - 1 - last[it] < window)
            last[it] = t
    return hits / max(total, 1)


def train_lengths(log_: EventLog, split: Split, max_seq_len: int) -> np.ndarray:
    """(U,) int64: each user's training events the model sees (at most ``max_seq_len``)."""
    return np.minimum(split.train_end - log_.offsets[:-1], max_seq_len)


def epoch_batches(log_: EventLog, split: Split, tcfg: TrainConfig, max_seq_len: int, epoch: int) -> list[np.ndarray]:
    """The (global) batches of ``epoch`` as arrays of EventLog rows: users with >= 2 training
    events, length-bucketed (:func:`hstu.data.batching.length_bucketed_batches`) from seed
    ``tcfg.seed * 1000 + epoch``; the same for every strategy and rank."""
    lengths = train_lengths(log_, split, max_seq_len)
    users = np.nonzero(lengths >= 2)[0]
    rng = np.random.default_rng(tcfg.seed * 1000 + epoch)
    return [users[b] for b in length_bucketed_batches(lengths[users], tcfg.batch_size, rng, pool=tcfg.length_pool)]


def loss_weights(batches: list[np.ndarray], lengths: np.ndarray, divisor: str) -> list[float]:
    """Each batch's multiplier of its mean loss (TrainConfig.loss_divisor): "batch" 1.0; "epoch"
    P_b / P̄ with P_b = sum(lengths[b] - 1) its positions and P̄ their mean over ``batches``, so that
    every position of the epoch weighs the same (the weighting of random batches, whose P_b vary
    little, kept under length-bucketed ones). ``lengths``: (U,) training lengths (:func:`train_lengths`)."""
    if divisor == "batch":
        return [1.0] * len(batches)
    p = [int((lengths[b] - 1).sum()) for b in batches]
    p_mean = sum(p) / max(len(p), 1)
    return [x / p_mean if p_mean else 0.0 for x in p]


def dense_adamw(params, tcfg: TrainConfig) -> torch.optim.AdamW:
    """The recipe's AdamW (TrainConfig learning_rate, beta1, beta2, weight_decay) over ``params``."""
    return torch.optim.AdamW(params, lr=tcfg.learning_rate, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)


class LocalStrategy:
    """One process on one device: the whole batch, the model's own item table, AdamW on every
    parameter; the hooks :func:`fit` calls (:class:`hstu.train.distributed.DistributedStrategy`
    implements the same ones). ``extra``: tables added to config.json, the last checkpoint's
    manifest and metrics.json (none here)."""

    rank, world_size, is_main = 0, 1, True
    extra: dict = {}
    packs = True  # trains packed rows (TrainConfig.packing "pack"); a strategy without it refuses them in fit

    def start(self, device: str, tcfg: TrainConfig) -> None:
        """Select the device (BackendUnavailableError if unusable); ValueError where WORLD_SIZE > 1 (torchrun, no --distributed)."""
        if (n := os.environ.get("WORLD_SIZE", "1")).isdigit() and int(n) > 1:
            raise ValueError(f"WORLD_SIZE={n} (torchrun?) but one process trains alone here: add --distributed (fit: DistributedStrategy)")
        self.backend = backend.select(device)

    def stop(self) -> None:
        pass

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def check_resume(self, run: Path, saved: dict) -> None:
        """ValueError when RUN_DIR (config.json ``saved``) is a distributed run."""
        if "distributed" in saved:
            raise ValueError(f"{run} holds a distributed run: resume it with `hstu train --distributed --resume` (or torchrun)")

    def check_setup(self, mcfg: ModelConfig, log_: EventLog, split: Split, tcfg: TrainConfig) -> None:
        """ValueError naming ``[train] packing`` for packed rows on a model that cannot train them."""
        if tcfg.packing == "pack" and (mcfg.architecture != "hstu" or mcfg.repeat_window > 0):
            raise ValueError(
                f"[train] packing = 'pack' trains architecture 'hstu' without a repeat head; got architecture "
                f"{mcfg.architecture!r}, repeat_window {mcfg.repeat_window}: set packing = 'off'"
            )

    def prepare(self, model: HSTUModel, tcfg: TrainConfig) -> torch.optim.Optimizer:
        """The optimizer of the model about to be trained (on :attr:`device`): AdamW on every
        parameter, or with ``tcfg.table_optimizer`` "rowwise_adagrad" AdamW on all but the item table
        and row-wise AdaGrad on the table's looked-up rows (its lookups switched to sparse gradients;
        :mod:`hstu.train.sparse_optim`)."""
        if tcfg.table_optimizer != "rowwise_adagrad":
            return dense_adamw(model.parameters(), tcfg)
        model.item_emb.sparse = True  # nn.Embedding: F.embedding(sparse=True); ShardedEmbedding: float32 sparse grads
        dense = [p for n, p in model.named_parameters() if not n.startswith("item_emb.")]
        table = [p for n, p in model.named_parameters() if n.startswith("item_emb.")]
        return TableAndDenseOptimizer(dense, table, tcfg, table_learning_rate(tcfg))

    def train(self, model: HSTUModel) -> None:
        model.train()

    def step(self, model: HSTUModel, log_: EventLog, split: Split, ub: np.ndarray, tcfg: TrainConfig, gen) -> tuple[torch.Tensor, int]:
        """Forward and loss of the batch ``ub`` (B,) EventLog rows; returns (loss to backpropagate, P positions)."""
        make = packed_train_batch if resolve_packing(tcfg, model.cfg, self.backend.name, self.packs) == "pack" else train_batch
        b = make(log_, split, ub, model.cfg.max_seq_len).to(self.device)
        out = model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories, segments=b.segments)
        return training_loss(model, out, b.ids, b.lengths, b.actions, tcfg, generator=gen, segments=b.segments)

    def global_loss(self, loss: torch.Tensor) -> float:
        """The batch's mean loss (every rank's, all-reduced, in the distributed strategy)."""
        return loss.item()

    def snapshot(self, model: HSTUModel) -> HSTUModel:
        """A plain HSTUModel with the current weights (here the model itself)."""
        return model

    def evaluate(self, plain: HSTUModel, log_: EventLog, split: Split, which: str, tcfg: TrainConfig) -> dict:
        return evaluate(plain, log_, split, which, batch_size=tcfg.eval_batch_size, device=self.device)

    def load_state(self, run: Path, model: HSTUModel, opt, gen: torch.Generator) -> tuple[dict, HSTUModel]:
        """Load the last committed epoch (:func:`hstu.runs.load_train_state`); returns (manifest, plain model)."""
        return load_train_state(run, model, opt, gen), model

    def keep_best(self, run: Path, plain: HSTUModel) -> None:
        """The reported weights so far: model.safetensors (rank 0)."""
        save_best_weights(run, plain)

    def best_model(self, run: Path, model: HSTUModel) -> HSTUModel:
        """A plain model holding the reported weights, for the final evaluation."""
        load_best_weights(run, model, self.device)
        return model

    def barrier(self) -> None:
        pass

    def machine(self) -> str:
        return f"{platform.machine()} {torch.get_num_threads()} threads, {self.device}"


def train_one_epoch(
    strategy: LocalStrategy,
    model: HSTUModel,
    log_: EventLog,
    split: Split,
    tcfg: TrainConfig,
    opt,
    gen: torch.Generator,
    epoch: int,
    progress_on: bool = True,
    on_step: Callable[[int, int, float], None] | None = None,
) -> dict:
    """One epoch over :func:`epoch_batches`; returns {"loss": mean batch loss weighted by sequences,
    "seconds", "sequences_per_s", "positions"}. ``on_step(epoch, step, loss)`` sees each step's loss.
    ``tcfg.loss_divisor`` "epoch": each batch backpropagates its mean loss x P_b / P̄ (P̄ the epoch's
    mean positions per batch), i.e. its summed loss over one divisor for the whole epoch."""
    strategy.train(model)
    batches = epoch_batches(log_, split, tcfg, model.cfg.max_seq_len, epoch)
    weights = loss_weights(batches, train_lengths(log_, split, model.cfg.max_seq_len), tcfg.loss_divisor)
    t0, total, n_pos, n_seq = time.perf_counter(), 0.0, 0, 0
    for i, ub, bar in progress(batches, f"epoch {epoch}", progress_on and strategy.is_main):
        loss, n = strategy.step(model, log_, split, ub, tcfg, gen)
        opt.zero_grad(set_to_none=True)
        (loss * weights[i]).backward()
        with warmed_up(opt.param_groups, tcfg, (epoch - 1) * len(batches) + i):
            opt.step()
        gl = strategy.global_loss(loss)
        if on_step is not None:
            on_step(epoch, i, gl)
        total += gl * len(ub)
        n_pos += n
        n_seq += len(ub)
        bar.set_postfix(loss=f"{gl:.4f}", seq_s=f"{n_seq / (time.perf_counter() - t0):.0f}")
    secs = time.perf_counter() - t0
    return {"loss": total / max(n_seq, 1), "seconds": secs, "sequences_per_s": n_seq / secs, "positions": n_pos}


def _resume(strategy: LocalStrategy, run: Path, model: HSTUModel, opt, gen: torch.Generator, state: dict, paper: bool) -> list[dict]:
    """Load the last committed epoch into ``model``, ``opt``, ``gen`` and ``state``; returns its
    history. Files a kill left behind the commit are rewritten: last.json and history.json, and
    model.safetensors when that epoch holds the reported weights (its weights are the ones just loaded)
    and metrics.json does not report it yet (a reported run's file holds them calibrated: kept as is)."""
    info, plain = strategy.load_state(run, model, opt, gen)
    state.update({k: v for k, v in info.items() if k not in ("param_groups", "history", *strategy.extra)})
    if strategy.is_main:
        repair_run_files(run, info)
    reported = read_json(run / "metrics.json").get("best_epoch") if (run / "metrics.json").exists() else None
    if state["epoch"] and (paper or state["best_epoch"] == state["epoch"]) and reported != state["epoch"]:
        strategy.keep_best(run, plain)
    log.info("resumed %s at epoch %d", run, state["epoch"])
    return list(info["history"])


def _report(
    strategy: LocalStrategy, run: Path, model: HSTUModel, log_, split, tcfg: TrainConfig, spec: DataSpec, state, history, status: str
) -> dict:
    """After the epochs: the reported weights (best, or the last epoch under --protocol paper) with
    the repeat scale and the next-action head calibrated on validation (hstu.train.calibrate; not
    under the paper protocol), evaluated on valid and test; writes (rank 0) and
    returns metrics.json's object (``status``: "completed", or why training stopped before ``tcfg.epochs``)."""
    paper = spec.protocol == "paper"
    best = strategy.best_model(run, model)
    calibration = valid = None
    if best.repeat is not None and not paper:
        calibration, valid = calibrate_repeat_scale(best, log_, split, evaluate_fn=lambda m, w: strategy.evaluate(m, log_, split, w, tcfg))
    head, kept = action_head_calibration(run, best, log_, split, state["best_epoch"], paper, strategy.device)
    if head is not None and not kept:
        valid = None  # the validation metrics again, with the calibrated head
    if calibration is not None or (head is not None and not kept):
        strategy.keep_best(run, best)
    metrics = {
        "valid": valid or strategy.evaluate(best, log_, split, "valid", tcfg),
        "test": strategy.evaluate(best, log_, split, "test", tcfg),
        "epochs": state["epoch"],
        "best_epoch": state["epoch"] if paper else state["best_epoch"],
        "train_seconds": round(state["train_seconds"], 2),
        "sequences_per_s": round(float(np.mean([h["sequences_per_s"] for h in history])) if history else math.nan, 1),
        "protocol": spec.protocol,
        "exclude_history": bool(log_.exclude_history_default),  # the candidate policy of valid and test
        "status": status,
        "machine": strategy.machine(),
        "recipe": recipe(tcfg, strategy.extra.get("distributed"), model.cfg.num_items),
        **strategy.extra,
        **recipes.recorded_changes(run),  # a resume that changed the recipe: from which epoch
    }
    if calibration is not None:
        metrics["repeat_scale"] = calibration
    if head is not None:
        metrics["action_head_calibration"] = head
    if strategy.is_main:
        write_metrics(run, metrics)
    strategy.barrier()
    return metrics


def fit(
    run_dir: str | Path,
    mcfg: ModelConfig,
    tcfg: TrainConfig,
    spec: DataSpec,
    *,
    device: str = "cpu",
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    use_features: bool = True,
    strategy: LocalStrategy | None = None,
    data: tuple[EventLog, Split] | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
    max_minutes: float | None = None,
    tensorboard: str | Path | None = None,
) -> dict:
    """Train, checkpoint every epoch (one commit per epoch, :func:`hstu.runs.save_train_state`), evaluate;
    returns the metrics.json object (on every rank). ``strategy``: :class:`LocalStrategy` (default) or
    :class:`hstu.train.distributed.DistributedStrategy`; ``data``: the (EventLog, Split) of ``spec`` if
    already loaded; ``on_step(epoch, step, loss)``: called after every step; ``max_minutes``: stop after
    the epoch during which this many minutes of wall time (this call's, :data:`clock`) have passed, with
    that epoch committed (``resume`` continues; metrics.json ``status`` says why it stopped);
    ``tensorboard``: a directory for TensorBoard epoch scalars (:class:`hstu.train.logs.TensorBoardCurves`). Raises
    FileExistsError for a ``run_dir`` that is a file, holds a run without ``resume`` or ``overwrite``, or a quantized copy (quant.json);
    ValueError for a config field's type or value (named, as in a config file), too little data (:func:`check_trainable`), malformed
    run files on ``resume`` (naming file and field), a run of the other strategy, ``max_minutes`` <= 0, ``tensorboard`` without its
    package, besides the module's."""
    mcfg, tcfg = model_config_from_dict(asdict(mcfg)), train_config_from_dict(asdict(tcfg))  # a config file's checks, naming the field
    if max_minutes is not None and not (math.isfinite(max_minutes) and max_minutes > 0):
        raise ValueError(f"--max-minutes must be a number > 0, got {max_minutes}")
    run = Path(run_dir)
    if run.exists() and not run.is_dir():
        raise FileExistsError(f"--out {run}: is a file, not a run directory; choose another --out")
    if is_quantized(run):  # hstu quantize's output: no train state; its INT8 weights would shadow new ones
        raise FileExistsError(f"--out {run} holds a quantized copy of a run (quant.json, from hstu quantize), not a run to train")
    if has_train_state(run) and not resume and not overwrite:
        raise FileExistsError(f"{run} already holds a run; resume=True (--resume) continues it, overwrite=True replaces it")
    strategy = strategy or LocalStrategy()
    strategy.start(device, tcfg)
    opts = {"progress": progress, "on_step": on_step, "max_minutes": max_minutes, "tensorboard": tensorboard}
    before = last_commit(run) if not resume else None  # an --overwrite's old run: its last commit
    try:
        return _fit(strategy, run, mcfg, tcfg, spec, resume, use_features, data, opts)
    except BaseException as exc:  # stopped before the new run's first commit: the old run, as it was (hstu.interrupts says so)
        said_restored(exc, before is not None and last_commit(run) == before)
        raise
    finally:
        strategy.stop()


def _setup(
    strategy: LocalStrategy, run: Path, mcfg: ModelConfig, tcfg: TrainConfig, spec: DataSpec, resume: bool, use_features: bool, data
):
    """Data, model configuration and the initial model on the strategy's device (same seed: the same
    init for every strategy and rank), ``tcfg.packing`` resolved. Nothing is written. Returns (log_, split, mcfg, tcfg, model)."""
    if tcfg.num_threads:
        torch.set_num_threads(tcfg.num_threads)
    check_table_trainable(mcfg, tcfg)  # before the data is read
    log_, split = (with_options(data[0], spec), data[1]) if data is not None else prepare_data(spec)
    if resume:
        saved = read_config(run)
        strategy.check_resume(run, saved)
        mcfg = ModelConfig(**saved["model"])
        check_table_trainable(mcfg, tcfg)
        check_resume_data(run / CONFIG, saved.get("data", {}), asdict(spec))
        check_resume_items(run, log_)
    else:
        mcfg = model_config_for(log_, mcfg, use_features)
    check_trainable(log_, split, mcfg.max_seq_len)  # before anything is written
    check_recipe(tcfg, mcfg.repeat_window, "distributed" in strategy.extra, saved["train"] if resume else None, run / CONFIG)
    tcfg = replace(tcfg, packing=resolve_packing(tcfg, mcfg, strategy.backend.name, getattr(strategy, "packs", False)))  # resolved
    if spec.protocol == "paper" and tcfg.lr_decay_patience:  # its "valid" is the test item: no decisions on it
        log.info("[train] lr_decay_patience = %d is not applied under --protocol paper: a constant lr", tcfg.lr_decay_patience)
        tcfg = replace(tcfg, lr_decay_patience=0)  # so config.json, metrics.json recipe and the log state what ran
    if tcfg.packing != "off" and not getattr(strategy, "packs", False):
        name = type(strategy).__name__
        raise ValueError(f"[train] packing = {tcfg.packing!r} is not supported by {name} (--distributed) yet; set it to 'off'")
    strategy.check_setup(mcfg, log_, split, tcfg)
    strategy.backend.manual_seed(tcfg.seed)
    model = build_hstu(mcfg, device=strategy.device).to(strategy.device)
    if model.cold_items is not None and not resume:
        model.set_cold_items(train_item_counts(log_, split))
    if model.repeat is not None and not resume:
        model.repeat.init_from_prior(repeat_share(log_, split, mcfg.repeat_window, mcfg.max_seq_len), mcfg.num_items)
    return log_, split, mcfg, tcfg, model


def _fit(strategy: LocalStrategy, run: Path, mcfg, tcfg: TrainConfig, spec: DataSpec, resume: bool, use_features, data, opts) -> dict:
    log_, split, mcfg, tcfg, model = _setup(strategy, run, mcfg, tcfg, spec, resume, use_features, data)
    opt = strategy.prepare(model, tcfg)
    gen = torch.Generator(device=strategy.device)
    gen.manual_seed(tcfg.seed)
    state = {"epoch": 0, "best": -1.0, "best_epoch": 0, "bad_epochs": 0, "train_seconds": 0.0}
    paper = spec.protocol == "paper"
    history = _resume(strategy, run, model, opt, gen, state, paper) if resume and has_train_state(run) else []
    tcfg, changes = recipes.resumed_recipe(read_config(run), tcfg, state, paper) if resume else (tcfg, [])  # a finished run: its own
    config = config_json(mcfg, tcfg, spec, **strategy.extra, **({"recipe_changes": changes} if changes else {}))
    board = TensorBoardCurves(opts["tensorboard"], state["epoch"] + 1) if opts["tensorboard"] and strategy.is_main else None
    started, status, aside, placed = clock(), "completed", None, False
    try:
        if strategy.is_main and not resume:  # --overwrite: the old run kept until an epoch commits, put back if none does
            aside, placed = set_aside(run), True
        if strategy.is_main:
            run.mkdir(parents=True, exist_ok=True)  # only now: a bad device or data set leaves no empty --out behind
            if not resume:  # a resume's config.json: once its first epoch commits (an interrupted resume changes nothing)
                write_config(run, config)
            write_idmap(run, log_, split)
            log.info("model: %s", model_text(mcfg, sum(p.numel() for p in model.parameters())))
            log.info("recipe: %s", recipe_text(tcfg, strategy.extra.get("distributed"), mcfg.num_items))
            steps = len(epoch_batches(log_, split, tcfg, mcfg.max_seq_len, 1)) if tcfg.lr_warmup_steps else None  # a warm-up's
            for warning in recipe_warnings(tcfg, steps):
                log.warning(warning)
        strategy.barrier()
        stops = lambda: not paper and state["bad_epochs"] >= tcfg.early_stopping_patience  # noqa: E731
        while state["epoch"] < tcfg.epochs and not stops():  # a resumed run that had stopped early trains no more
            entry = _epoch(strategy, run, model, log_, split, tcfg, opt, gen, state, history, paper, opts)
            aside = drop(aside)
            if resume and strategy.is_main:  # config.json now this training's; metrics.json an earlier epoch's until it reports
                resumed_commit(run, state["epoch"], config)
            if board is not None:
                board.epoch(entry)
            if state["epoch"] < tcfg.epochs and not stops() and _time_is_up(strategy, started, opts["max_minutes"]):
                status = f"stopped by --max-minutes {opts['max_minutes']:g} after epoch {state['epoch']} of {tcfg.epochs} "
                status += f"({(clock() - started) / 60:.1f} min); continue with --resume"
                log.warning(status)
                break
        if stops():
            status = f"early stopping at epoch {state['epoch']} (best {state['best_epoch']})"
            log.info(status)
    except BaseException:
        if placed and state["epoch"] == 0:  # nothing committed: no half-written run, an old one back
            put_back(run, aside)
        raise
    finally:
        if board is not None:
            board.close()
    return _report(strategy, run, model, log_, split, tcfg, spec, state, history, status)


def _time_is_up(strategy: LocalStrategy, started: float, max_minutes: float | None) -> bool:
    """Whether ``max_minutes`` of :data:`clock` time have passed since ``started`` on any rank (the
    ranks' flags are averaged by :meth:`LocalStrategy.global_loss`, an all-reduce under torchrun, so all stop together)."""
    if max_minutes is None:
        return False
    up = torch.tensor(float(clock() - started >= 60.0 * max_minutes), device=strategy.device)
    return strategy.global_loss(up) > 0


def _epoch(strategy: LocalStrategy, run: Path, model, log_, split, tcfg: TrainConfig, opt, gen, state, history, paper, opts) -> dict:
    """Train and evaluate one epoch, log its line, commit it (rank 0) and keep its weights if best;
    updates ``state`` and ``history``; returns the epoch's history entry."""
    epoch = state["epoch"] + 1
    stats = train_one_epoch(strategy, model, log_, split, tcfg, opt, gen, epoch, opts["progress"], opts["on_step"])
    if not math.isfinite(stats["loss"]):  # diverged: commit nothing of this epoch (the run resumes from the last good one)
        raise FloatingPointError(
            f"epoch {epoch}: the training loss is {stats['loss']} (diverged); nothing of this epoch was written. "
            "Lower [train] learning_rate, or check the data and [model] settings, then --resume from the last epoch"
        )
    state["train_seconds"] += stats["seconds"]
    entry = {"epoch": epoch, **stats}
    plain = strategy.snapshot(model)
    if epoch % tcfg.eval_every == 0 or epoch == tcfg.epochs:
        entry["valid"] = strategy.evaluate(plain, log_, split, "valid", tcfg)
        if paper:
            entry["test"] = entry["valid"]  # the paper protocol evaluates on the last item
        score = entry["valid"]["NDCG@10"]  # the same on every rank (metrics are gathered)
        if score > state["best"]:
            state.update(best=score, best_epoch=epoch, bad_epochs=0)
        else:
            state["bad_epochs"] += 1
            decay_on_plateau(opt.param_groups, tcfg, state["bad_epochs"], epoch)  # paper protocol: patience 0 (_setup)
    history.append(entry)
    state["epoch"] = epoch
    if strategy.is_main:  # the epoch's commit; then its reported weights (a kill in between is repaired by _resume)
        save_train_state(run, plain, opt, gen, {**state, **strategy.extra}, history)
    log.info(  # after the commit: a line printed is an epoch kept (an interrupt just after it lost a logged epoch)
        epoch_line(entry, tcfg.epochs, best="valid" in entry and state["best_epoch"] == epoch, exclude_history=log_.exclude_history_default)
    )
    if paper or state["best_epoch"] == epoch:
        strategy.keep_best(run, plain)
    strategy.barrier()
    return entry
