"""E-commerce event-log loaders: Taobao UserBehavior, Retailrocket, and a generic CSV/Parquet log.

Every loader returns an :class:`~hstu.data.sequences.EventLog` whose tokens carry (item, action,
category, timestamp) — the multi-action input of a generative recommender (Zhai et al. 2024, §2.1:
"actions" as part of the sequence). E-commerce users return to items they have seen (view → cart →
buy), so history items stay candidates by default (``exclude_history_default=False``); pass
``exclude_history=True`` to change that per data set.

Formats
    taobao        UserBehavior.csv (Zhu et al., KDD 2018; Alibaba Tianchi), no header:
                  ``user_id,item_id,category_id,behavior_type,timestamp`` (Unix s),
                  behavior_type in pv | cart | fav | buy.
    retailrocket  events.csv (Retailrocket recommender system data set, Kaggle), header
                  ``timestamp,visitorid,event,itemid,transactionid``; timestamp in Unix **ms**
                  (sorted on the ms, then converted to s, floor), event in view | addtocart | transaction. Item
                  categories come from item_properties_part*.csv (property ``categoryid``, the
                  latest value per item) when those files sit beside events.csv.
    csv           any delimited (``--format``: separator, header or none) or Parquet log, one
                  file or several, with a column mapping (names or positions), time optional
                  (order-only data): :mod:`hstu.data.delimited`.

Time order: events are sorted on the exact time as given (ms, us, ns, fractional ISO seconds), and
only then floored to the model's seconds (:mod:`hstu.data.times`).

Errors: a missing file raises FileNotFoundError; a malformed row raises
:class:`~hstu.data.errors.DataFormatError` naming the file and 1-based line (Parquet: row index),
unless ``skip_bad_rows`` (then rows are dropped, counted in ``EventLog.skipped_rows`` and logged).
Files are parsed with pandas' C parser first; only when that fails or a value is out of range does a
line-by-line pass run to name the first bad line (the shared parsing: :mod:`hstu.data.parsing`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from hstu.data.delimited import load_csv, parse_columns
from hstu.data.errors import DataFormatError
from hstu.data.parsing import Column, read_columns, resolve_path, to_event_log
from hstu.data.sequences import EventLog
from hstu.data.times import TIME_UNITS

log = logging.getLogger(__name__)

TAOBAO_ACTIONS = ("pv", "cart", "fav", "buy")
RETAILROCKET_ACTIONS = ("view", "addtocart", "transaction")
# Action names that mean a purchase, for the "HR@10 on purchase targets" slice.
PURCHASE_ACTIONS = frozenset({"buy", "transaction", "purchase", "order"})


def _no_options(loader: str, options: dict) -> None:
    if options:
        raise ValueError(f"{loader}: unknown option(s) {sorted(options)} (column mappings are for --dataset csv)")


# ----------------------------------------------------------------------------- loaders
def load_taobao(data_dir: str | Path, skip_bad_rows: bool = False, *, exclude_history: bool | None = None, **options) -> EventLog:
    """Taobao UserBehavior CSV (``user_id,item_id,category_id,behavior_type,timestamp``, no header).

    ``data_dir``: the CSV, or a directory with UserBehavior.csv or UserBehavior_head.csv.
    Actions are pv=1, cart=2, fav=3, buy=4 (fixed, whatever subset occurs); categories are
    ``category_id``; timestamps Unix s (kept as given, including the few outside the official
    2017-11-25..12-03 window).

    Raises:
        FileNotFoundError: no such file. DataFormatError: a row without 5 fields, a non-integer
        id or time, or an unknown behavior_type (file:line), unless ``skip_bad_rows``.
        ValueError: unknown options.
    """
    _no_options("taobao", options)
    path = resolve_path(data_dir, ("UserBehavior.csv", "UserBehavior_head.csv"), "the Taobao UserBehavior CSV")
    cols = [Column("user", 0), Column("item", 1), Column("category", 2), Column("action", 3, TAOBAO_ACTIONS), Column("time", 4)]
    df, skipped = read_columns(path, cols, header=False, skip_bad_rows=skip_bad_rows)
    return to_event_log(df, name="taobao", action_names=list(TAOBAO_ACTIONS), exclude_history=exclude_history, skipped=skipped, source=path)


def _retailrocket_categories(directory: Path) -> dict[int, int] | None:
    """item id -> latest ``categoryid`` from item_properties_part*.csv, or None if absent."""
    parts = sorted(directory.glob("item_properties_part*.csv"))
    if not parts:
        return None
    frames = []
    for p in parts:
        try:  # ~11M rows per part: read in chunks, keep only the categoryid rows
            for chunk in pd.read_csv(
                p, usecols=["timestamp", "itemid", "property", "value"], dtype={"property": str, "value": str}, chunksize=2_000_000
            ):
                frames.append(chunk[chunk["property"] == "categoryid"])
        except (ValueError, pd.errors.ParserError) as exc:
            raise DataFormatError(p, None, f"cannot read item properties: {exc}") from None
    props = pd.concat(frames, ignore_index=True)
    props["cat"] = pd.to_numeric(props["value"], errors="coerce")
    props = props.dropna(subset=["cat"]).sort_values("timestamp", kind="stable")
    latest = props.groupby("itemid")["cat"].last()
    log.info("retailrocket: categories for %d items from %s", len(latest), [p.name for p in parts])
    return {int(k): int(v) for k, v in latest.items()}


def load_retailrocket(
    data_dir: str | Path, skip_bad_rows: bool = False, *, exclude_history: bool | None = None, item_properties: bool = True, **options
) -> EventLog:
    """Retailrocket events.csv (header ``timestamp,visitorid,event,itemid,transactionid``).

    Timestamps are Unix ms, converted to s by floor division. Actions view=1, addtocart=2,
    transaction=3 (``transactionid`` is not needed: a transaction event is the purchase). With
    ``item_properties`` and item_properties_part*.csv beside events.csv, each item's category
    is its latest ``categoryid`` property; items without one get category 0 (none).

    Raises:
        FileNotFoundError: no such file. DataFormatError: header without a needed column
        (line 1), a non-integer id or time, or an unknown event (file:line), unless
        ``skip_bad_rows``. ValueError: unknown options.
    """
    _no_options("retailrocket", options)
    path = resolve_path(data_dir, ("events.csv",), "Retailrocket events.csv")
    cols = [
        Column("time", "timestamp"),
        Column("user", "visitorid"),
        Column("action", "event", RETAILROCKET_ACTIONS),
        Column("item", "itemid"),
    ]
    df, skipped = read_columns(path, cols, header=True, time_unit=TIME_UNITS["ms"], skip_bad_rows=skip_bad_rows)
    cats = _retailrocket_categories(path.parent) if item_properties else None
    if cats is not None:
        df["category"] = df["item"].map(cats).fillna(-1).astype(np.int64)
        missing = int((df["category"] < 0).sum())
        if missing:
            log.info("retailrocket: %d events on items without a categoryid property (category: none)", missing)
    out = to_event_log(
        df, name="retailrocket", action_names=list(RETAILROCKET_ACTIONS), exclude_history=exclude_history, skipped=skipped, source=path
    )
    if cats is not None:
        _drop_unknown_category(out)
    return out


def _drop_unknown_category(log_: EventLog) -> None:
    """Category raw id -1 (no categoryid property) becomes 0 = none, in place."""
    raw = log_.category_raw_ids
    if raw is None or len(raw) < 2 or raw[1] != -1:  # raw ids are ascending: -1 would be first
        return
    # dense 1 is "unknown": shift every other category down by one and make unknown 0.
    log_.categories = np.where(log_.categories == 1, 0, log_.categories - 1).clip(min=0)
    log_.item_category = np.where(log_.item_category == 1, 0, log_.item_category - 1).clip(min=0)
    log_.category_raw_ids = np.concatenate([[0], raw[2:]]).astype(np.int64)


__all__ = ["LOADERS", "PURCHASE_ACTIONS", "load_csv", "load_retailrocket", "load_taobao", "parse_columns"]
LOADERS: dict[str, Callable[..., EventLog]] = {"taobao": load_taobao, "retailrocket": load_retailrocket, "csv": load_csv}
