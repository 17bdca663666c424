"""The sampler of every generation path: next-item scores, exclusion, greedy / top-k picks.

One decode step scores every item with the current user vector (cosine / temperature, DESIGN.md
"The model"; plus the repeat bias of a repeat head, :mod:`hstu.model.repeat`), sets the items
that must never be generated to -inf, and picks: the best ("greedy") or a seeded draw among the
``top_k`` best at a softmax temperature ("topk"). Beam search ranks by the log-softmax of the
same scores. :func:`next_scores` is the one place the step's scores are formed (the engine, and
the oracle in :mod:`hstu.generate.decode`), on :func:`hstu.model.item_index.item_scores` (which
evaluation's full ranking uses too); :func:`pick` the one sampler.

Symbols: R rows (users, or users x beams), I items (dense ids 1..I, column 0 padding), d width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hstu.model.item_index import item_scores, stream_topk, streams, top_rows

# the smallest positive normal float32: below it a temperature acts as this one (see sample_topk)
TEMPERATURE_FLOOR = float(torch.finfo(torch.float32).tiny)
# the engine's (R, I+1) exclusion buffer: an additive mask, 0 or -inf, of this dtype (2 bytes per entry),
# added to the scores in one vectorised pass: at 16 x 3,707 on one CPU thread 10 us against 53 us for a
# bool ``masked_fill_`` (measured side by side, torch 2.13)
MASK_DTYPE = torch.float16


@dataclass
class GenerationResult:
    """items (B, k) int64 dense ids; scores (B, k) float model scores (cosine / temperature);
    actions (B, k) int64 predicted action ids or None; beam_logprob (B,) or None."""

    items: torch.Tensor
    scores: torch.Tensor
    actions: torch.Tensor | None = None
    beam_logprob: torch.Tensor | None = None


def next_scores(
    index, user: torch.Tensor, temperature: float, exclude: torch.Tensor, *, repeat: tuple | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Scores of one decode step: cosine(user, every item) / ``temperature`` (+ the repeat bias),
    -inf where ``exclude``.

    Args:
        index: the model's item index (:meth:`hstu.model.hstu.HSTUModel.item_index`), I+1 rows.
        user: (R, d) L2-normalised user vectors.
        temperature: the model's similarity temperature (``ModelConfig.temperature``, > 0).
        exclude: (R, I+1) bool, True = never generate (:func:`exclusion_mask`); or an additive
            mask, 0 or -inf, of a float dtype (the engine's, :data:`MASK_DTYPE`).
        repeat: (RepeatBias, static (R, I+1), in_window (R, I+1) bool) from
            ``model.repeat`` and ``model.repeat_parts`` when the model has a repeat head, else None.
        out: optional (R, I+1) buffer written in place (the engine's preallocated scores).
    Returns:
        (R, I+1) float scores (``out`` when given), -inf at excluded items.
    """
    scores = item_scores(index, user, temperature, repeat=repeat, out=out)  # (R, I+1)
    return scores.masked_fill_(exclude, float("-inf")) if exclude.dtype == torch.bool else scores.add_(exclude)


@dataclass
class Exclusions:
    """A batch's never-generate set without its (B, I+1) mask (a streamed engine's request form,
    :func:`exclusion_pairs`): item ``ids[j]`` never for row ``rows[j]`` ((n,) int64 each, on the
    engine's device), ``never`` an optional (I+1,) bool row excluded for every row; padding id 0
    is always excluded. ``batch`` B rows, ``num_items`` I."""

    rows: torch.Tensor
    ids: torch.Tensor
    batch: int
    num_items: int
    never: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """The (B, I+1) bool mask of the same set (:func:`exclusion_mask`)."""
        mask = torch.zeros(self.batch, self.num_items + 1, dtype=torch.bool, device=self.rows.device)
        if self.never is not None:
            mask |= self.never.view(1, -1)
        mask[:, 0] = True
        mask[self.rows, self.ids] = True
        return mask

    def left(self) -> torch.Tensor:
        """(B,) int64 items 1..I each row may still generate."""
        V = self.num_items + 1
        key = torch.unique(self.rows * V + self.ids)  # distinct (row, id) pairs
        r, i = key // V, key % V
        keep = i > 0
        base = 0
        if self.never is not None:
            keep &= ~self.never[i]
            base = never_count(self.never)
        return self.num_items - base - torch.bincount(r[keep], minlength=self.batch)


_NEVER: list = [None, None, 0]  # (the mask, its (pointer, version), its count): one count per mask


def never_count(never: torch.Tensor) -> int:
    """Items 1..I that ``never`` (I+1,) bool excludes, counted once per mask: the same tensor
    unchanged (kept alive here, so no other tensor takes its address; ``_version`` moves with any
    in-place write) reuses the count (a served request's untrained-items mask at 120M items: 68 ms)."""
    key = (never.data_ptr(), never._version, never.shape)
    if _NEVER[1] != key or _NEVER[0] is None:
        _NEVER[:] = [never, key, int(never[1:].sum())]
    return _NEVER[2]


def exclusion_pairs(
    num_items: int,
    batch: int,
    ids: torch.Tensor | None,
    lengths: torch.Tensor | None,
    block: list[list[int]] | None = None,
    device: torch.device | str = "cpu",
    never: torch.Tensor | None = None,
) -> Exclusions:
    """The never-generate set of :func:`exclusion_mask` (same arguments) as :class:`Exclusions`:
    the history ids (if given; (B, W) int64 with (B,) ``lengths``) and block lists (dense ids;
    others ignored) as (row, id) pairs, ``never`` kept as one row. Raises ValueError for a
    ``never`` of another shape."""
    if never is not None:
        if never.shape != (num_items + 1,):
            raise ValueError(f"exclusion_mask: never must be (I+1,) = ({num_items + 1},), got {tuple(never.shape)}")
        never = never.to(device=device, dtype=torch.bool)
    parts = []
    if ids is not None:
        live = torch.arange(ids.shape[1], device=ids.device).view(1, -1) < lengths.view(-1, 1)
        parts.append((torch.arange(batch, device=ids.device).view(-1, 1).expand_as(ids)[live].to(device), ids[live].to(device)))
    pairs = [(b, i) for b, items in enumerate(block or []) for i in items if 0 < i <= num_items]
    if pairs or not parts:
        parts.append(tuple(torch.tensor(pairs, dtype=torch.int64, device=device).view(-1, 2).T))
    rows, cols = parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return Exclusions(rows, cols, batch, num_items, never)


def exclusion_mask(
    num_items: int,
    batch: int,
    ids: torch.Tensor | None,
    lengths: torch.Tensor | None,
    block: list[list[int]] | None = None,
    device: torch.device | str = "cpu",
    never: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, I+1) bool, True = never generate: padding 0, the history ids (if given; (B, W) int64
    with (B,) ``lengths``), block lists (dense ids; others ignored) and ``never``: an optional
    (I+1,) bool row excluded for every user (e.g. the items without training events,
    :attr:`hstu.generate.recommend.Recommender.untrained`). :func:`exclusion_pairs` densified.
    Raises ValueError for a ``never`` of another shape."""
    return exclusion_pairs(num_items, batch, ids, lengths, block, device, never).mask()


def check_candidates(exclude: torch.Tensor | Exclusions, need: int, detail: str) -> None:
    """Raise ValueError when a row of ``exclude`` ((B, I+1) bool, True = never generate, column
    0 padding; or :class:`Exclusions`) leaves fewer than ``need`` items: that row would otherwise
    generate excluded items with score -inf. ``detail`` ends the message (e.g. "k=10, beam width 1")."""
    left = exclude.left() if isinstance(exclude, Exclusions) else (~exclude[:, 1:]).sum(dim=1)  # (B,)
    short = (left < need).nonzero().view(-1).tolist()
    if short:
        raise ValueError(f"row(s) {short[:10]}: fewer than {need} items left after exclusion ({detail})")


def sample_topk(scores: torch.Tensor, top_k: int, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """Seeded sampling among the ``top_k`` best of each row at softmax ``temperature``; the one
    top-k sampler of every generation path.

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
    return sample_from_top(vals, idx, temperature, gen)


def sample_from_top(vals: torch.Tensor, idx: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """The draw of :func:`sample_topk` from its candidates: ``vals`` (R, k') float descending
    (finite first entry) at ids ``idx`` (R, k') int64 -> (R,) int64 picked ids. Shared by the
    full path (``scores.topk``) and the streamed one (:func:`pick_streamed`)."""
    z = vals.float() if vals.dtype in (torch.float16, torch.bfloat16) else vals
    z = (z - z[:, :1]).div_(max(float(temperature), TEMPERATURE_FLOOR))  # (R, k') in [-inf, 0]
    probs = torch.softmax(z, dim=1)
    return idx.gather(1, torch.multinomial(probs, 1, generator=gen)).squeeze(1)


def pick_streamed(
    index,
    user: torch.Tensor,
    model_temperature: float,
    exclude: torch.Tensor,
    strategy: str,
    top_k: int,
    temperature: float,
    gen,
    repeat=None,
    exclude_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pick` for a catalogue whose (R, I+1) scores are too large to form
    (:func:`hstu.model.item_index.streams`): the candidates come from
    :func:`hstu.model.item_index.stream_topk` (the :func:`next_scores` of every item, excluded ones
    and padding at -inf, taken block by block). Arguments as :func:`next_scores` and :func:`pick`
    (``exclude`` may be None), plus ``exclude_pairs`` (rows (n,), ids (n,)) int64, the sparse
    exclusions :func:`hstu.model.item_index.stream_topk` takes (the streamed engine's: no (R, I+1)
    mask); returns (choice (R,) int64, its score (R,) float32). Greedy takes the best (the lowest
    id among exact ties, as ``argmax``); "topk" draws with :func:`sample_from_top` among the
    ``top_k`` best. Raises ValueError for another strategy."""
    if strategy not in ("greedy", "topk"):
        raise ValueError(f"unknown strategy {strategy!r}; valid: greedy, topk, beam")
    k = 1 if strategy == "greedy" else min(top_k, index.num_rows)
    ex = dict(exclude=exclude, exclude_pairs=exclude_pairs, repeat=repeat)
    vals, idx = stream_topk(index, user, model_temperature, k, **ex)  # (R, k)
    if strategy == "greedy":
        return idx[:, 0], vals[:, 0]
    choice = sample_from_top(vals, idx, temperature, gen)
    return choice, vals.gather(1, (idx == choice.view(-1, 1)).to(torch.int64).argmax(dim=1, keepdim=True)).squeeze(1)


def pick(scores: torch.Tensor, strategy: str, top_k: int, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """(R,) int64 next item per row of ``scores`` (R, I+1): argmax ("greedy": the first maximal
    index, which ``max(dim=1).indices`` returns as ``argmax`` does, at a third of its cost: 33 vs
    94 us at (16, 3707) float32, one CPU thread) or :func:`sample_topk` ("topk").
    Raises ValueError for another strategy."""
    if strategy == "greedy":
        return scores.max(dim=1).indices
    if strategy == "topk":
        return sample_topk(scores, top_k, temperature, gen)
    raise ValueError(f"unknown strategy {strategy!r}; valid: greedy, topk, beam")


def beam_step_streamed(
    index, user: torch.Tensor, model_temperature: float, exclude, repeat, beam_lp: torch.Tensor, first: bool, exclude_pairs=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One beam-search expansion without the (B*W, I+1) log-softmax: each beam's W best items
    (:func:`hstu.model.item_index.stream_topk`; the log-softmax is monotone per row, so the W best
    continuations of B beams lie among them) at log-probability score - logsumexp(row).

    Args:
        index, user (B*W, d), model_temperature, exclude (B*W, I+1) bool or None, repeat: as :func:`next_scores`;
            exclude_pairs: optional sparse exclusions as :func:`pick_streamed`.
        beam_lp: (B, W) the beams' summed log-probabilities; first: every beam is the same
            sequence (the first step): expand beam 0 only.
    Returns:
        (top_lp (B, W) new beam log-probabilities, parent (B, W) int64 beam each extends, item
        (B, W) int64 its item, score (B, W) its score), ordered as the full path's ``topk``.
    """
    B, W = beam_lp.shape
    ex = dict(exclude=exclude, exclude_pairs=exclude_pairs, repeat=repeat)
    vals, ids, lse = stream_topk(index, user, model_temperature, W, **ex, lse=True)  # (B*W, W), (B*W,)
    lp = (vals - lse.view(-1, 1)).view(B, W, W)
    if first:
        return lp[:, 0], torch.zeros(B, W, dtype=torch.int64, device=user.device), ids.view(B, W, W)[:, 0], vals.view(B, W, W)[:, 0]
    top_lp, flat = top_rows((beam_lp.unsqueeze(-1) + lp).view(B, W * W), W)  # ties: lower beam, then lower item
    return top_lp, flat // W, ids.view(B, W * W).gather(1, flat), vals.view(B, W * W).gather(1, flat)


__all__ = [
    "beam_step_streamed",
    "GenerationResult",
    "TEMPERATURE_FLOOR",
    "check_candidates",
    "Exclusions",
    "exclusion_mask",
    "exclusion_pairs",
    "MASK_DTYPE",
    "next_scores",
    "pick",
    "pick_streamed",
    "sample_from_top",
    "sample_topk",
    "streams",
]
