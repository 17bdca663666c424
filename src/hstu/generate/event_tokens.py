"""The token columns of a prepared history's events (:meth:`hstu.generate.recommend.Recommender.prepare`):
the items' categories and side features (:mod:`hstu.data.features`), an event's own feature values
(``History.features``) taking the place of the item's where given.
"""

from __future__ import annotations

import numpy as np

from hstu.data.features import FeatureMaps
from hstu.generate.histories import History, HistoryError

_UNSET = object()  # a feature an event does not name (History.features)


def event_tokens(
    features: FeatureMaps, item_tokens: np.ndarray, h: History, ids: np.ndarray, keep: np.ndarray, warnings: list[str] | None = None
) -> np.ndarray:
    """The kept events' categories: (n,) from the item table ``item_tokens`` ((I+1,) or (I+1, 1+F) int64)
    at their dense ``ids`` ((n,) int64), or with side features (``features``: the run's maps) (n, 1+F)
    token columns, the events' own feature values (``h.features``; ``keep`` (n,) their indices in ``h``)
    where given. HistoryError naming ``history[i].features[.NAME]`` for a bad entry, an unknown name or a bad value;
    a categorical value the run does not know reads as none (0), named in ``warnings`` (as an unknown action is)."""
    cats = item_tokens[ids]  # a copy (fancy indexing)
    if h.features is None:
        return cats
    if len(h.features) != len(h.items):
        raise HistoryError(f"history: features ({len(h.features)}) must have one entry (or null) per event ({len(h.items)})")
    given: dict[str, list] = {}
    for i, f in enumerate(h.features):
        if f is None:
            continue
        if not isinstance(f, dict):
            raise HistoryError(f"history[{i}].features: an object of feature name -> value or null, got {f!r}")
        for name, v in f.items():
            if name not in features.names:
                raise HistoryError(f"history[{i}].features.{name}: unknown feature {name!r}; this run's: {features.names or 'none'}")
            given.setdefault(name, [_UNSET] * len(h.items))[i] = v
    for name, vals in given.items():
        j = 1 + features.names.index(name)
        named = np.array([v is not _UNSET for v in vals])[keep]
        try:
            codes = features.encode(name, [None if v is _UNSET else v for v in vals], f"history[{{i}}].features.{name}")
        except ValueError as exc:
            raise HistoryError(str(exc)) from None
        cats[:, j] = np.where(named, codes[keep], cats[:, j])
        unknown = sorted({str(vals[i])[:40] for i in keep if vals[i] is not _UNSET and vals[i] is not None and codes[i] == 0})
        if unknown and warnings is not None and features.maps[j - 1]["kind"] != "numeric":
            warnings.append(f"features.{name}: unknown value(s) {unknown[:5]} (not in this run's data); those events read none")
    return cats
