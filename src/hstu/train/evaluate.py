"""Full-ranking evaluation (HR@K, NDCG@K, MRR) on the valid or test targets."""

from __future__ import annotations

import numpy as np
import torch

from hstu.data.batching import eval_batch
from hstu.data.sequences import EventLog, Split
from hstu.model.hstu import HSTUModel
from hstu.model.item_index import stream_ranks, streams
from hstu.train.metrics import DEFAULT_KS, action_metrics, ranking_metrics, target_ranks


def history_pairs(log_: EventLog, users: np.ndarray, ends: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (n,), items (n,)) int64 on ``device``: item items[j] was seen by batch row rows[j]
    (user ``users[b]``) before ``ends[b]``, each once."""
    rows, cols = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for b, (u, e) in enumerate(zip(users, ends)):
        h = np.unique(log_.items[log_.offsets[u] : e])
        rows.append(np.full(len(h), b))
        cols.append(h)
    return torch.from_numpy(np.concatenate(rows)).to(device), torch.from_numpy(np.concatenate(cols).astype(np.int64)).to(device)


def exclude_history(scores: torch.Tensor, log_: EventLog, users: np.ndarray, ends: np.ndarray, keep: torch.Tensor | None = None) -> None:
    """Set scores of items each user saw before ``ends[b]`` to -inf, in place.

    keep: optional (B,) ids that must stay scorable (never used for the reported protocol).
    """
    r, c = history_pairs(log_, users, ends, scores.device)
    scores[r, c] = float("-inf")


@torch.inference_mode()
def evaluate_ranks(
    model: HSTUModel,
    log_: EventLog,
    split: Split,
    which: str,
    *,
    batch_size: int = 256,
    exclude: bool | None = None,
    device: torch.device | str = "cpu",
    users: np.ndarray | None = None,
    actions_out: list | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rank every evaluated user's target among all items.

    Returns (users (U',) int64 rows of the EventLog, ranks (U',) int64, 1-based).
    exclude: drop history items from the candidates (None: the data set's default).
    actions_out: a list to receive, per batch in the returned users' order, the (B,) int64 next
    actions :func:`predict_actions` gives (for a model with an action head).
    """
    was_training = model.training
    model.eval()
    targets = split.targets(which)
    if users is None:
        users = np.nonzero(targets >= 0)[0]
    exclude = log_.exclude_history_default if exclude is None else exclude
    index = model.item_index()  # the similarity of the table's storage (model/item_index.py)
    order = users[np.argsort(targets[users] - log_.offsets[users], kind="stable")]  # by history length
    all_ranks = []
    for s in range(0, len(order), batch_size):
        ub = order[s : s + batch_size]
        b = eval_batch(log_, targets, ub, model.cfg.max_seq_len).to(device)
        seq = model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories)
        user = model.last_rows(seq, b.lengths)
        if actions_out is not None:
            actions_out.append(predict_actions(model, user))
        if streams(index, len(ub)):  # the (B, I+1) matrix too large: counted block by block (model/item_index.py)
            parts = model.repeat_parts(b.ids, b.actions, b.lengths)
            pairs = history_pairs(log_, ub, targets[ub], user.device) if exclude else None
            rep = None if parts is None else (model.repeat, *parts)
            all_ranks.append(stream_ranks(index, user, model.cfg.temperature, b.targets, exclude_pairs=pairs, repeat=rep).cpu().numpy())
            continue
        scores = model.history_scores(user, b.ids, b.actions, b.lengths, index)  # (B, I+1)
        if exclude:
            exclude_history(scores, log_, ub, targets[ub])
        all_ranks.append(target_ranks(scores, b.targets).cpu().numpy())
    model.train(was_training)
    ranks = np.concatenate(all_ranks) if all_ranks else np.zeros(0, np.int64)
    return order, ranks


def predict_actions(model: HSTUModel, user: torch.Tensor) -> np.ndarray:
    """(B,) int64 next actions 1..A (the argmax of the model's ``action_head`` over the real
    actions, 0 = none never predicted) of (B, d) user vectors; the one next-action prediction of
    evaluation and the slices. The head is trained by :func:`hstu.train.losses.next_action_loss`."""
    return (model.action_head(user)[:, 1:].argmax(dim=1) + 1).cpu().numpy().astype(np.int64)


def evaluate(model: HSTUModel, log_: EventLog, split: Split, which: str, ks=DEFAULT_KS, **kwargs) -> dict[str, float]:
    """Mean HR@K, NDCG@K, MRR over the users evaluated on ``which`` ("valid" | "test"); for a
    model with an action head on a data set with actions, also the next-action accuracy and
    macro-F1 of the target event's action (:func:`hstu.train.metrics.action_metrics`)."""
    acts = [] if getattr(model, "action_head", None) is not None and log_.num_actions else None
    users, ranks = evaluate_ranks(model, log_, split, which, actions_out=acts, **kwargs)
    out = ranking_metrics(ranks, ks)
    if acts:
        out.update(action_metrics(log_.actions[split.targets(which)[users]], np.concatenate(acts)))
    out["users"] = int(len(ranks))
    return out
