"""What a caller hands :class:`hstu.generate.recommend.Recommender` and gets back: a raw
:class:`History` (original ids), its :class:`Prepared` form (dense ids, checked), the
:class:`Ranked` items of one history, and :class:`HistoryError` for a history that cannot be
used. Importable from :mod:`hstu.generate.recommend` as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class HistoryError(ValueError):
    """A history that cannot be used; the message names the field and index."""


@dataclass
class History:
    """One user's events, original ids. items, timestamps (Unix s), actions: equal lengths.

    Item ids are the run's original ids, int or text (:mod:`hstu.data.sequences`: a text id is
    trimmed, case kept; an int given to a run of text ids is its decimal text, a decimal text
    given to a run of integer ids is that integer); a bool is refused (HistoryError).

    ``features``: per event, None or {feature name: value} for a run with side features
    (:mod:`hstu.data.features`): a number for a numeric feature (bucketised with the run's stored
    quantile edges), a text for a categorical one (through the run's map; unknown -> 0); a value
    None is unknown (0). A feature an event does not name takes the item's last value in the
    training data (as a generated item does). An unknown name is refused (HistoryError naming
    ``history[i].features.NAME``)."""

    items: list[int | str]
    timestamps: list[int]
    actions: list[str] | None = None
    request_time: int | None = None  # default: the last event's time
    exclude: list[int | str] = field(default_factory=list)  # user block list (original ids)
    features: list[dict | None] | None = None  # per event {name: value}; see above


@dataclass
class Prepared:
    """A checked history in dense ids, the most recent events the model reads (``ids`` (n,) int64 and
    the same-length timestamps, actions, categories), its request time, warnings, the request's block
    list (dense ids) and ``older``: (m,) int64 dense ids of the known events dropped by truncation
    (excluded with the history when the history is excluded, never read by the model)."""

    ids: np.ndarray
    timestamps: np.ndarray
    actions: np.ndarray
    categories: np.ndarray
    request_time: int
    warnings: list[str]
    block: list[int]
    older: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass
class Ranked:
    """One history's generated items before they are described (what a model process answers,
    :mod:`hstu.serve.wire`): ``items`` (k,) int64 dense ids, ``scores`` (k,) the engine's float
    scores (cosine / temperature), ``actions`` (k,) int64 predicted action ids (0 = none) or None."""

    items: np.ndarray
    scores: np.ndarray
    actions: np.ndarray | None = None
