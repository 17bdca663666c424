"""Sampled softmax over uniform negatives for next-item prediction at every position.

Zhai et al. 2024, §4.1.1 (and Klenitskiy & Vasilev 2023 for sampled softmax in sequential
recommenders): logits are cosine similarities / temperature of the L2-normalised output
row and item embeddings; the positive is the next item, negatives are drawn uniformly from
1..I; a negative equal to the positive is masked out (-inf).
Symbols: B sequences, W width, P live positions, M negatives, d width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstu.model.hstu import l2_normalize


def sampled_softmax_loss(out: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, item_emb, *, num_negatives: int,
                         temperature: float, sharing: str = "sequence", generator: torch.Generator | None = None,
                         num_items: int) -> tuple[torch.Tensor, int]:
    """Mean loss over positions 0..L-2 of each sequence (row i predicts ids[i+1]).

    Args:
        out: (B, W, d) L2-normalised encoder rows.
        ids: (B, W) int64 item ids (0 padding); lengths (B,) int64.
        item_emb: callable (…) int64 -> (…, d) rows.
        sharing: "sequence" (M negatives per sequence, shared by its positions: one batched
            GEMM) or "position" (M independent negatives per position, gathered; the
            reference's scheme, slower on CPU).
    Returns:
        (loss scalar, number of supervised positions P).
    """
    B, W, d = out.shape
    pos_mask = torch.arange(W - 1, device=ids.device).view(1, -1) < (lengths.view(-1, 1) - 1)  # (B, W-1)
    q = out[:, :-1]  # (B, W-1, d)
    tgt = ids[:, 1:]  # (B, W-1)
    pos_logit = (q * l2_normalize(item_emb(tgt))).sum(-1, keepdim=True)  # (B, W-1, 1)
    if sharing == "sequence":
        neg = torch.randint(1, num_items + 1, (B, num_negatives), device=ids.device, generator=generator)  # (B, M)
        neg_logit = torch.bmm(q, l2_normalize(item_emb(neg)).transpose(1, 2))  # (B, W-1, M)
        clash = tgt.unsqueeze(-1) == neg.unsqueeze(1)  # (B, W-1, M)
        logits = torch.cat([pos_logit, neg_logit.masked_fill(clash, float("-inf"))], dim=-1)[pos_mask]  # (P, 1+M)
    else:
        qp, tp = q[pos_mask], tgt[pos_mask]  # (P, d), (P,)
        neg = torch.randint(1, num_items + 1, (qp.shape[0], num_negatives), device=ids.device, generator=generator)  # (P, M)
        neg_logit = torch.einsum("pd,pmd->pm", qp, l2_normalize(item_emb(neg)))
        neg_logit = neg_logit.masked_fill(neg == tp.unsqueeze(1), float("-inf"))
        logits = torch.cat([pos_logit[pos_mask], neg_logit], dim=-1)  # (P, 1+M)
    n = logits.shape[0]
    if n == 0:
        return out.sum() * 0.0, 0
    loss = F.cross_entropy(logits / temperature, torch.zeros(n, dtype=torch.long, device=ids.device))
    return loss, n


def next_action_loss(out: torch.Tensor, actions: torch.Tensor, lengths: torch.Tensor, head) -> torch.Tensor:
    """Cross-entropy of the next action type from each row (row i predicts actions[i+1])."""
    W = out.shape[1]
    mask = torch.arange(W - 1, device=out.device).view(1, -1) < (lengths.view(-1, 1) - 1)
    logits = head(out[:, :-1][mask])  # (P, A+1)
    if logits.shape[0] == 0:
        return out.sum() * 0.0
    return F.cross_entropy(logits, actions[:, 1:][mask])
