"""User-prefix cache: per-layer keys / values of a returning user's history, LRU-bounded in bytes.

Why only rows 0..L-2 are kept. Row i's time bias compares t[i+1] with every earlier event
(Zhai et al. 2024, §3, rab^t); for the last history row L-1, t[L] is the *request* time. A
later request has a different request time, so row L-1 (and every layer's K/V of it, which
depend on the layer input) must be recomputed; rows 0..L-2 used only event times and are
reusable as long as the new history starts with the same L events (same items, times,
actions, categories at the same positions). A returning user with history h' therefore
computes rows L-1 .. len(h')-1 only (the new events plus the old last row).

Invalidation: a history that does not start with the cached events (edited, reordered, or
shifted because it passed the longest bucket and was truncated to its most recent events)
drops the entry and counts as a miss.

Symbols: Ly layers, H heads, P = L - 1 cached rows, d_qk / d_v, F side-feature columns. Tensors live on the engine's
device. Thread-safe (one lock around the table).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass
class PrefixEntry:
    """One user's cached prefix, with room to grow in place.

    events: (N, 3 + F) int64, N >= L: rows 0..L-1 are the L events the K/V rows were computed
        from, one row each: item id, timestamp, action, category column(s) (:func:`history_events`;
        zeros where absent).
    k, v: (Ly, H, N - 1, d_qk) and (Ly, H, N - 1, d_v): rows 0..L-2 of every layer are the cached
        keys / values, one tensor each (one copy in and out per user, whatever the depth); rows past
        L - 2 are room for a returning user's next events (the engine writes them there:
        :meth:`hstu.generate.pool.BucketPool.prefix_entry`; rows 0..L-2 and events 0..L-1 never
        change once stored).
    length: L, the live events (0: all N rows of ``events``).
    nbytes: the tensors' whole size, room included (what the LRU bound counts).
    """

    events: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.length = self.length or int(self.events.shape[0])

    @property
    def rows(self) -> int:
        """Reusable rows P = L - 1."""
        return self.length - 1

    @property
    def room(self) -> int:
        """Most events the entry can hold without a new allocation."""
        return min(int(self.events.shape[0]), int(self.k.shape[2]) + 1)


def entry_bytes(cfg, events: int, itemsize: int = 4) -> int:
    """Bytes of one entry holding ``events`` events of a model of ``cfg`` (a ModelConfig), without
    room: K and V of events - 1 rows in every layer and head (``itemsize`` bytes a value: 4 for
    float32) and the (events, 3 + F) int64 event block; :meth:`PrefixCache.put` counts the same of
    a real entry, whose room adds up to max(4, events // 16) events. For sizing ``prefix_cache_bytes``."""
    columns = 4 + len(cfg.features or {})  # item, time, action, category, the side features
    return cfg.num_blocks * cfg.num_heads * (events - 1) * (cfg.d_qk + cfg.d_v) * itemsize + events * columns * 8


def history_events(ids: torch.Tensor, timestamps: torch.Tensor, actions: torch.Tensor, categories: torch.Tensor) -> torch.Tensor:
    """A batch's events as the prefix cache keys them: (B, W) int64 ids, timestamps and actions and
    (B, W) or (B, W, 1 + F) int64 categories -> (B, W, 3 + F) int64, one op for the batch, so that a
    lookup compares one (L, 3 + F) block per user instead of four vectors."""
    B, W = ids.shape
    return torch.cat([ids.unsqueeze(-1), timestamps[:, :W].unsqueeze(-1), actions.unsqueeze(-1), categories.reshape(B, W, -1)], dim=-1)


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    invalidations: int = 0
    evictions: int = 0
    too_large: int = 0
    rows_reused: int = 0
    extra: dict = field(default_factory=dict)


class PrefixCache:
    """LRU map user id -> :class:`PrefixEntry`, bounded by ``max_bytes`` (tensor bytes).

    Raises ValueError for ``max_bytes`` < 0. An entry larger than the bound is not stored.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.stats = PrefixStats()
        self._table: OrderedDict[Hashable, PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, user: Hashable) -> bool:
        return user in self._table

    def lookup(self, user: Hashable, events: torch.Tensor) -> PrefixEntry | None:
        """The entry whose events are a prefix of this history (L' >= L), else None.

        Args: ``events`` (L', 3 + F) int64, one history's live events (:func:`history_events`).
        A present entry that is not a prefix is dropped (invalidation). A hit moves the entry
        to the most-recent end. Counts hits / misses / invalidations.
        """
        with self._lock:
            e = self._table.get(user)
            if e is None:
                self.stats.misses += 1
                return None
            L = e.length
            if not (events.shape[0] >= L and e.rows >= 1 and torch.equal(events[:L], e.events[:L])):
                self._drop(user)
                self.stats.invalidations += 1
                self.stats.misses += 1
                return None
            self._table.move_to_end(user)
            self.stats.hits += 1
            self.stats.rows_reused += e.rows
            return e

    def unhit(self, rows: int) -> None:
        """A hit of ``rows`` cached rows that the engine did not use (seeded top-k's order): counted a miss."""
        with self._lock:
            self.stats.hits -= 1
            self.stats.misses += 1
            self.stats.rows_reused -= rows

    def put(self, user: Hashable, entry: PrefixEntry) -> bool:
        """Store (replace) a user's entry, evicting least-recently-used ones to fit. False if
        the entry alone exceeds ``max_bytes`` (not stored)."""
        entry.nbytes = sum(t.numel() * t.element_size() for t in (entry.events, entry.k, entry.v))
        with self._lock:
            self._drop(user)
            if entry.nbytes > self.max_bytes:
                self.stats.too_large += 1
                return False
            while self.bytes + entry.nbytes > self.max_bytes and self._table:
                old, _ = next(iter(self._table.items()))
                self._drop(old)
                self.stats.evictions += 1
            self._table[user] = entry
            self.bytes += entry.nbytes
            return True

    def invalidate(self, user: Hashable) -> bool:
        """Drop a user's entry; True if there was one."""
        with self._lock:
            return self._drop(user)

    def clear(self) -> None:
        with self._lock:
            self._table.clear()
            self.bytes = 0

    def _drop(self, user: Hashable) -> bool:
        e = self._table.pop(user, None)
        if e is None:
            return False
        self.bytes -= e.nbytes
        return True
