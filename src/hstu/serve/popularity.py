"""Cold start: the most popular training items, for requests with no usable history.

The HSTU encoder needs at least one event (its user vector is the last live row, DESIGN.md
"The model"), so an empty history has no model answer. The documented fallback is popularity:
items ranked by how many **training** events (each user's events before ``Split.train_end``,
i.e. the rows the model was fitted on, so no validation or test target leaks in) name them,
ties broken by the smaller dense id. The score reported for such an item is its share of the
training events (count / total, 0..1), which says plainly that it is not a model score.

The counts come from the run's ``idmap.json`` when it stores them (key ``item_train_counts``:
I + 1 ints indexed by dense id; a large catalogue's array in its items.npz, :func:`hstu.runs.read_idmap`), else they are computed when the server loads the run, from the
data set recorded in the run's ``config.json`` (``data`` entry: dataset, data_dir, protocol,
max_users, ...; ``data_dir`` can be overridden). If neither is available the service still
starts, with cold start disabled (an empty history then answers 422 saying so).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hstu.data import EventLog, Split
from hstu.data.sequences import same_item_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Popularity:
    """order: (I,) int64 dense ids, most popular first; share: (I+1,) float64 training-event share
    per dense id (0 for padding and never-seen items); events: training events counted."""

    order: np.ndarray
    share: np.ndarray
    events: int
    source: str

    def top(self, k: int, blocked: set[int], trained_only: bool = False) -> list[tuple[int, float]]:
        """The ``k`` most popular (dense id, share) pairs whose id is not in ``blocked``;
        ``trained_only``: only items with training events (share > 0), fewer than k if so."""
        out = []
        for d in self.order:
            if trained_only and self.share[d] <= 0:
                break  # order is by count, descending: the rest have no training events
            if int(d) not in blocked:
                out.append((int(d), float(self.share[d])))
                if len(out) == k:
                    break
        return out


def popularity_from_counts(counts, source: str = "") -> Popularity:
    """Popularity from (I+1,) per-dense-id training event counts (index 0, padding, ignored)."""
    counts = np.asarray(counts, dtype=np.int64).copy()
    if counts.ndim != 1 or len(counts) < 2 or (counts < 0).any():
        raise ValueError(f"item_train_counts: expected I + 1 >= 2 non-negative counts, got shape {counts.shape}")
    counts[0] = 0
    total = int(counts.sum())
    order = np.argsort(-counts[1:], kind="stable") + 1  # stable: ties keep ascending dense id
    share = counts / total if total else counts.astype(np.float64)
    return Popularity(order.astype(np.int64), share.astype(np.float64), total, source)


def popularity_from_log(log_: EventLog, split: Split, source: str = "") -> Popularity:
    """Count each item's training events (per user: rows offsets[u] .. train_end[u])."""
    lengths = np.diff(log_.offsets)
    user_of = np.repeat(np.arange(len(lengths)), lengths)  # (E,) row -> user index
    train = np.arange(len(log_.items)) < split.train_end[user_of]  # (E,) bool
    return popularity_from_counts(np.bincount(log_.items[train], minlength=log_.num_items + 1), source)


def popularity_for_run(run_cfg: dict, idmap: dict, data_dir: str | Path | None = None) -> Popularity | None:
    """Popularity of a run's training data, or None (with a logged reason) when it cannot be computed.

    Args:
        run_cfg: the run's ``config.json`` dict (its ``data`` entry names the data set).
        idmap: the run's ``idmap.json`` dict; the data's item vocabulary must equal it.
        data_dir: overrides ``data.data_dir`` (e.g. the data moved since training); None: the
            counts stored in ``idmap.json``, else $HSTU_DATA_DIR, else ``data.data_dir``.
    """
    from hstu.data.prepare import DataSpec, prepare_data

    stored = idmap.get("item_train_counts")
    if stored is not None and data_dir is None:
        if len(stored) != len(idmap.get("item_raw_ids", [])):
            log.warning(
                "idmap.json item_train_counts has %d entries for %d ids; recomputing from the data",
                len(stored),
                len(idmap.get("item_raw_ids", [])),
            )
        else:
            return popularity_from_counts(stored, "idmap.json item_train_counts")
    data = dict(run_cfg.get("data") or {})
    if not data:
        log.warning("cold start disabled: the run's config.json has no 'data' entry")
        return None
    data_dir = data_dir if data_dir is not None else os.environ.get("HSTU_DATA_DIR") or None
    if data_dir is not None:
        data["data_dir"] = str(data_dir)
    try:
        spec = DataSpec(**{**data, "items": None})  # the counts only; item metadata is in idmap.json
        log_, split = prepare_data(spec)
    except (FileNotFoundError, ValueError, KeyError, TypeError, OSError) as exc:
        log.warning("cold start disabled: cannot load the run's training data (%s); pass --data-dir to enable it", exc)
        return None
    if not same_item_ids(idmap.get("item_raw_ids", []), log_.item_raw_ids):  # lists (idmap.json) or arrays (items.npz)
        log.warning("cold start disabled: the data at %s does not match the run's item vocabulary", spec.data_dir)
        return None
    return popularity_from_log(log_, split, source=f"{spec.dataset} at {spec.data_dir} (training events, protocol {spec.protocol})")


__all__ = ["Popularity", "popularity_for_run", "popularity_from_counts", "popularity_from_log"]
