"""Ranking and classification metrics.

Full-ranking protocol (Zhai et al. 2024, §4.1.1; Kang & McAuley 2018): score every item, exclude
the user's history items where the data set says so, rank the target.
Ties are broken against the target: rank = 1 + #{items with score >= target score, other than
the target}, so a model that scores everything equally ranks the target last, never first.

HR@K = 1[rank <= K];  NDCG@K = 1[rank <= K] / log2(rank + 1);  MRR = 1 / rank (untruncated).
A target the ranking excludes (a history item under ``exclude_history``, scored -inf) can never be
recommended: its rank is :data:`UNREACHABLE_RANK`, a miss at every K with an MRR term of ~2e-19
(it was ranked behind every item, a hit at any K past the catalogue's size: HR@50 = 1 on 20 items).
"""

from __future__ import annotations

import math

import numpy as np
import torch

DEFAULT_KS = (1, 10, 50, 200)
UNREACHABLE_RANK = 2**62  # the rank of an excluded target: past every K, 1 / rank ~ 0 (int64, as the other ranks)


def target_ranks(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Pessimistic 1-based ranks.

    Args:
        scores: (B, I) float, excluded items at -inf.
        targets: (B,) int64 column of each target.
    Returns:
        (B,) int64 ranks in 1..I; :data:`UNREACHABLE_RANK` where the target is excluded (-inf).
    """
    t = scores.gather(1, targets.view(-1, 1))  # (B, 1)
    ranks = (scores >= t).sum(dim=1)  # the target itself plus every other item scoring >= it
    return ranks.masked_fill_(t.view(-1) == float("-inf"), UNREACHABLE_RANK)


def ranking_metrics(ranks: np.ndarray, ks=DEFAULT_KS) -> dict[str, float]:
    """Mean HR@K, NDCG@K (K in ks) and MRR over 1-based ranks (B,)."""
    r = np.asarray(ranks, dtype=np.float64)
    if r.size == 0:
        raise ValueError("ranking_metrics: no ranks")
    out = {}
    for k in ks:
        hit = r <= k
        out[f"HR@{k}"] = float(hit.mean())
        out[f"NDCG@{k}"] = float(np.where(hit, 1.0 / np.log2(r + 1.0), 0.0).mean())
    out["MRR"] = float((1.0 / r).mean())
    return out


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Macro-averaged F1 over the classes occurring in ``y_true`` or ``y_pred`` (weighted counts).

    F1_c = 2 TP_c / (2 TP_c + FP_c + FN_c) = 2 TP_c / (#pred_c + #true_c) (Sokolova & Lapalme
    2009, "A systematic analysis of performance measures for classification tasks", Table 3).
    y_true, y_pred: (N,) int64 class ids >= 0; weights: (N,) per-example counts (bootstrap).
    NaN when there are no examples.
    """
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    w = np.ones(len(y_true)) if weights is None else np.asarray(weights, np.float64)
    C = int(max(y_true.max(initial=0), y_pred.max(initial=0))) + 1
    tp = np.bincount(y_true[y_true == y_pred], weights=w[y_true == y_pred], minlength=C)
    denom = np.bincount(y_true, weights=w, minlength=C) + np.bincount(y_pred, weights=w, minlength=C)
    present = denom > 0
    return float(np.mean(2 * tp[present] / denom[present])) if present.any() else float("nan")


def action_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """Next-action accuracy and macro-F1 (:func:`macro_f1`) of (N,) int64 target / predicted
    action ids: {"action_accuracy", "action_macro_F1"}. ValueError for no examples."""
    y_true, y_pred = np.asarray(y_true, np.int64), np.asarray(y_pred, np.int64)
    if y_true.size == 0 or y_true.shape != y_pred.shape:
        raise ValueError(f"action_metrics: need equal, non-empty arrays, got {y_true.shape} and {y_pred.shape}")
    return {"action_accuracy": float((y_true == y_pred).mean()), "action_macro_F1": macro_f1(y_true, y_pred)}


def auc(pos_scores: np.ndarray, neg_scores: np.ndarray) -> float:
    """AUC of positive vs negative scores per user, averaged over users.

    pos_scores: (B,), neg_scores: (B, M). Ties count one half (Mann-Whitney).
    """
    p = np.asarray(pos_scores, np.float64)[:, None]
    n = np.asarray(neg_scores, np.float64)
    return float(((p > n).mean(axis=1) + 0.5 * (p == n).mean(axis=1)).mean())


def shannon_entropy(items) -> float:
    """Entropy in nats of the empirical distribution of generated items (diversity)."""
    _, counts = np.unique(np.asarray(items).ravel(), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def long_tail_coverage(items, popularity: np.ndarray, head_share: float = 0.2) -> float:
    """Share of generated items outside the ``head_share`` most popular items.

    popularity: (I+1,) interaction counts by dense id.
    """
    n_head = max(1, int(math.ceil(head_share * (popularity[1:] > 0).sum())))
    head = set((np.argsort(-popularity[1:], kind="stable")[:n_head] + 1).tolist())
    flat = np.asarray(items).ravel()
    return float(np.mean([i not in head for i in flat])) if flat.size else 0.0
