"""The engine's decode loops: k picks with k - 1 cached steps (greedy, top-k, beam), or, without
a KV cache, a full prefill of the grown sequence per step. Methods of
:class:`hstu.generate.engine.Engine` (``Engine._decode``, ``Engine._decode_recompute``), kept in
their own module; every write goes into the engine's preallocated buffers (no factory or growth
op inside the loop: tests/generate/test_engine_alloc.py).

Symbols: Bp users in the chunk, W beams, R = Bp * W rows, k steps, I items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hstu.generate.pool import BucketPool
from hstu.generate.sampler import next_scores

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
):
    """The decode loop: k picks, k - 1 cached steps, all writes into preallocated buffers."""
    R = Bp * W
    I1 = eng._scores.shape[1]
    scores, excl = eng._scores[:R], eng._excl[:R]
    items, sc, acts = eng._out_items[:R], eng._out_scores[:R], eng._out_actions[:R]
    bidx = eng._bidx[:R]
    beam_lp = None
    beam = strategy == "beam"
    temp = eng.model.cfg.temperature
    for s in range(k):
        next_scores(eng._index, user, temp, excl, repeat=repeat, out=scores)  # (R, I+1)
        act = eng._next_action(user)
        if not beam:
            choice = eng._pick(scores, strategy, top_k, temperature)  # (R,)
            items[:, s] = choice
            sc[:, s] = scores.gather(1, choice.view(R, 1)).view(R)
        else:
            logp = torch.log_softmax(scores, dim=1).view(Bp, W, I1)
            if s == 0:  # every beam is the same sequence: expand beam 0 only
                top_lp, choice2 = logp[:, 0].topk(W, dim=1)  # (Bp, W)
                parent = choice2.mul(0)
            else:
                top_lp, flat = (beam_lp.unsqueeze(-1) + logp).view(Bp, W * I1).topk(W, dim=1)
                parent, choice2 = flat.div(I1, rounding_mode="floor"), flat.remainder(I1)
            src = (bidx[:Bp].view(Bp, 1) * W + parent).view(R)  # parent row of each new beam
            choice = choice2.view(R)
            step_score = scores[src, choice]  # (R,)
            for buf, scratch in ((items, eng._items_scratch[:R]), (sc, eng._scores_scratch[:R]), (excl, eng._excl_scratch[:R])):
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
        excl.scatter_(1, choice.view(R, 1), True)
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
    return items[rows, :k], sc[rows, :k], acts[rows, :k], beam_lp.max(dim=1).values, excl[rows]


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
):
    """No KV cache: append each pick to the padded inputs and rerun the bucket's prefill."""
    R = Bp
    scores, excl = eng._scores[:R], eng._excl[:R]
    items, sc, acts = eng._out_items[:R], eng._out_scores[:R], eng._out_actions[:R]
    bidx = eng._bidx[:R]
    temp = eng.model.cfg.temperature
    for s in range(k):
        next_scores(eng._index, user, temp, excl, repeat=repeat, out=scores)
        act = eng._next_action(user)
        choice = eng._pick(scores, strategy, top_k, temperature)
        items[:, s] = choice
        sc[:, s] = scores.gather(1, choice.view(R, 1)).view(R)
        excl.scatter_(1, choice.view(R, 1), True)
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
    return items[:, :k], sc[:, :k], acts[:, :k], None, excl
