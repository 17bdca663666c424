"""The optional approximate item index (hstu.model.ann, faiss) against the exact streamed top-k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("faiss", reason="faiss-cpu is not installed (the optional 'ann' extra: pip install 'hstu[ann]')")

from hstu.model.ann import AnnIndex, recall_at_k  # noqa: E402
from hstu.model.item_index import FloatIndex, stream_topk  # noqa: E402

V, D = 5001, 16


@pytest.fixture(scope="module")
def table():
    g = torch.Generator().manual_seed(0)
    tab = F.normalize(torch.randn(V, D, generator=g), dim=1)
    tab[0] = 0  # padding
    user = F.normalize(torch.randn(40, D, generator=g), dim=1)
    _, exact = stream_topk(FloatIndex(tab), user, 1.0, 10)
    return tab, user, exact


def test_ivf_visiting_every_cell_is_the_exact_top_k(table):
    tab, user, exact = table
    idx = AnnIndex(lambda a, b: tab[a:b], V, D, "IVF32,Flat", nprobe=32, train_rows=2000)
    cos, ids = idx.search(user, 10)
    assert torch.equal(ids, exact)  # all 32 cells: exhaustive, ids shifted past the padding row
    assert torch.allclose(cos, (user @ tab.T).gather(1, exact), atol=1e-5)


def test_fewer_cells_lose_recall_and_hnsw_keeps_it(table):
    tab, user, exact = table
    idx = AnnIndex(lambda a, b: tab[a:b], V, D, "IVF32,Flat", nprobe=1, train_rows=2000)
    low = recall_at_k(idx.search(user, 10)[1], exact)
    idx.set_search(nprobe=8)
    mid = recall_at_k(idx.search(user, 10)[1], exact)
    assert low < mid <= 1.0 and low < 0.9  # one of 32 cells misses most of the top 10
    hnsw = AnnIndex(lambda a, b: tab[a:b], V, D, "HNSW16", ef_search=128)
    ids = hnsw.search(user, 10)[1]
    assert recall_at_k(ids, exact) > 0.95 and (ids > 0).all()  # never the padding row


def test_recall_at_k_by_hand():
    assert recall_at_k(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[3, 2, 9], [7, 8, 9]])) == pytest.approx((2 / 3 + 0) / 2)


def test_a_bad_factory_string_is_named():
    with pytest.raises(ValueError, match="IVFbad"):
        AnnIndex(lambda a, b: torch.zeros(b - a, D), 10, D, "IVFbad")
