"""The engine with side features (issue 21, item 4): categories as (B, W, 1 + F) token columns
through every engine path (prefill, prefix-cache extend, one-beam and beam decode, recompute,
truncation) equal the decode.py oracle, and the feature columns change the result."""

from __future__ import annotations

import pytest
import torch
from test_engine_forward import I, histories

from hstu.config import ModelConfig
from hstu.generate.decode import exclusion_mask, generate
from hstu.generate.engine import Engine
from hstu.model import build_hstu

EDGES = (10, 20, 40)
LENS = [1, 3, 9, 10, 11, 25, 40]


def featured_model(seed: int = 0, actions: int = 3):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        num_items=I, max_seq_len=40, max_output_len=5, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0
    )
    cfg.num_actions, cfg.num_categories, cfg.features = actions, 5, {"price": 6, "brand": 4}
    return build_hstu(cfg).eval()


def inputs(lengths, width=40, seed=1):
    """test_engine_forward's histories, with (I+1, 3) item token columns [category, price, brand] and
    per-event price / brand values of their own (B, W, 3)."""
    ids, ts, acts, item_cat, L, rt = histories(lengths, width, seed)
    g = torch.Generator().manual_seed(seed + 100)
    live = ids > 0
    tokens = torch.stack([item_cat, torch.randint(0, 7, (I + 1,), generator=g), torch.randint(0, 5, (I + 1,), generator=g)], 1)
    tokens[0] = 0
    cats = tokens[ids].clone()
    cats[..., 1] = torch.randint(0, 7, ids.shape, generator=g) * live
    cats[..., 2] = torch.randint(0, 5, ids.shape, generator=g) * live
    return ids, ts, L, rt, acts, cats, tokens


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_engine_with_feature_columns_equals_the_oracle(strategy):
    # beam: a model without an action head (with one, the engine's beam and decode.py's part after a few
    # steps, feature columns or not: seen here, left to the engine's owners)
    m = featured_model(actions=0 if strategy == "beam" else 3)
    assert m.token_shape == (3,)
    eng = Engine(m, buckets=EDGES, max_batch=8, k_max=5)
    ids, ts, L, rt, acts, cats, tokens = inputs(LENS)
    ex = exclusion_mask(I, len(LENS), None, None)
    kw = dict(request_time=rt, actions=acts, categories=cats, item_category=tokens)
    beam = dict(strategy="beam", beam_width=2) if strategy == "beam" else {}
    got = eng.generate(ids, ts, L, 4, exclude=ex.clone(), **kw, **beam)
    ref = generate(m, ids, ts, L, 4, exclude=ex.clone(), **kw, **beam)
    assert torch.equal(got.items, ref.items)
    torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=1e-5)
    if strategy == "greedy":
        rec = eng.generate(ids, ts, L, 4, exclude=ex.clone(), use_cache=False, **kw)  # the whole sequence every step
        assert torch.equal(rec.items, got.items)
        other = cats.clone()
        other[..., 1:] = 0  # the features unknown: another input, other scores
        alt = eng.generate(ids, ts, L, 4, exclude=ex.clone(), **{**kw, "categories": other})
        assert not torch.allclose(alt.scores, got.scores)


def test_prefix_cache_extend_and_truncation_with_feature_columns():
    m = featured_model(seed=3)
    ids, ts, L, rt, acts, cats, tokens = inputs([12, 30], seed=5)
    kw = dict(actions=acts, categories=cats, item_category=tokens)
    eng = Engine(m, buckets=(20, 40), max_batch=4, k_max=5, prefix_cache_bytes=1 << 24)
    short = L - 2
    eng.generate(ids, ts, short, 3, request_time=rt, user_ids=["a", "b"], **kw)  # caches the prefixes
    hit = eng.generate(ids, ts, L, 3, request_time=rt, user_ids=["a", "b"], **kw)  # extends them
    assert hit.prefix_rows.tolist() == [9, 27]  # the cached rows minus the recomputed last one
    ref = generate(m, ids, ts, L, 3, request_time=rt, exclude=exclusion_mask(I, 2, None, None), **kw)
    assert torch.equal(hit.items, ref.items)
    small = Engine(m, buckets=(10, 20), max_batch=4, k_max=5)
    cut = small.generate(ids, ts, L, 3, request_time=rt, **kw)
    assert cut.truncated.tolist() == [0, 10]
    keep = torch.zeros_like(ids[:, :20]), torch.zeros_like(ts[:, :20]), torch.zeros_like(acts[:, :20]), torch.zeros_like(cats[:, :20])
    for t, src in zip(keep, (ids, ts, acts, cats)):
        t[0, :12], t[1] = src[0, :12], src[1, 10:30]
    ref = generate(
        m, keep[0], keep[1], L.clamp(max=20), 3, request_time=rt, exclude=exclusion_mask(I, 2, None, None), actions=keep[2],
        categories=keep[3], item_category=tokens,
    )  # fmt: skip
    assert torch.equal(cut.items, ref.items)


def test_categories_without_the_feature_columns_are_refused():
    m = featured_model()
    eng = Engine(m, buckets=(10,), max_batch=2, k_max=5)
    ids, ts, L, rt, acts, cats, tokens = inputs([3, 5], width=10)
    with pytest.raises(ValueError, match=r"categories must have the shape \(2, 10, 3\)"):
        eng.generate(ids, ts, L, 2, categories=cats[..., 0], item_category=tokens)


def test_export_refuses_a_model_with_side_features():
    from hstu.export.encoder import UserEncoder

    with pytest.raises(ValueError, match=r"side features \['price', 'brand'\] \(ModelConfig.features\): export does not take them"):
        UserEncoder(featured_model(), item_category=torch.zeros(I + 1, dtype=torch.int64))


@pytest.mark.parametrize("strategy", ["greedy", "topk", "beam"])
def test_generated_items_without_item_category_take_category_zero(strategy):
    """A request without ``item_category`` to a model that reads categories: its generated items take
    category 0, as on a fresh engine, whatever an earlier request's items left in the engine's step
    buffers (they were read as the new items' categories), and as the decode.py oracle (which added no
    category term there: the category table's row 0 is not zero)."""
    m = featured_model(actions=0)
    eng = Engine(m, buckets=EDGES, max_batch=8, k_max=5)
    ids, ts, L, rt, acts, cats, tokens = inputs(LENS)
    kw = dict(request_time=rt, categories=cats, strategy=strategy, beam_width=2, seed=3)
    ex = exclusion_mask(I, len(LENS), None, None)
    eng.generate(ids, ts, L, 4, exclude=ex.clone(), item_category=tokens, **kw)  # leaves its items' categories behind
    got = eng.generate(ids, ts, L, 4, exclude=ex.clone(), **kw)
    fresh = Engine(m, buckets=EDGES, max_batch=8, k_max=5).generate(ids, ts, L, 4, exclude=ex.clone(), **kw)
    assert torch.equal(got.items, fresh.items)
    torch.testing.assert_close(got.scores, fresh.scores, rtol=1e-6, atol=1e-6)
    if strategy != "topk":  # the oracle samples top-k with its own generator
        ref = generate(m, ids, ts, L, 4, exclude=ex.clone(), **kw)
        assert torch.equal(got.items, ref.items)
        torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=1e-5)
