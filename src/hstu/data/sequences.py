"""Per-user chronological event sequences in a jagged layout, and leave-one-out splits.

Layout (TorchRec-style values + offsets), for U users and E events in total:

    user u's events are rows offsets[u] : offsets[u+1] of every per-event array
    users        (U,)   int64  original user ids, ascending
    offsets      (U+1,) int64
    items        (E,)   int64  dense item ids 1..I (0 is padding, never stored)
    timestamps   (E,)   int64  Unix seconds, non-decreasing within a user
    actions      (E,)   int64  action ids 1..A (0 = none)
    categories   (E,)   int64  dense category ids 1..C (0 = none)

Example: users [7, 9], offsets [0, 2, 5] → user 7 has events 0-1, user 9 has events 2-4.
Events are stably sorted by their exact time (before flooring to s), so equal times keep file order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)


@dataclass
class EventLog:
    name: str
    users: np.ndarray
    offsets: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    actions: np.ndarray
    categories: np.ndarray
    values: np.ndarray
    item_raw_ids: np.ndarray  # (I+1,) original id of each dense id; [0] = 0 (padding)
    item_category: np.ndarray  # (I+1,) dense category of each item (0 = none)
    action_names: list[str] = field(default_factory=list)  # action id a -> action_names[a - 1]
    category_raw_ids: np.ndarray | None = None  # (C+1,) original category ids
    titles: dict[int, str] = field(default_factory=dict)  # original item id -> title
    item_genres: dict[int, list[str]] = field(default_factory=dict)
    exclude_history_default: bool = True
    skipped_rows: int = 0
    facts: dict = field(default_factory=dict)  # how the files were read, e.g. {"encodings": {"movies.dat": "utf-8"}}

    @property
    def num_users(self) -> int:
        return len(self.users)

    @property
    def num_items(self) -> int:
        return len(self.item_raw_ids) - 1

    @property
    def num_events(self) -> int:
        return len(self.items)

    @property
    def num_actions(self) -> int:
        return len(self.action_names)

    @property
    def num_categories(self) -> int:
        return 0 if self.category_raw_ids is None else len(self.category_raw_ids) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def user_index(self, raw_user_id: int) -> int:
        """Row of an original user id; KeyError names the id."""
        i = int(np.searchsorted(self.users, raw_user_id))
        if i >= len(self.users) or self.users[i] != raw_user_id:
            raise KeyError(f"unknown user id {raw_user_id}: not among the {len(self.users)} users of {self.name} in this run")
        return i

    def item_dense(self, raw_ids) -> np.ndarray:
        """Original item ids -> dense ids; unknown ids map to 0 (callers decide the policy)."""
        raw = np.asarray(raw_ids, dtype=np.int64)
        order = np.argsort(self.item_raw_ids[1:])
        sorted_raw = self.item_raw_ids[1:][order]
        pos = np.searchsorted(sorted_raw, raw).clip(0, max(len(sorted_raw) - 1, 0))
        found = (len(sorted_raw) > 0) & (sorted_raw[pos] == raw) if len(sorted_raw) else np.zeros(raw.shape, bool)
        return np.where(found, order[pos] + 1, 0).astype(np.int64)

    @classmethod
    def from_frame(
        cls,
        df: pd.DataFrame,
        *,
        name: str,
        titles: dict | None = None,
        item_genres: dict | None = None,
        action_names: list[str] | None = None,
        exclude_history_default: bool = True,
        skipped_rows: int = 0,
    ) -> "EventLog":
        """Build from a frame with columns user_id, item_id, timestamp (int64 Unix s) and optional
        action (str or int), category (int), value, subsecond_ns (int64, the part of the source's
        exact time below the second, 0..1e9-1: events are sorted on timestamp then it, so ms / ns
        times keep their order after flooring to s). Dense ids follow ascending original ids."""
        if df.empty:
            raise ValueError(f"{name}: no events")
        df = df.reset_index(drop=True)
        sub = df["subsecond_ns"].to_numpy() if "subsecond_ns" in df else np.zeros(len(df), np.int64)
        order = np.lexsort((np.arange(len(df)), sub, df["timestamp"].to_numpy(), df["user_id"].to_numpy()))
        df = df.iloc[order].reset_index(drop=True)  # by user, then exact time, ties in file order
        users, counts = np.unique(df["user_id"].to_numpy(), return_counts=True)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        item_raw, items = np.unique(df["item_id"].to_numpy(), return_inverse=True)
        item_raw_ids = np.concatenate([[0], item_raw]).astype(np.int64)
        items = (items + 1).astype(np.int64)
        n = len(df)
        actions = np.zeros(n, np.int64)
        names: list[str] = list(action_names or [])
        if "action" in df:
            col = df["action"].astype(str).to_numpy()
            for a in pd.unique(col):
                if a not in names:
                    names.append(a)
            lut = {a: i + 1 for i, a in enumerate(names)}
            actions = np.array([lut[a] for a in col], dtype=np.int64) if n < 10_000 else pd.Series(col).map(lut).to_numpy(np.int64)
        categories = np.zeros(n, np.int64)
        cat_raw = None
        item_category = np.zeros(len(item_raw_ids), np.int64)
        if "category" in df:
            cat_raw_vals, cat_inv = np.unique(df["category"].to_numpy(), return_inverse=True)
            categories = (cat_inv + 1).astype(np.int64)
            cat_raw = np.concatenate([[0], cat_raw_vals]).astype(np.int64)
            item_category[items] = categories  # last seen category per item
        elif item_genres:
            genre_names = sorted({g for gs in item_genres.values() for g in gs})
            glut = {g: i + 1 for i, g in enumerate(genre_names)}
            first = np.array([glut[item_genres[r][0]] if item_genres.get(r) else 0 for r in item_raw_ids[1:]], np.int64)
            item_category[1:] = first
        values = df["value"].to_numpy(np.int64) if "value" in df else np.zeros(n, np.int64)
        log.info("%s: %d events, %d users, %d items", name, n, len(users), len(item_raw))
        return cls(
            name=name,
            users=users.astype(np.int64),
            offsets=offsets,
            items=items,
            timestamps=df["timestamp"].to_numpy(np.int64),
            actions=actions,
            categories=categories,
            values=values,
            item_raw_ids=item_raw_ids,
            item_category=item_category,
            action_names=names,
            category_raw_ids=cat_raw,
            titles=dict(titles or {}),
            item_genres=dict(item_genres or {}),
            exclude_history_default=exclude_history_default,
            skipped_rows=skipped_rows,
        )


@dataclass
class Split:
    """Leave-one-out split, as event ranges into an EventLog (all arrays (U,) int64).

    Training sequence of user u: events [offsets[u], train_end[u]).
    Evaluation on split s: target event index s_target[u] (-1: user not evaluated), history =
    the events before it.
    protocol "clean": train on all but the last two, valid = second-to-last, test = last.
    protocol "paper": train on all but the last, valid = test = last (Zhai et al. 2024 setup).
    """

    protocol: str
    train_end: np.ndarray
    valid_target: np.ndarray
    test_target: np.ndarray

    def targets(self, split: str) -> np.ndarray:
        if split not in ("valid", "test"):
            raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
        return self.valid_target if split == "valid" else self.test_target


def make_split(log_: EventLog, protocol: str = "clean") -> Split:
    """Leave-one-out split. Users too short to hold out (< 3 events clean, < 2 paper) train on
    all their events and are not evaluated (count logged)."""
    if protocol not in ("clean", "paper"):
        raise ValueError(f"protocol must be 'clean' or 'paper', got {protocol!r}")
    start, end = log_.offsets[:-1], log_.offsets[1:]
    n = end - start
    hold = 2 if protocol == "clean" else 1
    ok = n >= hold + 1
    train_end = np.where(ok, end - hold, end)
    test_t = np.where(ok, end - 1, -1)
    valid_t = np.where(ok, end - 2, -1) if protocol == "clean" else test_t.copy()
    if (~ok).any():
        log.info("%s: %d users with <= %d events are trained on but not evaluated", log_.name, int((~ok).sum()), hold)
    return Split(protocol, train_end.astype(np.int64), valid_t.astype(np.int64), test_t.astype(np.int64))
