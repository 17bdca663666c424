"""The engine's decode loops: k picks with k - 1 cached steps (greedy, top-k, beam), or, without
a KV cache, a full prefill of the grown sequence per step. Methods of
:class:`hstu.generate.engine.Engine` (``Engine._decode``, ``Engine._decode_recompute``), kept in
their own module; every write goes into the engine's preallocated buffers (no factory or growth
op inside the loop: tests/generate/test_engine_alloc.py).

Streamed (``eng.streamed``: the engine's (R, I+1) scores would exceed
:data:`hstu.model.item_index.STREAM_BYTES`, decided once at construction): no (R, I+1) score or
exclusion buffer exists; each step's picks come from :func:`hstu.generate.sampler.pick_streamed` /
:func:`hstu.generate.sampler.beam_step_streamed` (exact top candidates block by block), with the
exclusions as (row, item id) pairs: the request's (:func:`load_exclusions`) plus each row's already
generated items (``items[:, :s]``, which beam search reorders with its beams).

Symbols: Bp users in the chunk, W beams, R = Bp * W rows, k steps, I items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hstu.generate.pool import BucketPool
from hstu.generate.sampler import Exclusions, beam_step_streamed, next_scores, pick_streamed

NEG_INF = float("-inf")

if TYPE_CHECKING:
    from hstu.generate.engine import Engine


def decode(
    eng: Engine,
    b: BucketPool,
    Bp: int,
    W: int,
    k: int,
    user: torch.Tensor,
    step: Callable[[], torch.Tensor],
    strategy: str,
    top_k: int,
    temperature: float,
    item_category: torch.Tensor | None,
    repeat: tuple | None = None,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """The decode loop: k picks, k - 1 cached steps, all writes into preallocated buffers
    (streamed: ``pairs``, the request's exclusions of :func:`load_exclusions`)."""
    R = Bp * W
    if item_category is None and b.has_features[1]:  # generated items' categories unknown: 0, not an earlier request's
        b.cat[:R].zero_()
    stream = eng.streamed
    excl = None if stream else eng._excl[:R]
    items, sc, acts = eng._out_items[:R], eng._out_scores[:R], eng._out_actions[:R]
    bidx = eng._bidx[:R]
    beam_lp = None
    beam = strategy == "beam"
    for s in range(k):
        if not beam:
            choice = pick_step(eng, R, s, user, strategy, top_k, temperature, repeat, pairs)  # (R,), written to items, sc
            act = eng._next_action(user)
        else:
            top_lp, src, choice, step_score = beam_expand(eng, Bp, W, s, user, beam_lp, repeat, pairs)  # (Bp, W), (R,) x 3
            act = eng._next_action(user)
            bufs = ((items, eng._items_scratch[:R]), (sc, eng._scores_scratch[:R]))
            for buf, scratch in bufs if stream else (*bufs, (excl, eng._excl_scratch[:R])):
                torch.index_select(buf, 0, src, out=scratch)
                buf.copy_(scratch)
            items[:, s] = choice
            sc[:, s] = step_score
            if act is not None:
                act = act.index_select(0, src)
            if s > 0:
                torch.index_select(acts, 0, src, out=eng._items_scratch[:R])
                acts.copy_(eng._items_scratch[:R])
            beam_lp = top_lp
            if not stream:
                excl.scatter_(1, choice.view(R, 1), NEG_INF)
        if act is not None:
            acts[:, s] = act
        if s == k - 1:
            break
        if beam and W > 1 and s > 0:
            for g, scratch in ((b.gk, b.gk_scratch), (b.gv, b.gv_scratch)):
                for t in g:
                    torch.index_select(t[:R], 0, src, out=scratch[:R])
                    t[:R].copy_(scratch[:R])
        b.item[:R].copy_(choice)
        b.s_idx.fill_(s)
        b.s_idx_j.fill_(b.C + s)
        if act is not None:
            b.act[:R].copy_(act)
        if item_category is not None:
            torch.index_select(item_category, 0, choice, out=b.cat[:R])
        user = step()  # (R, d)
        b.pos[:R].add_(1)
    if not beam:
        return items[:, :k], sc[:, :k], acts[:, :k], None, excl
    best = beam_lp.argmax(dim=1)  # (Bp,)
    rows = bidx[:Bp] * W + best
    return items[rows, :k], sc[rows, :k], acts[rows, :k], beam_lp.max(dim=1).values, None if stream else excl[rows]


def beam_expand(eng: Engine, Bp: int, W: int, s: int, user: torch.Tensor, beam_lp, repeat, pairs) -> tuple[torch.Tensor, ...]:
    """Step ``s`` of beam search for Bp users x W beams: the W best continuations by summed
    log-probability (log-softmax over the non-excluded items; step 0 expands beam 0 only).
    Returns (top_lp (Bp, W), src (R,) parent row of each new beam, choice (R,) its item,
    step_score (R,) the item's score). Full path: the (R, I+1) buffers; streamed:
    :func:`beam_step_streamed` with ``pairs`` and the generated items."""
    R, bidx, temp = Bp * W, eng._bidx[: Bp * W], eng.model.cfg.temperature
    if eng.streamed:
        lp = beam_lp if s > 0 else torch.zeros(Bp, W, dtype=torch.float32, device=user.device)
        ex = step_pairs(pairs, eng._out_items[:R], bidx, s)
        top_lp, parent, choice2, step_score = beam_step_streamed(eng._index, user, temp, ex[2], repeat, lp, s == 0, exclude_pairs=ex[:2])
        src = (bidx[:Bp].view(Bp, 1) * W + parent).view(R)
        return top_lp, src, choice2.reshape(R), step_score.reshape(R)
    scores = eng._scores[:R]
    next_scores(eng._index, user, temp, eng._excl[:R], repeat=repeat, out=scores)  # (R, I+1)
    I1 = scores.shape[1]
    logp = torch.log_softmax(scores, dim=1).view(Bp, W, I1)
    if s == 0:  # every beam is the same sequence: expand beam 0 only
        top_lp, choice2 = logp[:, 0].topk(W, dim=1)  # (Bp, W)
        parent = choice2.mul(0)
    else:
        top_lp, flat = (beam_lp.unsqueeze(-1) + logp).view(Bp, W * I1).topk(W, dim=1)
        parent, choice2 = flat.div(I1, rounding_mode="floor"), flat.remainder(I1)
    src = (bidx[:Bp].view(Bp, 1) * W + parent).view(R)  # parent row of each new beam
    choice = choice2.view(R)
    return top_lp, src, choice, scores[src, choice]  # (R,)


def pick_step(eng: Engine, R: int, s: int, user, strategy: str, top_k: int, temperature: float, repeat, pairs) -> torch.Tensor:
    """Step ``s`` of greedy / top-k for R rows: scores, pick, written to the engine's ``items[:, s]``
    and ``scores[:, s]``; returns the (R,) int64 picks. Full path: the (R, I+1) buffers (the pick
    then excluded in place); streamed: :func:`pick_streamed` with ``pairs`` and the generated items."""
    items, sc, temp = eng._out_items[:R], eng._out_scores[:R], eng.model.cfg.temperature
    if eng.streamed:
        ex = step_pairs(pairs, items, eng._bidx[:R], s)
        choice, score = pick_streamed(eng._index, user, temp, ex[2], strategy, top_k, temperature, eng._gen, repeat, exclude_pairs=ex[:2])
        items[:, s] = choice
        sc[:, s] = score
        return choice
    scores, excl = eng._scores[:R], eng._excl[:R]
    next_scores(eng._index, user, temp, excl, repeat=repeat, out=scores)  # (R, I+1)
    choice = eng._pick(scores, strategy, top_k, temperature)  # (R,)
    items[:, s] = choice
    sc[:, s] = scores.gather(1, choice.view(R, 1)).view(R)
    excl.scatter_(1, choice.view(R, 1), NEG_INF)
    return choice


def step_pairs(pairs: tuple, items: torch.Tensor, rows: torch.Tensor, s: int) -> tuple:
    """The exclusions of step ``s``: (rows (n,), ids (n,)) int64, the request's ``pairs`` and each
    row r's generated items ``items[r, :s]`` (``items`` (R, K), ``rows`` = arange(R)), and the
    request's (1, I+1) bool row excluded for every row, or None."""
    if s == 0:
        return pairs
    return torch.cat([pairs[0], rows.repeat_interleave(s)]), torch.cat([pairs[1], items[:, :s].reshape(-1)]), pairs[2]


def load_exclusions(eng: Engine, exclude, ri: torch.Tensor, Bu: int, Bp: int, W: int):
    """A group's exclusions: rows ``ri`` (Bu,) of the request's ``exclude`` ((B, I+1) bool,
    :class:`hstu.generate.sampler.Exclusions` (streamed only) or None) for Bp users x W beams.
    Full path: into the engine's (R, I+1) additive mask (:data:`hstu.generate.sampler.MASK_DTYPE`, -inf where
    excluded) with padding id 0 (returns None); streamed:
    (rows (n,), ids (n,)) int64 pairs, each user's repeated for its W beams, and the Exclusions'
    ``never`` as a (1, I+1) row or None (padding id 0 is excluded by the streamed scoring itself)."""
    R = Bp * W
    if not eng.streamed:
        excl = eng._excl[:R]  # additive: 0, or -inf where excluded
        excl.zero_()
        ex_rows = exclude[ri]  # (Bu, I+1) bool
        if W > 1:
            excl.view(Bp, W, -1)[:Bu].masked_fill_(ex_rows.view(Bu, 1, -1), NEG_INF)
        else:
            excl[:Bu].masked_fill_(ex_rows, NEG_INF)
        excl[:, 0] = NEG_INF
        return None
    rows, ids = [eng._bidx[:0]], [eng._bidx[:0]]
    sparse = isinstance(exclude, Exclusions)
    for j, i in enumerate(ri.tolist() if exclude is not None else []):
        hit = exclude.ids[exclude.rows == i] if sparse else exclude[i].nonzero().view(-1)  # one row at a time: no (Bu, I+1) copy
        rows.append((eng._bidx[:W] + j * W).repeat(hit.numel()))
        ids.append(hit.repeat_interleave(W))
    never = exclude.never.view(1, -1) if sparse and exclude.never is not None else None
    return torch.cat(rows), torch.cat(ids), never


def store_exclusions(exclude: torch.Tensor | None, ri: torch.Tensor, final_excl: torch.Tensor | None, items: torch.Tensor) -> None:
    """Add a group's generated items to the request's ``exclude`` (B, I+1) in place (the engine's
    documented contract): its final additive mask rows (full path; -inf = excluded) or the picked ids ``items`` (Bu, k) (streamed;
    an :class:`hstu.generate.sampler.Exclusions` is left as given)."""
    if final_excl is not None:
        exclude[ri] = final_excl.ne(0)  # the engine's additive mask: -inf where excluded
    elif isinstance(exclude, torch.Tensor):
        exclude[ri.view(-1, 1), items] = True


def decode_recompute(
    eng: Engine,
    b: BucketPool,
    Bp: int,
    k: int,
    user: torch.Tensor,
    prefill: Callable[[], torch.Tensor],
    strategy: str,
    top_k: int,
    temperature: float,
    item_category: torch.Tensor | None,
    repeat: tuple | None = None,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """No KV cache: append each pick to the padded inputs and rerun the bucket's prefill."""
    R = Bp
    items, sc, acts = eng._out_items[:R], eng._out_scores[:R], eng._out_actions[:R]
    bidx = eng._bidx[:R]
    for s in range(k):
        choice = pick_step(eng, R, s, user, strategy, top_k, temperature, repeat, pairs)
        act = eng._next_action(user)
        if act is not None:
            acts[:, s] = act
        if s == k - 1:
            break
        p = b.lengths[:R]
        b.ids[bidx, p] = choice
        if act is not None and b.has_features[0]:
            b.actions[bidx, p] = act
        if item_category is not None:
            b.categories[bidx, p] = item_category[choice]
        b.lengths[:R].add_(1)  # times at L.. already hold the request time
        user = prefill()
    return items[:, :k], sc[:, :k], acts[:, :k], None, None if eng.streamed else eng._excl[:R]
