"""Sampled softmax over uniform negatives for next-item prediction at every position.

Zhai et al. 2024, §4.1.1 (and Klenitskiy & Vasilev 2023 for sampled softmax in sequential
recommenders): logits are cosine similarities / temperature of the L2-normalised output
row and item embeddings; the positive is the next item, negatives are drawn uniformly from
1..I; a negative equal to the positive is masked out (-inf).
Negative schemes (TrainConfig): per position (negatives_chunk = 1, the reference's), shared by runs of
c positions (negatives_chunk = c), or per position from a batch pool of K distinct items
(negatives_pool = K, :func:`draw_pool`, :func:`pool_softmax_loss`: the (P x K) product by blocks, :func:`sampled_scores`,
no (P x M x d) rows).
Symbols: B sequences, W width, P live positions, M negatives, K pool items, d width.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from hstu.model.hstu import l2_normalize
from hstu.model.kernels import get_kernels
from hstu.model.repeat import windows

log = logging.getLogger(__name__)
_SAID: set[str] = set()  # the outcomes of resolve_packing logged so far


def draw_negatives(
    batch_size: int,
    width: int,
    *,
    num_negatives: int,
    chunk: int,
    num_items: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, int]:
    """The uniform negatives of a batch of ``batch_size`` sequences padded to ``width``: each run of
    c = min(chunk, max(width - 1, 1)) consecutive supervised positions of a sequence shares its own
    M = ``num_negatives`` ids drawn from 1..I (one ``torch.randint`` of (B * nc, M), sequence-major,
    nc = ceil((width - 1) / c)).

    Returns (neg (B, nc, M) int64, c). Raises ValueError for chunk < 1. The distributed trainer makes
    this draw for the global batch on every rank and keeps its own sequences' rows
    (:func:`hstu.train.dist_table.draw_negatives`), so both recipes see the same negatives.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    T = width - 1  # supervised slots
    c = min(chunk, max(T, 1))
    nc = -(-T // c)  # runs per sequence
    neg = torch.randint(1, num_items + 1, (batch_size * nc, num_negatives), device=device, generator=generator)
    return neg.view(batch_size, nc, num_negatives), c


def _negatives(neg, B: int, W: int, chunk: int, num_negatives: int, num_items: int, generator, device) -> tuple[torch.Tensor, int, int]:
    """The loss's negatives as (B * nc, M) rows, c and nc: drawn here (:func:`draw_negatives`) when
    ``neg`` is None, else pre-drawn (B, nc, M) for runs of ``chunk`` positions (ValueError if not)."""
    if neg is None:
        neg, c = draw_negatives(B, W, num_negatives=num_negatives, chunk=chunk, num_items=num_items, generator=generator, device=device)
    else:
        c = chunk
        if neg.dim() != 3 or tuple(neg.shape[:2]) != (B, -(-(W - 1) // c)):
            raise ValueError(f"negatives of shape {tuple(neg.shape)} do not match {B} sequences x {-(-(W - 1) // c)} runs of {c} positions")
    nc = neg.shape[1]
    return neg.reshape(B * nc, neg.shape[2]), c, nc


def uses_dense_logits(positions: int, chunk: int, num_items: int) -> bool:
    """Whether :func:`sampled_softmax_loss` scores ``positions`` rows against the whole table
    (per-position negatives, c = 1, and P x (I + 1) <= DENSE_LOGITS_MAX): it then reads every row."""
    return chunk == 1 and positions * (num_items + 1) <= DENSE_LOGITS_MAX


def supervised_mask(lengths: torch.Tensor, T: int, segments: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool, True at the supervised positions of a batch of width T + 1: row i predicts
    row i + 1, so i < lengths - 1; for packed rows (``segments`` (B, T + 1) int64, -1 after the
    fill) also only where row i + 1 is of the same segment, i.e. positions 0..L-2 of every
    segment of length L, exactly the padded batch's positions of the same users."""
    mask = torch.arange(T, device=lengths.device).view(1, T) < (lengths.view(-1, 1) - 1)  # (B, T)
    if segments is not None:
        mask = mask & (segments[:, 1:] == segments[:, :-1])
    return mask


def sampled_softmax_loss(
    out: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    item_emb,
    *,
    num_negatives: int,
    temperature: float,
    chunk: int = 16,
    generator: torch.Generator | None = None,
    num_items: int,
    neg: torch.Tensor | None = None,
    pool: int = 0,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Mean loss over positions 0..L-2 of each sequence (row i predicts ids[i+1]).

    Negatives: each run of ``chunk`` consecutive positions of a sequence shares its own M
    uniform negatives (:func:`draw_negatives`), scored with one batched GEMM. chunk = 1 gives
    independent negatives per position (the reference's scheme; for a small catalogue scored as
    dense logits, :func:`uses_dense_logits`); chunk >= W one set per sequence. Measured on ML-1M:
    the number of distinct negatives per batch drives learning speed, and chunks of 16 keep
    most of the per-position benefit at the cost of the per-sequence GEMM.

    Args:
        out: (B, W, d) L2-normalised encoder rows.
        ids: (B, W) int64 item ids (0 padding); lengths (B,) int64.
        item_emb: callable (…) int64 -> (…, d) rows.
        chunk: positions per negative set (>= 1).
        neg: (B, nc, M) int64 negatives drawn beforehand (the distributed trainer's share of its
            global batch's draw); ``chunk`` is then the run length they were drawn for, used as is,
            and ``num_negatives`` / ``generator`` are not read.
        pool: > 0: per-position negatives from one batch pool of min(pool, I) distinct items
            (:func:`draw_pool`, :func:`pool_softmax_loss`); ``chunk`` is then not read.
        segments: (B, W) int64 packed rows (:func:`supervised_mask`): the positions are each
            segment's 0..L-2; a run of ``chunk`` positions may then span two segments.
    Returns (loss scalar, number of supervised positions P). ValueError: chunk < 1; ``neg`` not (B, nc, M) or with ``pool``.
    """
    B, W, d = out.shape
    T = W - 1  # supervised slots
    if pool > 0:
        if neg is not None:
            raise ValueError("pre-drawn negatives (the distributed trainer's) cannot be combined with a negatives pool")
        mask = supervised_mask(lengths, T, segments)  # (B, T)
        q, tgt = out[:, :-1][mask], ids[:, 1:][mask]  # (P, d), (P,)
        pool_ids, cols = draw_pool(
            q.shape[0], pool=pool, num_negatives=num_negatives, num_items=num_items, generator=generator, device=ids.device
        )
        return pool_softmax_loss(q, tgt, pool_ids, cols, item_emb, temperature=temperature, zero=out.sum() * 0.0)
    neg, c, nc = _negatives(neg, B, W, chunk, num_negatives, num_items, generator, ids.device)  # (B*nc, M)
    M = neg.shape[1]
    pad = nc * c - T
    mask = F.pad(supervised_mask(lengths, T, segments), (0, pad))  # (B, nc*c)
    if uses_dense_logits(int(mask.sum()), c, num_items):  # nc*c == T
        return _per_position_dense(
            out[:, :-1][mask],
            ids[:, 1:][mask],
            neg.view(B, T, -1)[mask],
            item_emb,
            temperature=temperature,
            num_items=num_items,
            zero=out.sum() * 0.0,
        )
    q = F.pad(out[:, :-1], (0, 0, 0, pad))  # (B, nc*c, d)
    tgt = F.pad(ids[:, 1:], (0, pad))  # (B, nc*c)
    pos_logit = (q * l2_normalize(item_emb(tgt))).sum(-1, keepdim=True)  # (B, nc*c, 1)
    neg_logit = torch.bmm(q.reshape(B * nc, c, d), l2_normalize(item_emb(neg)).transpose(1, 2))  # (B*nc, c, M)
    clash = tgt.reshape(B * nc, c, 1) == neg.unsqueeze(1)  # (B*nc, c, M)
    neg_logit = neg_logit.masked_fill(clash, float("-inf")).reshape(B, nc * c, M)
    logits = torch.cat([pos_logit, neg_logit], dim=-1)[mask]  # (P, 1+M)
    n = logits.shape[0]
    if n == 0:
        return out.sum() * 0.0, 0
    loss = F.cross_entropy(logits / temperature, torch.zeros(n, dtype=torch.long, device=ids.device))
    return loss, n


# Per-position negatives through dense logits when P x (I + 1) is at most this many elements: their work,
# P x (I + 1) x d multiply-adds, grows with the catalogue where gathering rows grows with M (memory does
# not: sampled_scores holds ~SCORE_BLOCK elements at a time; ML-1M batches of 128 x 200 are ~5e7).
DENSE_LOGITS_MAX = 1 << 28


def _per_position_dense(
    q: torch.Tensor, tgt: torch.Tensor, neg: torch.Tensor, item_emb, *, temperature: float, num_items: int, zero: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """chunk = 1 for a small catalogue: the same loss as gathering M rows per position, computed
    as q · Ênᵀ against the whole L2-normalised table, by blocks of positions (:func:`sampled_scores`),
    picking the negatives' logits (:func:`pool_softmax_loss` with the whole table as the pool,
    row = id), which avoids gathering and scattering P x M x d rows (measured ~5x faster on ML-1M).
    q: (P, d) normalised rows; tgt: (P,) int64; neg: (P, M) int64 in 1..I."""
    table_ids = torch.arange(num_items + 1, device=q.device)
    return pool_softmax_loss(q, tgt, table_ids, neg, item_emb, temperature=temperature, zero=zero)


def draw_pool(
    positions: int,
    *,
    pool: int,
    num_negatives: int,
    num_items: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's negatives as a pool and per-position columns: K = min(``pool``, I) distinct ids,
    the first K of a uniform random permutation of 1..I (``torch.randperm``), and for each of the
    ``positions`` rows M = ``num_negatives`` columns drawn uniformly from 0..K-1 with replacement
    (``torch.randint``), so position p's negatives are pool_ids[cols[p]].

    Each negative is marginally uniform over 1..I, as the reference's per-position draws; the M of one
    position are independent given the pool, and with K = I (the pool is then all items) the
    negatives are exactly i.i.d. uniform per position (the reference scheme, Zhai et al. 2024 §4.1.1).
    K < I correlates positions of one batch only through the pool (two positions share about
    M^2 / K ids, where chunks of c positions share all M), the trade that in-batch / mixed negative
    sampling makes (Yi et al., RecSys 2019; Yang et al., WWW 2020) for one (P x K) GEMM.

    Returns (pool_ids (K,) int64 in 1..I, cols (positions, M) int64 in 0..K-1). Raises ValueError for pool < 1.
    """
    if pool < 1:
        raise ValueError(f"pool must be >= 1, got {pool}")
    K = min(pool, num_items)
    pool_ids = torch.randperm(num_items, generator=generator, device=device)[:K] + 1
    cols = torch.randint(0, K, (positions, num_negatives), generator=generator, device=device)
    return pool_ids, cols


def pool_softmax_loss(
    q: torch.Tensor,
    tgt: torch.Tensor,
    pool_ids: torch.Tensor,
    cols: torch.Tensor,
    item_emb,
    *,
    temperature: float,
    zero: torch.Tensor,
    neg_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Sampled softmax with per-position negatives taken from a shared pool of rows: position p's
    negative logits are S[p, cols[p]] of S = q · Ê_poolᵀ (P x K), computed by :func:`sampled_scores`
    (blocks of S, never the whole of it, its gradient or a (P x M x d) tensor of rows); the positive's
    logit is q_p · ê_tgt[p]. A negative equal to its position's target is masked (-inf), as in
    :func:`sampled_softmax_loss`. Loss: mean over p of -log softmax([pos, neg_1..neg_M] / temperature)[0].

    Args:
        q: (P, d) L2-normalised encoder rows; tgt: (P,) int64 target ids.
        pool_ids: (K,) int64 item ids of the pool's rows (:func:`draw_pool`; the whole table 0..I
            for :func:`_per_position_dense`).
        cols: (P, M) int64 columns of the pool, position p's negatives being pool_ids[cols[p]].
        item_emb: callable (…) int64 -> (…, d) rows.
        zero: the loss to return when P = 0 (keeps the graph).
        neg_offset: (P, M) float subtracted from the negatives' logits / temperature (logQ, :mod:`hstu.train.mixed_negatives`).
    Returns:
        (mean loss, P).
    """
    P = q.shape[0]
    if P == 0:
        return zero, 0
    pos = (q * l2_normalize(item_emb(tgt))).sum(-1, keepdim=True)  # (P, 1)
    negl = sampled_scores(q, l2_normalize(item_emb(pool_ids)), cols)  # (P, M)
    negl = negl if neg_offset is None else negl - temperature * neg_offset
    negl = negl.masked_fill(pool_ids[cols] == tgt.view(P, 1), float("-inf"))
    logits = torch.cat([pos, negl], dim=1)  # (P, 1+M)
    return F.cross_entropy(logits / temperature, torch.zeros(P, dtype=torch.long, device=q.device)), P


# Rows of S = q · Rᵀ that sampled_scores computes at once: about this many elements (float32: 4 MiB,
# cache-sized; measured on ML-1M, K = 3707: blocks of 128-512 rows all ~2.5x faster than the whole S).
SCORE_BLOCK = 1 << 20
# sampled_scores gathers the picked rows instead of forming q·rowsᵀ by blocks when rows outnumber the picks
# per position more than this. Forward + backward, M = 128, d = 50, 1 thread: blocks 1.9x faster at K/M = 29
# (ML-1M), gathering 2.1x faster at K/M = 156 and 8.5x at K/M = 431 (Taobao's 55k items).
GATHER_RATIO = 64


class _SampledScores(torch.autograd.Function):
    """out[p, m] = q[p] · rows[cols[p, m]]; see :func:`sampled_scores`."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        P, K, rows = q.shape[0], rows.shape[0], rows.contiguous()  # embedding_bag's weight (backward)
        M = cols.shape[1]
        ctx.gathered = K > GATHER_RATIO * M  # a block's q·rowsᵀ would compute K / M times the picked dots
        c = max(1, SCORE_BLOCK // max(M * rows.shape[1] if ctx.gathered else K, 1))
        out = q.new_empty(P, M)
        for a in range(0, P, c):
            if ctx.gathered:  # (c, M, d) picked rows times (c, d, 1)
                out[a : a + c] = torch.bmm(rows[cols[a : a + c]], q[a : a + c].unsqueeze(-1)).squeeze(-1)
            else:
                out[a : a + c] = (q[a : a + c] @ rows.T).gather(1, cols[a : a + c])  # (c, K) block, picked
        ctx.save_for_backward(q, rows, cols)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        q, rows, cols = ctx.saved_tensors
        g = g.contiguous()
        gq = grows = None
        if ctx.needs_input_grad[0]:  # dL/dq[p] = sum_m g[p, m] rows[cols[p, m]]: a weighted bag of rows
            gq = F.embedding_bag(cols, rows, per_sample_weights=g, mode="sum")
        if ctx.needs_input_grad[1] and ctx.gathered:  # dL/drows[k] = sum over (p, m) with cols[p, m] = k of g[p, m] q[p]
            P, (M, d) = q.shape[0], (cols.shape[1], q.shape[1])
            c = max(1, SCORE_BLOCK // max(M * d, 1))
            grows = rows.new_zeros(rows.shape)
            for a in range(0, P, c):
                grows.index_add_(0, cols[a : a + c].reshape(-1), (g[a : a + c].unsqueeze(-1) * q[a : a + c].unsqueeze(1)).reshape(-1, d))
        elif ctx.needs_input_grad[1]:  # dL/drows = Gᵀ q, G (P x K) holding g at (p, cols[p, m]), built by blocks
            P, K = q.shape[0], rows.shape[0]
            c = max(1, SCORE_BLOCK // max(K, 1))
            grows = rows.new_zeros(rows.shape[1], K)  # (d, K): qᵀ G measured ~20 % faster than Gᵀ q
            buf = g.new_zeros(min(c, P), K)  # one block of G, zeroed once and reset at its M entries per row
            for a in range(0, P, c):
                G = buf[: min(c, P - a)]
                G.scatter_add_(1, cols[a : a + c], g[a : a + c])
                grows.addmm_(q[a : a + c].T, G)
                G.scatter_(1, cols[a : a + c], 0.0)
            grows = grows.T
        return gq, grows, None


def sampled_scores(q: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The sampled dot products out[p, m] = q[p] · rows[cols[p, m]] (a sampled dense-dense product,
    SDDMM), differentiable in ``q`` and ``rows``: the value of ``(q @ rows.T).gather(1, cols)`` and
    its autograd gradients (up to float rounding), without holding the (P x K) product or its
    gradient: the forward takes blocks of ~``SCORE_BLOCK`` elements of q · rowsᵀ and keeps the
    picked columns; the backward computes dL/dq as a weighted bag of rows (``F.embedding_bag``,
    per-sample weights dL/dout) and dL/drows = Gᵀ q by blocks of the sparse (P x K) G. Where K > GATHER_RATIO x M
    (a large catalogue) it gathers the picked rows instead (blocks of (c, M, d) rows times q) and adds g·q into
    the picked rows (``index_add_``): the same values, without the K / M times larger block products. Measured side
    by side at ML-1M sizes (P = 14k, K = 3707, M = 128, d = 50, 1 thread, load ~4): 135-170 ms forward
    and backward where the whole product's autograd graph took 505-545 ms (benchmarks/packing_speed.py
    --scores measures the training step).

    Args:
        q: (P, d) float rows; rows: (K, d) of the same dtype and device.
        cols: (P, M) int64 in 0..K-1 (repeats allowed: each is scored and gets its gradient).
    Returns:
        (P, M) of q's dtype. Not twice differentiable.
    """
    return _SampledScores.apply(q, rows, cols)


def repeat_aware_loss(
    out: torch.Tensor,
    ids: torch.Tensor,
    actions: torch.Tensor | None,
    lengths: torch.Tensor,
    model,
    *,
    num_negatives: int,
    chunk: int = 16,
    generator: torch.Generator | None = None,
    neg: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Sampled softmax for a model with a repeat head (:mod:`hstu.model.repeat`).

    At each position t (row t predicts ids[t+1]) the candidates are the target, M uniform
    negatives (one set per run of ``chunk`` positions, as :func:`sampled_softmax_loss`) and the
    distinct items of the window ids[t-R+1 .. t] other than the target ("history negatives").
    Logits: cos / temperature plus the repeat bias of the candidate; uniform negatives that fall
    in the window are masked (the window copy carries them, with their bias), as are negatives
    equal to the target, padding and repeated window items. The window items are enumerated
    while the M uniform negatives stand for all I items, so each uniform logit gets + log(I / M)
    (the sampled-softmax importance correction, Bengio & Senecal 2008; Jean et al. 2015):
    without it the softmax over-weights history items M/I-fold against the full-ranking one and
    the model learns to push revisits down.
    ``neg``: (B, nc, M) negatives drawn beforehand, with ``chunk`` their run length (as
    :func:`sampled_softmax_loss`). Returns (mean loss, P supervised positions).
    """
    rep, I, tau = model.repeat, model.cfg.num_items, model.cfg.temperature
    B, W, d = out.shape
    T, R = W - 1, rep.window
    neg, c, nc = _negatives(neg, B, W, chunk, num_negatives, I, generator, ids.device)  # (B*nc, M)
    num_negatives = neg.shape[1]
    mask = torch.arange(T, device=ids.device).view(1, T) < (lengths.view(B, 1) - 1)  # (B, T)
    negP = neg.view(B, nc, 1, num_negatives).expand(B, nc, c, num_negatives).reshape(B, nc * c, num_negatives)[:, :T][mask]
    q, tgt = out[:, :-1][mask], ids[:, 1:][mask]  # (P, d), (P,)
    P = q.shape[0]
    if P == 0:
        return out.sum() * 0.0, 0
    win = windows(ids, R)[:, :T][mask]  # (P, R) items t-R+1 .. t, oldest first
    wact = windows(actions, R)[:, :T][mask] if (actions is not None and model.cfg.num_actions > 0) else None
    cand = torch.cat([tgt.view(P, 1), win], dim=1)  # (P, 1+R): target and history negatives
    if uses_dense_logits(P, c, I):  # per-position negatives: the table normalised once, rows picked (sampled_scores)
        table = l2_normalize(model.item_emb(torch.arange(I + 1, device=ids.device)))  # (I+1, d)
        neg_logit, emb = sampled_scores(q, table, negP), F.embedding(cand, table)  # (P, M), (P, 1+R, d)
    else:  # one GEMM per run of c positions against its M rows
        q_pad = F.pad(out[:, :-1], (0, 0, 0, nc * c - T))  # (B, nc*c, d)
        neg_logit = torch.bmm(q_pad.reshape(B * nc, c, d), l2_normalize(model.item_emb(neg)).transpose(1, 2))  # (B*nc, c, M)
        neg_logit = neg_logit.reshape(B, nc * c, num_negatives)[:, :T][mask]  # (P, M)
        emb = l2_normalize(model.item_emb(cand))  # (P, 1+R, d)
    own = torch.einsum("pd,pcd->pc", q, emb) / tau + rep.candidates(q, cand, win, wact)  # (P, 1+R)
    slot = torch.arange(R, device=ids.device)
    later_same = ((win.unsqueeze(2) == win.unsqueeze(1)) & (slot.view(1, 1, R) > slot.view(1, R, 1))).any(dim=2)  # (P, R)
    drop_win = (win == tgt.view(P, 1)) | (win == 0) | later_same
    drop_neg = (negP == tgt.view(P, 1)) | (negP.unsqueeze(-1) == win.unsqueeze(1)).any(dim=-1)  # (P, M)
    log_q = math.log(I / num_negatives)
    logits = torch.cat(
        [own[:, :1], (neg_logit / tau + log_q).masked_fill(drop_neg, float("-inf")), own[:, 1:].masked_fill(drop_win, float("-inf"))], dim=1
    )  # (P, 1+M+R)
    return F.cross_entropy(logits, torch.zeros(P, dtype=torch.long, device=ids.device)), P


def next_action_loss(
    out: torch.Tensor, actions: torch.Tensor, lengths: torch.Tensor, head, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of the next action type from each row (row i predicts actions[i+1]);
    ``segments``: packed rows (:func:`supervised_mask`)."""
    mask = supervised_mask(lengths, out.shape[1] - 1, segments)
    logits = head(out[:, :-1][mask])  # (P, A+1)
    if logits.shape[0] == 0:
        return out.sum() * 0.0
    return F.cross_entropy(logits, actions[:, 1:][mask])


def resolve_packing(tcfg, mcfg, backend: str, packs: bool) -> str:
    """``tcfg.packing`` resolved (an "auto" outcome logged once): "auto" -> "pack" where the trainer packs
    (``packs``, a strategy's attribute), the kernel set of ``[model] attention`` on ``backend`` takes
    segment masks (KernelSet.segments) and the model is an hstu one without a repeat head
    (:func:`training_loss`), else "off"; "off" / "pack" as given."""
    if tcfg.packing != "auto":
        return tcfg.packing
    segments = get_kernels(backend, mcfg.attention, field="[model] attention").segments
    bad = {"the trainer does not pack": not packs, "the attention kernel set has no segment masks": not segments}
    bad |= {f"architecture {mcfg.architecture!r}": mcfg.architecture != "hstu", "a repeat head": mcfg.repeat_window > 0}
    why = "; ".join(w for w, b in bad.items() if b)
    if (said := f"'off' ({why})" if why else "'pack'") not in _SAID:  # once per outcome (LocalStrategy.step resolves per batch)
        _SAID.add(said)
        log.info("[train] packing = 'auto' resolved to %s", said)
    return "off" if why else "pack"


def _full(model, out, ids, lengths, neg, segments) -> tuple[torch.Tensor, int]:
    """training_loss's ``[train] softmax = "full"`` (:func:`hstu.train.full_softmax.full_softmax_loss`)."""
    from hstu.train.full_softmax import full_softmax_loss  # it imports this module

    if model.repeat is not None:
        raise ValueError("[train] softmax = 'full' is not supported with a repeat head (repeat_window > 0); use 'sampled'")
    if neg is not None:
        raise ValueError("[train] softmax = 'full' is not supported by the distributed trainer (--distributed) yet; use 'sampled'")
    c = model.cfg
    return full_softmax_loss(out, ids, lengths, model.item_emb, temperature=c.temperature, num_items=c.num_items, segments=segments)


def training_loss(
    model,
    out: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    actions: torch.Tensor | None,
    tcfg,
    *,
    generator: torch.Generator | None = None,
    neg: torch.Tensor | None = None,
    chunk: int | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """The recipe's loss on one batch, for single-process and distributed training alike:
    :func:`repeat_aware_loss` with a repeat head, else :func:`sampled_softmax_loss` (Zhai et al.
    2024, §4.1.1), or with ``tcfg.softmax`` "full" :func:`hstu.train.full_softmax.full_softmax_loss`, or with
    ``tcfg.in_batch_negatives`` :func:`hstu.train.mixed_negatives.mixed_softmax_loss`,
    plus ``tcfg.action_loss_weight`` x :func:`next_action_loss` with an action head.

    Args:
        model: the HSTUModel (its ``item_emb`` supplies the rows: an ``nn.Embedding`` or the
            TorchRec-sharded table inside its step's prefetch).
        out: (B, W, d) encoder rows; ids (B, W) int64; lengths (B,) int64; actions (B, W) int64 or None.
        tcfg: TrainConfig (num_negatives, negatives_chunk, negatives_pool, in_batch_negatives, action_loss_weight).
        neg, chunk: pre-drawn negatives (B, nc, M) and their run length; None: drawn here from
            ``generator`` with ``tcfg.negatives_chunk``.
        segments: (B, W) int64 packed rows (TrainConfig.packing "pack", :func:`supervised_mask`);
            not with a repeat head (ValueError naming ``[train] packing``).
    Returns:
        (mean loss over the P supervised positions, P).
    """
    c = tcfg.negatives_chunk if chunk is None else chunk
    pool = tcfg.negatives_pool
    if pool and model.repeat is not None:
        raise ValueError("TrainConfig.negatives_pool is not supported with a repeat head (repeat_window > 0); set it to 0")
    if pool and neg is not None:
        raise ValueError("TrainConfig.negatives_pool is not supported by the distributed trainer (--distributed) yet; set it to 0")
    if segments is not None and model.repeat is not None:
        raise ValueError("[train] packing = 'pack' is not supported with a repeat head (repeat_window > 0): its windows would cross users")
    if tcfg.softmax == "full":
        loss, n = _full(model, out, ids, lengths, neg, segments)
    elif tcfg.in_batch_negatives:
        from hstu.train.mixed_negatives import model_mixed_loss  # it imports this module

        loss, n = model_mixed_loss(model, out, ids, lengths, tcfg, generator, neg, segments)
    elif model.repeat is not None:
        loss, n = repeat_aware_loss(
            out, ids, actions, lengths, model, num_negatives=tcfg.num_negatives, chunk=c, generator=generator, neg=neg
        )
    else:
        loss, n = sampled_softmax_loss(
            out,
            ids,
            lengths,
            model.item_emb,
            num_negatives=tcfg.num_negatives,
            temperature=model.cfg.temperature,
            chunk=c,
            generator=generator,
            num_items=model.cfg.num_items,
            neg=neg,
            pool=pool,
            segments=segments,
        )
    if model.action_head is not None:
        loss = loss + tcfg.action_loss_weight * next_action_loss(out, actions, lengths, model.action_head, segments)
    return loss, n
