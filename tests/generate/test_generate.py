"""KV-cached generation equals full recompute; exclusion; beam width 1 = greedy; bad input."""

from __future__ import annotations

import pytest
import torch

from hstu.config import ModelConfig
from hstu.generate.decode import KVCache, exclusion_mask, generate, generate_recompute
from hstu.model import HSTUModel


def model(seed=0) -> HSTUModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        num_items=60, max_seq_len=12, max_output_len=5, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0
    )
    m = HSTUModel(cfg).eval()
    with torch.no_grad():
        for layer in m.layers:
            layer.rel_bias.ts_w.normal_(0, 0.5)
            layer.rel_bias.pos_w.normal_(0, 0.5)
    return m


def batch():
    ids = torch.tensor([[5, 9, 1, 33, 2, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    lengths = torch.tensor([5, 1, 10])
    t0 = 978_300_000
    ts = torch.tensor([[t0 + 60 * i for i in range(10)], [t0] + [0] * 9, [t0 + 3600 * i for i in range(10)]]) * (
        torch.arange(10) < lengths.view(-1, 1)
    )
    req = torch.tensor([t0 + 86400, t0 + 5, t0 + 10**6])
    return ids, ts, lengths, req


def test_cached_equals_recompute():
    m = model()
    ids, ts, lengths, req = batch()
    a = generate(m, ids, ts, lengths, 5, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths))
    b = generate_recompute(m, ids, ts, lengths, 5, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths))
    assert torch.equal(a.items, b.items)
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-5)


def test_batch_rows_equal_single_rows():
    m = model(1)
    ids, ts, lengths, req = batch()
    full = generate(m, ids, ts, lengths, 4, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths))
    for b in range(3):
        L = int(lengths[b])
        one = generate(
            m,
            ids[b : b + 1, :L],
            ts[b : b + 1, :L],
            lengths[b : b + 1],
            4,
            request_time=req[b : b + 1],
            exclude=exclusion_mask(60, 1, ids[b : b + 1, :L], lengths[b : b + 1]),
        )
        assert torch.equal(one.items[0], full.items[b])
        torch.testing.assert_close(one.scores[0], full.scores[b], rtol=1e-5, atol=1e-5)


def test_exclusion_history_generated_and_block():
    m = model(2)
    ids, ts, lengths, req = batch()
    block = [[11, 12, 13], [], [40]]
    mask = exclusion_mask(60, 3, ids, lengths, block)
    out = generate(m, ids, ts, lengths, 5, request_time=req, exclude=mask)
    for b in range(3):
        gen = out.items[b].tolist()
        assert len(set(gen)) == 5 and 0 not in gen
        assert not set(gen) & set(ids[b, : lengths[b]].tolist())
        assert not set(gen) & set(block[b])
    # without history exclusion, the argmax of the first step is the unrestricted best item
    free = generate(m, ids, ts, lengths, 1, request_time=req, exclude=exclusion_mask(60, 3, None, None))
    with torch.no_grad():
        seq = m.encode(
            torch.nn.functional.pad(ids, (0, 1)), torch.nn.functional.pad(ts, (0, 1)).index_put_((torch.arange(3), lengths), req), lengths
        )
        s = m.last_rows(seq, lengths) @ m.item_vectors()[1:].T
    assert free.items[:, 0].tolist() == (s.argmax(1) + 1).tolist()


def test_beam_width_one_is_greedy_and_beam_is_no_worse():
    m = model(3)
    ids, ts, lengths, req = batch()
    g = generate(m, ids, ts, lengths, 4, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths))
    b1 = generate(m, ids, ts, lengths, 4, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths), strategy="beam", beam_width=1)
    assert torch.equal(g.items, b1.items)
    b4 = generate(m, ids, ts, lengths, 4, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths), strategy="beam", beam_width=4)
    assert (b4.beam_logprob >= b1.beam_logprob - 1e-5).all()


def test_topk_sampling_is_seeded():
    m = model(4)
    ids, ts, lengths, req = batch()

    def run(s):
        mask = exclusion_mask(60, 3, ids, lengths)
        return generate(m, ids, ts, lengths, 5, request_time=req, exclude=mask, strategy="topk", top_k=10, seed=s).items

    assert torch.equal(run(7), run(7))


def test_preallocated_cache_is_written_in_place():
    m = model(5)
    ids, ts, lengths, req = batch()
    cache = KVCache.for_model(m, batch_size=4, capacity=16)
    ptrs = [t.data_ptr() for t in (*cache.k, *cache.v, cache.timestamps)]
    a = generate(m, ids, ts, lengths, 5, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths), cache=cache)
    assert ptrs == [t.data_ptr() for t in (*cache.k, *cache.v, cache.timestamps)]
    assert cache.timestamps[2, 10:14].tolist() == [int(req[2])] * 4  # appended tokens at the request time
    b = generate_recompute(m, ids, ts, lengths, 5, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths))
    assert torch.equal(a.items, b.items)
    assert cache.nbytes == 2 * 2 * 4 * 2 * 16 * 8 * 4 + 4 * 16 * 8


def test_no_cat_in_decode_loop(monkeypatch):
    m = model(6)
    ids, ts, lengths, req = batch()
    calls = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append(1) or real_cat(*a, **k))
    generate(m, ids, ts, lengths, 5, request_time=req, exclude=exclusion_mask(60, 3, ids, lengths))
    # torch.cat is used once per prefill (time buckets); never in the 4 decode steps
    assert len(calls) == 1


@pytest.mark.parametrize(
    "k,lengths,msg",
    [
        (0, [5, 1, 10], "k must be"),
        (6, [5, 1, 10], "max_output_len"),
        (3, [5, 0, 10], "empty history"),
        (3, [5, 1, 13], "exceeds max_seq_len"),
    ],
)
def test_bad_input(k, lengths, msg):
    m = model()
    ids, ts, _, req = batch()
    ids = torch.nn.functional.pad(ids, (0, 3))
    ts = torch.nn.functional.pad(ts, (0, 3))
    with pytest.raises(ValueError, match=msg):
        generate(m, ids, ts, torch.tensor(lengths), k, request_time=req, exclude=exclusion_mask(60, 3, None, None))
