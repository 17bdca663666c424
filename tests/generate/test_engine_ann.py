"""Approximate candidates in the engine (``Engine(ann=...)``, hstu.model.ann.ann_topk): a flat
inner-product index proposes every item in exact cosine order, so with enough candidates the
engine's picks must be the exact engine's (items equal, scores within float tolerance) under
greedy, seeded top-k and beam, with history and block-list exclusions; a coarse IVF index probing
one cell leaves rows short of candidates, which fall back to the exact streamed top-k (counted);
the index built for a run is stored beside it and reloaded, and rebuilt when its file is corrupt
or the weights change."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("faiss", reason="faiss-cpu is not installed (the optional 'ann' extra: pip install 'hstu[ann]')")

from test_engine_stream import EDGES, LENS, I, V, inputs, model_with  # noqa: E402

from hstu.generate.decode import exclusion_mask  # noqa: E402
from hstu.generate.engine import Engine  # noqa: E402
from hstu.generate.sampler import exclusion_pairs  # noqa: E402
from hstu.model import item_index as ii  # noqa: E402
from hstu.model.ann import AnnIndex, AnnItemIndex, ann_for_run, l2_vectors  # noqa: E402
from hstu.model.checkpoint import save_weights  # noqa: E402


def flat_index(model) -> AnnIndex:
    with torch.inference_mode():
        return AnnIndex(lambda a, b: model.item_vectors(a, b).float(), V, model.cfg.embedding_dim, "Flat")


CASES = [dict(strategy="greedy"), dict(strategy="topk", top_k=7, temperature=0.7, seed=3), dict(strategy="beam", beam_width=3)]


@pytest.mark.parametrize("heads", [{}, dict(num_actions=3, num_categories=5, repeat_window=6)], ids=["plain", "actions+categories+repeat"])
def test_flat_candidates_give_the_exact_engines_picks(heads):
    m = model_with(5, **heads)
    kw = dict(buckets=EDGES, max_batch=6, k_max=6, batch_sizes=(1, 2, 4, 6))
    exact = Engine(m, **kw)
    approx = Engine(m, **kw, ann=flat_index(m), ann_candidates=40)
    assert approx.streamed and isinstance(approx._index, AnnItemIndex)
    ids, ts, L, rt, acts, cats, item_cat = inputs()
    feats = dict(actions=acts, categories=cats, item_category=item_cat) if heads else {}
    never = torch.zeros(V, dtype=torch.bool)
    never[[2, 63, 64, 200]] = True
    for case in CASES:
        ex = exclusion_mask(I, len(LENS), ids, L, [[3, 64, 65, 128], [], [300]], never=never)
        want = exact.generate(ids, ts, L, 5, request_time=rt, exclude=ex.clone(), **feats, **case)
        got = approx.generate(ids, ts, L, 5, request_time=rt, exclude=ex.clone(), **feats, **case)
        assert torch.equal(got.items, want.items), case
        torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)
        for b, row in enumerate(got.items.tolist()):
            assert len(set(row)) == len(row) and not any(ex[b, i] for i in row), (case, b, row)
    assert approx._index.fallbacks == 0


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW8"])
def test_a_shared_exclusion_filters_the_search_and_costs_no_candidates(factory):
    """The run's untrained items (``Exclusions.never``, (1, I+1) on the streamed path) go to faiss
    as an allowed-items selector: with 80 % of the catalogue excluded and 4 candidates per row,
    every pick is still found among allowed items (no fallback) and equals the exact engine's
    (an exhaustive search: IVF probing all 8 cells, HNSW with a candidate list of 400)."""
    m = model_with(11)
    g = torch.Generator().manual_seed(0)
    never = torch.rand(V, generator=g) < 0.8
    with torch.inference_mode():
        ann = AnnIndex(lambda a, b: m.item_vectors(a, b).float(), V, m.cfg.embedding_dim, factory, nprobe=8, ef_search=400, train_rows=300)
    kw = dict(buckets=EDGES, max_batch=6, k_max=6, batch_sizes=(1, 2, 4, 6))
    exact, approx = Engine(m, **kw), Engine(m, **kw, ann=ann, ann_candidates=4)
    ids, ts, L, rt, *_ = inputs(seed=3)
    args = (I, len(LENS), ids, L, [[3, 64], [], [300]])
    want = exact.generate(ids, ts, L, 5, request_time=rt, exclude=exclusion_mask(*args, never=never))
    got = approx.generate(ids, ts, L, 5, request_time=rt, exclude=exclusion_pairs(*args, never=never))
    assert approx._index.fallbacks == 0 and torch.equal(got.items, want.items)
    assert not never[got.items].any()
    packed = approx._index._shared[2]
    approx.generate(ids, ts, L, 5, request_time=rt, exclude=exclusion_pairs(*args, never=never))
    assert approx._index._shared[2] is packed  # the same mask: packed once
    never[1:] = False  # written in place: packed again
    again = approx.generate(ids, ts, L, 5, request_time=rt, exclude=exclusion_pairs(*args, never=never))
    plain = exact.generate(ids, ts, L, 5, request_time=rt, exclude=exclusion_mask(*args))
    assert approx._index._shared[2] is not packed and torch.equal(again.items, plain.items)


def test_rows_short_of_candidates_fall_back_to_the_exact_top_k():
    """IVF100 over 300 items probing one cell: ~3 candidates per row, fewer than k = 12, so the
    call is the exact streamed top-k (equal values and ids) and is counted; with k = 1 the cell
    suffices and the answer is its best candidate."""
    m = model_with(7)
    with torch.inference_mode():
        ivf = AnnIndex(lambda a, b: m.item_vectors(a, b).float(), V, m.cfg.embedding_dim, "IVF100,Flat", nprobe=1, train_rows=300)
        exact = m.item_index()
        index = AnnItemIndex(exact, ivf, l2_vectors(m), candidates=4)
        user = l2_vectors(m)(torch.tensor([3, 50, 77, 120]))
        ex = torch.zeros(4, V, dtype=torch.bool)
        ex[:, [0, 3, 50]] = True
        want = ii.stream_topk(exact, user, 0.05, 12, exclude=ex)
        got = ii.stream_topk(index, user, 0.05, 12, exclude=ex)
        assert index.fallbacks == 1 and torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        v, i = ii.stream_topk(index, user, 0.05, 1, exclude=ex)
        assert index.fallbacks == 1 and not ex.gather(1, i).any()
        cos = (user @ m.item_vectors().float().T).gather(1, i) / 0.05
        torch.testing.assert_close(v, cos, rtol=1e-5, atol=1e-5)  # rescored exactly


def test_int8_tables_are_refused():
    class Int8Like(ii.ItemIndex):  # like Int8Index: one prepacked GEMM, no row-range product
        pass

    with pytest.raises(ValueError, match="float or 16-bit"):
        AnnItemIndex(Int8Like(), None, None)


def test_run_index_is_stored_reloaded_and_rebuilt(tmp_path, caplog):
    m = model_with(3)
    save_weights(tmp_path / "model.safetensors", m)
    first = ann_for_run(tmp_path, m, "Flat")
    files = sorted(p.name for p in (tmp_path / "ann").iterdir())
    assert len(files) == 2 and files[0].endswith(".faiss") and files[1].endswith(".json")
    key = json.loads((tmp_path / "ann" / files[1]).read_text())
    assert key["factory"] == "Flat" and key["rows"] == V
    user = l2_vectors(m)(torch.tensor([5, 9]))
    again = ann_for_run(tmp_path, m, "Flat")  # loaded: the same answers
    assert torch.equal(again.search(user, 10)[1], first.search(user, 10)[1])
    (tmp_path / "ann" / files[0]).write_bytes(b"not faiss")
    with caplog.at_level("WARNING"):
        rebuilt = ann_for_run(tmp_path, m, "Flat")
    assert "rebuilding" in caplog.text and torch.equal(rebuilt.search(user, 10)[1], first.search(user, 10)[1])
    with torch.no_grad():
        m.item_emb.weight.mul_(-1)  # other weights: another key, another file
    save_weights(tmp_path / "model.safetensors", m)
    ann_for_run(tmp_path, m, "Flat")
    assert len(list((tmp_path / "ann").glob("*.faiss"))) == 2


def test_unusable_factories_are_refused_in_one_line_before_any_work(monkeypatch, tmp_path, caplog):
    """A type the item filter cannot search (PQ, a PCA pre-transform) is refused before training;
    an IVF with more cells than items says so; a bad string names --ann; a run directory where
    faiss cannot write keeps the index unsaved with a warning; INT8 item rows are refused."""
    m = model_with(3)
    rows = lambda a, b: m.item_vectors(a, b).detach().float()  # noqa: E731
    for factory, message in (
        ("PQ4", "cannot filter items"),
        ("PCA8,IVF4,Flat", "cannot filter items"),
        ("IVF4096,Flat", "cannot train it on 300 item rows: 4096 IVF cells need at least 4096 rows"),
        ("Bogus", "--ann Bogus: faiss cannot parse it"),
    ):
        with pytest.raises(ValueError, match=message) as info:
            AnnIndex(rows, V, m.cfg.embedding_dim, factory)
        assert "\n" not in str(info.value), factory
    save_weights(tmp_path / "model.safetensors", m)

    def read_only(self, path):
        raise RuntimeError(f"Error in faiss::FileIOWriter: could not open {path}.tmp for writing: Read-only file system")

    monkeypatch.setattr(AnnIndex, "save", read_only)
    with caplog.at_level("WARNING"):
        assert ann_for_run(tmp_path, m, "Flat").index.ntotal == I
    assert "cannot store the index" in caplog.text
    m.item_emb.weight_int8 = torch.zeros(V, m.cfg.embedding_dim, dtype=torch.int8)
    with pytest.raises(ValueError, match="INT8"):
        ann_for_run(tmp_path, m, "Flat")
