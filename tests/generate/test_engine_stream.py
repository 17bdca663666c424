"""The Engine's streamed scoring (issue 21, item 8): above item_index.STREAM_BYTES for the engine's
max rows, the engine keeps no (R, I+1) score / exclusion buffer and every step's picks come from
stream_topk with sparse (row, id) exclusions (decode_loop.py). Forced here by patching the threshold
to 0 and the block to 64 rows (a 301-row table in 5 blocks, so the running top-k and the exclusion
pairs cross block edges); the expected items / scores are the full-buffer engine's on the same model
(ties are absent: random float tables and a trained one), and the buffers that must not exist are
checked by shape and by recording every tensor the call creates."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hstu.config import ModelConfig
from hstu.generate.decode import exclusion_mask
from hstu.generate.engine import Engine
from hstu.generate.recommend import History
from hstu.generate.sampler import Exclusions, check_candidates, exclusion_pairs
from hstu.model import build_hstu
from hstu.model import item_index as ii

I = 300
V = I + 1
EDGES = (20, 40)
LENS = [1, 5, 19, 20, 33, 40, 7]


def model_with(seed: int, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        num_items=I, max_seq_len=40, max_output_len=6, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0, **kw
    )
    return build_hstu(cfg).eval()


def inputs(seed: int = 1, width: int = 40):
    g = torch.Generator().manual_seed(seed)
    B, L = len(LENS), torch.tensor(LENS)
    ids = torch.randint(1, I + 1, (B, width), generator=g)
    ts = torch.sort(torch.randint(10**8, 10**8 + 10**7, (B, width), generator=g), dim=1).values
    live = torch.arange(width).view(1, -1) < L.view(-1, 1)
    ids, ts = ids * live, ts * live
    acts = torch.randint(1, 4, ids.shape, generator=g) * live
    item_cat = torch.randint(1, 6, (V,), generator=g)
    return ids, ts, L, ts.max(dim=1).values + 7, acts, item_cat[ids] * live, item_cat


def streamed_engine(model, monkeypatch, **kw) -> Engine:
    monkeypatch.setattr(ii, "STREAM_BYTES", 0)  # every batch streams
    monkeypatch.setattr(ii, "HALF_BLOCK_ROWS", 64)  # the streamed block's alignment ...
    monkeypatch.setattr(ii, "STREAM_CHUNK_BYTES", 1)  # ... and size: 64 rows, 5 blocks
    eng = Engine(model, **kw)
    assert eng.streamed
    return eng


CASES = [
    dict(strategy="greedy"),
    dict(strategy="topk", top_k=7, temperature=0.7, seed=3),
    dict(strategy="beam", beam_width=3),
    dict(strategy="greedy", use_cache=False),
    dict(strategy="topk", top_k=5, seed=11, use_cache=False),
]


@pytest.mark.parametrize("heads", [{}, dict(num_actions=3, num_categories=5, repeat_window=6)], ids=["plain", "actions+categories+repeat"])
def test_streamed_engine_equals_full_engine(heads, monkeypatch):
    """Greedy, seeded top-k, beam and the no-cache path, history excluded plus a block list: the
    same items, actions, beam log-probabilities and request mask (generated items added in
    place), scores within float tolerance; no row repeats an item or returns an excluded one."""
    m = model_with(5, **heads)
    full = Engine(m, buckets=EDGES, max_batch=6, k_max=6, batch_sizes=(1, 2, 4, 6))
    assert not full.streamed and full._scores.shape == (6, V)
    stream = streamed_engine(m, monkeypatch, buckets=EDGES, max_batch=6, k_max=6, batch_sizes=(1, 2, 4, 6))
    ids, ts, L, rt, acts, cats, item_cat = inputs()
    feats = dict(actions=acts, categories=cats, item_category=item_cat) if heads else {}
    never = torch.zeros(V, dtype=torch.bool)
    never[[2, 63, 64, 200]] = True
    for case in CASES:
        args = (I, len(LENS), ids, L, [[3, 64, 65, 128], [], [300]])
        ex = exclusion_mask(*args, never=never)
        ex_full, ex_stream = ex.clone(), ex.clone()
        want = full.generate(ids, ts, L, 5, request_time=rt, exclude=ex_full, **feats, **case)
        got = stream.generate(ids, ts, L, 5, request_time=rt, exclude=ex_stream, **feats, **case)
        sparse = stream.generate(ids, ts, L, 5, request_time=rt, exclude=exclusion_pairs(*args, never=never), **feats, **case)
        assert torch.equal(got.items, want.items) and torch.equal(sparse.items, want.items), case
        torch.testing.assert_close(sparse.scores, want.scores, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)
        if heads:
            assert torch.equal(got.actions, want.actions), case
        if case["strategy"] == "beam":
            torch.testing.assert_close(got.beam_logprob, want.beam_logprob, rtol=1e-5, atol=1e-5)
        assert torch.equal(ex_stream, ex_full), case
        for b, row in enumerate(got.items.tolist()):
            assert len(set(row)) == len(row) and not any(ex[b, i] for i in row), (case, b, row)


def test_exclusions_are_the_mask_in_pairs():
    """exclusion_pairs' set, densified, is the mask built by hand; left() counts the mask's free
    items; check_candidates reads both forms alike; a full engine densifies Exclusions itself."""
    ids, _, L, *_ = inputs(seed=4)
    block = [[1, 2, 2, 999], [], [300, 0]]
    never = torch.zeros(V, dtype=torch.bool)
    never[[5, 6, 300]] = True
    want = torch.zeros(len(LENS), V, dtype=torch.bool)
    for b in range(len(LENS)):
        want[b, 0] = True
        want[b, never] = True
        want[b, ids[b, : L[b]]] = True
        want[b, [i for i in (block[b] if b < len(block) else []) if 0 < i <= I]] = True
    ex = exclusion_pairs(I, len(LENS), ids, L, block, never=never)
    assert isinstance(ex, Exclusions) and torch.equal(ex.mask(), want)
    assert torch.equal(exclusion_mask(I, len(LENS), ids, L, block, never=never), want)
    assert ex.left().tolist() == (~want[:, 1:]).sum(dim=1).tolist()
    need = int((~want[:, 1:]).sum(dim=1).min()) + 1
    for form in (ex, want):
        with pytest.raises(ValueError, match=r"fewer than \d+ items left"):
            check_candidates(form, need, "k")
        check_candidates(form, need - 1, "k")


def test_streamed_engine_without_a_mask(monkeypatch):
    """exclude=None: the streamed request forms no (B, I+1) mask; generated items stay excluded."""
    m = model_with(7)
    full = Engine(m, buckets=EDGES, max_batch=4, k_max=6)
    stream = streamed_engine(m, monkeypatch, buckets=EDGES, max_batch=4, k_max=6)
    ids, ts, L, rt, *_ = inputs(seed=2)
    for case in CASES[:3]:
        want, got = (e.generate(ids, ts, L, 6, request_time=rt, **case) for e in (full, stream))
        assert torch.equal(got.items, want.items), case
        torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)
        ex = exclusion_pairs(I, len(LENS), ids, L)  # the full engine densifies the sparse form
        dense = full.generate(ids, ts, L, 6, request_time=rt, exclude=exclusion_mask(I, len(LENS), ids, L), **case)
        assert torch.equal(full.generate(ids, ts, L, 6, request_time=rt, exclude=ex, **case).items, dense.items), case


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_streamed_engine_holds_and_creates_no_rows_by_items_tensor(monkeypatch, caplog):
    """No (R, I+1) buffer on the streamed engine (memory_report: only the index; the saving logged
    at INFO), and no op of a greedy, top-k or beam call returns a tensor with an I+1 axis; the full
    engine's calls do (the check can fail)."""
    m = model_with(9)
    full = Engine(m, buckets=EDGES, max_batch=4, k_max=6)
    with caplog.at_level(logging.INFO, logger="hstu.generate.engine"):
        stream = streamed_engine(m, monkeypatch, buckets=EDGES, max_batch=4, k_max=6)
    saved = f"{4 * V * (2 + 2 + 4) / 2**20:.1f} MiB saved"  # float16 additive exclusion mask and its beam scratch, float32 scores
    assert any("streamed scoring of 4 rows x 301 items" in r.message and saved in r.message for r in caplog.records), caplog.text
    assert stream._scores is None and stream._excl is None and stream._excl_scratch is None
    assert stream.memory_report()["shared_decode_buffers"] == stream._index.nbytes
    assert full.memory_report()["shared_decode_buffers"] == full._index.nbytes + 4 * V * (2 + 2 + 4)
    ids, ts, L, rt, *_ = inputs(seed=3)
    for eng, wide in ((full, True), (stream, False)):
        for case in CASES[:3]:
            with Shapes() as rec:
                eng.generate(ids, ts, L, 4, request_time=rt, **case)
            assert any(V in s for s in rec.shapes) == wide, (wide, case, [s for s in rec.shapes if V in s][:3])


def test_recommender_through_the_streamed_engine(rec, monkeypatch):
    """Recommender.recommend (the product path: history and untrained items excluded, as
    Exclusions for the streamed engine) on the tiny trained ML-1M run: the streamed engine returns
    the full engine's items and scores for greedy, seeded top-k and beam, and no op of its calls
    returns a (rows > 1, I+1) tensor (the full engine's do)."""
    hists = [
        History([1, 2858, 260, 1196], [978300000, 978300100, 978300200, 978300300]),
        History([32, 50], [978300000, 978300100]),
        History([int(r) for r in rec.raw_ids[1:30]], list(range(978300000, 978300029))),
    ]
    preps = [rec.prepare(h) for h in hists]
    full = rec.build_engine(graphs="eager")
    monkeypatch.setattr(ii, "STREAM_BYTES", 0)
    monkeypatch.setattr(ii, "HALF_BLOCK_ROWS", 512)  # several blocks of the run's ~3,700 items
    monkeypatch.setattr(ii, "STREAM_CHUNK_BYTES", 1)
    stream = rec.build_engine(graphs="eager")
    assert stream.streamed and stream._scores is None
    Vr = rec.model.cfg.num_items + 1
    for opts in (dict(strategy="greedy"), dict(strategy="topk", top_k=20, seed=5), dict(strategy="beam", beam_width=3)):
        shapes = []
        for eng in (full, stream):
            with Shapes() as seen:
                out = rec.recommend(preps, 5, engine=eng, **opts)
            shapes.append([s for s in seen.shapes if Vr in s and math.prod(s) > Vr])
        want, got = rec.recommend(preps, 5, engine=full, **opts), out
        assert shapes[0] and not shapes[1], (opts, shapes[1][:3])
        assert [[i["item_id"] for i in r] for r in got] == [[i["item_id"] for i in r] for r in want], opts
        for a, b in zip(got, want):
            assert [i["score"] for i in a] == pytest.approx([i["score"] for i in b], rel=1e-5, abs=1e-5)


def test_never_count_is_counted_once_per_mask_and_again_after_a_write():
    from hstu.generate import sampler

    never = torch.zeros(V, dtype=torch.bool)
    never[[0, 5, 9]] = True  # padding is not an item
    assert sampler.never_count(never) == 2
    assert sampler._NEVER[0] is never and sampler.never_count(never) == 2
    never[10] = True  # in place: the version moves, counted again
    assert sampler.never_count(never) == 3
    other = never.clone()
    other[11] = True
    assert sampler.never_count(other) == 4 and sampler.never_count(never) == 3
