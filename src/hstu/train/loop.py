"""Training recipe: setup → epochs (sampled softmax, AdamW) → validation / early stopping →
checkpoint every epoch → final evaluation of the best weights.

Features: deterministic with a seed (batch order, negatives, init); length-bucketed batches
(padding costs little; results do not depend on the width since the divisor N is fixed);
tqdm progress with loss and sequences/s; ``resume`` continues from RUN_DIR/last.*.

Raises: FileNotFoundError / DataFormatError from the loaders; ValueError for bad configs;
BackendUnavailableError for a missing device; FileExistsError when RUN_DIR holds a run and
neither ``resume`` nor ``overwrite`` is set.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from hstu import backend
from hstu.config import ModelConfig, TrainConfig
from hstu.data import EventLog, Split, train_batch
from hstu.data.batching import length_bucketed_batches
from hstu.data.prepare import PROTOCOL_NEEDS, DataSpec, check_trainable, model_config_for, prepare_data, subset_users, train_item_counts  # noqa: F401
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
    load_best_weights,
    load_train_state,
    read_config,
    remove_run_files,
    repair_run_files,
    save_best_weights,
    save_train_state,
    write_config,
    write_idmap,
    write_metrics,
)
from hstu.runs import load_float_run as load_run  # noqa: F401 (the old hstu.train.loop.load_run)
from hstu.runs import make_idmap as idmap  # noqa: F401 (the old hstu.train.loop.idmap)
from hstu.train.evaluate import evaluate
from hstu.train.losses import next_action_loss, repeat_aware_loss, sampled_softmax_loss

# Re-exported for the old import paths (issue 18): data options and preparation live in
# hstu.data.prepare, the run directory in hstu.runs; this module is the training recipe only.

log = logging.getLogger(__name__)


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


REPEAT_SCALES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def calibrate_repeat_scale(
    model, log_: EventLog, split: Split, *, batch_size: int = 256, device: torch.device | str = "cpu"
) -> tuple[dict, dict]:
    """Choose the repeat head's scale (:mod:`hstu.model.repeat`) among REPEAT_SCALES by
    validation NDCG@10 (ties: the smaller scale) and set it on the model. Returns
    ({"chosen": s, "valid_NDCG@10": {s: value}}, the validation metrics at s). The test split
    is never read."""
    valid = {}
    for s in REPEAT_SCALES:
        model.repeat.scale.fill_(s)
        valid[s] = evaluate(model, log_, split, "valid", batch_size=batch_size, device=device)
    grid = {s: m["NDCG@10"] for s, m in valid.items()}
    best = max(REPEAT_SCALES, key=lambda s: (grid[s], -s))
    model.repeat.scale.fill_(best)
    log.info("repeat scale %g chosen on validation NDCG@10 %s", best, {k: round(v, 4) for k, v in grid.items()})
    return {"chosen": best, "valid_NDCG@10": {str(k): v for k, v in grid.items()}}, valid[best]


def train_one_epoch(
    model: HSTUModel,
    log_: EventLog,
    split: Split,
    tcfg: TrainConfig,
    opt,
    gen: torch.Generator,
    epoch: int,
    device: torch.device,
    progress: bool = True,
) -> dict:
    model.train()
    lengths = np.minimum(split.train_end - log_.offsets[:-1], model.cfg.max_seq_len)
    users = np.nonzero(lengths >= 2)[0]
    rng = np.random.default_rng(tcfg.seed * 1000 + epoch)
    batches = [users[b] for b in length_bucketed_batches(lengths[users], tcfg.batch_size, rng, pool=tcfg.length_pool)]
    t0, total, n_pos, n_seq = time.perf_counter(), 0.0, 0, 0
    bar = tqdm(batches, desc=f"epoch {epoch}", disable=not progress, leave=False, mininterval=2.0)
    for ub in bar:
        b = train_batch(log_, split, ub, model.cfg.max_seq_len).to(device)
        out = model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories)
        if model.repeat is not None:
            loss, n = repeat_aware_loss(
                out, b.ids, b.actions, b.lengths, model, num_negatives=tcfg.num_negatives, chunk=tcfg.negatives_chunk, generator=gen
            )
        else:
            loss, n = sampled_softmax_loss(
                out,
                b.ids,
                b.lengths,
                model.item_emb,
                num_negatives=tcfg.num_negatives,
                temperature=model.cfg.temperature,
                chunk=tcfg.negatives_chunk,
                generator=gen,
                num_items=model.cfg.num_items,
            )
        if model.action_head is not None:
            loss = loss + tcfg.action_loss_weight * next_action_loss(out, b.actions, b.lengths, model.action_head)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.item() * len(ub)
        n_pos += n
        n_seq += len(ub)
        bar.set_postfix(loss=f"{loss.item():.4f}", seq_s=f"{n_seq / (time.perf_counter() - t0):.0f}")
    secs = time.perf_counter() - t0
    return {"loss": total / max(n_seq, 1), "seconds": secs, "sequences_per_s": n_seq / secs, "positions": n_pos}


def _resume(run: Path, model: HSTUModel, opt, gen: torch.Generator, state: dict) -> list[dict]:
    """Load the last committed epoch into ``model``, ``opt``, ``gen`` and ``state``; returns its
    history. Files a kill left behind the commit are rewritten: last.json and history.json, and
    model.safetensors when that epoch was the best (its weights are the ones just loaded)."""
    info = load_train_state(run, model, opt, gen)
    state.update({k: v for k, v in info.items() if k not in ("param_groups", "history")})
    repair_run_files(run, info)
    if state["epoch"] and state["best_epoch"] == state["epoch"]:
        save_best_weights(run, model)
    log.info("resumed %s at epoch %d", run, state["epoch"])
    return list(info["history"])


def _report(
    run: Path,
    model: HSTUModel,
    log_: EventLog,
    split: Split,
    tcfg: TrainConfig,
    spec: DataSpec,
    state: dict,
    history: list[dict],
    device: torch.device,
) -> dict:
    """After the epochs: the reported weights (best, or the last epoch under --protocol paper) with
    the repeat scale calibrated on validation, evaluated on valid and test; writes and returns
    metrics.json's object."""
    paper = spec.protocol == "paper"
    if paper:  # report the last epoch, as the published protocol does
        save_best_weights(run, model)
    load_best_weights(run, model, device)
    calibration = valid = None
    if model.repeat is not None and not paper:
        calibration, valid = calibrate_repeat_scale(model, log_, split, batch_size=tcfg.eval_batch_size, device=device)
        save_best_weights(run, model)
    metrics = {
        "valid": valid or evaluate(model, log_, split, "valid", batch_size=tcfg.eval_batch_size, device=device),
        "test": evaluate(model, log_, split, "test", batch_size=tcfg.eval_batch_size, device=device),
        "epochs": state["epoch"],
        "best_epoch": state["epoch"] if paper else state["best_epoch"],
        "train_seconds": round(state["train_seconds"], 2),
        "sequences_per_s": round(float(np.mean([h["sequences_per_s"] for h in history])) if history else math.nan, 1),
        "protocol": spec.protocol,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {device}",
    }
    if calibration is not None:
        metrics["repeat_scale"] = calibration
    write_metrics(run, metrics)
    return metrics


def fit(
    run_dir: str | Path,
    mcfg: ModelConfig,
    tcfg: TrainConfig,
    spec: DataSpec,
    *,
    device: str = "cpu",
    resume: bool = False,
    overwrite: bool = True,
    progress: bool = True,
    use_features: bool = True,
) -> dict:
    """Train, checkpoint every epoch (one commit per epoch, :func:`hstu.runs.save_train_state`), evaluate;
    returns the metrics.json object. Raises ValueError for too little data (:func:`check_trainable`)
    and for malformed run files on ``resume`` (naming file and field), besides the module's."""
    tcfg.validate()
    run = Path(run_dir)
    if has_train_state(run) and not resume and not overwrite:
        raise FileExistsError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
    dev = backend.select(device)
    if tcfg.num_threads:
        torch.set_num_threads(tcfg.num_threads)
    dev.manual_seed(tcfg.seed)
    log_, split = prepare_data(spec)
    if resume:
        saved = read_config(run)
        mcfg = ModelConfig(**saved["model"])
        check_resume_data(run / CONFIG, saved.get("data", {}), asdict(spec))
        check_resume_items(run, log_)
    else:
        mcfg = model_config_for(log_, mcfg, use_features)
    check_trainable(log_, split, mcfg.max_seq_len)  # before anything is written
    model = build_hstu(mcfg, device=dev.device).to(dev.device)
    if model.cold_items is not None and not resume:
        model.set_cold_items(train_item_counts(log_, split))
    if model.repeat is not None and not resume:
        model.repeat.init_from_prior(repeat_share(log_, split, mcfg.repeat_window, mcfg.max_seq_len), mcfg.num_items)
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg.learning_rate, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    gen = torch.Generator(device=dev.device)
    gen.manual_seed(tcfg.seed)
    cfg_json = config_json(mcfg, tcfg, spec)
    state = {"epoch": 0, "best": -1.0, "best_epoch": 0, "bad_epochs": 0, "train_seconds": 0.0}
    history: list[dict] = []
    if resume and has_train_state(run):
        history = _resume(run, model, opt, gen, state)
    run.mkdir(parents=True, exist_ok=True)  # only now: a bad device or data set leaves no empty --out behind
    if not resume:  # a fresh run in place of an old one (--overwrite): the old files go only now that data and device are good
        remove_run_files(run)
    write_config(run, cfg_json)
    write_idmap(run, log_, split)
    paper = spec.protocol == "paper"
    while state["epoch"] < tcfg.epochs:
        epoch = state["epoch"] + 1
        stats = train_one_epoch(model, log_, split, tcfg, opt, gen, epoch, dev.device, progress)
        state["train_seconds"] += stats["seconds"]
        entry = {"epoch": epoch, **stats}
        if epoch % tcfg.eval_every == 0 or epoch == tcfg.epochs:
            entry["valid"] = evaluate(model, log_, split, "valid", batch_size=tcfg.eval_batch_size, device=dev.device)
            if paper:
                entry["test"] = entry["valid"]  # the paper protocol evaluates on the last item
            score = entry["valid"]["NDCG@10"]
            if score > state["best"]:
                state.update(best=score, best_epoch=epoch, bad_epochs=0)
            else:
                state["bad_epochs"] += 1
        log.info(
            "epoch %d: %s",
            epoch,
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items() if k != "valid"}
            | {"valid": {k: round(v, 4) for k, v in entry.get("valid", {}).items() if k in ("HR@10", "NDCG@10")}},
        )
        history.append(entry)
        state["epoch"] = epoch
        save_train_state(run, model, opt, gen, state, history)  # the epoch's commit; then its best weights:
        if state["best_epoch"] == epoch:  # a kill in between is repaired by _resume
            save_best_weights(run, model)
        if not paper and state["bad_epochs"] >= tcfg.early_stopping_patience:
            log.info("early stopping at epoch %d (best %d)", epoch, state["best_epoch"])
            break
    return _report(run, model, log_, split, tcfg, spec, state, history, dev.device)
