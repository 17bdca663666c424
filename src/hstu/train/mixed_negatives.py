"""Mixed negative sampling: per position, uniform negatives plus negatives drawn from the batch's targets.

Yang et al., "Mixed Negative Sampling for Learning Two-tower Neural Networks in Recommendations", WWW 2020:
in-batch negatives (other positions' targets, so drawn in proportion to how often an item is a target in the
batch, popular items more often) beside uniform ones; Yi et al., "Sampling-Bias-Corrected Neural Modeling for
Large Corpus Item Recommendations", RecSys 2019: the logQ correction, each sampled logit minus the log of its
sampling probability, so the sampled softmax estimates the same softmax whatever the proposal.

Here each of the P supervised positions draws M = ``[train] num_negatives`` ids uniformly from 1..I (the
per-position scheme's draw, :func:`hstu.train.losses.draw_negatives`) and N = ``[train] in_batch_negatives``
positions of the batch uniformly, taking their targets. One draw picks item j with probability
Q(j) = (M / I + N c_j / P) / (M + N), c_j the number of positions whose target is j. Each negative's logit / τ
is lowered by log(I Q(j)) = log((M + N I c_j / P) / (M + N)): the correction relative to the uniform sampler,
so the objective stays the one the uniform negatives estimate (with N = 0 the loss is the per-position one,
draw for draw) while popular items, the hard negatives, are scored more often.
"""

from __future__ import annotations

import torch

from hstu.train.losses import draw_negatives, pool_softmax_loss, supervised_mask, uses_dense_logits


def draw_mixed(
    tgt: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_negatives: int,
    in_batch: int,
    num_items: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's mixed negatives and their logQ corrections (module docstring).

    Args:
        tgt: (P,) int64 targets of the supervised positions; mask: (B, T) bool, those positions
            (:func:`hstu.train.losses.supervised_mask`), T = W - 1.
        num_negatives: M uniform draws per position (>= 0); in_batch: N in-batch draws per position (>= 0).
    Returns:
        (neg (P, M + N) int64 in 1..I, the uniform ones first; offset (P, M + N) float64, log(I Q(j)) of each).
    """
    B, T = mask.shape
    P, M, N = tgt.shape[0], num_negatives, in_batch
    device = tgt.device
    uni = torch.empty(P, 0, dtype=torch.long, device=device)
    if M:
        uni = draw_negatives(B, T + 1, num_negatives=M, chunk=1, num_items=num_items, generator=generator, device=device)[0][mask]
    picks = torch.randint(0, max(P, 1), (P, N), generator=generator, device=device)
    neg = torch.cat([uni, tgt[picks]], dim=1)  # (P, M + N)
    ids, counts = torch.unique(tgt, return_counts=True)  # c_j of the targets only: no (I + 1,) table a batch
    at = torch.searchsorted(ids, neg).clamp(max=max(len(ids) - 1, 0))
    c = torch.where(ids[at] == neg, counts[at], 0).to(torch.float64)  # (P, M + N); P = 0: empty
    return neg, ((M + N * num_items * c / max(P, 1)) / (M + N)).log()  # log(I Q(j))


def mixed_softmax_loss(
    out: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    item_emb,
    *,
    num_negatives: int,
    in_batch: int,
    temperature: float,
    num_items: int,
    generator: torch.Generator | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Mean sampled-softmax loss over positions 0..L-2 of each sequence (row i predicts ids[i + 1]) with
    :func:`draw_mixed`'s negatives, logQ-corrected; a negative equal to its position's target is masked, as in
    :func:`hstu.train.losses.sampled_softmax_loss`.

    Args:
        out: (B, W, d) L2-normalised encoder rows; ids (B, W) int64 (0 padding); lengths (B,) int64.
        item_emb: callable (…) int64 -> (…, d) rows.
        segments: (B, W) int64 packed rows, or None.
    Returns:
        (loss scalar, P supervised positions).
    """
    mask = supervised_mask(lengths, ids.shape[1] - 1, segments)  # (B, T)
    q, tgt = out[:, :-1][mask], ids[:, 1:][mask]  # (P, d), (P,)
    neg, offset = draw_mixed(tgt, mask, num_negatives=num_negatives, in_batch=in_batch, num_items=num_items, generator=generator)
    if uses_dense_logits(q.shape[0], 1, num_items):  # the whole table as the pool, row = id
        pool_ids, cols = torch.arange(num_items + 1, device=ids.device), neg
    else:  # the distinct ids drawn
        pool_ids, cols = torch.unique(neg, return_inverse=True)
    return pool_softmax_loss(q, tgt, pool_ids, cols, item_emb, temperature=temperature, zero=out.sum() * 0.0, neg_offset=offset.to(q.dtype))


def model_mixed_loss(model, out, ids, lengths, tcfg, generator, neg, segments) -> tuple[torch.Tensor, int]:
    """:func:`hstu.train.losses.training_loss` with ``[train] in_batch_negatives`` > 0: :func:`mixed_softmax_loss` with
    the model's table and sizes. ValueError with a repeat head or pre-drawn (distributed) negatives ``neg``."""
    where = (
        "with a repeat head (repeat_window > 0)" if model.repeat is not None else "by the distributed trainer" if neg is not None else ""
    )
    if where:
        raise ValueError(f"TrainConfig.in_batch_negatives is not supported {where}; set it to 0")
    c = model.cfg
    kw = dict(num_negatives=tcfg.num_negatives, in_batch=tcfg.in_batch_negatives, temperature=c.temperature, num_items=c.num_items)
    return mixed_softmax_loss(out, ids, lengths, model.item_emb, generator=generator, segments=segments, **kw)
