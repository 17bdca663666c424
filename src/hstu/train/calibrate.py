"""Post-training calibration on the validation split (never the test split): the repeat head's
scale (:func:`calibrate_repeat_scale`) and the next-action head's temperature and per-action
offsets (:func:`calibrate_action_head`). Both are folded into the saved weights, so every path
that reads the model (evaluation, the engine, the server) gets the calibrated model.

Symbols: U validation users, A real actions (ids 1..A; column 0 of the action head is "none",
never a target and never predicted), d the user vector width.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hstu.data.batching import eval_batch
from hstu.data.sequences import EventLog, Split
from hstu.train.evaluate import evaluate
from hstu.train.metrics import action_metrics

log = logging.getLogger(__name__)

REPEAT_SCALES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def calibrate_repeat_scale(
    model,
    log_: EventLog,
    split: Split,
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    evaluate_fn: Callable[..., dict] | None = None,
) -> tuple[dict, dict]:
    """Choose the repeat head's scale (:mod:`hstu.model.repeat`) among REPEAT_SCALES by
    validation NDCG@10 (ties: the smaller scale) and set it on the model. Returns
    ({"chosen": s, "valid_NDCG@10": {s: value}}, the validation metrics at s). The test split
    is never read. ``evaluate_fn(model, which)``: the evaluation to use (default
    :func:`hstu.train.evaluate.evaluate`; the distributed strategy splits the users over ranks)."""
    if evaluate_fn is None:
        evaluate_fn = lambda m, which: evaluate(m, log_, split, which, batch_size=batch_size, device=device)  # noqa: E731
    valid = {}
    for s in REPEAT_SCALES:
        model.repeat.scale.fill_(s)
        valid[s] = evaluate_fn(model, "valid")
    grid = {s: m["NDCG@10"] for s, m in valid.items()}
    best = max(REPEAT_SCALES, key=lambda s: (grid[s], -s))
    model.repeat.scale.fill_(best)
    log.info("repeat scale %g chosen on validation NDCG@10 %s", best, {k: round(v, 4) for k, v in grid.items()})
    return {"chosen": best, "valid_NDCG@10": {str(k): v for k, v in grid.items()}}, valid[best]


@torch.inference_mode()
def action_logits(model, log_: EventLog, split: Split, which: str, *, batch_size: int = 256, device="cpu") -> tuple[np.ndarray, np.ndarray]:
    """The action head's logits over the real actions for every user evaluated on ``which``:
    ((U, A) float64 logits, (U,) int64 target actions 1..A), users in EventLog order."""
    was_training = model.training
    model.eval()
    targets = split.targets(which)
    users = np.nonzero(targets >= 0)[0]
    out = []
    for s in range(0, len(users), batch_size):
        ub = users[s : s + batch_size]
        b = eval_batch(log_, targets, ub, model.cfg.max_seq_len).to(device)
        seq = model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories)
        out.append(model.action_head(model.last_rows(seq, b.lengths))[:, 1:].double().cpu().numpy())
    model.train(was_training)
    A = log_.num_actions
    return (np.concatenate(out) if out else np.zeros((0, A))), log_.actions[targets[users]].astype(np.int64)


def fit_temperature_and_offsets(logits: np.ndarray, y: np.ndarray, max_iter: int = 200) -> tuple[float, np.ndarray]:
    """Minimise the mean cross-entropy of softmax(logits / T + δ) over (T > 0, δ (A,) with δ summing
    to 0): temperature scaling with per-class offsets (Guo et al., "On Calibration of Modern Neural
    Networks", ICML 2017, §4.2: vector scaling with one shared scale). logits (U, A) float, y (U,)
    int64 in 1..A. Returns (T, δ (A,) float64). L-BFGS in float64 from T = 1, δ = 0."""
    z = torch.as_tensor(logits, dtype=torch.float64)
    t = torch.as_tensor(y - 1, dtype=torch.int64)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    raw = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t, raw], max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-10)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(z / log_t.exp() + (raw - raw.mean()), t)
        loss.backward()
        return loss

    with torch.enable_grad():  # callers may hold no_grad (calibrate_action_head)
        opt.step(closure)
    delta = (raw - raw.mean()).detach()
    return float(log_t.detach().exp()), delta.numpy()


def _metrics(logits: np.ndarray, y: np.ndarray) -> dict:
    z = torch.as_tensor(logits, dtype=torch.float64)
    m = action_metrics(y, logits.argmax(axis=1) + 1)
    ce = float(F.cross_entropy(z, torch.as_tensor(y - 1)))
    return {"accuracy": m["action_accuracy"], "macro_F1": m["action_macro_F1"], "cross_entropy": ce}


@torch.no_grad()
def calibrate_action_head(model, log_: EventLog, split: Split, *, batch_size: int = 256, device="cpu") -> dict | None:
    """Calibrate the next-action head on the validation targets (:func:`fit_temperature_and_offsets`)
    and fold the result into it: with W, b the head's weight (A+1, d) and bias, the real-action rows
    become W / T and b / T + δ (row 0, "none", is never predicted and is left alone), so its argmax
    is the Bayes decision under the calibrated probabilities. A jointly trained head can answer rarer
    actions where the majority action is the likelier (the Taobao run of ``taobao_floors_hstu.json``
    before calibration: accuracy .79 against the majority's .84; its fitted T ≈ 3e5 says its logits
    carried nothing the validation targets could use). Returns {"temperature", "offsets" {action: δ},
    "valid_before" / "valid_after" {accuracy, macro_F1, cross_entropy}}, or None when the model has
    no head or the data no actions or no validation targets. The test split is never read."""
    if getattr(model, "action_head", None) is None or not log_.num_actions:
        return None
    z, y = action_logits(model, log_, split, "valid", batch_size=batch_size, device=device)
    if len(y) == 0:
        return None
    T, delta = fit_temperature_and_offsets(z, y)
    head = model.action_head
    head.weight[1:] /= T
    head.bias[1:] = head.bias[1:] / T + torch.as_tensor(delta, dtype=head.bias.dtype, device=head.bias.device)
    names = log_.action_names or [str(a) for a in range(1, log_.num_actions + 1)]
    out = {
        "temperature": T,
        "offsets": {n: float(d) for n, d in zip(names, delta)},
        "valid_before": _metrics(z, y),
        "valid_after": _metrics(z / T + delta, y),
    }
    log.info(
        "next-action head calibrated on validation (T %.3g, offsets %s): accuracy %.4f -> %.4f, macro-F1 %.4f -> %.4f",
        T,
        {n: round(d, 3) for n, d in out["offsets"].items()},
        out["valid_before"]["accuracy"],
        out["valid_after"]["accuracy"],
        out["valid_before"]["macro_F1"],
        out["valid_after"]["macro_F1"],
    )
    return out


def action_head_calibration(run, best, log_: EventLog, split: Split, best_epoch: int, paper: bool, device) -> tuple[dict | None, bool]:
    """(calibrate_action_head's record or None, whether kept from ``run``'s metrics.json): a resumed run whose best epoch
    (``best_epoch``) did not change holds the calibrated head already (its file is kept; calibrating again would record
    T = 1). None without a next-action head or actions, and under --protocol paper (its validation targets are the test's)."""
    from pathlib import Path

    from hstu.model.checkpoint import read_json

    if getattr(best, "action_head", None) is None or not log_.num_actions:
        return None, False
    if paper:
        log.info("next-action head not calibrated: under --protocol paper the validation targets are the test's")
        return None, False
    prev = read_json(Path(run) / "metrics.json") if (Path(run) / "metrics.json").exists() else {}
    if prev.get("best_epoch") == best_epoch and "action_head_calibration" in prev:
        return prev["action_head_calibration"], True
    return calibrate_action_head(best, log_, split, device=device), False
