"""Next-k generation: greedy, top-k / temperature sampling, beam search, with a KV cache.

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

from dataclasses import dataclass

import torch

from hstu.generate.kv_cache import KVCache
from hstu.model.hstu import HSTUModel


@dataclass
class GenerationResult:
    """items (B, k) int64 dense ids; scores (B, k) float model scores (cosine / temperature);
    actions (B, k) int64 predicted action ids or None; beam_logprob (B,) or None."""

    items: torch.Tensor
    scores: torch.Tensor
    actions: torch.Tensor | None = None
    beam_logprob: torch.Tensor | None = None


def exclusion_mask(num_items: int, batch: int, ids: torch.Tensor | None, lengths: torch.Tensor | None,
                   block: list[list[int]] | None = None, device: torch.device | str = "cpu",
                   never: torch.Tensor | None = None) -> torch.Tensor:
    """(B, I+1) bool, True = never generate: padding 0, the history ids (if given), block lists
    and ``never``: an optional (I+1,) bool row excluded for every user (e.g. the items without
    training events, :attr:`hstu.generate.recommend.Recommender.untrained`)."""
    mask = torch.zeros(batch, num_items + 1, dtype=torch.bool, device=device)
    if never is not None:
        if never.shape != (num_items + 1,):
            raise ValueError(f"exclusion_mask: never must be (I+1,) = ({num_items + 1},), got {tuple(never.shape)}")
        mask |= never.to(device=device, dtype=torch.bool).view(1, -1)
    mask[:, 0] = True
    if ids is not None:
        live = torch.arange(ids.shape[1], device=ids.device).view(1, -1) < lengths.view(-1, 1)
        rows = torch.arange(batch, device=ids.device).view(-1, 1).expand_as(ids)
        mask[rows[live], ids[live]] = True
    for b, items in enumerate(block or []):
        ok = [i for i in items if 0 < i <= num_items]
        if ok:
            mask[b, torch.tensor(ok, device=device)] = True
    return mask


def check_candidates(exclude: torch.Tensor, need: int, detail: str) -> None:
    """Raise ValueError when a row of ``exclude`` ((B, I+1) bool, True = never generate, column
    0 padding) leaves fewer than ``need`` items: that row would otherwise generate excluded
    items with score -inf. ``detail`` ends the message (e.g. "k=10, beam width 1")."""
    left = (~exclude[:, 1:]).sum(dim=1)  # (B,)
    short = (left < need).nonzero().view(-1).tolist()
    if short:
        raise ValueError(f"row(s) {short[:10]}: fewer than {need} items left after exclusion ({detail})")


# the smallest positive normal float32: below it a temperature acts as this one (see sample_topk)
TEMPERATURE_FLOOR = float(torch.finfo(torch.float32).tiny)


def sample_topk(scores: torch.Tensor, top_k: int, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """Seeded sampling among the ``top_k`` best of each row at softmax ``temperature``; the one
    top-k sampler of every generation path (``generate``, the engine).

    Args:
        scores: (R, I+1) float scores, -inf where excluded; every row needs >= 1 finite entry.
        top_k: candidates per row (>= 1; more than I+1 means all).
        temperature: > 0. Computed in a way that cannot overflow: in float32 (at least), the
            row's best score subtracted first, then divided by max(temperature,
            ``TEMPERATURE_FLOOR`` = 1.18e-38), so the logits lie in [-inf, 0] with 0 at the best
            item and the softmax is finite for any temperature. A tiny temperature (1e-38,
            1e-300, 5e-324) is the greedy limit: the best item, or one of exactly tied ones
            uniformly.
        gen: the generator drawn from (seeded by the caller).
    Returns:
        (R,) int64 column ids of the picks.
    """
    vals, idx = scores.topk(min(top_k, scores.shape[1]), dim=1)  # (R, k') descending
    z = vals.float() if vals.dtype in (torch.float16, torch.bfloat16) else vals
    z = (z - z[:, :1]).div_(max(float(temperature), TEMPERATURE_FLOOR))  # (R, k') in [-inf, 0]
    probs = torch.softmax(z, dim=1)
    return idx.gather(1, torch.multinomial(probs, 1, generator=gen)).squeeze(1)


def pick(scores: torch.Tensor, strategy: str, top_k: int, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """(R,) int64 next item per row of ``scores`` (R, I+1): argmax ("greedy") or
    :func:`sample_topk` ("topk"). Raises ValueError for another strategy."""
    if strategy == "greedy":
        return scores.argmax(dim=1)
    if strategy == "topk":
        return sample_topk(scores, top_k, temperature, gen)
    raise ValueError(f"unknown strategy {strategy!r}; valid: greedy, topk, beam")


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
        raise ValueError(f"history length {int(lengths.max())} exceeds max_seq_len={model.cfg.max_seq_len}; truncate to the most recent events")


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
    tbuf[:, :ids.shape[1]].copy_(timestamps[:, :tbuf.shape[1]])
    bidx = torch.arange(B, device=ids.device)
    tbuf[bidx, lengths] = request_time
    pad = lambda t: None if t is None else _fit(t, Wp)  # noqa: E731
    seq = model.encode(_fit(ids, Wp), tbuf[:, :Wp].clone(), lengths, actions=pad(actions), categories=pad(categories), kv_cache=kv)
    return model.last_rows(seq, lengths), kv, tbuf


def _fit(t: torch.Tensor, W: int) -> torch.Tensor:
    if t.shape[1] >= W:
        return t[:, :W]
    return torch.nn.functional.pad(t, (0, W - t.shape[1]))


@torch.inference_mode()
def generate(model: HSTUModel, ids: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor, k: int, *,
             request_time: torch.Tensor, exclude: torch.Tensor, strategy: str = "greedy", top_k: int = 50, temperature: float = 1.0,
             beam_width: int = 4, seed: int = 0, cache: KVCache | None = None, actions: torch.Tensor | None = None,
             categories: torch.Tensor | None = None, item_category: torch.Tensor | None = None) -> GenerationResult:
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
    bias_parts = model.repeat_parts(ids, actions, lengths)  # repeat-aware bias, fixed while generating
    out_items = torch.zeros(B, k, dtype=torch.int64, device=ids.device)
    out_scores = torch.zeros(B, k, dtype=user.dtype, device=ids.device)
    out_actions = torch.zeros(B, k, dtype=torch.int64, device=ids.device) if model.action_head is not None else None
    bidx = torch.arange(B, device=ids.device)
    pos = lengths.clone()
    for step in range(k):
        scores = index.cosine(user).div_(model.cfg.temperature)  # (B, I+1)
        if bias_parts is not None:
            model.repeat.add_to(scores, user, *bias_parts)
        scores = scores.masked_fill(exclude, float("-inf"))
        choice = pick(scores, strategy, top_k, temperature, gen)
        out_items[:, step] = choice
        out_scores[:, step] = scores[bidx, choice]
        exclude[bidx, choice] = True
        act = None
        if out_actions is not None:
            act = model.action_head(user)[:, 1:].argmax(dim=1) + 1
            out_actions[:, step] = act
        if step == k - 1:
            break
        tbuf[bidx, pos] = request_time
        cat = item_category[choice] if (item_category is not None and model.category_emb is not None) else None
        user = model.step(choice, pos, tbuf, request_time, kv, actions=act, categories=cat)
        pos += 1
    return GenerationResult(out_items, out_scores, out_actions)


def _beam(model, ids, timestamps, lengths, k, request_time, exclude, W, cache, actions, categories, item_category) -> GenerationResult:
    B = ids.shape[0]
    rep = lambda t: None if t is None else t.repeat_interleave(W, dim=0)  # noqa: E731
    ids_r, ts_r, len_r, rt_r = rep(ids), rep(timestamps), rep(lengths), rep(request_time)
    user, kv, tbuf = _prefill(model, ids_r, ts_r, len_r, rt_r, k, cache, rep(actions), rep(categories))
    index = model.item_index()
    I1 = index.num_rows
    bias_parts = model.repeat_parts(ids, actions, lengths)
    bias_parts = None if bias_parts is None else tuple(rep(t) for t in bias_parts)  # the same for every beam
    excl = exclude.repeat_interleave(W, dim=0)  # (B*W, I+1)
    seq_items = torch.zeros(B * W, k, dtype=torch.int64, device=ids.device)
    seq_scores = torch.zeros(B * W, k, dtype=user.dtype, device=ids.device)
    beam_lp = torch.zeros(B, W, dtype=user.dtype, device=ids.device)
    pos = len_r.clone()
    for step in range(k):
        scores = index.cosine(user).div_(model.cfg.temperature)  # (B*W, I+1)
        if bias_parts is not None:
            model.repeat.add_to(scores, user, *bias_parts)
        scores = scores.masked_fill(excl, float("-inf"))
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
        cat = item_category[item_f] if (item_category is not None and model.category_emb is not None) else None
        user = model.step(item_f, pos, tbuf, rt_r, kv, categories=cat)
        pos += 1
    best = beam_lp.argmax(dim=1)  # (B,)
    rows = torch.arange(B, device=ids.device) * W + best
    exclude |= excl.view(B, W, I1)[torch.arange(B, device=ids.device), best]
    return GenerationResult(seq_items[rows], seq_scores[rows], None, beam_lp.max(dim=1).values)


@torch.inference_mode()
def generate_recompute(model: HSTUModel, ids: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor, k: int, *,
                       request_time: torch.Tensor, exclude: torch.Tensor) -> GenerationResult:
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
    bias_parts = model.repeat_parts(ids, None, lengths)
    items = torch.zeros(B, k, dtype=torch.int64, device=ids.device)
    scores_out = torch.zeros(B, k, device=ids.device)
    for step in range(k):
        cur_ts[bidx, cur_len] = request_time
        w = int(cur_len.max()) + 1
        seq = model.encode(cur_ids[:, :w], cur_ts[:, :w], cur_len)
        user = model.last_rows(seq, cur_len)
        scores = index.cosine(user).div_(model.cfg.temperature)
        if bias_parts is not None:
            model.repeat.add_to(scores, user, *bias_parts)
        scores = scores.masked_fill(exclude, float("-inf"))
        choice = scores.argmax(dim=1)
        items[:, step], scores_out[:, step] = choice, scores[bidx, choice]
        exclude[bidx, choice] = True
        cur_ids[bidx, cur_len] = choice
        cur_len = cur_len + 1
    return GenerationResult(items, scores_out)
