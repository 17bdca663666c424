"""HotRowCache: hand-worked LRU/LFU eviction, exact coherence with the host table, metrics."""

from __future__ import annotations

import pytest
import torch

from hstu.model.embedding import HotRowCache, ShardedEmbedding

D = 4


def host_table(rows: int = 50) -> torch.Tensor:
    return torch.arange(rows * D, dtype=torch.float32).reshape(rows, D)  # row r = [4r, 4r+1, ...]


def one_set_cache(policy: str) -> HotRowCache:
    # 2 rows x 4 floats x 4 bytes = 32 bytes: one set of two ways
    c = HotRowCache(D, torch.float32, "cpu", 32, ways=2, policy=policy)
    assert (c.num_sets, c.ways, c.capacity) == (1, 2, 2)
    return c


@pytest.mark.parametrize(
    ("policy", "hits"),
    [
        # [1,2] miss miss | [1] hit | [3] miss, evicts 2 (LRU: 2 is older; LFU: 2 has 1 use, 1 has 2)
        # | [2] miss: LRU evicts 1 (used at t2, 3 at t3); LFU evicts 3 (1 use vs 2) | [1]: LRU miss, LFU hit
        ("lru", 1),
        ("lfu", 2),
    ],
)
def test_hand_worked_eviction(policy: str, hits: int) -> None:
    W = host_table()
    c = one_set_cache(policy)
    for batch in ([1, 2], [1], [3], [2], [1]):
        rows = torch.tensor(batch)
        assert torch.equal(c.lookup(rows, W), W[rows])
    m = c.metrics()
    assert m["hits"] == hits and m["misses"] == 6 - hits
    assert m["hit_rate"] == pytest.approx(hits / 6)
    assert m["evictions"] == 4 - hits  # every miss after the first two evicts one row


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cache_equals_host_table_under_skewed_traffic(policy: str) -> None:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(1000, D, generator=g)
    c = HotRowCache(D, torch.float32, "cpu", 64 * D * 4, ways=8, policy=policy)
    total = 0
    for _ in range(30):
        rows = torch.multinomial(1.0 / torch.arange(1, 1001, dtype=torch.float64) ** 1.2, 256, replacement=True, generator=g)
        assert torch.equal(c.lookup(rows, W), W[rows])
        total += 256
    m = c.metrics()
    assert m["hits"] + m["misses"] == total
    assert m["hit_rate"] > 0.3  # Zipf(1.2) head fits in 64 rows; exact value depends on the policy


def test_coherence_after_updates_through_the_table() -> None:
    e = ShardedEmbedding(300, D, num_shards=3, num_overflow_rows=8, placement="host", cache_bytes=40 * D * 4, seed=5)
    ref = ShardedEmbedding(300, D, num_shards=1, num_overflow_rows=8, seed=5)
    ids = torch.tensor([3, 4, 5, 3, 3, 250, 299, 4])
    with torch.no_grad():
        assert torch.equal(e(ids), ref(ids))
        assert torch.equal(e(ids), ref(ids))  # second time from the cache
    assert e.cache_metrics()["hits"] > 0

    # 1) write-through: no flush needed, the next lookup sees the new values
    new = torch.randn(2, D)
    e.write_rows(torch.tensor([3, 250]), new)
    flushes = e.cache_metrics()["invalidations"]
    with torch.no_grad():
        out = e(torch.tensor([3, 250, 4]))
    assert torch.equal(out[:2], new) and e.cache_metrics()["invalidations"] == flushes

    # 2) an optimizer step writes the host shards in place: the cache notices and flushes
    opt = torch.optim.SGD(e.parameters(), lr=0.5)
    loss = e(ids).pow(2).sum()  # grad enabled: bypasses the cache, gradient reaches the host rows
    loss.backward()
    opt.step()
    with torch.no_grad():
        dense = torch.cat([e.shards[s].detach() for s in range(3)])  # shard contents, for reference
        out = e(ids)
        direct = [e.shards[int(s)][int(e._local_row[g])] for s, g in zip(*_shard_and_rows(e, ids))]
    assert torch.equal(out, torch.stack(direct).masked_fill((ids == 0).unsqueeze(1), 0))
    assert dense.abs().sum() > 0 and e.cache_metrics()["invalidations"] > flushes

    # 3) load_state_dict copies into the shards in place: flushed too
    e.load_state_dict(ShardedEmbedding(300, D, num_shards=3, num_overflow_rows=8, placement="host", seed=9).state_dict())
    with torch.no_grad():
        assert torch.equal(e(ids), ShardedEmbedding(300, D, num_shards=1, num_overflow_rows=8, seed=9)(ids))


def _shard_and_rows(e: ShardedEmbedding, ids: torch.Tensor) -> tuple[list[int], list[int]]:
    from hstu.model.embedding import shard_of, to_global_rows

    g = to_global_rows(ids, e.num_embeddings, e.num_overflow_rows)
    return shard_of(g, e.num_shards).tolist(), g.tolist()


def test_training_bypasses_cache_and_keeps_gradients() -> None:
    e = ShardedEmbedding(100, D, num_shards=2, num_overflow_rows=4, placement="host", cache_bytes=1024)
    ids = torch.tensor([1, 2, 3])
    e(ids).sum().backward()
    assert e.cache_metrics()["hits"] + e.cache_metrics()["misses"] == 0
    assert sum(int(torch.count_nonzero(p.grad)) for p in e.shards) == 3 * D


def test_cache_rejects_too_small_budget() -> None:
    with pytest.raises(ValueError, match="holds no row"):
        HotRowCache(128, torch.float16, "cpu", 100)
    with pytest.raises(ValueError, match="policy"):
        HotRowCache(4, torch.float32, "cpu", 1024, policy="fifo")


def test_a_cache_larger_than_its_shards_holds_at_most_them(caplog) -> None:
    """A trial's finding: item_table_cache_bytes = 1e9 over ~600 KiB of host shards allocated the whole GB (train
    peak RSS +1 GB on a CPU, whose log said the cache "adds only bookkeeping"); the plan printed 953 MiB of cache."""
    from hstu.model.embedding_plan import plan_memory

    with caplog.at_level("INFO", logger="hstu.model.embedding"):
        e = ShardedEmbedding(1000, D, num_shards=2, placement=["device", "host"], cache_bytes=10**9)
    host = e.shards[1].nbytes
    assert list(e.caches) == [1] and e.caches[1].data.nbytes <= host  # its rows (the keys and scores beside them: bookkeeping)
    assert f"copies of up to {host} bytes of rows" in caplog.text
    assert e.plan.cache_bytes == host  # the plan it was checked with counts the same
    plan = plan_memory(1000, D, num_shards=2, placement=["device", "host"], cache_bytes=10**9, num_overflow_rows=1)
    assert plan.cache_bytes == plan.shards[1].bytes < 10**9
    ids = torch.arange(1, 1000)
    with torch.no_grad():
        assert torch.equal(e(ids), e(ids))  # served from the cache the second time, the same rows
