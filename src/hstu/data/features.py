"""Side features of a token (issue 21, item 4): categorical columns (``brand``, a ready ``price_bucket``)
and numeric columns bucketised into quantile buckets at load (``price`` -> price bucket).

Each feature is one embedding table summed into the token as the action and category embeddings
are (:meth:`hstu.model.base.SequenceModel.embed`; the reference port's token carries a price
bucket besides item, category, action and time). Value 0 of every feature is padding / unknown.

Options (the delimited loader's, :func:`hstu.data.delimited.load_csv`; ``[data]`` keys, or
``hstu train --feature COL --numeric-feature COL:BUCKETS``):

    features          = ["brand"]            categorical: a column's distinct texts -> ids 1..n
    numeric_features  = {price = 10}         name -> number of quantile buckets (>= 2)

Numeric: the bucket edges are the ``j / B`` quantiles (j = 1..B-1, NumPy's default linear
interpolation) of the **training** events' values (NaN and missing excluded), repeated edges
dropped; a value v goes to bucket ``1 + #(edges <= v)`` (1..len(edges)+1, values above the top
edge in the last), NaN / missing / non-numbers to 0. The edges are stored in idmap.json
(``features``), so evaluation, generation and serving bucketise a value identically.

Layout: ``EventLog.features`` (E, 1 + F) int64 token columns, column 0 the category (a copy of
``EventLog.categories``), columns 1..F the features in option order; ``item_features`` (I+1, 1 + F)
the item's last seen values (fed with generated items, as ``item_category`` is). Tensors that
carry categories through training, evaluation and the engine take this trailing axis when the
model has feature tables (``ModelConfig.features``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd

MIN_BUCKETS, MAX_BUCKETS = 2, 10_000


def parse_feature_options(features=None, numeric_features=None, where: str = "[data]") -> tuple[list[str], dict[str, int]]:
    """``features`` (a list, or a comma text) and ``numeric_features`` (a table name -> buckets, or a
    text ``"price:10,weight:5"``) -> (categorical names, numeric name -> buckets).

    Raises:
        ValueError naming ``where`` and the option: an empty or repeated name, a bucket count that
        is no integer in 2..10000.
    """
    cat = [s.strip() for s in features.split(",")] if isinstance(features, str) else list(features or [])
    if isinstance(numeric_features, str):
        pairs = []
        for part in filter(None, (p.strip() for p in numeric_features.split(","))):
            name, sep, n = part.rpartition(":")
            if not sep:
                raise ValueError(f"{where} numeric_features: {part!r} is not COLUMN:BUCKETS (e.g. price:10)")
            pairs.append((name.strip(), n.strip()))
    else:
        pairs = list((numeric_features or {}).items())
    num: dict[str, int] = {}
    for name, n in pairs:
        try:
            b = int(n) if not isinstance(n, bool) and str(n).strip().lstrip("-").isdigit() else None
        except ValueError:
            b = None
        if b is None or not MIN_BUCKETS <= b <= MAX_BUCKETS:
            raise ValueError(
                f"{where} numeric_features.{name}: the number of buckets must be an integer in {MIN_BUCKETS}..{MAX_BUCKETS}, got {n!r}"
            )
        num[str(name)] = b
    names = [*cat, *num]
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where} features: a feature name must be a non-empty column name, got {name!r}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where} features: {dup} given twice (each column is one feature)")
    return cat, num


def quantile_edges(values: np.ndarray, buckets: int) -> np.ndarray:
    """(n,) float64 training values (NaN = missing) -> (<= buckets - 1,) ascending float64 edges:
    the j / buckets quantiles, j = 1..buckets-1, repeats dropped; no values: no edges (one bucket)."""
    v = np.asarray(values, np.float64)
    v = v[~np.isnan(v)]
    if not len(v):
        return np.zeros(0, np.float64)
    return np.unique(np.quantile(v, np.arange(1, buckets) / buckets))


def bucketise(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """(n,) float64 values -> (n,) int64 buckets: ``1 + #(edges <= v)``; NaN -> 0 (unknown)."""
    v = np.asarray(values, np.float64)
    out = 1 + np.searchsorted(np.asarray(edges, np.float64), v, side="right")
    return np.where(np.isnan(v), 0, out).astype(np.int64)


def numeric_column(col: pd.Series) -> np.ndarray:
    """A loader column -> (n,) float64, NaN where a value is missing or no number (those events are unknown, 0)."""
    return pd.to_numeric(col, errors="coerce").to_numpy(np.float64)


def text_column(col: pd.Series) -> np.ndarray:
    """A categorical loader column -> (n,) object of trimmed texts, None where missing or empty."""
    s = col.astype("string").str.strip()
    keep = (s.notna() & (s != "")).to_numpy(bool)
    out = np.full(len(s), None, dtype=object)
    out[keep] = s[keep].to_numpy(dtype=object)
    return out


def fresh_maps(log_, train: np.ndarray) -> list[dict]:
    """The maps of ``log_``'s raw feature columns from its training events (``train``: (E,) bool):
    categorical -> ``{"name", "kind": "categorical", "values"}`` (the distinct texts, ascending; id
    = position + 1); numeric -> ``{"name", "kind": "numeric", "buckets", "edges"}`` (:func:`quantile_edges`)."""
    maps = []
    for name, raw in log_.feature_raw.items():
        if name in log_.feature_buckets:
            b = log_.feature_buckets[name]
            maps.append({"name": name, "kind": "numeric", "buckets": b, "edges": quantile_edges(raw[train], b).tolist()})
        else:
            vals = np.unique(np.array([v for v in raw if v is not None], dtype=str))
            maps.append({"name": name, "kind": "categorical", "values": vals.tolist()})
    return maps


def encode_column(m: dict, raw: np.ndarray) -> np.ndarray:
    """One feature's raw values ((n,) float64 with NaN, or object texts with None) -> (n,) int64 ids
    through its map ``m``: numeric :func:`bucketise`; categorical the value's position + 1, 0 for an
    unknown or missing text."""
    if m["kind"] == "numeric":
        return bucketise(raw, np.asarray(m["edges"], np.float64))
    return (pd.Index(m["values"], dtype=object).get_indexer(pd.Index(raw, dtype=object)) + 1).astype(np.int64)


def apply_features(log_, train_end: np.ndarray, stored: list[dict] | None = None):
    """``log_`` with its pending raw feature columns (``log_.feature_raw``: name -> (E,) object texts
    or float64 numbers; ``log_.feature_buckets``: numeric name -> buckets) encoded through ``stored``
    maps (a run's, so that evaluation bucketises as training did under any split), else
    :func:`fresh_maps` from the training events (each user's rows ``offsets[u] : train_end[u]``).
    Returns a shallow copy with ``features`` (E, 1+F), ``item_features`` (I+1, 1+F) and
    ``feature_maps`` (idmap.json ``features``); ``log_`` itself when it has no features.
    ValueError when ``stored`` names other features than the log's columns."""
    if not log_.feature_raw:
        return log_
    train = np.zeros(log_.num_events, bool)
    for s, e in zip(log_.offsets[:-1], train_end):
        train[s:e] = True
    maps = fresh_maps(log_, train) if stored is None else stored
    if [m["name"] for m in maps] != list(log_.feature_raw):
        raise ValueError(f"the run's side features {[m['name'] for m in maps]} are not the data's {list(log_.feature_raw)}")
    cols = [log_.categories] + [encode_column(m, log_.feature_raw[m["name"]]) for m in maps]
    features = np.stack(cols, axis=1).astype(np.int64)  # (E, 1 + F)
    item_features = np.zeros((log_.num_items + 1, features.shape[1]), np.int64)
    item_features[:, 0] = log_.item_category
    item_features[log_.items, 1:] = features[:, 1:]  # the last event of each item wins (fancy assignment order)
    return replace(log_, features=features, item_features=item_features, feature_maps=maps)


def feature_sizes(maps: list[dict]) -> dict[str, int]:
    """idmap.json ``features`` -> name -> number of values (ids 1..n; ModelConfig.features)."""
    return {m["name"]: len(m["edges"]) + 1 if m["kind"] == "numeric" else len(m["values"]) for m in maps}


class FeatureMaps:
    """A run's feature maps (idmap.json ``features``): per-event values -> ids, as the run's data was
    encoded. ``names``: the features in column order (token column 1 + i)."""

    def __init__(self, maps: list[dict] | None) -> None:
        self.maps = list(maps or [])
        self.names = [m["name"] for m in self.maps]

    def encode(self, name: str, values: list, where: str) -> np.ndarray:
        """Per-event values of feature ``name`` -> (n,) int64 ids: a categorical text through the run's
        map (unknown text -> 0), a number through the stored edges; None (missing) -> 0.

        Raises:
            KeyError: ``name`` is no feature of this run (the message lists them).
            ValueError naming ``where`` (``{i}``: the event index): a numeric feature's value that is
            no finite number, a categorical one that is no text or integer.
        """
        if name not in self.names:
            raise KeyError(f"unknown feature {name!r}; this run's: {self.names or 'none'}")
        m = self.maps[self.names.index(name)]
        numeric = m["kind"] == "numeric"
        raw = np.full(len(values), np.nan) if numeric else np.full(len(values), None, dtype=object)
        for i, v in enumerate(values):
            if v is None:
                continue
            if numeric and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise ValueError(f"{where.format(i=i)}: feature {name!r} is numeric: a finite number or null, got {v!r}")
            if not numeric and (isinstance(v, bool) or not isinstance(v, (str, int))):
                raise ValueError(f"{where.format(i=i)}: feature {name!r} is categorical: a text or null, got {v!r}")
            raw[i] = float(v) if numeric else (str(v).strip() or None)
        return encode_column(m, raw)
