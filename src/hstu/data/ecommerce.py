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
    csv           any CSV (header row) or Parquet file with a column mapping
                  ``user=…,item=…,time=…[,action=…][,category=…][,time_unit=s|ms|us|ns]``.
                  user/item/category must be integers; time is integer Unix time (``time_unit``,
                  default: s, or ms when every value is >= 1e11, i.e. after year 5138 in s) or a
                  date-time string (ISO 8601, UTC unless it carries an offset).

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

from hstu.data.errors import DataFormatError
from hstu.data.parsing import MAPPING_KEYS, Column, parse_lines, read_columns, resolve_path, to_event_log
from hstu.data.sequences import EventLog
from hstu.data.times import TIME_UNITS, exact_times, split_time, unit_of

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
    return to_event_log(df, name="taobao", action_names=list(TAOBAO_ACTIONS), exclude_history=exclude_history, skipped=skipped)


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
    out = to_event_log(df, name="retailrocket", action_names=list(RETAILROCKET_ACTIONS), exclude_history=exclude_history, skipped=skipped)
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


def parse_columns(spec: str | dict) -> tuple[dict[str, str], str | None]:
    """``"user=uid,item=iid,time=ts[,action=ev][,category=cat][,time_unit=ms]"`` (or a dict)
    -> (mapping key -> column name, time_unit or None).

    Raises:
        ValueError: not ``key=value`` pairs, an unknown key, a duplicate, or user/item/time missing.
    """
    if isinstance(spec, dict):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    else:
        pairs = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ValueError(f"--columns: {part!r} is not key=column (e.g. user=uid,item=iid,time=ts)")
            k, v = part.split("=", 1)
            pairs.append((k.strip(), v.strip()))
    mapping: dict[str, str] = {}
    unit = None
    for k, v in pairs:
        if k == "time_unit":
            unit = v
            continue
        if k not in MAPPING_KEYS:
            raise ValueError(f"--columns: unknown key {k!r}; valid: {list(MAPPING_KEYS) + ['time_unit']}")
        if k in mapping:
            raise ValueError(f"--columns: {k!r} given twice")
        if not v:
            raise ValueError(f"--columns: {k}= needs a column name")
        mapping[k] = v
    missing = [k for k in ("user", "item", "time") if k not in mapping]
    if missing:
        raise ValueError(f"--columns: missing {missing} (user, item and time are required), got {spec!r}")
    if unit is not None and unit not in TIME_UNITS:
        raise ValueError(f"--columns: time_unit must be one of {list(TIME_UNITS)}, got {unit!r}")
    return mapping, unit


def _exact_int(v) -> int | None:
    """An id value as an exact Python int, or None: ints as they are, whole floats below 2^53
    (where float64 is still exact), strings such as '12' or '12.0'; anything else None."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return int(v) if float(v).is_integer() and abs(v) < 2**53 else None
    try:
        return int(str(v).strip())
    except ValueError:
        try:
            f = float(str(v))
        except ValueError:
            return None
        return int(f) if f.is_integer() and abs(f) < 2**53 else None


def _exact_ids(col: pd.Series) -> tuple[pd.Series, np.ndarray]:
    """(int64 ids, bad-row mask) of an id column, exactly: an int64 column (or strings that
    pandas reads as int64) as it is, anything else value by value (:func:`_exact_int`), so an
    id past int64 is a bad row instead of a float rounded onto another id or a wrapped integer."""
    if col.dtype == object:
        try:
            num = pd.to_numeric(col)
        except (ValueError, TypeError, OverflowError):
            num = None
        col = num if num is not None and num.dtype == np.int64 else col
    if pd.api.types.is_signed_integer_dtype(col):
        return col.astype(np.int64), np.zeros(len(col), bool)
    vals = [_exact_int(v) for v in col.tolist()]
    bad = np.array([v is None or not -(2**63) <= v < 2**63 for v in vals], bool)
    return pd.Series([0 if b else v for v, b in zip(vals, bad)], index=col.index, dtype=np.int64), bad


def _frame_checks(
    df: pd.DataFrame,
    mapping: dict[str, str],
    unit: str | None,
    where: Callable[[int], tuple[int | None, str]],
    path: Path,
    skip_bad_rows: bool,
) -> tuple[pd.DataFrame, int]:
    """Vectorised checks and conversion of a frame read with inferred dtypes (Parquet, or a CSV
    with a header). ``where(i)`` gives (line, prefix) of frame row i for error messages.

    Returns (frame with the mapping keys as columns, skipped rows). Raises DataFormatError at
    the first bad row unless ``skip_bad_rows`` (then bad rows are dropped, counted, logged).
    """
    problems: list[tuple[np.ndarray, Callable[[int], str]]] = []
    out: dict[str, pd.Series] = {}
    for key in ("user", "item", "category"):
        if key not in mapping:
            continue
        col = df[mapping[key]]
        num, bad = _exact_ids(col)
        problems.append(
            (
                bad,
                lambda i, key=key, col=col: (
                    f"{key} ({mapping[key]!r}) is "
                    + ("missing" if pd.isna(col.iloc[i]) else f"not an integer in the int64 range: {str(col.iloc[i])[:40]!r}")
                ),
            )
        )
        out[key] = num
    if "action" in mapping:
        col = df[mapping["action"]]
        text = col.astype(str).str.strip()
        bad = (col.isna() | (text == "")).to_numpy()
        problems.append((bad, lambda i: f"action ({mapping['action']!r}) is empty"))
        out["action"] = text
    col = df[mapping["time"]]
    secs, out["subsecond_ns"], bad = exact_times(col, unit, path)
    problems.append(
        (
            bad,
            lambda i: (
                f"time ({mapping['time']!r}) is "
                + (
                    "missing"
                    if pd.isna(col.iloc[i])
                    else f"neither integer Unix time (int64) nor an ISO 8601 date-time: {str(col.iloc[i])[:40]!r}"
                )
            ),
        )
    )
    out["time"] = secs
    any_bad = np.zeros(len(df), bool)
    for bad, _ in problems:
        any_bad |= bad
    skipped = 0
    if any_bad.any():
        i = int(np.argmax(any_bad))
        msg = next(m(i) for bad, m in problems if bad[i])
        line, prefix = where(i)
        exc = DataFormatError(path, line, prefix + msg)
        if not skip_bad_rows:
            raise exc
        skipped = int(any_bad.sum())
        log.warning("%s: skipped %d malformed rows (first: %s)", path, skipped, exc)
    keep = ~any_bad
    frame = pd.DataFrame({k: (v[keep].astype(np.int64) if k != "action" else v[keep]) for k, v in out.items()}).reset_index(drop=True)
    return frame, skipped


def load_csv(
    data_dir: str | Path,
    skip_bad_rows: bool = False,
    *,
    columns: str | dict | None = None,
    sep: str = ",",
    time_unit: str | None = None,
    exclude_history: bool | None = None,
    name: str = "csv",
    **options,
) -> EventLog:
    """A generic event log: CSV with a header row, or Parquet (``.parquet`` / ``.pq``).

    Args:
        data_dir: the file, or a directory holding exactly one .csv / .parquet file.
        columns: mapping ``user=…,item=…,time=…[,action=…][,category=…][,time_unit=…]``
            (string, as ``--columns`` gives it, or a dict).
        sep: CSV field separator.
        time_unit: unit of integer times (s | ms | us | ns); default s, or ms when every
            value is >= 1e11. Date-time strings are parsed as ISO 8601 (UTC if no offset).
        exclude_history: the data set's candidate-exclusion default (default False).
    Returns:
        EventLog named ``name``; action names in order of first appearance.
    Raises:
        ValueError: no or bad ``columns``, unknown options. FileNotFoundError.
        DataFormatError: a mapped column missing from the header (line 1), a row with too
        few fields, a non-integer user/item/category, an empty action, an unparsable time
        (file:line; Parquet: row index), unless ``skip_bad_rows``.
    """
    if options:
        raise ValueError(f"csv: unknown option(s) {sorted(options)}; valid: columns, sep, time_unit, exclude_history")
    if columns is None:
        raise ValueError("csv: a column mapping is needed, e.g. --columns user=user_id,item=item_id,time=timestamp,action=event")
    mapping, unit_from_map = parse_columns(columns)
    unit = time_unit or unit_from_map
    if unit is not None and unit not in TIME_UNITS:
        raise ValueError(f"csv: time_unit must be one of {list(TIME_UNITS)}, got {unit!r}")
    path = resolve_path(data_dir, (), "an event log (.csv or .parquet)", exts=(".csv", ".parquet", ".pq", ".tsv"))
    if path.suffix.lower() in (".parquet", ".pq"):
        df, skipped = _read_parquet(path, mapping, unit, skip_bad_rows)
    else:
        df, skipped = _read_csv_mapped(path, mapping, unit, sep, skip_bad_rows)
    return to_event_log(df, name=name, action_names=None, exclude_history=exclude_history, skipped=skipped)


def _read_csv_mapped(path: Path, mapping: dict[str, str], unit: str | None, sep: str, skip_bad_rows: bool) -> tuple[pd.DataFrame, int]:
    keys = [k for k in MAPPING_KEYS if k in mapping]
    try:
        head = pd.read_csv(path, sep=sep, nrows=0)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise DataFormatError(path, 1, f"cannot read the header: {exc}") from None
    names = [str(c).strip() for c in head.columns]
    for k in keys:
        if mapping[k] not in names:
            raise DataFormatError(path, 1, f"column {mapping[k]!r} (for {k}) not in the header; columns: {names}")
    try:
        # blank lines kept as all-NaN rows, so frame index i is file line i + 2 (header = line 1)
        # no usecols: with it pandas silently accepts rows with extra fields (shifted columns)
        raw = pd.read_csv(
            path, sep=sep, engine="c", skip_blank_lines=False, dtype={mapping["action"]: str} if "action" in mapping else None
        )[[mapping[k] for k in keys]]
        for k in ("user", "item", "category"):  # an id column pandas did not read as int64 (one id past int64 makes
            c = mapping.get(k)  # it float64, rounding every id above 2^53): again as text, parsed exactly
            if c is not None and not pd.api.types.is_signed_integer_dtype(raw[c]):
                raw[c] = pd.read_csv(path, sep=sep, engine="c", skip_blank_lines=False, usecols=[c], dtype=str)[c]
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError):
        raw = None
    if raw is not None:
        raw = raw.dropna(how="all")
        lines = raw.index.to_numpy() + 2
        raw = raw.reset_index(drop=True)
        return _frame_checks(raw, mapping, unit, lambda i: (int(lines[i]), ""), path, skip_bad_rows)
    # a row with too many fields stops the C parser: the line-by-line pass names it
    cols = [Column(k, mapping[k]) for k in keys]
    df, skipped = parse_lines(path, cols, header=True, sep=sep, time_unit=TIME_UNITS[unit] if unit else 1, skip_bad_rows=skip_bad_rows)
    if unit is None and len(df):  # integer times were read as seconds; ISO ones are seconds already (auto only
        auto = unit_of(df["time"], None, path)  # turns to ms when every value is >= 1e11, far past ISO's range)
        if auto != 1:
            df["time"], df["subsecond_ns"] = split_time(df["time"], auto)
    return df, skipped


def _read_parquet(path: Path, mapping: dict[str, str], unit: str | None, skip_bad_rows: bool) -> tuple[pd.DataFrame, int]:
    keys = [k for k in MAPPING_KEYS if k in mapping]
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a test dependency
        raise ImportError("reading Parquet needs pyarrow (pip install pyarrow)") from exc
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError
        raise DataFormatError(path, None, f"not a readable Parquet file: {exc}") from None
    for k in keys:
        if mapping[k] not in names:
            raise DataFormatError(path, None, f"column {mapping[k]!r} (for {k}) not in the file; columns: {names}")
    raw = pd.read_parquet(path, columns=[mapping[k] for k in keys]).reset_index(drop=True)
    return _frame_checks(raw, mapping, unit, lambda i: (None, f"row {i}: "), path, skip_bad_rows)


LOADERS: dict[str, Callable[..., EventLog]] = {"taobao": load_taobao, "retailrocket": load_retailrocket, "csv": load_csv}
