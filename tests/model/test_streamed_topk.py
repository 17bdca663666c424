"""Streamed exact top-k and ranks over table blocks (hstu.model.item_index.stream_topk / stream_ranks)
against the full (B, V) scores: a stable descending sort (ties by lower id) and metrics.target_ranks.

Tables hold small integers, so every dot product is exact in float32 whatever the GEMM's blocking,
and many scores tie exactly (the tie order is what the streamed merge must get right)."""

from __future__ import annotations

import pytest
import torch

from hstu.config import ModelConfig
from hstu.generate import decode
from hstu.generate.sampler import exclusion_mask, next_scores, pick, pick_streamed
from hstu.model import item_index as ii
from hstu.model.embedding import ShardedEmbedding
from hstu.model.hstu import build_hstu
from hstu.model.item_index import FloatIndex, HalfIndex, RowsIndex, ShardIndex, item_scores, stream_ranks, stream_topk, top_rows
from hstu.train.metrics import UNREACHABLE_RANK, target_ranks

V, D, B = 9000, 6, 5


def _ints(shape, seed, lo=-2, hi=3):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).float()


def _indexes(tab):
    return {
        "float-user-major": FloatIndex(tab),  # 54k elements: (B, d) . (d, V)
        "float-table-major": _table_major(tab),
        "half": HalfIndex(tab.half(), block=1000),
        "rows": RowsIndex(lambda a, b: tab[a:b], V, block=777),
        "shard": ShardIndex(_sharded(tab), block=512),
    }


def _sharded(tab):
    """A 3-shard hashed table (7 overflow rows) holding ``tab``'s rows."""
    emb = ShardedEmbedding(tab.shape[0], tab.shape[1], num_shards=3, num_overflow_rows=7, init_std=0.0)
    emb.write_rows(torch.arange(1, tab.shape[0]), tab[1:])
    return emb


def _table_major(tab):
    idx = FloatIndex(tab)
    idx.table_major, idx.vecs = True, tab.contiguous()  # the (V, d) . (d, B) layout of tables from 4 MB
    return idx


def _full(index, user, exclude):
    s = item_scores(index, user, 0.5)
    s[:, 0] = float("-inf")
    return s.masked_fill_(exclude, float("-inf"))


def test_top_rows_breaks_ties_by_lower_column_like_a_stable_sort():
    x = _ints((7, 400), 3, 0, 3)  # three values: ties everywhere
    x[2, :] = float("-inf")  # a row of -inf ties
    x[3, 10:] = float("-inf")
    for k in (1, 5, 137, 400):
        v, i = top_rows(x, k)
        sv, si = x.sort(dim=1, descending=True, stable=True)
        assert torch.equal(i, si[:, :k]) and torch.equal(v, sv[:, :k])
    y = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))  # distinct values: the fast path
    y[:, [400, 7, 250]] = 10.0  # a tie inside the top k, not at its edge: ordered by column all the same
    v, i = top_rows(y, 5)
    assert i[:, :3].tolist() == [[7, 250, 400]] * 3
    assert torch.equal(i, y.sort(dim=1, descending=True, stable=True).indices[:, :5])


@pytest.mark.parametrize("name", ["float-user-major", "float-table-major", "half", "rows", "shard"])
@pytest.mark.parametrize("sparse", [False, True])
def test_stream_topk_equals_the_full_sort_with_forced_ties(name, sparse):
    tab, user = _ints((V, D), 0), _ints((B, D), 1)
    tab[100:3000] = tab[50]  # 2,900 identical rows: exact ties across several blocks
    index = _indexes(tab)[name]
    exclude = torch.rand(B, V, generator=torch.Generator().manual_seed(2)) < 0.2
    exclude[0, 40:9000] = True  # a row with only 39 candidates: -inf fills the rest of its top-k
    pairs = exclude.nonzero(as_tuple=True)
    sv, si = _full(index, user, exclude).sort(dim=1, descending=True, stable=True)
    for k in (1, 10, 300):
        kw = dict(exclude_pairs=pairs) if sparse else dict(exclude=exclude)
        v, i = stream_topk(index, user, 0.5, k, rows=2048, **kw)  # 5 blocks, the last one short
        assert torch.equal(i, si[:, :k]), (name, k)
        assert torch.equal(v, sv[:, :k]), (name, k)


@pytest.mark.parametrize("name", ["float-user-major", "half", "rows", "shard"])
def test_stream_ranks_equal_target_ranks(name):
    tab, user = _ints((V, D), 4), _ints((B, D), 5)
    index = _indexes(tab)[name]
    exclude = torch.rand(B, V, generator=torch.Generator().manual_seed(6)) < 0.3
    targets = torch.tensor([1, 2047, 2048, 8999, 4000])  # both sides of a block edge, the last row
    exclude[4, 4000] = True  # an excluded target (-inf): never recommended (a miss at every K), as target_ranks says
    want = target_ranks(_full(index, user, exclude), targets)
    got = stream_ranks(index, user, 0.5, targets, exclude_pairs=exclude.nonzero(as_tuple=True), rows=2048)
    assert torch.equal(got, want)
    assert got[4] == UNREACHABLE_RANK


def test_stream_topk_refuses_k_beyond_the_table():
    with pytest.raises(ValueError, match="outside"):
        stream_topk(FloatIndex(_ints((10, D), 0)), _ints((2, D), 1), 1.0, 11)


def test_block_bytes_bound_the_chunk():
    assert ii.chunk_rows(256, 10, chunk_bytes=32 << 20) * 256 * 4 <= 32 << 20
    assert ii.chunk_rows(1 << 20, 10) == ii.HALF_BLOCK_ROWS  # never below one widening block
    assert not ii.streams(FloatIndex(_ints((3707, D), 0)), 256)  # ML-1M's eval batch: the full path, unchanged
    assert ii.streams(RowsIndex(lambda a, b: None, 2_000_001), 256)  # 2M items x 256 users: 2 GB of scores
    int8 = ii.Int8Index.__new__(ii.Int8Index)
    int8.num_rows = 2_000_001
    assert not ii.streams(int8, 256)  # no row-range product: the full path, as before


def _float_model(V=4000):
    cfg = ModelConfig(num_items=V - 1, max_seq_len=8, embedding_dim=8, d_qk=8, d_v=8, num_blocks=1, num_heads=1)
    torch.manual_seed(0)
    return build_hstu(cfg).eval()


@pytest.mark.parametrize("strategy", ["greedy", "topk"])
def test_pick_streamed_equals_pick_on_the_full_scores(strategy):
    model = _float_model()
    index = model.item_index()
    user = torch.nn.functional.normalize(torch.randn(6, 8, generator=torch.Generator().manual_seed(3)), dim=1)
    excl = exclusion_mask(model.cfg.num_items, 6, torch.randint(1, 4000, (6, 5)), torch.full((6,), 5))
    scores = next_scores(index, user, model.cfg.temperature, excl)
    want = pick(scores, strategy, 20, 0.7, torch.Generator().manual_seed(9))
    got, got_score = pick_streamed(index, user, model.cfg.temperature, excl, strategy, 20, 0.7, torch.Generator().manual_seed(9))
    assert torch.equal(got, want)  # random float rows: no ties, so the same candidates in the same order, the same draw
    assert torch.equal(got_score, scores.gather(1, want.view(-1, 1)).view(-1))


def test_greedy_pick_is_the_first_maximal_index_under_ties():
    """pick("greedy") is argmax: the lowest id among exact ties, -inf rows and half / bfloat16 scores
    included; checked against a Python scan of each row (not against argmax itself)."""
    g = torch.Generator().manual_seed(4)
    for I in (7, 3707, 9001):
        s = torch.randint(0, 3, (9, I), generator=g).float()  # many exact ties
        s[0] = float("-inf")
        s[1, :5] = float("-inf")
        for t in (s, s.half(), s.bfloat16(), s[:, 1:]):
            want = [max(range(t.shape[1]), key=lambda j, r=r: (t[r, j].item(), -j)) for r in range(t.shape[0])]
            assert pick(t, "greedy", 1, 1.0, None).tolist() == want


def test_beam_candidates_equal_the_full_log_softmax_top_w():
    model = _float_model()
    index = model.item_index()
    user = torch.nn.functional.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(4)), dim=1)
    excl = exclusion_mask(model.cfg.num_items, 4, None, None)
    logp = torch.log_softmax(next_scores(index, user, model.cfg.temperature, excl), dim=1)
    want = logp.topk(4, dim=1).indices  # a beam step's expansion of one beam (the log-softmax is monotone per row)
    _, got = stream_topk(index, user, model.cfg.temperature, 4, exclude=excl, rows=2048)
    assert torch.equal(got, want)


@pytest.mark.parametrize("strategy", ["greedy", "topk"])
def test_generate_streams_above_the_threshold_with_the_same_items(strategy, monkeypatch):
    model = _float_model()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 4000, (3, 6), generator=g)
    ts = torch.arange(6).repeat(3, 1) * 60
    lengths = torch.tensor([6, 4, 2])
    kw = dict(request_time=torch.full((3,), 1000), strategy=strategy, top_k=15, seed=7)
    want = decode.generate(model, ids, ts, lengths, 5, exclude=exclusion_mask(3999, 3, ids, lengths), **kw)
    calls = []
    real = ii.stream_topk
    monkeypatch.setattr(ii, "STREAM_BYTES", 0)  # every batch streams
    monkeypatch.setattr("hstu.generate.sampler.stream_topk", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = decode.generate(model, ids, ts, lengths, 5, exclude=exclusion_mask(3999, 3, ids, lengths), **kw)
    assert len(calls) == 5  # one streamed top-k per generated position
    assert torch.equal(got.items, want.items) and torch.equal(got.scores, want.scores)


def test_stream_topk_logsumexp_is_the_full_one():
    tab, user = _ints((V, D), 7), _ints((B, D), 8)
    index = FloatIndex(tab)
    exclude = torch.rand(B, V, generator=torch.Generator().manual_seed(9)) < 0.5
    full = _full(index, user, exclude)
    *_, lse = stream_topk(index, user, 0.5, 3, exclude=exclude, rows=2048, lse=True)
    assert torch.allclose(lse.double(), torch.logsumexp(full.double(), dim=1), rtol=0, atol=1e-5)


def test_beam_search_streams_above_the_threshold_with_the_same_beams(monkeypatch):
    model = _float_model()
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 4000, (3, 6), generator=g)
    ts = torch.arange(6).repeat(3, 1) * 60
    lengths = torch.tensor([6, 5, 3])
    kw = dict(request_time=torch.full((3,), 1000), strategy="beam", beam_width=4)
    want = decode.generate(model, ids, ts, lengths, 4, exclude=exclusion_mask(3999, 3, ids, lengths), **kw)
    calls = []
    real = ii.stream_topk
    monkeypatch.setattr(ii, "STREAM_BYTES", 0)
    monkeypatch.setattr("hstu.generate.sampler.stream_topk", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = decode.generate(model, ids, ts, lengths, 4, exclude=exclusion_mask(3999, 3, ids, lengths), **kw)
    assert len(calls) == 4
    assert torch.equal(got.items, want.items)
    assert torch.allclose(got.scores, want.scores, rtol=0, atol=1e-6)
    assert torch.allclose(got.beam_logprob, want.beam_logprob, rtol=0, atol=1e-5)  # logsumexp by blocks vs log_softmax


def test_shard_index_maps_positions_to_ids_and_scores_like_float64():
    """ShardIndex scores the shards in storage order: positions map back to every id once, the full
    scores are in id order (a float64 reference of the cosine), and beam search's logsumexp over
    the streamed blocks equals the full one (the overflow rows are never scored)."""
    g = torch.Generator().manual_seed(8)
    tab, user = torch.randn(V, D, generator=g), torch.nn.functional.normalize(torch.randn(B, D, generator=g), dim=1)
    tab[0] = 0
    index = ShardIndex(_sharded(tab), block=512)
    ids = torch.arange(V)
    pos = index.positions(ids)
    assert torch.equal(index.ids_at(pos), ids) and pos.unique().numel() == V and index.num_rows == V + 7
    assert len(index.dead) == 8 and index.storage_order  # padding + 7 overflow rows
    t64 = tab.double()
    want = (t64 / t64.norm(dim=1, keepdim=True).clamp(min=1e-6)) @ user.double().T  # (V, B)
    torch.testing.assert_close(index.cosine(user).double(), want.T, atol=1e-6, rtol=1e-5)
    full = item_scores(index, user, 0.5)
    full[:, 0] = float("-inf")
    _, _, lse = stream_topk(index, user, 0.5, 5, rows=1024, lse=True)
    torch.testing.assert_close(lse, torch.logsumexp(full, dim=1))


def test_a_large_hashed_table_is_scored_in_storage_order(monkeypatch):
    monkeypatch.setattr(ii, "ROWS_INDEX_BYTES", 1000)  # "large": any float32 copy over 1 kB
    cfg = ModelConfig(num_items=3000, max_seq_len=8, embedding_dim=8, d_qk=8, d_v=8, num_blocks=1, num_heads=1)
    cfg.item_table, cfg.item_table_shards, cfg.item_table_dtype = "hashed", 3, "fp16"
    model = build_hstu(cfg).eval()
    with torch.inference_mode():
        index = model.item_index()
        assert isinstance(index, ShardIndex)
        user = torch.nn.functional.normalize(torch.randn(3, 8), dim=1)
        torch.testing.assert_close(index.cosine(user), FloatIndex(model.item_vectors()).cosine(user), atol=1e-6, rtol=1e-5)
