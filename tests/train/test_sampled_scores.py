"""The per-position loss's sampled scores (hstu.train.losses.sampled_scores, issue 20 A): by blocks of
rows, with a hand-written backward, they must give the values and the autograd gradients of the whole
(P x K) product picked at cols, and the per-position loss (negatives_chunk 1) must stay the loss of
gathering each position's M rows (the chunk path with c = 1, an independent computation), in float64."""

from __future__ import annotations

import pytest
import torch

from hstu.train import losses as L


def _inputs(P=9, K=7, d=4, M=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(P, d, generator=g, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(K, d, generator=g, dtype=torch.float64, requires_grad=True)
    cols = torch.randint(0, K, (P, M), generator=g)
    cols[0] = 3  # one row of repeats: each copy is scored and gets its share of the gradient
    return q, rows, cols


@pytest.mark.parametrize("gather_ratio", [10**9, 0])  # q·rowsᵀ by blocks; the picked rows gathered (a large catalogue)
@pytest.mark.parametrize("block", [1, 14, 1 << 20])  # one row per block, 2 rows (the last block partial), one block
def test_sampled_scores_equal_the_whole_product_and_its_gradients(monkeypatch, block, gather_ratio) -> None:
    monkeypatch.setattr(L, "SCORE_BLOCK", block)
    monkeypatch.setattr(L, "GATHER_RATIO", gather_ratio)
    q, rows, cols = _inputs()
    w = torch.randn(cols.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = L.sampled_scores(q, rows, cols)
    (out * w).sum().backward()
    got = (out.detach(), q.grad.clone(), rows.grad.clone())
    q.grad = rows.grad = None
    ref = (q @ rows.T).gather(1, cols)
    (ref * w).sum().backward()
    # by hand at one entry: out[p, m] = q[p] . rows[cols[p, m]]
    assert float(got[0][2, 1]) == pytest.approx(float(q[2].detach() @ rows[cols[2, 1]].detach()), rel=1e-12)
    for a, b in zip(got, (ref.detach(), q.grad, rows.grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # row 0's gradient is M times w-weighted copies of rows[3]
    torch.testing.assert_close(got[1][0], w[0].sum() * rows[3].detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gather_ratio", [10**9, 0])
def test_sampled_scores_gradcheck_and_one_input_without_grad(monkeypatch, gather_ratio) -> None:
    monkeypatch.setattr(L, "SCORE_BLOCK", 14)
    monkeypatch.setattr(L, "GATHER_RATIO", gather_ratio)
    q, rows, cols = _inputs(P=5, K=6, d=3, M=4)
    assert torch.autograd.gradcheck(lambda a, b: L.sampled_scores(a, b, cols), (q, rows))
    fixed = rows.detach()
    L.sampled_scores(q, fixed, cols).sum().backward()
    counts = torch.zeros(5, 6, dtype=torch.float64).scatter_add_(1, cols, torch.ones(5, 4, dtype=torch.float64))  # (P, K)
    torch.testing.assert_close(q.grad, counts @ fixed)  # d(sum)/dq[p] = sum over p's columns of their rows


@pytest.mark.parametrize("block", [12, 1 << 20])
def test_per_position_loss_on_packed_rows_equals_gathered_rows(monkeypatch, block) -> None:
    """chunk = 1 on packed rows: the dense path (sampled_scores against the whole table) gives the loss and
    gradients of the gathered-rows path, for the same seed and so the same negatives (float64)."""
    monkeypatch.setattr(L, "SCORE_BLOCK", block)
    g = torch.Generator().manual_seed(3)
    B, W, d, I, M = 2, 8, 5, 11, 6
    emb = torch.nn.Embedding(I + 1, d).double()
    out = torch.nn.functional.normalize(torch.randn(B, W, d, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, -1, -1, -1]])
    lengths = torch.tensor([8, 5])
    ids = torch.randint(1, I + 1, (B, W), generator=g) * (segments >= 0)
    res = {}
    for name, limit in (("dense", 1 << 28), ("gather", 0)):
        monkeypatch.setattr(L, "DENSE_LOGITS_MAX", limit)
        emb.zero_grad()
        out.grad = None
        loss, n = L.sampled_softmax_loss(
            out,
            ids,
            lengths,
            emb,
            num_negatives=M,
            temperature=0.05,
            chunk=1,
            num_items=I,
            generator=torch.Generator().manual_seed(5),
            segments=segments,
        )
        loss.backward()
        res[name] = (loss.detach(), n, out.grad.clone(), emb.weight.grad.clone())
    assert res["dense"][1] == res["gather"][1] == (2 + 4) + 4  # segments of 3 and 5, then 5: L - 1 each
    for a, b in zip(res["dense"][::2] + res["dense"][3:], res["gather"][::2] + res["gather"][3:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
