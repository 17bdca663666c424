"""What a caller hands :class:`hstu.generate.recommend.Recommender` and gets back: a raw
:class:`History` (original ids), its :class:`Prepared` form (dense ids, checked), the
:class:`Ranked` items of one history, and :class:`HistoryError` for a history that cannot be
used, and the checks of an event's integer fields (:func:`check_event_int`, :func:`event_times`) that
``hstu generate --history`` and :meth:`Recommender.prepare` share. Importable from
:mod:`hstu.generate.recommend` as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hstu.config import INT64_MAX, TIME_S_MAX

TIME_FIELDS = ("timestamp", "request_time")  # an event's time and a request's: Unix seconds, 0..TIME_S_MAX


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


def check_event_int(where: str, name: str, value, minimum: int = 0) -> None:
    """Refuse an event's integer field: HistoryError ``"{where}.{name} must be an integer, got 1.7"``
    unless ``value`` is an int or a NumPy integer (a bool is not), ``"... must be in {minimum}..INT64_MAX,
    got -1"`` outside that range; a time (``name`` "timestamp" or "request_time") in 0..TIME_S_MAX (Unix
    seconds up to 2262-04-11: a millisecond time is named as such). The messages of ``hstu generate --history``
    (``where`` "FILE: event [i]") and :meth:`Recommender.prepare` (``where`` "history[i]"); the HTTP schema
    holds the same ranges."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise HistoryError(f"{where}.{name} must be an integer, got {value!r}")
    if name in TIME_FIELDS:
        if not minimum <= value <= TIME_S_MAX:
            hint = f" (up to 2262-04-11){ms_hint(value)}"
            raise HistoryError(f"{where}.{name} must be Unix seconds in {minimum}..{TIME_S_MAX}{hint}, got {value}")
    elif not minimum <= value <= INT64_MAX:
        raise HistoryError(f"{where}.{name} must be in {minimum}..{INT64_MAX}, got {value}")


def ms_hint(value) -> str:
    """The likely unit of a time past TIME_S_MAX (milliseconds today are ~1.7e12): "; milliseconds? ..." or ""."""
    return "; milliseconds? divide by 1000" if isinstance(value, int) and TIME_S_MAX < value < TIME_S_MAX * 1000 else ""


def event_times(timestamps) -> np.ndarray:
    """(n,) int64 Unix seconds of a :class:`History`'s ``timestamps`` (a list of ints, or an integer
    array), each in 0..TIME_S_MAX; else HistoryError naming the first bad one (:func:`check_event_int`,
    ``history[i].timestamp``). A list of Python ints in range is checked in one pass in C."""
    if (isinstance(timestamps, np.ndarray) and timestamps.dtype.kind in "iu") or set(map(type, timestamps)) <= {int}:
        try:
            ts = np.asarray(timestamps, dtype=np.int64)  # a uint64 past INT64_MAX wraps negative: refused below
            if not len(ts) or (ts.min() >= 0 and ts.max() <= TIME_S_MAX):
                return ts
        except OverflowError:  # a Python int past int64
            pass
    for i, t in enumerate(timestamps):
        check_event_int(f"history[{i}]", "timestamp", t)
    return np.asarray([int(t) for t in timestamps], dtype=np.int64)  # NumPy and Python ints mixed
