"""Full softmax: next-item cross-entropy over the whole catalogue instead of sampled negatives.

At every supervised position p the logits are the cosine similarities of the L2-normalised output
row q_p with every item's L2-normalised embedding, divided by the temperature; the loss is
-log softmax(logits)[target] over items 1..I (row 0, padding, takes no part). This is the
cross-entropy over the full item set that Klenitskiy & Vasilev (RecSys 2023, "Turning Dross Into
Gold Loss: is BERT4Rec really better than SASRec?") found to beat sampled losses in sequential
recommenders; it is the limit of the sampled softmax of Zhai et al. 2024 §4.1.1
(:func:`hstu.train.losses.sampled_softmax_loss`) as the negatives cover the catalogue.

Work: the per-position sampled scheme on a small catalogue already scores every position against the
whole table (:func:`hstu.train.losses.sampled_scores`) and keeps M columns; here all I columns enter a
log-sum-exp. Memory: the (P x (I + 1)) logits are never held: the forward takes them by blocks of ~SCORE_BLOCK
elements and forms the gradients there, G = softmax - onehot(target) block by block
(dL/dq = G · Ê / τ, dL/dÊ = Gᵀ · q / τ), so only (P x d) and ((I + 1) x d) are kept for the backward.
Symbols: P supervised positions, I items, K = I + 1 table rows, d width, τ temperature.
"""

from __future__ import annotations

import torch

from hstu.model.base import l2_normalize
from hstu.train.losses import SCORE_BLOCK, supervised_mask


def _block_logits(q: torch.Tensor, rows: torch.Tensor, inv_t: float) -> torch.Tensor:
    """(c, d) x (K, d) -> (c, K) logits q · rowsᵀ / τ, column 0 (padding) at -inf."""
    s = (q @ rows.T).mul_(inv_t)
    s[:, 0] = float("-inf")
    return s


class _FullSoftmaxCE(torch.autograd.Function):
    """sum_p [logsumexp_j>=1 (q_p · r_j / τ) - q_p · r_tgt[p] / τ]; see :func:`full_softmax_loss`.

    The gradients are formed in the forward, block by block, while each block of logits is at hand
    (the loss is only used to train, so they are always needed): one pass over the (P x K) logits
    instead of a second one in the backward, which only scales them by dL/dloss."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, rows: torch.Tensor, tgt: torch.Tensor, inv_t: float) -> torch.Tensor:
        P, K = q.shape[0], rows.shape[0]
        c = max(1, SCORE_BLOCK // max(K, 1))
        total = q.new_zeros(())
        gq, grows = torch.empty_like(q), torch.zeros_like(rows)
        for a in range(0, P, c):
            qb, tb = q[a : a + c], tgt[a : a + c]
            G = torch.log_softmax(_block_logits(qb, rows, inv_t), dim=1)  # (c, K)
            total -= G.gather(1, tb[:, None]).sum()
            G.exp_()  # softmax; column 0 is 0
            G.scatter_add_(1, tb[:, None], G.new_full((len(tb), 1), -1.0)).mul_(inv_t)  # d(loss)/d(q · r) = (softmax - onehot) / τ
            gq[a : a + c] = G @ rows
            grows.addmm_(G.T, qb)
        ctx.save_for_backward(gq, grows)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        gq, grows = ctx.saved_tensors
        return gq * g, grows * g, None, None


def full_softmax_loss(
    out: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    item_emb,
    *,
    temperature: float,
    num_items: int,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Mean full-softmax cross-entropy over positions 0..L-2 of each sequence (row i predicts ids[i+1]).

    Args:
        out: (B, W, d) L2-normalised encoder rows.
        ids: (B, W) int64 item ids in 0..I (0 padding); lengths (B,) int64.
        item_emb: callable (…) int64 -> (…, d) rows; called once on all ids 0..I per batch.
        temperature: τ > 0 (ModelConfig.temperature).
        num_items: I.
        segments: (B, W) int64 packed rows (:func:`hstu.train.losses.supervised_mask`).
    Returns:
        (loss scalar, number of supervised positions P); the loss is 0 (with its graph) when P = 0.
    """
    mask = supervised_mask(lengths, out.shape[1] - 1, segments)  # (B, W-1)
    q, tgt = out[:, :-1][mask], ids[:, 1:][mask]  # (P, d), (P,)
    P = q.shape[0]
    if P == 0:
        return out.sum() * 0.0, 0
    rows = l2_normalize(item_emb(torch.arange(num_items + 1, device=ids.device)))  # (I+1, d)
    return _FullSoftmaxCE.apply(q, rows, tgt, 1.0 / temperature) / P, P
