"""Argument checks and history truncation of :meth:`hstu.generate.engine.Engine.generate`.

Symbols: B rows, W padded width, I items, E a bucket edge.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hstu.generate.hardening import check_inputs_on

if TYPE_CHECKING:
    from hstu.generate.engine import Engine

log = logging.getLogger(__name__)


def validate_request(
    eng: Engine, ids, timestamps, lengths, k, strategy, beam_width, use_cache, actions, categories, exclude, user_ids
) -> int:
    """Check one Engine.generate call's arguments (see its docstring); returns B.

    Raises:
        ValueError / TypeError: as Engine.generate documents. StrayTensorError: an input on another device.
    """
    c = eng.model.cfg
    check_inputs_on(eng.device, ids=ids, timestamps=timestamps, lengths=lengths, actions=actions, categories=categories, exclude=exclude)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if k > eng.k_max:
        raise ValueError(f"k={k} exceeds the engine's k_max={eng.k_max}")
    if strategy not in ("greedy", "topk", "beam"):
        raise ValueError(f"unknown strategy {strategy!r}; valid: greedy, topk, beam")
    if strategy == "beam" and beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    if strategy == "beam" and not use_cache:
        raise ValueError("use_cache=False supports greedy and topk only")
    for name, t in (("ids", ids), ("timestamps", timestamps), ("lengths", lengths), ("actions", actions), ("categories", categories)):
        if t is not None and t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
    if ids.dim() != 2 or ids.shape != timestamps.shape:
        raise ValueError(f"ids and timestamps must both be (B, W), got {tuple(ids.shape)} and {tuple(timestamps.shape)}")
    B, Wd = ids.shape
    if B == 0:
        raise ValueError("empty batch")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be (B,) = ({B},), got {tuple(lengths.shape)}")
    for name, t in (("actions", actions), ("categories", categories)):
        if t is not None and t.shape != ids.shape:
            raise ValueError(f"{name} must have the shape of ids {tuple(ids.shape)}, got {tuple(t.shape)}")
    if exclude is not None and (exclude.shape != (B, c.num_items + 1) or exclude.dtype != torch.bool):
        raise ValueError(f"exclude must be (B, I+1) = ({B}, {c.num_items + 1}) bool, got {tuple(exclude.shape)} {exclude.dtype}")
    if user_ids is not None and len(user_ids) != B:
        raise ValueError(f"user_ids has {len(user_ids)} entries for a batch of {B}")
    empty = (lengths < 1).nonzero().view(-1).tolist()
    if empty:
        raise ValueError(
            f"empty history at row(s) {empty[:10]}: HSTU needs at least one event (no cold-start path in the "
            "model; serve a popularity list upstream)"
        )
    if int(lengths.max()) > Wd:
        bad = int((lengths > Wd).nonzero()[0])
        raise ValueError(f"lengths[{bad}]={int(lengths[bad])} exceeds the padded width {Wd}")
    live = eng._arange[:Wd].view(1, Wd) < lengths.view(B, 1)
    bad = live & ((ids < 1) | (ids > c.num_items))
    if bool(bad.any()):
        r, p = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"ids[{r}, {p}]={int(ids[r, p])}: unknown item id (valid dense ids 1..{c.num_items}; 0 is padding)")
    return B


def truncate(
    Emax: int,
    ids: torch.Tensor,
    timestamps: torch.Tensor,
    actions: torch.Tensor,
    categories: torch.Tensor,
    lengths: torch.Tensor,
    warnings: list[str],
):
    """Keep the most recent ``Emax`` events of over-long histories: (B, W) int64 inputs and (B,)
    lengths -> the same (B, Emax) where any row was cut, plus truncated (B,) int64 events cut per
    row; appends (and logs) one warning when anything was cut."""
    B = ids.shape[0]
    truncated = (lengths - Emax).clamp(min=0)
    if bool((truncated > 0).any()):
        shift = truncated.view(B, 1) + torch.arange(Emax, device=ids.device).view(1, Emax)  # (B, Emax)
        ids, timestamps = ids.gather(1, shift), timestamps.gather(1, shift)
        actions, categories = actions.gather(1, shift), categories.gather(1, shift)
        lengths = lengths.clamp(max=Emax)
        n_cut = int((truncated > 0).sum())
        msg = f"{n_cut} history(ies) longer than the largest bucket {Emax}: kept the most recent {Emax} events"
        warnings.append(msg)
        log.warning(msg)
    return ids, timestamps, actions, categories, lengths, truncated
