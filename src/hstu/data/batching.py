"""Padded batches from an EventLog: training sequences and evaluation histories.

A batch is right-padded to width W (the longest sequence in the batch, + 1 for evaluation
where position ``length`` holds the query time). Batches are drawn by length bucket so that
padding costs little; the divisor N is fixed, so the width never changes a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hstu.data.sequences import EventLog, Split


@dataclass
class SequenceBatch:
    """Padded batch. Symbols: B sequences, W padded width.

    Worked example (B = 2, lengths [3, 1], an evaluation batch so W = 3 + 1):

        jagged (EventLog):  items [7, 2, 9 | 4], offsets [0, 3, 4]
        padded ids          [[7, 2, 9, 0],
                             [4, 0, 0, 0]]
        padded timestamps   [[t0, t1, t2, tq0],     tq = query time (the target's time),
                             [s0, sq1, 0, 0]]       at position `length`
        lengths             [3, 1]

    ids, timestamps, actions, categories: (B, W) int64, 0 after the live rows (timestamps
    hold the query time at position ``length`` for evaluation batches); categories (B, W, 1+F)
    when the log has side features (:mod:`hstu.data.features`).
    lengths: (B,) int64. users: (B,) int64 EventLog rows. targets: (B,) int64 dense target
    item (evaluation) or None. target_actions: (B,) or None.
    segments: None, or for a packed training batch (:func:`packed_train_batch`) (R, W) int64: row r
    holds several users' sequences one after another, segments[r, j] the index in ``users`` (U,)
    of the user at column j, -1 after ``lengths[r]`` (the row's filled width); each user's
    columns are its training events oldest first.
    """

    ids: torch.Tensor
    timestamps: torch.Tensor
    lengths: torch.Tensor
    actions: torch.Tensor
    categories: torch.Tensor
    users: torch.Tensor
    targets: torch.Tensor | None = None
    target_actions: torch.Tensor | None = None
    segments: torch.Tensor | None = None

    def to(self, device: torch.device) -> "SequenceBatch":
        f = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        keys = ("ids", "timestamps", "lengths", "actions", "categories", "users", "targets", "target_actions", "segments")
        return SequenceBatch(*(f(getattr(self, k)) for k in keys))


def _pad(log_: EventLog, users: np.ndarray, starts: np.ndarray, ends: np.ndarray, extra: int, query_ts: np.ndarray | None) -> dict:
    lengths = ends - starts
    W = int(lengths.max()) + extra
    B = len(users)
    out = {k: np.zeros((B, W), np.int64) for k in ("ids", "timestamps", "actions")}
    tokens = log_.token_categories  # (E,) categories, or (E, 1+F) with side features (hstu.data.features)
    out["categories"] = np.zeros((B, W, *tokens.shape[1:]), np.int64)
    for b in range(B):
        s, e, L = starts[b], ends[b], lengths[b]
        out["ids"][b, :L] = log_.items[s:e]
        out["timestamps"][b, :L] = log_.timestamps[s:e]
        out["actions"][b, :L] = log_.actions[s:e]
        out["categories"][b, :L] = tokens[s:e]
        if query_ts is not None:
            out["timestamps"][b, L] = query_ts[b]
    out = {k: torch.from_numpy(v) for k, v in out.items()}
    out["lengths"] = torch.from_numpy(lengths.astype(np.int64))
    out["users"] = torch.from_numpy(users.astype(np.int64))
    return out


def train_batch(log_: EventLog, split: Split, users: np.ndarray, max_seq_len: int) -> SequenceBatch:
    """Training sequences (the most recent ``max_seq_len`` training events) of ``users``."""
    ends = split.train_end[users]
    starts = np.maximum(log_.offsets[users], ends - max_seq_len)
    return SequenceBatch(**_pad(log_, users, starts, ends, 0, None))


def pack_rows(lengths: np.ndarray, width: int) -> list[list[int]]:
    """First-fit decreasing: the indices of ``lengths`` (U,) (each 1..width) grouped into rows whose
    lengths sum to at most ``width``, longest first; a row's indices in the order they are laid out.
    Raises ValueError for a length outside 1..width."""
    if len(lengths) and (lengths.min() < 1 or lengths.max() > width):
        raise ValueError(f"pack_rows: lengths must be in 1..{width}, got {int(lengths.min())}..{int(lengths.max())}")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        L = int(lengths[i])
        r = next((r for r, f in enumerate(free) if f >= L), None)
        if r is None:
            rows.append([int(i)])
            free.append(width - L)
        else:
            rows[r].append(int(i))
            free[r] -= L
    return rows


def packed_train_batch(log_: EventLog, split: Split, users: np.ndarray, max_seq_len: int) -> SequenceBatch:
    """The training sequences of ``users`` (as :func:`train_batch`) packed into rows of width
    ``max_seq_len`` (:func:`pack_rows`): several short users share a row, told apart by
    ``segments`` (TrainConfig.packing "pack"). ``users`` of the result are reordered as laid
    out (row by row, left to right), so a row-major walk over the supervised positions visits
    the users in that order, as a padded batch of them in that order would."""
    ends = split.train_end[users]
    starts = np.maximum(log_.offsets[users], ends - max_seq_len)
    rows = pack_rows(ends - starts, max_seq_len)
    order = np.array([i for r in rows for i in r], np.int64)
    R, W = len(rows), max_seq_len
    tokens = log_.token_categories
    out = {k: np.zeros((R, W), np.int64) for k in ("ids", "timestamps", "actions")}
    out["categories"] = np.zeros((R, W, *tokens.shape[1:]), np.int64)
    seg = np.full((R, W), -1, np.int64)
    fill = np.zeros(R, np.int64)
    u = 0
    for r, row in enumerate(rows):
        c = 0
        for i in row:
            s, e = starts[i], ends[i]
            L = e - s
            out["ids"][r, c : c + L] = log_.items[s:e]
            out["timestamps"][r, c : c + L] = log_.timestamps[s:e]
            out["actions"][r, c : c + L] = log_.actions[s:e]
            out["categories"][r, c : c + L] = tokens[s:e]
            seg[r, c : c + L] = u
            c, u = c + L, u + 1
        fill[r] = c
    b = {k: torch.from_numpy(v) for k, v in out.items()}
    return SequenceBatch(
        **b, lengths=torch.from_numpy(fill), users=torch.from_numpy(users[order].astype(np.int64)), segments=torch.from_numpy(seg)
    )


def eval_batch(log_: EventLog, targets: np.ndarray, users: np.ndarray, max_seq_len: int) -> SequenceBatch:
    """Histories before each user's target event (most recent ``max_seq_len``), the target's
    time as query time at position ``length``, and the dense target ids."""
    t = targets[users]
    if (t < 0).any():
        raise ValueError("eval_batch: some users have no target in this split")
    starts = np.maximum(log_.offsets[users], t - max_seq_len)
    b = _pad(log_, users, starts, t, 1, log_.timestamps[t])
    return SequenceBatch(**b, targets=torch.from_numpy(log_.items[t]), target_actions=torch.from_numpy(log_.actions[t]))


def length_bucketed_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator, pool: int = 50) -> list[np.ndarray]:
    """Shuffle, then sort by length inside pools of ``pool`` batches, cut into batches, and
    shuffle the batches: similar lengths share a batch, order stays random."""
    idx = rng.permutation(len(lengths))
    batches = []
    step = batch_size * pool
    for s in range(0, len(idx), step):
        chunk = idx[s : s + step]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def history_items(log_: EventLog, users: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """All dense items each user saw before event ``ends[b]`` (for candidate exclusion)."""
    return [log_.items[log_.offsets[u] : e] for u, e in zip(users, ends)]
