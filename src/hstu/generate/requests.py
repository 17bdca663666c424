"""Request preparation of :meth:`hstu.generate.engine.Engine.generate`: the engine's size checks,
argument checks, defaults, history truncation, bucket choice and the result's buffers.

Symbols: B rows, W padded width, I items, E a bucket edge.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from hstu.generate.hardening import check_inputs_on
from hstu.generate.prefix_cache import history_events
from hstu.generate.sampler import Exclusions, GenerationResult, check_candidates

if TYPE_CHECKING:
    from hstu.generate.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class EngineResult(GenerationResult):
    """GenerationResult plus: bucket (B,) int64 edge each row ran in; truncated (B,) int64 events
    cut from the oldest end; prefix_rows (B,) int64 rows reused from the prefix cache (0 = miss)."""

    bucket: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    prefix_rows: torch.Tensor | None = None
    warnings: list[str] = field(default_factory=list)


class EngineCall(NamedTuple):
    """One checked call: ``req`` the (B, ...) tensors the groups read (ids, timestamps, lengths,
    actions, categories, request_time, exclude, item_category), ``bucket_of`` / ``lengths`` B host
    ints, ``width`` beams per user (1 unless beam search), ``out`` the result to fill, and the
    call's decoding arguments as Engine.generate takes them. ``events``: (B, W, 3 + F) int64
    (:func:`hstu.generate.prefix_cache.history_events`) when the user-prefix cache is on for this
    call (a cache, ``user_ids`` and the KV cache), else None."""

    req: dict
    bucket_of: list[int]
    lengths: list[int]
    width: int
    out: EngineResult
    k: int
    strategy: str
    top_k: int
    temperature: float
    user_ids: Sequence[Hashable] | None
    use_cache: bool
    events: torch.Tensor | None = None


def check_engine_sizes(cfg, buckets, max_batch: int, k_max: int) -> tuple[int, ...]:
    """The bucket edges of an Engine over a model of ``cfg`` (ModelConfig), checked: increasing and
    positive, the largest <= max_seq_len; 1 <= k_max <= max_output_len; max_batch >= 1.
    ValueError quoting the value otherwise."""
    edges = tuple(int(b) for b in buckets)
    if not edges or any(b <= 0 for b in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"buckets must be increasing positive edges, got {list(buckets)}")
    if edges[-1] > cfg.max_seq_len:
        raise ValueError(f"largest bucket {edges[-1]} exceeds the model max_seq_len={cfg.max_seq_len}")
    if not 1 <= k_max <= cfg.max_output_len:
        raise ValueError(f"k_max must be in 1..max_output_len={cfg.max_output_len}, got {k_max}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return edges


def parse_buckets(text: str) -> list[int]:
    """ "20,50,100" -> [20, 50, 100]; ValueError naming --buckets on anything else."""
    try:
        edges = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--buckets: expected comma-separated integers such as 20,50,100,200, got {text!r}") from None
    if not edges or any(e < 1 for e in edges) or edges != sorted(set(edges)):
        raise ValueError(f"--buckets: edges must be distinct, ascending and >= 1, got {text!r}")
    return edges


def fit_buckets(edges: list[int] | None, max_seq_len: int, name: str = "--buckets") -> list[int]:
    """Explicit edges must fit the model (ValueError naming ``name``, their flag or config field, otherwise); the
    defaults are clipped to ``max_seq_len`` and closed by it, so that every history up to the model's length has a bucket."""
    if edges is not None:
        if edges[-1] > max_seq_len:
            raise ValueError(f"{name}: edge {edges[-1]} exceeds the model's max_seq_len={max_seq_len}")
        return edges
    from hstu.generate.recommend import default_buckets  # the Recommender's own edges: one definition

    return list(default_buckets(max_seq_len))


def prepare_request(
    eng: Engine,
    ids,
    timestamps,
    lengths,
    k,
    *,
    request_time,
    exclude,
    strategy,
    top_k,
    temperature,
    beam_width,
    actions,
    categories,
    item_category,
    user_ids,
    use_cache,
    bucket,
) -> EngineCall:
    """Everything :meth:`Engine.generate` does before the first bucket runs (arguments as it
    documents): checks, zero features and the default request time (each row's last event),
    truncation to the largest edge, the exclusion mask with padding id 0 excluded and enough
    candidates left, each row's bucket, and the result's (B, k) buffers on the engine's device.

    Raises:
        ValueError / TypeError / StrayTensorError: as Engine.generate documents.
    """
    B = validate_request(eng, ids, timestamps, lengths, k, strategy, beam_width, use_cache, actions, categories, exclude, user_ids)
    dev, warnings = eng.device, []
    lengths = lengths.clone()
    actions = actions if actions is not None else torch.zeros_like(ids)
    if categories is None:
        categories = torch.zeros(*ids.shape, *eng.model.token_shape, dtype=torch.int64, device=ids.device)
    if request_time is None:
        request_time = timestamps.gather(1, (lengths - 1).clamp(min=0).view(B, 1)).view(B)
    check_inputs_on(dev, request_time=request_time, item_category=item_category)
    ids, timestamps, actions, categories, lengths, truncated = truncate(
        eng.edges[-1], ids, timestamps, actions, categories, lengths, warnings
    )
    if isinstance(exclude, Exclusions) and not eng.streamed:
        exclude = exclude.mask()  # the full engine's (B, I+1) form
    if exclude is None and not eng.streamed:  # a streamed engine forms no (B, I+1) mask (decode_loop.py)
        exclude = torch.zeros(B, eng.model.cfg.num_items + 1, dtype=torch.bool, device=dev)
    W = beam_width if strategy == "beam" else 1
    if exclude is not None:
        if not isinstance(exclude, Exclusions):
            exclude[:, 0] = True
        check_candidates(exclude, max(k, W), f"k={k}, beam width {W}")
    elif eng.model.cfg.num_items < max(k, W):
        raise ValueError(f"fewer than {max(k, W)} items in the catalogue (k={k}, beam width {W})")
    if strategy == "beam" and W > eng.max_batch:
        raise ValueError(f"beam_width={W} exceeds max_batch={eng.max_batch} (pool rows)")
    L_host = lengths.tolist()
    bucket_of = choose_buckets(eng, L_host, bucket)
    out = EngineResult(
        items=torch.zeros(B, k, dtype=torch.int64, device=dev),
        scores=torch.zeros(B, k, dtype=eng.score_dtype, device=dev),
        actions=torch.zeros(B, k, dtype=torch.int64, device=dev) if eng.model.action_head is not None else None,
        beam_logprob=torch.zeros(B, dtype=eng.score_dtype, device=dev) if strategy == "beam" else None,
        bucket=torch.tensor(bucket_of, dtype=torch.int64, device=dev),
        truncated=truncated,
        prefix_rows=torch.zeros(B, dtype=torch.int64, device=dev),
        warnings=warnings,
    )
    req = {"ids": ids, "timestamps": timestamps, "lengths": lengths, "actions": actions, "categories": categories}
    req.update(request_time=request_time, exclude=exclude, item_category=item_category)
    events = history_events(ids, timestamps, actions, categories) if eng.prefix is not None and user_ids is not None and use_cache else None
    user_ids = user_keys(user_ids) if events is not None else user_ids
    return EngineCall(req, bucket_of, L_host, W, out, k, strategy, top_k, temperature, user_ids, use_cache, events)


def user_keys(user_ids: Sequence[Hashable]) -> list[Hashable]:
    """The prefix cache's keys of ``user_ids`` (B entries): a tensor or NumPy array as its Python
    values, a tensor / NumPy scalar entry as its value (a tensor hashes by identity: a returning
    user would never be found). TypeError naming the entry for an unhashable one."""
    if hasattr(user_ids, "tolist"):
        user_ids = user_ids.tolist()
    keys = [u.item() if hasattr(u, "item") and getattr(u, "ndim", 1) == 0 else u for u in user_ids]
    for i, u in enumerate(keys):
        if not isinstance(u, Hashable):
            raise TypeError(f"user_ids[{i}] is a {type(u).__name__}: user keys must be hashable (an int or a string)")
    return keys


def row_groups(rows: list[int], hits: dict, per_group: int, in_order: bool) -> list[tuple[list[int], dict]]:
    """One bucket's ``rows`` as the engine runs them: chunks of at most ``per_group``, each with the
    prefix-cache ``hits`` it uses (a chunk either extends cached prefixes or prefills). Misses first,
    then hits; ``in_order`` (seeded top-k, whose one generator is drawn chunk by chunk): the rows'
    own order in chunks as without a cache, so the same call gives the same items whatever the cache
    holds; a chunk with a miss then prefills every row (its hits unused)."""
    if in_order:
        chunks = [rows[j : j + per_group] for j in range(0, len(rows), per_group)]
        return [(c, {i: hits[i] for i in c} if all(i in hits for i in c) else {}) for c in chunks]
    out = []
    for g in ([i for i in rows if i not in hits], [i for i in rows if i in hits]):
        out += [(g[j : j + per_group], {i: hits[i] for i in g[j : j + per_group] if i in hits}) for j in range(0, len(g), per_group)]
    return out


def smallest_edge(edges, length: int, *, truncate: bool = False) -> int:
    """The smallest of ascending bucket ``edges`` >= ``length`` (the one bucket choice of the engine,
    the Recommender and the server). A longer history: the largest edge when ``truncate`` (the engine
    keeps its most recent events), else ValueError naming the length."""
    for E in edges:
        if length <= E:
            return E
    if truncate:
        return edges[-1]
    raise ValueError(f"history length {length} exceeds the largest bucket {edges[-1]}")


def choose_buckets(eng: Engine, lengths: list[int], bucket: int | None) -> list[int]:
    """Each row's bucket edge: ``bucket`` for all (one of the engine's edges, every history must fit),
    else each row's smallest (:meth:`Engine.bucket_for`). ValueError naming the bucket or the row."""
    if bucket is not None:
        if bucket not in eng.edges:
            raise ValueError(f"bucket={bucket} is not one of the engine's buckets {list(eng.edges)}")
        if max(lengths) > bucket:
            raise ValueError(f"bucket={bucket}: row {lengths.index(max(lengths))} has {max(lengths)} events")
    return [bucket or eng.bucket_for(n) for n in lengths]


def validate_request(
    eng: Engine, ids, timestamps, lengths, k, strategy, beam_width, use_cache, actions, categories, exclude, user_ids
) -> int:
    """Check one Engine.generate call's arguments (see its docstring); returns B.

    Raises:
        ValueError / TypeError: as Engine.generate documents. StrayTensorError: an input on another device.
    """
    c = eng.model.cfg
    ex = (exclude.rows, exclude.never) if isinstance(exclude, Exclusions) else (exclude, None)
    check_inputs_on(eng.device, ids=ids, timestamps=timestamps, lengths=lengths, actions=actions, categories=categories, exclude=ex[0])
    check_inputs_on(eng.device, never=ex[1])
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
    for name, t, tail in (("actions", actions, ()), ("categories", categories, eng.model.token_shape)):
        if t is not None and t.shape != (*ids.shape, *tail):
            raise ValueError(f"{name} must have the shape {(*ids.shape, *tail)} (ids' + the model's token columns), got {tuple(t.shape)}")
    if isinstance(exclude, Exclusions):
        if (exclude.batch, exclude.num_items) != (B, c.num_items):
            raise ValueError(f"exclude: Exclusions of {exclude.batch} rows x {exclude.num_items} items for {B} rows x {c.num_items} items")
    elif exclude is not None and (exclude.shape != (B, c.num_items + 1) or exclude.dtype != torch.bool):
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
    ar = eng._arange if Wd <= eng._arange.numel() else torch.arange(Wd, device=lengths.device)  # a width past the model's: truncated later
    live = ar[:Wd].view(1, Wd) < lengths.view(B, 1)
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
        actions = actions.gather(1, shift)
        categories = categories.gather(1, shift.view(B, Emax, *[1] * (categories.dim() - 2)).expand(B, Emax, *categories.shape[2:]))
        lengths = lengths.clamp(max=Emax)
        n_cut = int((truncated > 0).sum())
        msg = f"{n_cut} history(ies) longer than the largest bucket {Emax}: kept the most recent {Emax} events"
        warnings.append(msg)
        log.warning(msg)
    return ids, timestamps, actions, categories, lengths, truncated
