"""Engine equivalence: every path (bucketed, cached, recompute, beam, features, truncation)
against the model and the lead's decode.py oracle; bad input. Tolerances: float32 rows computed
in a different association order (two key segments, bucket padding) differ by ~1e-7 relative;
1e-5 is the bar (issue 4). The float64 oracle is the same model cast to float64."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hstu.config import ModelConfig
from hstu.generate.decode import exclusion_mask, generate, generate_recompute
from hstu.generate.engine import Engine
from hstu.generate.runners import row_blocks
from hstu.model import build_hstu

I = 300  # items
EDGES = (20, 40, 60)


def small_model(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    kw = {"num_heads": 2, **kw}
    cfg = ModelConfig(num_items=I, max_seq_len=60, max_output_len=6, embedding_dim=16, num_blocks=2, d_qk=8, d_v=8, dropout=0.0, **kw)
    return build_hstu(cfg).eval()


def histories(lengths: list[int], width: int = 60, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    L = torch.tensor(lengths, dtype=torch.int64)
    ids = torch.randint(1, I + 1, (B, width), generator=g)
    ts = torch.sort(torch.randint(10**8, 10**8 + 10**7, (B, width), generator=g), dim=1).values
    live = torch.arange(width).view(1, -1) < L.view(-1, 1)
    ids, ts = ids * live, ts * live
    rt = ts.max(dim=1).values + torch.randint(1, 10**5, (B,), generator=g)
    return ids, ts, L, rt


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.fixture(scope="module")
def engine(model):
    # batch padded to 1, 2 or 4 users (as under graph capture): padding users are exercised too
    return Engine(model, buckets=EDGES, max_batch=4, k_max=6, batch_sizes=(1, 2, 4))


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=rtol * float(b.abs().max()))


LENS = [1, 2, 19, 20, 21, 39, 40, 41, 60, 7]


def test_first_scores_match_float64_encoder(model, engine):
    """Step-0 scores = cosine(user, item) / temperature with the user vector of model.encode,
    run in float64 on the full width N (the oracle)."""
    ids, ts, L, rt = histories(LENS)
    res = engine.generate(ids, ts, L, 1, request_time=rt)
    m64 = copy.deepcopy(model).double()
    B, N = ids.shape[0], model.cfg.width
    ids_n = torch.nn.functional.pad(ids, (0, N - ids.shape[1]))
    ts_n = torch.nn.functional.pad(ts, (0, N - ts.shape[1]))
    ts_n[torch.arange(B), L] = rt  # the query time sits at position `length`
    with torch.no_grad():
        user = m64.last_rows(m64.encode(ids_n, ts_n, L), L)
        want = m64.score_all(user)
    close(res.scores[:, 0], want[torch.arange(B), res.items[:, 0]])
    assert torch.equal(res.items[:, 0], want.argmax(dim=1))


def test_cached_equals_recompute_and_reference(model, engine):
    ids, ts, L, rt = histories(LENS)
    ex = exclusion_mask(I, len(LENS), ids, L)
    got = engine.generate(ids, ts, L, 5, request_time=rt, exclude=ex.clone())
    no_cache = engine.generate(ids, ts, L, 5, request_time=rt, exclude=ex.clone(), use_cache=False)
    oracle = generate_recompute(model, ids, ts, L, 5, request_time=rt, exclude=ex.clone())
    lead = generate(model, ids, ts, L, 5, request_time=rt, exclude=ex.clone())
    for other in (no_cache, oracle, lead):
        assert torch.equal(got.items, other.items)
        close(got.scores, other.scores)


def test_stale_generated_slots_never_change_a_result(model):
    """A one-beam step attends to all K generated slots of its row; slots not yet written for this
    request (left by an earlier, longer or beam request) must contribute exactly nothing: the same
    call on a used engine and on a fresh one gives bitwise equal results."""
    used = Engine(model, buckets=EDGES, max_batch=4, k_max=6)
    ids, ts, L, rt = histories([60, 41, 39, 20], seed=11)
    used.generate(ids, ts, L, 6, request_time=rt)  # every generated slot written, later positions
    used.generate(ids[:1], ts[:1], L[:1], 6, request_time=rt[:1], strategy="beam", beam_width=4)
    short_ids, short_ts, short_L, short_rt = histories([5, 2, 19, 1], seed=12)
    for strategy in ("greedy", "topk"):
        a = used.generate(short_ids, short_ts, short_L, 4, request_time=short_rt, strategy=strategy, seed=3)
        b = Engine(model, buckets=EDGES, max_batch=4, k_max=6).generate(
            short_ids, short_ts, short_L, 4, request_time=short_rt, strategy=strategy, seed=3
        )
        assert torch.equal(a.items, b.items) and torch.equal(a.scores, b.scores)


def test_bucketed_equals_single_padded_bucket(model, engine):
    ids, ts, L, rt = histories(LENS, seed=3)
    flat = Engine(model, buckets=(60,), max_batch=16, k_max=6)  # eager default: batches unpadded
    a = engine.generate(ids, ts, L, 4, request_time=rt)
    b = flat.generate(ids, ts, L, 4, request_time=rt)
    assert torch.equal(a.items, b.items)
    close(a.scores, b.scores)
    assert a.bucket.tolist() == [engine.bucket_for(n) for n in LENS]
    assert set(b.bucket.tolist()) == {60}
    # one forced bucket for every row (a server mixing short histories into a long batch): same results
    c = engine.generate(ids, ts, L, 4, request_time=rt, bucket=60)
    assert torch.equal(c.items, a.items) and set(c.bucket.tolist()) == {60}
    close(c.scores, a.scores)
    with pytest.raises(ValueError, match="row 8 has 60 events"):
        engine.generate(ids, ts, L, 4, request_time=rt, bucket=EDGES[-2])
    with pytest.raises(ValueError, match="not one of the engine's buckets"):
        engine.generate(ids, ts, L, 4, request_time=rt, bucket=61)


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.sampled_from([1, 2, 5, 19, 20, 21, 40, 41, 59, 60]), min_size=1, max_size=6), seed=st.integers(0, 10**6))
def test_bucket_and_batch_order_never_change_a_result(model, engine, lengths, seed):
    ids, ts, L, rt = histories(lengths, seed=seed)
    a = engine.generate(ids, ts, L, 3, request_time=rt)
    ref = generate(model, ids, ts, L, 3, request_time=rt, exclude=exclusion_mask(I, len(lengths), None, None))
    assert torch.equal(a.items, ref.items)
    close(a.scores, ref.scores)
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed))
    p = engine.generate(ids[perm], ts[perm], L[perm], 3, request_time=rt[perm])
    assert torch.equal(p.items, a.items[perm])


def test_beam_matches_reference_beam_and_width_one_is_greedy(model, engine):
    ids, ts, L, rt = histories(LENS[:6], seed=5)
    ex = exclusion_mask(I, 6, ids, L)
    for w in (2, 3):
        got = engine.generate(ids, ts, L, 5, request_time=rt, exclude=ex.clone(), strategy="beam", beam_width=w)
        ref = generate(model, ids, ts, L, 5, request_time=rt, exclude=ex.clone(), strategy="beam", beam_width=w)
        assert torch.equal(got.items, ref.items)
        close(got.beam_logprob, ref.beam_logprob)
        close(got.scores, ref.scores)
    b1 = engine.generate(ids, ts, L, 5, request_time=rt, exclude=ex.clone(), strategy="beam", beam_width=1)
    g = engine.generate(ids, ts, L, 5, request_time=rt, exclude=ex.clone())
    assert torch.equal(b1.items, g.items)


def test_topk_sampling_is_seeded_and_top1_is_greedy(engine):
    ids, ts, L, rt = histories(LENS, seed=7)
    a = engine.generate(ids, ts, L, 5, request_time=rt, strategy="topk", top_k=20, seed=11)
    b = engine.generate(ids, ts, L, 5, request_time=rt, strategy="topk", top_k=20, seed=11)
    c = engine.generate(ids, ts, L, 5, request_time=rt, strategy="topk", top_k=20, seed=12)
    assert torch.equal(a.items, b.items) and not torch.equal(a.items, c.items)
    one = engine.generate(ids, ts, L, 5, request_time=rt, strategy="topk", top_k=1, seed=3)
    g = engine.generate(ids, ts, L, 5, request_time=rt)
    assert torch.equal(one.items, g.items)
    for r in (a, c):  # no repeats within a row, never the padding id
        assert all(len(set(row)) == 5 and 0 not in row for row in r.items.tolist())


def test_exclusion_history_and_block_list(engine):
    ids, ts, L, rt = histories(LENS, seed=9)
    first = engine.generate(ids, ts, L, 3, request_time=rt).items
    block = [row[:2] for row in first.tolist()]  # block the two items it would pick first
    ex = exclusion_mask(I, len(LENS), ids, L, block)
    res = engine.generate(ids, ts, L, 5, request_time=rt, exclude=ex)
    for b, row in enumerate(res.items.tolist()):
        hist = set(ids[b, : L[b]].tolist())
        assert not (set(row) & hist) and not (set(row) & set(block[b]))
        assert all(ex[b, i] for i in row)  # generated items were added to the mask in place


def test_features_match_reference():
    """Actions + categories in the input and a next-action head: same items as decode.generate."""
    m = small_model(seed=4, num_actions=3, num_categories=5)
    eng = Engine(m, buckets=EDGES, max_batch=4, k_max=6)
    ids, ts, L, rt = histories(LENS, seed=11)
    g = torch.Generator().manual_seed(2)
    acts = torch.randint(1, 4, ids.shape, generator=g) * (ids > 0)
    item_cat = torch.randint(1, 6, (I + 1,), generator=g)
    cats = item_cat[ids] * (ids > 0)
    ex = exclusion_mask(I, len(LENS), None, None)
    got = eng.generate(ids, ts, L, 5, request_time=rt, actions=acts, categories=cats, item_category=item_cat, exclude=ex.clone())
    ref = generate(m, ids, ts, L, 5, request_time=rt, actions=acts, categories=cats, item_category=item_cat, exclude=ex.clone())
    assert torch.equal(got.items, ref.items) and torch.equal(got.actions, ref.actions)
    close(got.scores, ref.scores)


@pytest.mark.parametrize("flags", [dict(use_time_bias=False), dict(use_position_bias=False), dict(attention_norm="causal")])
def test_bias_ablations_match_reference(flags):
    m = small_model(seed=6, **flags)
    eng = Engine(m, buckets=EDGES, max_batch=4, k_max=6)
    ids, ts, L, rt = histories(LENS, seed=12)
    ex = exclusion_mask(I, len(LENS), None, None)
    got = eng.generate(ids, ts, L, 4, request_time=rt, exclude=ex.clone())
    ref = generate(m, ids, ts, L, 4, request_time=rt, exclude=ex.clone())
    assert torch.equal(got.items, ref.items)
    close(got.scores, ref.scores)


def test_causal_attention_norm_every_engine_path():
    """ModelConfig.attention_norm="causal" (divisor i + 1 per row; at this init scale A·V is far
    below LN's eps, so the divisor shows through LN(A·V)): prefill + one-beam decode against full recomputation,
    beam decode against the reference beam, a prefix-cache extend against a cold call."""
    m = small_model(seed=8, attention_norm="causal")
    eng = Engine(m, buckets=EDGES, max_batch=4, k_max=6, prefix_cache_bytes=10**7)
    ids, ts, L, rt = histories(LENS[:6], seed=14)
    ex = exclusion_mask(I, 6, None, None)
    got = eng.generate(ids, ts, L, 4, request_time=rt, exclude=ex.clone())
    ref = generate_recompute(m, ids, ts, L, 4, request_time=rt, exclude=ex.clone())
    assert torch.equal(got.items, ref.items)
    close(got.scores, ref.scores)
    beam = eng.generate(ids, ts, L, 4, request_time=rt, exclude=ex.clone(), strategy="beam", beam_width=3)
    rbeam = generate(m, ids, ts, L, 4, request_time=rt, exclude=ex.clone(), strategy="beam", beam_width=3)
    assert torch.equal(beam.items, rbeam.items)
    close(beam.scores, rbeam.scores)
    users = [f"u{i}" for i in range(6)]
    L1 = (L - 1).clamp(min=1)
    eng.generate(ids, ts, L1, 4, request_time=rt, user_ids=users)  # fills the prefix cache
    ext = eng.generate(ids, ts, L, 4, request_time=rt, exclude=ex.clone(), user_ids=users)
    assert int(ext.prefix_rows.sum()) > 0
    assert torch.equal(ext.items, got.items)
    close(ext.scores, got.scores)


@pytest.mark.parametrize("norm,heads", [("fixed", 2), ("causal", 2), ("fixed", 1)])
def test_decode_bias_formed_once_equals_bias_formed_every_step(norm, heads):
    """The reference kernel set forms each decode step's bias once per request group
    (decode_bias / attention_bias, whose one-head case is a 3-D baddbmm); a set without them
    forms it inside every step's attention."""
    from dataclasses import replace

    from hstu.model.kernels import REFERENCE, available_kernels, register_kernels

    if "reference-per-step-bias" not in available_kernels("cpu"):
        register_kernels("cpu", replace(REFERENCE, name="reference-per-step-bias", decode_bias=None, attention_bias=None))
    m = small_model(seed=9, attention_norm=norm, num_heads=heads)
    once = Engine(m, buckets=EDGES, max_batch=4, k_max=6)
    per_step = Engine(m, buckets=EDGES, max_batch=4, k_max=6, kernels="reference-per-step-bias")
    assert once._buckets[EDGES[0]].bias_j is not None and per_step._buckets[EDGES[0]].bias_j is None
    ids, ts, L, rt = histories(LENS, seed=15)
    for kw in (dict(), dict(strategy="topk", top_k=7, seed=3)):
        a = once.generate(ids, ts, L, 6, request_time=rt, **kw)
        b = per_step.generate(ids, ts, L, 6, request_time=rt, **kw)
        assert torch.equal(a.items, b.items)
        close(a.scores, b.scores, rtol=1e-6)


def test_engine_takes_the_models_kernel_set_unless_one_is_named():
    """No ``kernels`` argument: the engine runs the model's own set (``model.kernels``, what training
    and evaluation run), not a device default; a named set comes from the device backend's registry
    ("auto" = that backend's default_kernels)."""
    from dataclasses import replace

    from hstu.backend import for_device
    from hstu.model.kernels import REFERENCE, get_kernels

    m = small_model(seed=4)
    own = replace(REFERENCE, name="model-own-set")  # registered nowhere: only the model holds it
    m.kernels = own
    assert Engine(m, buckets=EDGES, max_batch=2, k_max=2).kernels is own
    named = Engine(m, buckets=EDGES, max_batch=2, k_max=2, kernels="reference").kernels
    assert named is REFERENCE
    auto = Engine(m, buckets=EDGES, max_batch=2, k_max=2, kernels="auto").kernels
    assert auto is get_kernels("cpu", for_device(torch.device("cpu")).default_kernels)


def test_truncation_keeps_most_recent_events(model):
    eng = Engine(model, buckets=(10, 20), max_batch=4, k_max=6)
    ids, ts, L, rt = histories([35, 20, 3], width=40, seed=13)
    res = eng.generate(ids, ts, L, 3, request_time=rt)
    assert res.truncated.tolist() == [15, 0, 0] and res.warnings
    cut = torch.zeros_like(ids)
    cut_ts = torch.zeros_like(ts)
    cut[0, :20], cut_ts[0, :20] = ids[0, 15:35], ts[0, 15:35]
    cut[1:], cut_ts[1:] = ids[1:], ts[1:]
    ref = generate(model, cut, cut_ts, L.clamp(max=20), 3, request_time=rt, exclude=exclusion_mask(I, 3, None, None))
    assert torch.equal(res.items, ref.items)


def test_a_history_wider_than_the_model_window_is_truncated():
    """A padded width past max_seq_len + k_max + 2 (here 30 for a window of 8 + 2): the width check
    indexed a range sized by the window ("shape '[1, 30]' is invalid"); now the most recent events
    are kept as for any over-long history, and equal the same events given at the model's width."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=I, max_seq_len=8, max_output_len=2, embedding_dim=16, num_blocks=1, num_heads=1, d_qk=8, d_v=8, dropout=0.0)
    eng = Engine(build_hstu(cfg).eval(), buckets=(8,), max_batch=2, k_max=2)
    ids, ts, L, rt = histories([20], width=30, seed=3)
    res = eng.generate(ids, ts, L, 2, request_time=rt)
    assert res.truncated.tolist() == [12]
    ref = eng.generate(ids[:, 12:20], ts[:, 12:20], torch.tensor([8]), 2, request_time=rt)
    assert torch.equal(res.items, ref.items) and torch.equal(res.scores, ref.scores)


def test_default_request_time_is_last_event(engine, model):
    ids, ts, L, _ = histories([5, 30], seed=14)
    last = ts[torch.arange(2), L - 1]
    a = engine.generate(ids, ts, L, 2)
    b = engine.generate(ids, ts, L, 2, request_time=last)
    assert torch.equal(a.items, b.items)


def test_bad_input(engine):
    ids, ts, L, rt = histories([5, 8])
    with pytest.raises(ValueError, match="empty history at row"):
        engine.generate(ids, ts, torch.tensor([5, 0]), 3, request_time=rt)
    for k in (0, -1):
        with pytest.raises(ValueError, match="k must be"):
            engine.generate(ids, ts, L, k, request_time=rt)
    with pytest.raises(ValueError, match="k_max"):
        engine.generate(ids, ts, L, 7, request_time=rt)
    bad = ids.clone()
    bad[1, 4] = I + 1
    with pytest.raises(ValueError, match=r"ids\[1, 4\]=301: unknown item id"):
        engine.generate(bad, ts, L, 3, request_time=rt)
    bad[1, 4] = 0
    with pytest.raises(ValueError, match="unknown item id"):
        engine.generate(bad, ts, L, 3, request_time=rt)
    bad = ids.clone()
    bad[1, 20] = 10**6  # after the length: ignored
    engine.generate(bad, ts, L, 3, request_time=rt)
    with pytest.raises(TypeError, match="int64"):
        engine.generate(ids.int(), ts, L, 3, request_time=rt)
    with pytest.raises(ValueError, match="strategy"):
        engine.generate(ids, ts, L, 3, request_time=rt, strategy="nucleus")
    with pytest.raises(ValueError, match="exceeds the padded width"):
        engine.generate(ids[:, :6], ts[:, :6], L, 3, request_time=rt)
    with pytest.raises(ValueError, match="exclude must be"):
        engine.generate(ids, ts, L, 3, request_time=rt, exclude=torch.zeros(2, I, dtype=torch.bool))
    with pytest.raises(ValueError, match="empty history"):
        engine.bucket_for(0)
    nearly_all = torch.ones(2, I + 1, dtype=torch.bool)
    nearly_all[:, 1:4] = False  # three items left
    with pytest.raises(ValueError, match=r"row\(s\) \[0, 1\]: fewer than 4 items left"):
        engine.generate(ids, ts, L, 4, request_time=rt, exclude=nearly_all.clone())
    res = engine.generate(ids, ts, L, 3, request_time=rt, exclude=nearly_all.clone(), strategy="topk")
    assert sorted(res.items[0].tolist()) == [1, 2, 3]


def test_bad_construction(model):
    with pytest.raises(ValueError, match="increasing"):
        Engine(model, buckets=(40, 20))
    with pytest.raises(ValueError, match="max_seq_len"):
        Engine(model, buckets=(20, 100))
    with pytest.raises(ValueError, match="k_max"):
        Engine(model, buckets=(20,), k_max=7)
    with pytest.raises(ValueError, match="graphs"):
        Engine(model, buckets=(20,), k_max=6, graphs="turbo")
    with pytest.raises(ValueError, match="needs a cuda device"):
        Engine(model, buckets=(20,), k_max=6, graphs="cuda_graph")
    with pytest.raises(ValueError, match="flash"):
        Engine(model, buckets=(20,), k_max=6, kernels="flash")


def test_cache_bytes_per_bucket_formula(model, engine):
    c = model.cfg
    R, K, H = 4, 6, c.num_heads
    for E, n in engine.cache_bytes_per_bucket().items():
        per_row = (E + 1) * (c.d_qk + c.d_v) + K * (c.d_qk + c.d_v)  # history + generated slots
        want = 4 * (c.num_blocks * R * H * per_row + R * H * K * (c.d_qk + c.d_v))  # + beam scratch, float32
        assert n == want
    assert engine.bucket_for(1) == 20 and engine.bucket_for(20) == 20 and engine.bucket_for(21) == 40
    assert engine.bucket_for(61) == 60  # longer histories are truncated into the largest bucket


def test_hardening_applied(model, engine):
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_compile_mode_traces_each_bucket_once_and_matches():
    """graphs="compile" with the aot_eager backend (dynamo capture + functionalisation, no C++
    code generation, to keep the test fast): same items, one graph per bucket and kind."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=I, max_seq_len=20, max_output_len=3, embedding_dim=8, num_blocks=1, num_heads=1, d_qk=8, d_v=8, dropout=0.0)
    m = build_hstu(cfg).eval()
    eng = Engine(m, buckets=(20,), max_batch=2, k_max=3, graphs="compile", compile_backend="aot_eager")
    ids, ts, L, rt = histories([3, 17], width=20)
    got = eng.generate(ids, ts, L, 3, request_time=rt)
    ref = generate(m, ids, ts, L, 3, request_time=rt, exclude=exclusion_mask(I, 2, None, None))
    assert torch.equal(got.items, ref.items)
    close(got.scores, ref.scores)
    again = eng.generate(ids, ts, L, 3, request_time=rt)
    assert torch.equal(again.items, got.items)
    assert sorted(k[0] for k in eng._buckets[20].runners) == ["prefill", "setup", "step"]


def test_engine_serves_recommender_batches(model, engine):
    """The server path: Recommender.prepare / .batch feed the engine; same items as .recommend."""
    from hstu.generate.recommend import History, Recommender

    rec = Recommender(model, {"item_raw_ids": [0] + [1000 + i for i in range(1, I + 1)]})
    hists = [
        History(items=[1000 + i for i in (5, 9, 33)], timestamps=[100, 200, 300], request_time=400),
        History(items=[1000 + i for i in range(1, 45)], timestamps=list(range(1000, 1044)), exclude=[1007]),
    ]
    preps = [rec.prepare(h) for h in hists]
    want = rec.recommend(preps, k=4)
    b = rec.batch(preps)
    mask = exclusion_mask(I, 2, b["ids"], b["lengths"], [p.block for p in preps])  # history excluded (MovieLens-style default)
    res = engine.generate(
        b["ids"],
        b["timestamps"],
        b["lengths"],
        4,
        request_time=b["request_time"],
        exclude=mask,
        actions=b["actions"],
        categories=b["categories"],
        item_category=rec.item_category,
    )
    got = [[int(rec.raw_ids[i]) for i in row] for row in res.items.tolist()]
    assert got == [[d["item_id"] for d in row] for row in want]


def test_warmup_runs_every_bucket_and_batch_size(model):
    eng = Engine(model, buckets=(20, 40), max_batch=2, k_max=6, batch_sizes=(1, 2))
    secs = eng.warmup(("greedy", "beam"))
    assert set(secs) == {20, 40} and all(s >= 0 for s in secs.values())
    for E in (20, 40):
        keys = set(eng._buckets[E].runners)
        assert {("prefill", 1), ("prefill", 2), ("step", 1, 1), ("step", 2, 1), ("step", 1, 2)} <= keys


@pytest.mark.parametrize("blocks, chunk", [(2, 0), (3, 0), (None, 0), (4, 100)])
def test_prefill_in_causal_row_blocks_equals_one_square(blocks, chunk):
    """Buckets from 64 rows run the prefill's attention in row blocks (each block against the
    keys up to its last row, with the time buckets of its own pairs; ``chunk``: those buckets
    computed a few batch rows at a time); same items, scores within float reassociation, and
    the same first-step scores as the float64 encoder."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=I, max_seq_len=80, max_output_len=4, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0
    )
    m = build_hstu(cfg).eval()
    lens = [80, 64, 65, 33, 1, 79]
    ids, ts, L, rt = histories(lens, width=80, seed=5)
    one = Engine(m, buckets=(80,), max_batch=8, k_max=4)
    one.prefill_blocks = 1
    split = Engine(m, buckets=(80,), max_batch=8, k_max=4)
    split.prefill_blocks, split.tb_chunk_elements = blocks, chunk
    assert len(row_blocks(split, 80)) == (blocks or 2) and len(row_blocks(split, 200)) == (blocks or 4)
    a, b = one.generate(ids, ts, L, 4, request_time=rt), split.generate(ids, ts, L, 4, request_time=rt)
    assert torch.equal(a.items, b.items)
    close(a.scores, b.scores)
    m64 = copy.deepcopy(m).double()
    N, B = cfg.width, len(lens)
    ids_n, ts_n = torch.nn.functional.pad(ids, (0, N - 80)), torch.nn.functional.pad(ts, (0, N - 80))
    ts_n[torch.arange(B), L] = rt
    with torch.no_grad():
        want = m64.score_all(m64.last_rows(m64.encode(ids_n, ts_n, L), L))
    close(b.scores[:, 0], want[torch.arange(B), b.items[:, 0]])


def test_a_batch_wider_than_the_model_window_generates_as_one_user_at_a_time():
    """max_batch above max_seq_len + k + 2 (here 24 users, window 8 + 3): the prefill indexed a range
    sized by the window (IndexError); each user's items equal its batch-of-one answer."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=I, max_seq_len=8, max_output_len=3, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0)
    m = build_hstu(cfg).eval()
    ids, ts, L, rt = histories([1, 3, 2, 4] * 6, width=8)  # all 24 in bucket 4: one batch
    wide = Engine(m, buckets=(4, 8), max_batch=24, k_max=3).generate(ids, ts, L, 3, request_time=rt)
    one = Engine(m, buckets=(4, 8), max_batch=1, k_max=3)
    for u in range(len(L)):
        r = one.generate(ids[u : u + 1], ts[u : u + 1], L[u : u + 1], 3, request_time=rt[u : u + 1])
        assert torch.equal(wide.items[u], r.items[0])
        close(wide.scores[u], r.scores[0])
