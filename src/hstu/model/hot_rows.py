"""Device-side hot-row cache for host-placed shards of the sharded item table (set-associative, LRU / LFU).

Symbols as in :mod:`hstu.model.embedding`; the cache is built and used by ``ShardedEmbedding``.
"""

from __future__ import annotations

import logging

import torch

from hstu.backend.memory_guard import parse_bytes
from hstu.model.embedding_rows import CACHE_SALT, _hash_mod, dtype_name

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Hot-row cache
# ---------------------------------------------------------------------------------------------

CACHE_POLICIES = ("lru", "lfu")


class HotRowCache:
    """Device-side, set-associative cache of rows of one host-placed table (R, d).

    ``capacity_bytes // (d * itemsize)`` rows in ``num_sets`` sets of ``ways`` slots; row r may only
    live in set ``hash(r) % num_sets``. On a miss the row is read from the host table and admitted,
    evicting the slot with the oldest use (``"lru"``) or the fewest uses (``"lfu"``, counts halved
    after every 4 x ``capacity`` admissions so old favourites age out). This is the layout of
    FBGEMM's TBE LRU/LFU caches (set-associative, 32 ways), re-done here in plain torch ops.

    Coherence: lookups return exactly what the host table holds. The cache remembers the host
    tensor's storage pointer and autograd version counter (``Tensor._version``, bumped by every
    in-place write: ``optimizer.step``, ``copy_``, ``load_state_dict``); on any change it is
    flushed. :meth:`update` writes rows through to both host table and cache without a flush.
    Writes made through ``tensor.data`` bypass the version counter: call :meth:`invalidate` after them.

    Metrics (:meth:`metrics`): ``hits``, ``misses`` (per looked-up id, duplicates counted),
    ``hit_rate``, ``evictions``, ``invalidations``, ``capacity_rows``, ``bytes``.
    """

    def __init__(
        self,
        embedding_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity_bytes: int | str,
        *,
        ways: int = 16,
        policy: str = "lru",
        pin_staging: bool = False,
    ) -> None:
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy {policy!r} unknown; valid: {', '.join(CACHE_POLICIES)}")
        if int(ways) < 1:
            raise ValueError(f"cache ways must be >= 1, got {ways!r}")
        row_bytes = int(embedding_dim) * torch.tensor([], dtype=dtype).element_size()
        cap = parse_bytes(capacity_bytes, field="cache_bytes") // row_bytes
        if cap < 1:
            raise ValueError(f"cache_bytes={capacity_bytes!r} holds no row of {row_bytes} bytes (d={embedding_dim}, {dtype_name(dtype)})")
        W = min(int(ways), cap)
        self.num_sets = cap // W
        self.ways = W
        self.capacity = self.num_sets * W
        self.dim = int(embedding_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.policy = policy
        self.pin_staging = pin_staging
        self.keys = torch.full((self.num_sets, W), -1, dtype=torch.int64, device=self.device)  # (sets, W)
        self.score = torch.full((self.num_sets, W), -1, dtype=torch.int64, device=self.device)  # (sets, W)
        self.data = torch.zeros(self.capacity, self.dim, dtype=dtype, device=self.device)  # (sets * W, d)
        self._tick = 0
        self._admitted_since_aging = 0
        self._seen: tuple[int, int] | None = None
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.invalidations = 0

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size() + 2 * self.keys.numel() * 8

    def to(self, device: torch.device | str) -> HotRowCache:
        """Move the cache to another device (it is emptied)."""
        self.device = torch.device(device)
        self.keys = torch.full_like(self.keys, -1, device=self.device)
        self.score = torch.full_like(self.score, -1, device=self.device)
        self.data = torch.zeros_like(self.data, device=self.device)
        self._seen = None
        return self

    def invalidate(self) -> None:
        """Empty the cache (keeps metrics; counts one invalidation)."""
        self.keys.fill_(-1)
        self.score.fill_(-1)
        self._seen = None
        self.invalidations += 1

    def reset_metrics(self) -> None:
        self.hits = self.misses = self.evictions = self.invalidations = 0

    def metrics(self) -> dict[str, float]:
        total = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / total if total else 0.0,
            "evictions": self.evictions,
            "invalidations": self.invalidations,
            "capacity_rows": self.capacity,
            "bytes": self.bytes,
        }

    def _check_coherent(self, weight: torch.Tensor) -> None:
        state = (weight.data_ptr(), weight._version)
        if self._seen is not None and self._seen != state:
            log.debug("hot-row cache flushed: host table changed (ptr/version %s -> %s)", self._seen, state)
            self.invalidate()
        self._seen = state

    def _sets(self, rows: torch.Tensor) -> torch.Tensor:
        return _hash_mod(rows, CACHE_SALT, self.num_sets)

    def _fetch(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        idx = rows.to(weight.device)
        if self.pin_staging:
            return gather_staged(weight, idx, self.device)
        return weight.detach().index_select(0, idx).to(self.device)

    @torch.no_grad()
    def lookup(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows ``weight[rows]`` through the cache.

        Args:
            rows: (n,) int64 local rows of ``weight``, on the cache device; trusted to be in [0, R).
            weight: (R, d) host table (CPU), dtype = the cache dtype.
        Returns:
            (n, d) tensor on the cache device, dtype of ``weight``, equal to ``weight[rows]``; no autograd.
        """
        self._check_coherent(weight)
        n = rows.numel()
        out = torch.empty(n, self.dim, dtype=self.dtype, device=self.device)  # (n, d)
        if n == 0:
            return out
        self._tick += 1
        sets = self._sets(rows)  # (n,)
        match = self.keys[sets].eq(rows.unsqueeze(1))  # (n, W)
        hit = match.any(1)  # (n,)
        hit_idx = hit.nonzero().squeeze(1)
        miss_idx = (~hit).nonzero().squeeze(1)
        if hit_idx.numel():
            h_sets = sets[hit_idx]
            h_ways = match[hit_idx].to(torch.uint8).argmax(1)
            out[hit_idx] = self.data[h_sets * self.ways + h_ways]
            if self.policy == "lru":
                self.score[h_sets, h_ways] = self._tick
            else:
                self.score.index_put_((h_sets, h_ways), torch.ones_like(h_sets), accumulate=True)
        if miss_idx.numel():
            uniq, inverse, counts = torch.unique(rows[miss_idx], return_inverse=True, return_counts=True)
            fetched = self._fetch(uniq, weight)  # (u, d)
            out[miss_idx] = fetched[inverse]
            self._admit(uniq, fetched, counts)
        self.hits += int(hit_idx.numel())
        self.misses += int(miss_idx.numel())
        return out

    def _admit(self, rows: torch.Tensor, values: torch.Tensor, counts: torch.Tensor) -> None:
        """Insert distinct ``rows`` (u,) with ``values`` (u, d); at most ``ways`` per set per call."""
        sets = self._sets(rows)
        order = torch.argsort(sets, stable=True)
        s_sorted = sets[order]
        m = s_sorted.numel()
        pos = torch.arange(m, device=self.device)
        first = torch.ones(m, dtype=torch.bool, device=self.device)
        first[1:] = s_sorted[1:] != s_sorted[:-1]
        rank = pos - torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), 0).values  # rank within its set
        keep = rank < self.ways
        sel = order[keep]
        k_sets, k_rank = s_sorted[keep], rank[keep]
        # the rank-th least recently / frequently used way of each set (empty ways score -1: first)
        victims = torch.argsort(self.score[k_sets], dim=1, stable=True).gather(1, k_rank.unsqueeze(1)).squeeze(1)
        old = self.keys[k_sets, victims]
        self.evictions += int((old >= 0).sum())
        self.keys[k_sets, victims] = rows[sel]
        self.data[k_sets * self.ways + victims] = values[sel]
        self.score[k_sets, victims] = self._tick if self.policy == "lru" else counts[sel]
        if self.policy == "lfu":
            self._admitted_since_aging += int(sel.numel())
            if self._admitted_since_aging >= 4 * self.capacity:
                live = self.score >= 0
                self.score[live] = torch.bitwise_right_shift(self.score[live], 1)
                self._admitted_since_aging = 0

    @torch.no_grad()
    def update(self, rows: torch.Tensor, values: torch.Tensor, weight: torch.Tensor) -> None:
        """Write ``values`` (n, d) to host rows ``rows`` (n,) and to any cached copies (write-through)."""
        self._check_coherent(weight)
        weight.index_copy_(0, rows.to(weight.device), values.to(weight.device, weight.dtype))
        sets = self._sets(rows.to(self.device))
        match = self.keys[sets].eq(rows.to(self.device).unsqueeze(1))  # (n, W)
        hit = match.any(1)
        if hit.any():
            idx = hit.nonzero().squeeze(1)
            ways = match[idx].to(torch.uint8).argmax(1)
            self.data[sets[idx] * self.ways + ways] = values[idx].to(self.device, self.dtype)
        self._seen = (weight.data_ptr(), weight._version)


def gather_staged(weight: torch.Tensor, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host rows ``weight[idx]`` (n, d) gathered into a pinned staging buffer, then copied to ``device``
    asynchronously (non_blocking); no autograd."""
    staging = torch.empty(idx.numel(), weight.shape[1], dtype=weight.dtype, pin_memory=True)
    torch.index_select(weight.detach(), 0, idx, out=staging)
    return staging.to(device, non_blocking=True)
