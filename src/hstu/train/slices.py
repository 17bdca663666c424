"""Evaluation slices beyond mean HR/NDCG, each with a 95 % bootstrap confidence interval over users.

For one scorer (a trained model, or a baseline of :mod:`hstu.train.baselines`) on one split:
- next item: HR@K, NDCG@K, MRR (full ranking, as :mod:`hstu.train.evaluate`);
- next action: accuracy and macro-F1 of the action predicted for the target event (the model's
  ``action_head`` on the user vector);
- purchases: HR@10 over users whose target action is a purchase (buy / transaction / …);
- repeats: HR@10 over users whose target item is already in their history ("repeat targets") and
  over the others ("new targets"), and the share of history items among the 10 best-ranked
  candidates (how much of the list a scorer spends on items the user has seen);
- cold start: HR@10 / NDCG@10 with every history truncated to its most recent 1 and 2 events
  ("users with < 3 prior events"), the target unchanged (it stays held out);
- diversity: Shannon entropy (nats) of the generated next-k items pooled across users, and
  long-tail coverage: the share of generated items outside the 20 % most popular items (by
  training events). Models generate through the one engine (:class:`hstu.generate.engine.Engine`:
  greedy, KV cache), as ``hstu generate`` and ``hstu serve`` do; baselines' next-k are their top-k.

Bootstrap: percentile intervals (Efron & Tibshirani 1993, §13.3) from ``R`` resamples of the
evaluated users with replacement (seeded); macro-F1 is recomputed on each resample. The pooled
entropy is the exception: resampling users drops the items only the missing users generated, so
its bootstrap distribution sits wholly below the estimate; it gets a delete-one-user jackknife
interval instead (see :func:`ci_entropy_jackknife`). Paired comparisons resample the same users
for both scorers; a win is "beyond the CI" when the 95 % interval of the difference lies above 0.

Symbols: U evaluated users, B users per batch, I items, k generated items per user, R resamples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hstu.data.batching import eval_batch
from hstu.data.ecommerce import PURCHASE_ACTIONS
from hstu.data.sequences import EventLog, Split
from hstu.generate.engine import Engine
from hstu.generate.recommend import default_buckets
from hstu.generate.sampler import exclusion_mask
from hstu.train.evaluate import exclude_history, predict_actions
from hstu.train.metrics import macro_f1, target_ranks

COLD_START_LENGTHS = (1, 2)
SCORER_MAX_BATCH = 32  # pool rows of a ModelScorer's engine (users per engine chunk)


# ----------------------------------------------------------------------------- scorers
class ModelScorer:
    """Wraps an HSTUModel / SASRecModel as a scorer: scores (B, I+1) and next actions (B,), and
    next-k generation through the engine. For a trained model: the first :meth:`generate` builds
    the engine, which hardens the model in place (eval, frozen; :func:`hstu.generate.hardening.harden`)."""

    def __init__(self, model, name: str = "model", device: torch.device | str = "cpu") -> None:
        self.model, self.name, self.device = model, name, torch.device(device)
        self._engine: Engine | None = None

    def _batch(self, log_: EventLog, users: np.ndarray, ends: np.ndarray, max_history: int | None):
        L = self.model.cfg.max_seq_len if max_history is None else min(max_history, self.model.cfg.max_seq_len)
        targets = np.full(log_.num_users, -1, np.int64)
        targets[users] = ends
        return eval_batch(log_, targets, users, L).to(self.device)

    @torch.inference_mode()
    def predict(self, log_: EventLog, users: np.ndarray, ends: np.ndarray, max_history: int | None = None):
        """(B,) rows, (B,) target event indices -> (scores (B, I+1) float, next actions (B,) or None).

        The history is the (at most ``max_history``, and ``max_seq_len``) events before ``ends``."""
        was = self.model.training
        self.model.eval()
        b = self._batch(log_, users, ends, max_history)
        seq = self.model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories)
        user = self.model.last_rows(seq, b.lengths)  # (B, d)
        scores = self.model.history_scores(user, b.ids, b.actions, b.lengths)  # (B, I+1), repeat bias included
        acts = predict_actions(self.model, user) if self.model.action_head is not None else None
        self.model.train(was)
        return scores, acts

    @property
    def engine(self) -> Engine:
        """The scorer's engine, built on first use: the Recommender's default buckets for the model's
        max_seq_len, SCORER_MAX_BATCH rows, k_max = max_output_len, eager, the model's kernels."""
        if self._engine is None:
            c = self.model.cfg
            self._engine = Engine(
                self.model,
                buckets=default_buckets(c.max_seq_len),
                max_batch=SCORER_MAX_BATCH,
                k_max=c.max_output_len,
                device=self.device,
                graphs="eager",
            )
        return self._engine

    @torch.inference_mode()
    def generate(self, log_: EventLog, users: np.ndarray, ends: np.ndarray, k: int, exclude: bool) -> np.ndarray:
        """(B, k) int64 dense items generated greedily by :attr:`engine` from the (at most
        max_seq_len) events before ``ends``; request time = the target's time; ``exclude``: the
        history's items are never generated. ValueError as Engine.generate (k > max_output_len)."""
        eng, B = self.engine, len(users)
        b = self._batch(log_, users, ends, None)
        mask = exclusion_mask(self.model.cfg.num_items, B, b.ids if exclude else None, b.lengths, device=eng.device)
        res = eng.generate(
            b.ids,
            b.timestamps,
            b.lengths,
            k,
            request_time=b.timestamps[torch.arange(B, device=eng.device), b.lengths],  # the target's time (eval_batch)
            exclude=mask,
            actions=b.actions,
            categories=b.categories,
            item_category=torch.from_numpy(log_.item_tokens).to(eng.device),  # (I+1[, 1+F]) as the batch's categories
        )
        return res.items.cpu().numpy()


class BaselineScorer:
    """Wraps a baseline of :mod:`hstu.train.baselines` as a scorer."""

    def __init__(self, baseline) -> None:
        self.baseline, self.name = baseline, baseline.name

    def predict(self, log_: EventLog, users: np.ndarray, ends: np.ndarray, max_history: int | None = None):
        return self.baseline.scores(users, ends, max_history), self.baseline.next_actions(users, ends, max_history)

    def generate(self, log_: EventLog, users: np.ndarray, ends: np.ndarray, k: int, exclude: bool) -> np.ndarray:
        s = self.baseline.scores(users, ends)
        if exclude:
            exclude_history(s, log_, users, ends)
        return s.topk(k, dim=1).indices.numpy()


# ----------------------------------------------------------------------------- per-user results
@dataclass
class UserResults:
    """Per-user outcomes on one split (all (U,) unless stated), users in EventLog-row order."""

    users: np.ndarray
    ranks: np.ndarray  # 1-based target rank among all items
    target_actions: np.ndarray
    pred_actions: np.ndarray | None
    generated: np.ndarray | None  # (U, k) dense items
    repeat_target: np.ndarray | None = None  # bool: the target item occurs in the user's history before it
    top_history_share: np.ndarray | None = None  # share of the 10 best-ranked candidates that are history items


@torch.inference_mode()
def collect(
    scorer,
    log_: EventLog,
    split: Split,
    which: str,
    *,
    exclude: bool | None = None,
    max_history: int | None = None,
    k: int = 10,
    generate: bool = True,
    batch_size: int = 128,
) -> UserResults:
    """Rank every evaluated user's target (and generate next-k) with ``scorer``.

    exclude: drop history items (those before the target, whole history even when
    ``max_history`` truncates the input) from the candidates; None: the data set's default.
    """
    targets = split.targets(which)
    users = np.nonzero(targets >= 0)[0]
    exclude = log_.exclude_history_default if exclude is None else exclude
    ranks, acts, gens, shares = [], [], [], []
    repeat = np.array([log_.items[t] in set(log_.items[log_.offsets[u] : t].tolist()) for u, t in zip(users, targets[users])], bool)
    for s in range(0, len(users), batch_size):
        ub = users[s : s + batch_size]
        ends = targets[ub]
        scores, a = scorer.predict(log_, ub, ends, max_history)
        if exclude:
            exclude_history(scores, log_, ub, ends)
        ranks.append(target_ranks(scores, torch.from_numpy(log_.items[ends]).to(scores.device)).cpu().numpy())
        top = scores.topk(min(10, scores.shape[1] - 1), dim=1).indices.cpu().numpy()  # (B, 10)
        shares += [np.isin(top[b], log_.items[log_.offsets[u] : e]).mean() for b, (u, e) in enumerate(zip(ub, ends))]
        acts.append(a)
        if generate:
            gens.append(scorer.generate(log_, ub, ends, k, exclude))
    has_acts = bool(acts) and acts[0] is not None
    return UserResults(
        users=users,
        ranks=np.concatenate(ranks).astype(np.int64),
        target_actions=log_.actions[targets[users]],
        pred_actions=np.concatenate(acts).astype(np.int64) if has_acts else None,
        generated=np.concatenate(gens) if generate and gens else None,
        repeat_target=repeat,
        top_history_share=np.asarray(shares, np.float64),
    )


# ----------------------------------------------------------------------------- statistics
def hits(ranks: np.ndarray, k: int) -> np.ndarray:
    """(U,) float64 1[rank <= k]."""
    return (np.asarray(ranks) <= k).astype(np.float64)


def ndcgs(ranks: np.ndarray, k: int) -> np.ndarray:
    """(U,) float64 1[rank <= k] / log2(rank + 1)."""
    r = np.asarray(ranks, np.float64)
    return np.where(r <= k, 1.0 / np.log2(r + 1.0), 0.0)


def bootstrap_weights(n: int, resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """(R, n) int64 multiplicities of each user in R resamples with replacement."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=resamples)


def ci_mean(values: np.ndarray, weights: np.ndarray, level: float = 0.95) -> dict:
    """{"value": mean, "ci": [lo, hi]} of the per-user ``values`` (U,) with bootstrap ``weights`` (R, U)."""
    v = np.asarray(values, np.float64)
    stats = weights @ v / v.size
    return _summary(float(v.mean()), stats, level)


def _summary(value: float, stats: np.ndarray, level: float) -> dict:
    a = (1 - level) / 2
    lo, hi = np.nanpercentile(stats, [100 * a, 100 * (1 - a)])
    return {"value": value, "ci": [float(lo), float(hi)]}


def ci_stat(fn, n: int, weights: np.ndarray, level: float = 0.95) -> dict:
    """Percentile bootstrap CI of a set-level statistic ``fn(w)`` of per-user weights (n,)
    (w = 1: the value), e.g. macro-F1 recomputed on each resample."""
    stats = np.array([fn(w) for w in weights], np.float64)
    return _summary(float(fn(np.ones(n))), stats, level)


def ci_entropy_jackknife(items: np.ndarray, level: float = 0.95) -> dict:
    """Entropy (nats) of the generated items pooled across users, with a delete-one-user
    jackknife normal interval (Efron & Tibshirani 1993, §11.2-11.5).

    The bootstrap does not suit this statistic: a resample repeats some users and drops about
    37 % of them, so the items only they generated vanish and every resampled entropy falls
    below the observed one (the percentile interval then lies below the estimate, the basic one
    above it). Deleting one user at a time perturbs the pooled counts by at most k items.
    items: (U, k) dense ids. Returns {"value", "ci", "method", "jackknife_bias"}.
    """
    U, k = items.shape
    uniq, inv = np.unique(items.ravel(), return_inverse=True)
    counts = np.bincount(inv, minlength=len(uniq)).astype(np.float64)
    total = counts.sum()
    plogp = lambda c: np.where(c > 0, c * np.log(np.where(c > 0, c, 1.0)), 0.0)  # noqa: E731
    s_all = plogp(counts).sum()
    value = float(np.log(total) - s_all / total)
    inv = inv.reshape(U, k)
    loo = np.empty(U)
    for u in range(U):  # remove user u's k items from the pooled counts
        ids, c_u = np.unique(inv[u], return_counts=True)
        s = s_all - plogp(counts[ids]).sum() + plogp(counts[ids] - c_u).sum()
        t = total - k
        loo[u] = np.log(t) - s / t if t > 0 else 0.0
    mean = loo.mean()
    se = float(np.sqrt((U - 1) / U * ((loo - mean) ** 2).sum()))
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + level / 2)
    return {
        "value": value,
        "ci": [value - z * se, value + z * se],
        "method": "jackknife (delete one user)",
        "jackknife_bias": float((U - 1) * (mean - value)),
    }


def tail_flags(items: np.ndarray, popularity: np.ndarray, head_share: float = 0.2) -> np.ndarray:
    """(U,) share of each user's generated items outside the ``head_share`` most popular items
    (the per-user terms whose mean is :func:`hstu.train.metrics.long_tail_coverage`)."""
    n_head = max(1, int(np.ceil(head_share * (popularity[1:] > 0).sum())))
    head = np.zeros(len(popularity), bool)
    head[np.argsort(-popularity[1:], kind="stable")[:n_head] + 1] = True
    return (~head[items]).mean(axis=1)


def purchase_targets(log_: EventLog, actions: np.ndarray) -> np.ndarray:
    """(N,) bool: which of the action ids ``actions`` (N,) are a purchase (an action named in
    :data:`hstu.data.ecommerce.PURCHASE_ACTIONS`, case-insensitive)."""
    buy_ids = [a + 1 for a, n in enumerate(log_.action_names) if n.lower() in PURCHASE_ACTIONS]
    return np.isin(actions, buy_ids)


def slice_report(
    res: UserResults,
    log_: EventLog,
    *,
    weights: np.ndarray | None = None,
    popularity: np.ndarray | None = None,
    cold: dict[int, UserResults] | None = None,
    ks=(10, 50),
    resamples: int = 1000,
    seed: int = 0,
) -> dict:
    """Every slice metric of one scorer with 95 % bootstrap CIs (see the module docstring).

    Args:
        res: per-user results on the split (full histories).
        weights: (R, U) bootstrap multiplicities (shared across scorers for paired CIs);
            default: ``bootstrap_weights(U, resamples, seed)``.
        popularity: (I+1,) training counts for long-tail coverage.
        cold: results with histories truncated to n events, n in COLD_START_LENGTHS.
    Returns:
        JSON-ready dict of {"value", "ci"} entries (and user counts).
    """
    U = len(res.users)
    W = bootstrap_weights(U, resamples, seed) if weights is None else weights
    out: dict = {"users": U, "next_item": {}}
    for k in ks:
        out["next_item"][f"HR@{k}"] = ci_mean(hits(res.ranks, k), W)
        out["next_item"][f"NDCG@{k}"] = ci_mean(ndcgs(res.ranks, k), W)
    out["next_item"]["MRR"] = ci_mean(1.0 / res.ranks, W)
    if res.pred_actions is not None and log_.num_actions:
        y, p = res.target_actions, res.pred_actions
        out["next_action"] = {
            "accuracy": ci_mean((y == p).astype(np.float64), W),
            "macro_f1": ci_stat(lambda w: macro_f1(y, p, w), U, W),
            "classes": log_.action_names,
            "predicted_share": {n: float((p == a + 1).mean()) for a, n in enumerate(log_.action_names)},
        }
    if log_.num_actions:
        sel = purchase_targets(log_, res.target_actions)
        if sel.any():
            Ws = bootstrap_weights(int(sel.sum()), W.shape[0], seed + 1)
            out["purchase"] = {
                "users": int(sel.sum()),
                "HR@10": ci_mean(hits(res.ranks[sel], 10), Ws),
                "NDCG@10": ci_mean(ndcgs(res.ranks[sel], 10), Ws),
            }
    if res.repeat_target is not None:
        rep = res.repeat_target
        out["repeat"] = {"share_of_targets": float(rep.mean()), "history_share_of_top10": ci_mean(res.top_history_share, W)}
        for name, sel, off in (("repeat_targets", rep, 2), ("new_targets", ~rep, 3)):
            if sel.any():
                Ws = bootstrap_weights(int(sel.sum()), W.shape[0], seed + off)
                out["repeat"][name] = {"users": int(sel.sum()), "HR@10": ci_mean(hits(res.ranks[sel], 10), Ws)}
    if cold:
        for name, fn in (("HR@10", hits), ("NDCG@10", ndcgs)):
            per_user = np.mean([fn(cold[n].ranks, 10) for n in sorted(cold)], axis=0)  # (U,) mean over truncations
            out.setdefault("cold_start", {"history_lengths": sorted(cold)})[name] = ci_mean(per_user, W)
            for n in sorted(cold):
                out["cold_start"].setdefault("by_history", {}).setdefault(str(n), {})[name] = ci_mean(fn(cold[n].ranks, 10), W)
    if res.generated is not None:
        g = res.generated
        out["diversity"] = {"k": int(g.shape[1]), "entropy_nats": ci_entropy_jackknife(g), "distinct_items": int(len(np.unique(g)))}
        if popularity is not None:
            out["diversity"]["long_tail_coverage"] = ci_mean(tail_flags(g, popularity), W)
    return out


def scorer_slices(
    scorer,
    log_: EventLog,
    split: Split,
    which: str = "test",
    *,
    exclude: bool | None = None,
    weights: np.ndarray | None = None,
    popularity: np.ndarray | None = None,
    resamples: int = 1000,
    seed: int = 0,
) -> tuple[dict, UserResults]:
    """Every slice of one scorer on ``which``: :func:`collect` on full histories (with next-10
    generation) and on histories cut to each of :data:`COLD_START_LENGTHS`, then :func:`slice_report`.
    Returns (the report, the full-history results)."""
    res = collect(scorer, log_, split, which, exclude=exclude, k=10)
    cold = {n: collect(scorer, log_, split, which, exclude=exclude, max_history=n, generate=False) for n in COLD_START_LENGTHS}
    return slice_report(res, log_, weights=weights, popularity=popularity, cold=cold, resamples=resamples, seed=seed), res


def paired_comparison(a: np.ndarray, b: np.ndarray, weights: np.ndarray, level: float = 0.95) -> dict:
    """Per-user values of two scorers on the same users (U,) -> ratio and difference of the means
    with paired bootstrap CIs. ``win_beyond_ci``: the difference's interval lies above 0;
    ``loss_beyond_ci``: below 0. A ratio with a zero denominator is None (JSON null)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ma, mb = weights @ a / a.size, weights @ b / b.size
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(mb > 0, ma / np.where(mb > 0, mb, 1.0), np.nan)
    ratio = _summary(float(a.mean() / b.mean()), ratios, level) if b.mean() > 0 else {"value": None, "ci": [None, None]}
    if ratio["value"] is not None and not all(np.isfinite(ratio["ci"])):
        ratio["ci"] = [None, None]
    diff = _summary(float(a.mean() - b.mean()), ma - mb, level)
    return {
        "ratio": ratio,
        "difference": diff,
        "win": diff["value"] > 0,
        "win_beyond_ci": bool(diff["ci"][0] > 0),
        "loss_beyond_ci": bool(diff["ci"][1] < 0),
    }
