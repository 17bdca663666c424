"""User-prefix cache: a hit computes only the new rows (plus the old last row, whose time bias
used the old request time) and equals a full computation; invalidation; LRU bound in bytes."""

from __future__ import annotations

import pytest
import torch

from hstu.config import ModelConfig
from hstu.generate.decode import exclusion_mask, generate
from hstu.generate.engine import Engine
from hstu.generate.prefix_cache import PrefixCache, PrefixEntry, entry_bytes
from hstu.model import build_hstu

I = 300


@pytest.fixture(scope="module", params=[False, True], ids=["hstu", "multi_channel"])
def model(request):
    """The HSTU block, and FuXi-alpha's multi-channel attention ([model] multi_channel), whose position and
    time channels read the cached rows' values as the semantic one does."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=I, max_seq_len=60, max_output_len=6, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0,
        multi_channel=request.param,
    )  # fmt: skip
    return build_hstu(cfg).eval()


def full(model, ids, ts, L, rt, k=4):
    return generate(model, ids, ts, L, k, request_time=rt, exclude=exclusion_mask(I, ids.shape[0], None, None))


def data(B=6, width=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, I + 1, (B, width), generator=g)
    ts = torch.sort(torch.randint(10**8, 10**8 + 10**7, (B, width), generator=g), dim=1).values
    return ids, ts


def check(res, ref):
    assert torch.equal(res.items, ref.items)
    torch.testing.assert_close(res.scores, ref.scores, rtol=1e-5, atol=1e-5 * float(ref.scores.abs().max()))


def test_returning_users_compute_only_new_rows_and_match_full(model):
    eng = Engine(model, buckets=(20, 40, 60), max_batch=4, k_max=6, prefix_cache_bytes=10**7)
    ids, ts = data()
    users = [f"u{i}" for i in range(6)]
    L1 = torch.tensor([2, 5, 19, 20, 33, 50])
    rt1 = ts[torch.arange(6), L1 - 1] + 60
    first = eng.generate(ids, ts, L1, 4, request_time=rt1, user_ids=users)
    assert first.prefix_rows.tolist() == [0] * 6 and len(eng.prefix) == 6
    check(first, full(model, ids, ts, L1, rt1))
    # same history again with a later request time; one new event; several new events;
    # crossing a bucket edge (20 -> 21)
    L2 = L1 + torch.tensor([0, 1, 1, 1, 4, 10])
    rt2 = ts[torch.arange(6), L2 - 1] + 3600
    second = eng.generate(ids, ts, L2, 4, request_time=rt2, user_ids=users)
    assert second.prefix_rows.tolist() == (L1 - 1).tolist()  # rows 0..L-2 reused
    check(second, full(model, ids, ts, L2, rt2))
    assert eng.prefix.stats.hits == 6


@pytest.mark.parametrize("lengths", [[6, 6, 10, 6], [6, 6, 10, 10]])
def test_hits_of_equal_prefix_each_load_their_own_rows(model, lengths):
    """A chunk's hits of equal cached rows P, consecutive or not, beside a P of its own: each user
    gets its own rows (BucketPool.load_prefixes; the result equals the uncached oracle's)."""
    eng = Engine(model, buckets=(20,), max_batch=4, k_max=6, prefix_cache_bytes=10**7)
    ids, ts = data(B=4, width=20, seed=3)
    users = [f"u{i}" for i in range(4)]
    L1 = torch.tensor(lengths)
    eng.generate(ids, ts, L1, 4, request_time=ts[torch.arange(4), L1 - 1] + 60, user_ids=users)
    other, ots = data(B=4, width=20, seed=4)  # other histories through the same pool rows: no stale row can pass
    eng.generate(other, ots, torch.full((4,), 19), 4, request_time=ots[:, -1] + 60)
    L2 = L1 + 1
    rt2 = ts[torch.arange(4), L2 - 1] + 3600
    second = eng.generate(ids, ts, L2, 4, request_time=rt2, user_ids=users)
    assert second.prefix_rows.tolist() == (L1 - 1).tolist()
    check(second, full(model, ids, ts, L2, rt2))


def test_returning_user_grows_its_entry_in_place(model):
    """An entry keeps room for max(4, n // 16) more events (at most the largest edge): a returning
    user's store writes the new rows into it (the same tensors, the same bytes); past its room a new
    entry. Every visit equals the uncached oracle."""
    eng = Engine(model, buckets=(20, 40, 60), max_batch=4, k_max=6, prefix_cache_bytes=10**7)
    ids, ts = data(B=2, seed=5)
    users = ["a", "b"]

    def visit(L):
        L = torch.tensor(L)
        rt = ts[torch.arange(2), L - 1] + 60
        res = eng.generate(ids, ts, L, 4, request_time=rt, user_ids=users)
        check(res, full(model, ids, ts, L, rt))
        return res, [eng.prefix._table[u] for u in users]

    _, first = visit([10, 57])
    assert [e.room for e in first] == [14, 60] and eng.prefix.bytes == sum(e.nbytes for e in first)
    assert [e.nbytes for e in first] == [entry_bytes(model.cfg, 14), entry_bytes(model.cfg, 60)]  # the sizing formula
    keys = [e.k.data_ptr() for e in first]
    res, second = visit([12, 60])  # within the room
    assert res.prefix_rows.tolist() == [9, 56]
    assert [e.k.data_ptr() for e in second] == keys and [e.length for e in second] == [12, 60]
    assert eng.prefix.bytes == sum(e.nbytes for e in first)
    res, third = visit([16, 60])  # a: past its room (14) -> a new entry; b: the same history again
    assert res.prefix_rows.tolist() == [11, 59] and third[0].k.data_ptr() != keys[0] and third[0].room == 20


@pytest.mark.parametrize("max_batch", [1, 4])
def test_one_user_twice_in_a_call_each_row_its_own_prefix(model, max_batch):
    """Two rows of one user id whose histories share the cached prefix and then differ: both hit the
    same entry; the first row's store grows it in place, so the second loads the rows found at its
    lookup (P) only and stores a new entry (in another chunk, max_batch 1, or the same one)."""
    eng = Engine(model, buckets=(20,), max_batch=max_batch, k_max=6, prefix_cache_bytes=10**7)
    ids, ts = data(B=2, width=20, seed=6)
    ts[1] = ts[0]
    ids[1, :10] = ids[0, :10]  # the same first 10 events, then other items
    ids[1, 10:] = ids[0, 10:] % I + 1
    eng.generate(ids[:1], ts[:1], torch.tensor([10]), 4, request_time=ts[:1, 9] + 60, user_ids=["u"])
    L = torch.tensor([12, 13])
    rt = ts[torch.arange(2), L - 1] + 60
    res = eng.generate(ids, ts, L, 4, request_time=rt, user_ids=["u", "u"])
    assert res.prefix_rows.tolist() == [9, 9]
    check(res, full(model, ids, ts, L, rt))
    e = eng.prefix._table["u"]  # what is stored is one history's events and rows: its next visit equals the oracle
    n = e.length
    nid, nts = ids[:1].clone(), ts[:1].clone()
    nid[0, :n], nts[0, :n] = e.events[:n, 0], e.events[:n, 1]
    L3, rt3 = torch.tensor([n + 1]), nts[:, n] + 60
    res = eng.generate(nid, nts, L3, 4, request_time=rt3, user_ids=["u"])
    assert res.prefix_rows.tolist() == [n - 1]
    check(res, full(model, nid, nts, L3, rt3))


@pytest.mark.parametrize("max_batch", [1, 4])
def test_seeded_topk_gives_the_same_items_whatever_the_cache_holds(model, max_batch):
    """Seeded top-k draws one generator chunk by chunk: a bucket's hits and misses in separate chunks
    drew it in another order than without a cache (other items, even for a row that missed, and the
    same call twice differed). Top-k keeps the uncached chunks; a chunk with a miss prefills its hits,
    which count as misses."""
    kw = dict(strategy="topk", top_k=20, seed=7)
    on = Engine(model, buckets=(20,), max_batch=max_batch, k_max=6, prefix_cache_bytes=10**7)
    off = Engine(model, buckets=(20,), max_batch=max_batch, k_max=6)
    ids, ts = data(B=2, width=20, seed=8)
    on.generate(ids[:1], ts[:1], torch.tensor([10]), 5, user_ids=["a"], **kw)
    L = torch.tensor([11, 15])
    first = on.generate(ids, ts, L, 5, user_ids=["a", "b"], **kw)  # a hit and a miss
    again = on.generate(ids, ts, L, 5, user_ids=["a", "b"], **kw)  # two hits
    want = off.generate(ids, ts, L, 5, **kw)
    assert torch.equal(first.items, want.items) and torch.equal(again.items, want.items)
    assert again.prefix_rows.tolist() == [10, 14]
    assert first.prefix_rows.tolist() == ([9, 0] if max_batch == 1 else [0, 0])  # one chunk of a hit and a miss: prefilled
    assert on.prefix.stats.hits == (3 if max_batch == 1 else 2) and on.prefix.stats.rows_reused == sum(again.prefix_rows.tolist()) + (
        9 if max_batch == 1 else 0
    )


def test_tensor_and_numpy_user_ids_are_their_values(model):
    """A tensor hashes by identity: user_ids=torch.tensor([7]) never found a returning user and filled
    the cache with entries no key could reach. Tensors, arrays and their scalars key by value."""
    import numpy as np

    eng = Engine(model, buckets=(20,), max_batch=2, k_max=6, prefix_cache_bytes=10**7)
    ids, ts = data(B=1, width=20, seed=9)
    for n, users in ((10, torch.tensor([7])), (11, np.array([7])), (12, [torch.tensor(7)]), (13, [7])):
        res = eng.generate(ids, ts, torch.tensor([n]), 3, user_ids=users)
        assert res.prefix_rows.tolist() == [0 if n == 10 else n - 2] and len(eng.prefix) == 1
    with pytest.raises(TypeError, match=r"user_ids\[0\] is a list"):
        eng.generate(ids, ts, torch.tensor([10]), 3, user_ids=[[7]])


def test_history_that_does_not_extend_the_prefix_is_invalidated(model):
    eng = Engine(model, buckets=(20, 40, 60), max_batch=4, k_max=6, prefix_cache_bytes=10**7)
    ids, ts = data(B=4, seed=1)
    users = ["a", "b", "c", "d"]
    L = torch.tensor([10, 10, 10, 10])
    rt = ts[:, 9] + 5
    eng.generate(ids, ts, L, 3, request_time=rt, user_ids=users)
    ids2, ts2 = ids.clone(), ts.clone()
    ids2[0, 3] = ids2[0, 3] % I + 1  # an edited item
    ts2[1, 9] += 1  # an edited time of the last cached event
    L2 = torch.tensor([12, 12, 8, 12])  # c: shorter history
    rt2 = ts2[torch.arange(4), L2 - 1] + 5
    res = eng.generate(ids2, ts2, L2, 3, request_time=rt2, user_ids=users)
    assert res.prefix_rows.tolist() == [0, 0, 0, 9]
    assert eng.prefix.stats.invalidations == 3
    check(res, full(model, ids2, ts2, L2, rt2, k=3))


def test_truncated_history_shifts_and_misses(model):
    eng = Engine(model, buckets=(20,), max_batch=4, k_max=6, prefix_cache_bytes=10**7)
    ids, ts = data(B=1, seed=2)
    eng.generate(ids, ts, torch.tensor([20]), 2, user_ids=["u"])
    res = eng.generate(ids, ts, torch.tensor([21]), 2, user_ids=["u"])  # window moved by one event
    assert res.prefix_rows.tolist() == [0] and res.truncated.tolist() == [1]
    assert eng.prefix.stats.invalidations == 1


def test_lru_bound_in_bytes():
    def entry(n):
        return PrefixEntry(events=torch.zeros(n, 4, dtype=torch.int64), k=torch.zeros(2, 1, n - 1, 4), v=torch.zeros(2, 1, n - 1, 4))

    one = 4 * 8 * 10 + 2 * 2 * 4 * 9 * 4  # (10, 4) int64 events + two float32 (2, 1, 9, 4)
    cache = PrefixCache(max_bytes=3 * one)
    for u in "abc":
        assert cache.put(u, entry(10))
    assert cache.bytes == 3 * one and len(cache) == 3
    assert cache.lookup("a", torch.zeros(10, 4, dtype=torch.int64)) is not None  # "a" is now the most recent
    cache.put("d", entry(10))
    assert "b" not in cache and {"a", "c", "d"} <= {u for u in "abcd" if u in cache}
    assert cache.stats.evictions == 1 and cache.bytes <= cache.max_bytes
    assert not cache.put("big", entry(100)) and cache.stats.too_large == 1
    assert cache.invalidate("a") and not cache.invalidate("a")
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


def test_engine_prefix_cache_respects_bound(model):
    eng = Engine(model, buckets=(60,), max_batch=4, k_max=6, prefix_cache_bytes=20_000)
    ids, ts = data(B=6, seed=3)
    eng.generate(ids, ts, torch.full((6,), 50), 2, user_ids=list(range(6)))
    assert 0 < len(eng.prefix) < 6 and eng.prefix.bytes <= 20_000
    held = eng.prefix.bytes
    assert eng.release_caches() == held and len(eng.prefix) == 0 and eng.prefix.bytes == 0
