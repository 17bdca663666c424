"""Next-k generation with a KV cache, model-level: the **test oracle** of the engine.

No user path runs this loop: ``hstu generate``, the Python API
(:meth:`hstu.generate.recommend.Recommender.recommend`) and ``hstu serve`` generate through
:class:`hstu.generate.engine.Engine`; tests compare the engine against :func:`generate` and
:func:`generate_recompute`. Its beam search feeds no predicted actions to the next step (the
engine does), so the two differ in beam search for models with a next-action head only.
The sampler (scores, exclusion, top-k) is shared: :mod:`hstu.generate.sampler`, re-exported here.

Greedy, top-k / temperature sampling, beam search.

Each of the k steps scores every item with the current user vector (cosine / temperature,
DESIGN.md), picks an item, appends it as a token at the next position with timestamp = the
request time, and runs one cached decode step. Because the divisor N is fixed and the
appended timestamp equals the query time, a cached step equals a full recompute of the grown
sequence (checked against :func:`generate_recompute`).

Beam search keeps W beams per user ranked by the **sum of log-probabilities** (log-softmax
over the non-excluded items). All beams have the same length k, so length normalisation would
not change the ranking; width 1 equals greedy.

Symbols: B users, W padded history width, I items (dense ids 1..I), k steps.
"""

from __future__ import annotations

import torch

from hstu.generate.kv_cache import KVCache
from hstu.generate.sampler import (
    TEMPERATURE_FLOOR,
    GenerationResult,
    beam_step_streamed,
    check_candidates,
    exclusion_mask,
    next_scores,
    pick,
    pick_streamed,
    sample_topk,
    streams,
)
from hstu.model.hstu import HSTUModel


def _check(model: HSTUModel, ids: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > model.cfg.max_output_len:
        raise ValueError(f"k={k} exceeds the model's max_output_len={model.cfg.max_output_len}")
    if ids.shape[0] == 0:
        raise ValueError("empty batch")
    if int(lengths.min()) < 1:
        raise ValueError("every history needs at least one event (empty history)")
    if int(lengths.max()) > model.cfg.max_seq_len:
        raise ValueError(
            f"history length {int(lengths.max())} exceeds max_seq_len={model.cfg.max_seq_len}; truncate to the most recent events"
        )


def _prefill(model: HSTUModel, ids, timestamps, lengths, request_time, k, cache: KVCache | None, actions=None, categories=None):
    B = ids.shape[0]
    Wp = int(lengths.max()) + 1  # + the query-time slot
    S = int(lengths.max()) + k
    if cache is None:
        cache = KVCache.for_model(model, B, max(S, Wp))
    kv, tbuf = cache.views(B)
    if tbuf.shape[1] < max(S, Wp):
        raise ValueError(f"KV cache capacity {tbuf.shape[1]} < needed {max(S, Wp)}")
    tbuf.zero_()
    tbuf[:, : ids.shape[1]].copy_(timestamps[:, : tbuf.shape[1]])
    bidx = torch.arange(B, device=ids.device)
    tbuf[bidx, lengths] = request_time
    pad = lambda t: None if t is None else _fit(t, Wp)  # noqa: E731
    seq = model.encode(_fit(ids, Wp), tbuf[:, :Wp].clone(), lengths, actions=pad(actions), categories=pad(categories), kv_cache=kv)
    return model.last_rows(seq, lengths), kv, tbuf


def _repeat(model: HSTUModel, parts: tuple | None) -> tuple | None:
    """The ``repeat`` argument of :func:`next_scores`: (model.repeat, static, in_window) or None."""
    return None if parts is None else (model.repeat, *parts)


def _fit(t: torch.Tensor, W: int) -> torch.Tensor:
    """(B, W', …) -> (B, W, …): cut or zero-padded on axis 1 (categories may carry feature columns)."""
    if t.shape[1] >= W:
        return t[:, :W]
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, W - t.shape[1]))


@torch.inference_mode()
def generate(
    model: HSTUModel,
    ids: torch.Tensor,
    timestamps: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    request_time: torch.Tensor,
    exclude: torch.Tensor,
    strategy: str = "greedy",
    top_k: int = 50,
    temperature: float = 1.0,
    beam_width: int = 4,
    seed: int = 0,
    cache: KVCache | None = None,
    actions: torch.Tensor | None = None,
    categories: torch.Tensor | None = None,
    item_category: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate the next ``k`` items for each sequence with a KV cache.

    Args:
        ids, timestamps: (B, W) int64 histories, oldest first, 0 after each length.
        lengths: (B,) int64 in 1..max_seq_len.
        request_time: (B,) int64 Unix seconds: the query time of the last history row and the
            timestamp of every generated token.
        exclude: (B, I+1) bool, True = never generate (see :func:`exclusion_mask`). Updated
            in place with the generated items.
        strategy: "greedy" | "topk" (seeded sampling among the ``top_k`` best, softmax at
            ``temperature``) | "beam" (``beam_width`` beams, sum of log-probs).
        cache: optional preallocated cache with batch >= B (and >= B * beam_width for beam)
            and capacity >= max(lengths) + k; written in place.
        actions, categories: optional (B, W) history features; item_category (I+1,) maps a
            generated item to its category feature.
    Returns:
        GenerationResult with (B, k) items and scores.
    Raises:
        ValueError: k <= 0 or > max_output_len, empty history, history > max_seq_len, bad strategy,
            a row of ``exclude`` leaving fewer than max(k, beam width) items (:func:`check_candidates`).
    """
    _check(model, ids, lengths, k)
    W = beam_width if strategy == "beam" else 1
    check_candidates(exclude, max(k, W), f"k={k}, beam width {W}")
    if strategy == "beam":
        return _beam(model, ids, timestamps, lengths, k, request_time, exclude, beam_width, cache, actions, categories, item_category)
    B = ids.shape[0]
    gen = torch.Generator(device=ids.device).manual_seed(seed) if strategy == "topk" else None
    user, kv, tbuf = _prefill(model, ids, timestamps, lengths, request_time, k, cache, actions, categories)
    index = model.item_index()  # (I+1) rows, the table's storage
    rep = _repeat(model, model.repeat_parts(ids, actions, lengths))  # repeat-aware bias, fixed while generating
    out_items = torch.zeros(B, k, dtype=torch.int64, device=ids.device)
    out_scores = torch.zeros(B, k, dtype=user.dtype, device=ids.device)
    out_actions = torch.zeros(B, k, dtype=torch.int64, device=ids.device) if model.action_head is not None else None
    bidx = torch.arange(B, device=ids.device)
    pos = lengths.clone()
    stream = streams(index, B)  # a (B, I+1) score matrix too large: streamed top candidates (model/item_index.py)
    for step in range(k):
        if stream:
            choice, score = pick_streamed(index, user, model.cfg.temperature, exclude, strategy, top_k, temperature, gen, rep)
        else:
            scores = next_scores(index, user, model.cfg.temperature, exclude, repeat=rep)  # (B, I+1)
            choice = pick(scores, strategy, top_k, temperature, gen)
            score = scores[bidx, choice]
        out_items[:, step] = choice
        out_scores[:, step] = score
        exclude[bidx, choice] = True
        act = None
        if out_actions is not None:
            act = model.action_head(user)[:, 1:].argmax(dim=1) + 1
            out_actions[:, step] = act
        if step == k - 1:
            break
        tbuf[bidx, pos] = request_time
        user = model.step(choice, pos, tbuf, request_time, kv, actions=act, categories=_step_categories(model, item_category, choice))
        pos += 1
    return GenerationResult(out_items, out_scores, out_actions)


def _step_categories(model, item_category: torch.Tensor | None, items: torch.Tensor) -> torch.Tensor | None:
    """The generated items' category tokens: ``item_category[items]``; without ``item_category``
    category 0 (unknown), as the engine gives them; None for a model that reads no categories."""
    if not model.reads_categories:
        return None
    return item_category[items] if item_category is not None else torch.zeros_like(items)


def _beam(model, ids, timestamps, lengths, k, request_time, exclude, W, cache, actions, categories, item_category) -> GenerationResult:
    B = ids.shape[0]
    rep = lambda t: None if t is None else t.repeat_interleave(W, dim=0)  # noqa: E731
    ids_r, ts_r, len_r, rt_r = rep(ids), rep(timestamps), rep(lengths), rep(request_time)
    user, kv, tbuf = _prefill(model, ids_r, ts_r, len_r, rt_r, k, cache, rep(actions), rep(categories))
    index = model.item_index()
    I1 = index.num_rows
    parts = model.repeat_parts(ids, actions, lengths)
    bias = _repeat(model, None if parts is None else tuple(rep(t) for t in parts))  # the same for every beam
    excl = exclude.repeat_interleave(W, dim=0)  # (B*W, I+1)
    seq_items = torch.zeros(B * W, k, dtype=torch.int64, device=ids.device)
    seq_scores = torch.zeros(B * W, k, dtype=user.dtype, device=ids.device)
    beam_lp = torch.zeros(B, W, dtype=user.dtype, device=ids.device)
    pos = len_r.clone()
    stream = streams(index, B * W)  # a (B*W, I+1) matrix too large: each beam's W best, streamed (sampler.beam_step_streamed)
    for step in range(k):
        if stream:
            top_lp, parent, item, step_score = beam_step_streamed(index, user, model.cfg.temperature, excl, bias, beam_lp, step == 0)
        else:
            scores = next_scores(index, user, model.cfg.temperature, excl, repeat=bias)  # (B*W, I+1)
            logp = torch.log_softmax(scores, dim=1).view(B, W, I1)
            if step == 0:  # all beams are identical: expand from beam 0 only
                cand = logp[:, 0]  # (B, I+1)
                top_lp, top_idx = cand.topk(W, dim=1)
                parent = torch.zeros(B, W, dtype=torch.int64, device=ids.device)
                item = top_idx
            else:
                total = (beam_lp.unsqueeze(-1) + logp).view(B, W * I1)
                top_lp, flat = total.topk(W, dim=1)
                parent, item = flat // I1, flat % I1
        src = (torch.arange(B, device=ids.device).view(B, 1) * W + parent).view(-1)  # (B*W,)
        item_f = item.reshape(-1)
        if not stream:
            step_score = scores.view(B, W, I1).gather(2, item.unsqueeze(-1)).squeeze(-1) if step == 0 else scores[src, item_f].view(B, W)
        seq_items = seq_items[src]
        seq_scores = seq_scores[src]
        seq_items[:, step] = item_f
        seq_scores[:, step] = step_score.reshape(-1)
        excl = excl[src]
        excl[torch.arange(B * W, device=ids.device), item_f] = True
        beam_lp = top_lp
        if step == k - 1:
            break
        for kk, vv in kv:
            kk.copy_(kk.index_select(0, src))
            vv.copy_(vv.index_select(0, src))
        tbuf.copy_(tbuf.index_select(0, src))
        tbuf[torch.arange(B * W, device=ids.device), pos] = rt_r
        user = model.step(item_f, pos, tbuf, rt_r, kv, categories=_step_categories(model, item_category, item_f))
        pos += 1
    best = beam_lp.argmax(dim=1)  # (B,)
    rows = torch.arange(B, device=ids.device) * W + best
    exclude |= excl.view(B, W, I1)[torch.arange(B, device=ids.device), best]
    return GenerationResult(seq_items[rows], seq_scores[rows], None, beam_lp.max(dim=1).values)


@torch.inference_mode()
def generate_recompute(
    model: HSTUModel,
    ids: torch.Tensor,
    timestamps: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    request_time: torch.Tensor,
    exclude: torch.Tensor,
) -> GenerationResult:
    """Greedy next-k by full recomputation of the grown sequence at every step (the oracle
    for the cached path; also the "no cache" side of the benchmark). Raises as :func:`generate`."""
    _check(model, ids, lengths, k)
    check_candidates(exclude, k, f"k={k}")
    B = ids.shape[0]
    W = int(lengths.max()) + k + 1
    cur_ids, cur_ts = _fit(ids, W).clone(), _fit(timestamps, W).clone()
    cur_len = lengths.clone()
    bidx = torch.arange(B, device=ids.device)
    index = model.item_index()
    rep = _repeat(model, model.repeat_parts(ids, None, lengths))
    items = torch.zeros(B, k, dtype=torch.int64, device=ids.device)
    scores_out = torch.zeros(B, k, device=ids.device)
    for step in range(k):
        cur_ts[bidx, cur_len] = request_time
        w = int(cur_len.max()) + 1
        seq = model.encode(cur_ids[:, :w], cur_ts[:, :w], cur_len)
        user = model.last_rows(seq, cur_len)
        scores = next_scores(index, user, model.cfg.temperature, exclude, repeat=rep)
        choice = scores.argmax(dim=1)
        items[:, step], scores_out[:, step] = choice, scores[bidx, choice]
        exclude[bidx, choice] = True
        cur_ids[bidx, cur_len] = choice
        cur_len = cur_len + 1
    return GenerationResult(items, scores_out)


__all__ = [
    "GenerationResult",
    "TEMPERATURE_FLOOR",
    "check_candidates",
    "exclusion_mask",
    "generate",
    "generate_recompute",
    "pick",
    "sample_topk",
]
