"""Generic event logs: delimited text (CSV, TSV, any separator, header or none) or Parquet, one
file or several files of one log, mapped onto (user, item[, time][, action][, category]).

Column mapping (``--columns``): ``user=…,item=…[,time=…][,action=…][,category=…][,time_unit=s|ms|us|ns]``;
each value is a header name or a 0-based position (a headerless file: positions only; with a
header, a value that is not a header name but a number is a position); ``action=@file`` makes each
file's name (without suffix) the action of its events (one file per action type). Without ``time`` the data
is **order-only**: the file order is the order (timestamps all 0, ``facts["order_only"]``), and
:func:`hstu.data.prepare.model_config_for` switches the time bias off (Zhai et al. 2024, §3: rab^t would only
repeat the position bias, rab^p).

File format (``--format``): ``sep=…`` (a character, or ``tab`` / ``comma`` / ``semicolon`` /
``pipe`` / ``space``; default ``\t`` for .tsv, else ``,``) and ``header=yes|none``, as
comma-separated ``key=value`` pairs (e.g. ``sep=;,header=none``).

A delimited file may be compressed: ``.csv.gz`` / ``.bz2`` / ``.xz`` (:func:`hstu.data.records.opener`).
Several files as one log: ``data_dir`` a directory (every .csv / .tsv / .txt / .parquet / .pq in it, compressed or not, in
natural name order: part2 before part10), a glob (``logs/2024-*.csv``, the same order) or a list
of paths (the order given). Rows are concatenated in that order and then sorted per user on the
exact time, ties in that order (:meth:`~hstu.data.sequences.EventLog.from_frame`): the same log
as one file holding the rows in that order.

User and item ids are integers (exact int64) when every one of a column is an int64 integer written canonically
(``42``, ``-7``, ``0``; not ``042``, ``+42``, ``-0``, ``42.0``, ``4.2e1``), else text (each as written: ``042`` stays
``042``; trimmed, case kept, at most 256 characters; :mod:`hstu.data.sequences`); a Parquet integer column is integer
ids. Categories are integers (``12.0`` is 12). Time is integer Unix time (``time_unit``, default s, or ms when most
values are >= 1e11: a column with values on both sides of 1e11 is an error naming the first value in the minority's
unit; in this automatic unit a time after 2262-04-11 is an error suggesting ``time_unit=us`` / ``ns``) or ISO 8601
(UTC unless it carries an offset); a time before 1970-01-01 is a bad row, see :mod:`hstu.data.times`. A quote that
is never closed is an error naming the line it opens on, also with ``skip_bad_rows`` (:mod:`hstu.data.records`).
A text file is UTF-8 when all of it decodes so, else latin-1 (ISO-8859-1, as the
MovieLens loader decides), unless a byte-order mark says UTF-16 or UTF-8 (``facts["encodings"]`` names the files
in another encoding than plain UTF-8). Header names are trimmed; each column has one role (a key of the mapping
or a side feature). Errors name the file and the 1-based line a row starts on (a quoted field may span lines;
Parquet: row index).
"""

from __future__ import annotations

import glob
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from hstu.data.errors import DataFormatError, plural
from hstu.data.features import numeric_column, parse_feature_options
from hstu.data.parsing import MAPPING_KEYS, Column, exact_ids, id_problem, parse_lines, row_width_error, to_event_log
from hstu.data.records import COMPRESSIONS, check_quotes, record_line, text_encoding, text_suffix
from hstu.data.sequences import FEATURE_PREFIX, EventLog
from hstu.data.times import TIME_UNITS, exact_times, range_problem, unit_problem

log = logging.getLogger(__name__)

TEXT_EXTS = (".csv", ".tsv", ".txt")
LOG_EXTS = (*TEXT_EXTS, *(e + c for e in TEXT_EXTS for c in COMPRESSIONS), ".parquet", ".pq")  # a directory's log files
SEPARATORS = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|", "space": " "}
FILE_ACTION = "@file"  # action=@file: the action of a file's events is the file's name (views.csv -> "views")
HEADER_VALUES = {"yes": True, "true": True, "first": True, "none": False, "no": False, "false": False}


@dataclass(frozen=True)
class Format:
    """How a delimited file is laid out: ``sep`` (None: by suffix, tab for .tsv, else comma) and
    whether its first row is a header."""

    sep: str | None = None
    header: bool = True

    def sep_for(self, path: Path) -> str:
        return self.sep if self.sep is not None else ("\t" if text_suffix(path) == ".tsv" else ",")


def parse_format(spec: str | dict | None) -> Format:
    """``"sep=;,header=none"`` (or a dict, or None) -> :class:`Format`. ValueError names a bad pair."""
    if spec is None or spec == "":
        return Format()
    if isinstance(spec, dict):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    else:
        text = re.sub(r"sep\s*=\s*,(?=\s*(?:,|$))", "sep=comma", str(spec).strip())  # 'sep=,' is the comma
        pairs = []
        for part in text.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"--format: {part.strip()!r} is not key=value (e.g. sep=;,header=none)")
            k, v = part.split("=", 1)
            pairs.append((k.strip(), v.strip() or v))  # 'sep= ' is the space
    out: dict = {}
    for k, v in pairs:
        if k == "sep":
            sep = SEPARATORS.get(v.lower(), v) if len(v) > 1 else v
            if len(sep) != 1:
                raise ValueError(f"--format: sep must be one character or one of {sorted(SEPARATORS)}, got {v!r}")
            out["sep"] = sep
        elif k == "header":
            if v.lower() not in HEADER_VALUES:
                raise ValueError(f"--format: header must be one of {sorted(HEADER_VALUES)}, got {v!r}")
            out["header"] = HEADER_VALUES[v.lower()]
        else:
            raise ValueError(f"--format: unknown key {k!r}; valid: sep, header")
    return Format(**out)


def parse_columns(spec: str | dict) -> tuple[dict[str, str], str | None]:
    """``"user=uid,item=iid[,time=ts][,action=ev][,category=cat][,time_unit=ms]"`` (or a dict)
    -> (mapping key -> column name or position, time_unit or None). No ``time``: order-only data.

    Raises:
        ValueError: not ``key=value`` pairs, an unknown key, a duplicate, or user/item missing.
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
            raise ValueError(f"--columns: {k}= needs a column name or position")
        mapping[k] = v
    missing = [k for k in ("user", "item") if k not in mapping]
    if missing:
        raise ValueError(f"--columns: missing {missing} (user and item are required; time too unless the data is order-only), got {spec!r}")
    if unit is not None and unit not in TIME_UNITS:
        raise ValueError(f"--columns: time_unit must be one of {list(TIME_UNITS)}, got {unit!r}")
    if unit is not None and "time" not in mapping:
        raise ValueError("--columns: time_unit without a time column")
    return mapping, unit


def _natural_key(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def log_files(data_dir: str | Path | list | tuple) -> list[Path]:
    """The files of one log, in order: a file; a directory's LOG_EXTS files (natural name order);
    a glob (same order); a list of these (the order given). FileNotFoundError says what was sought; ValueError
    names a file a list reaches twice (its events would count twice)."""
    if isinstance(data_dir, (list, tuple)):
        if not data_dir:
            raise FileNotFoundError("an empty list of event-log files")
        files = [f for d in data_dir for f in log_files(d)]
        seen: dict[Path, Path] = {}
        for f in files:
            if (r := f.resolve()) in seen:
                raise ValueError(f"{f}: listed twice in the event-log files (also as {seen[r]}); each file is read once")
            seen[r] = f
        return files
    p = Path(data_dir)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = [q for q in p.iterdir() if not q.name.startswith(".")]  # subdirectories too: named below, never read
        found = sorted((q for q in files if q.is_file() and q.name.lower().endswith(LOG_EXTS)), key=_natural_key)
        looked = "/".join(TEXT_EXTS) + f" (also {'/'.join(COMPRESSIONS)} compressed)/.parquet/.pq"
        if not found:
            raise FileNotFoundError(f"{p}: no event-log file in it (looked for {looked}); pass the file path instead")
        if other := sorted(q.name + "/" * q.is_dir() for q in files if q.is_dir() or not q.name.lower().endswith(LOG_EXTS)):
            log.warning("%s: %d file(s) not read as event-log parts (only %s): %s", p, len(other), looked, ", ".join(other[:5]))
        return found
    if glob.has_magic(str(data_dir)):
        found = sorted((Path(q) for q in glob.glob(str(data_dir)) if Path(q).is_file()), key=_natural_key)
        if not found:
            raise FileNotFoundError(f"{data_dir}: no file matches")
        return found
    raise FileNotFoundError(f"{p}: not found (expected an event log: a file, a directory of parts, or a glob)")


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
    for key in (k for k in mapping if k.startswith(FEATURE_PREFIX)):  # side features: unchecked, encoded after the split
        out[key] = df[mapping[key]].reset_index(drop=True)
    for key in ("user", "item", "category"):
        if key not in mapping:
            continue
        col = df[mapping[key]]
        num, bad = exact_ids(col, text=key != "category")
        problems.append(
            (bad, lambda i, key=key, col=col: f"{key} ({mapping[key]!r}) is " + id_problem(col.iloc[i], text=key != "category"))
        )
        out[key] = num
    if "action" in mapping:
        col = df[mapping["action"]]
        text = col.astype(str).str.strip()
        bad = (col.isna() | (text == "")).to_numpy()
        problems.append((bad, lambda i: f"action ({mapping['action']!r}) is empty"))
        out["action"] = text
    if "time" in mapping:
        _time_checks(df[mapping["time"]], mapping, unit, path, out, problems)
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
        log.warning("%s: skipped %s (first: %s)", path, plural(skipped, "malformed row"), exc)
    keep = ~any_bad
    frame = pd.DataFrame(
        {k: (v[keep].astype(np.int64) if pd.api.types.is_integer_dtype(v) else v[keep]) for k, v in out.items()}
    ).reset_index(drop=True)
    return frame, skipped


def _time_checks(col: pd.Series, mapping: dict[str, str], unit: str | None, path: Path, out: dict, problems: list) -> None:
    """The time column's part of :func:`_frame_checks`: ``out["time"]``, ``out["subsecond_ns"]`` and its problems
    (unparsed times; with the automatic unit, integers on the other side of 1e11 than most, :func:`unit_problem`;
    times before 1970 or after 2262: :func:`range_problem`)."""
    t = exact_times(col, unit, path)
    out["subsecond_ns"] = t.rest
    what = f"time ({mapping['time']!r}) is "
    problems.append(
        (
            t.bad,
            lambda i: (
                what
                + (
                    "missing"
                    if pd.isna(col.iloc[i])
                    else "neither integer Unix time (int64) nor an ISO 8601 date-time of years 1970..2262 (one format per column): "
                    + repr(str(col.iloc[i])[:40])
                )
            ),
        )
    )
    problems.append((t.mixed, lambda i: what + unit_problem(int(pd.to_numeric(col.iloc[i])))))
    problems.append((t.out, lambda i: what + range_problem(str(col.iloc[i]).strip(), int(t.secs.iloc[i]), t.per_s, unit is None)))
    out["time"] = t.secs


def load_csv(
    data_dir: str | Path | list,
    skip_bad_rows: bool = False,
    *,
    columns: str | dict | None = None,
    format: str | dict | None = None,  # noqa: A002 - the --format option's name
    sep: str | None = None,
    time_unit: str | None = None,
    exclude_history: bool | None = None,
    name: str = "csv",
    features: str | list | None = None,
    numeric_features: str | dict | None = None,
    **options,
) -> EventLog:
    """A generic event log: delimited text or Parquet (``.parquet`` / ``.pq``), one file or several.

    Args:
        data_dir: a file, a directory of parts, a glob or a list (:func:`log_files`).
        columns: mapping ``user=…,item=…[,time=…][,action=…][,category=…][,time_unit=…]``
            (string, as ``--columns`` gives it, or a dict), names or 0-based positions;
            ``action=@file``: the file name is the action.
        format: ``sep=…,header=yes|none`` (:func:`parse_format`); ``sep`` overrides its separator.
        time_unit: unit of integer times (s | ms | us | ns); default s, or ms when most
            values are >= 1e11 (values on both sides: an error; a time after 2262 then: an error suggesting us / ns).
            Date-time strings are parsed as ISO 8601 (UTC if no offset).
        exclude_history: the data set's candidate-exclusion default (default False).
        features, numeric_features: side-feature columns (names or positions; categorical, and
            numeric name -> quantile buckets), :func:`hstu.data.features.parse_feature_options`;
            read raw here, encoded after the split (:func:`hstu.data.features.apply_features`).
    Returns:
        EventLog named ``name``; action names in order of first appearance; without a time
        column ``facts["order_only"] = True`` and all timestamps 0.
    Raises:
        ValueError: no or bad ``columns`` / ``format``, unknown options. FileNotFoundError.
        DataFormatError: a mapped column missing from the header (line 1) or past a row's last
        field, one column with two roles, a numeric feature column without a number (the file), a quote
        never closed (the line it opens on, also with ``skip_bad_rows``); unless ``skip_bad_rows`` (file:line;
        Parquet: row index): a row with too few or many fields, a non-integer category, a missing or over-long
        user/item id, an empty action, an unparsable time, a time before 1970, an integer time in the other unit
        than most of the column or after 2262 (automatic unit).
    """
    if options:
        raise ValueError(
            f"csv: unknown option(s) {sorted(options)}; valid: columns, format, sep, time_unit, exclude_history, features, numeric_features"
        )
    if columns is None:
        raise ValueError("csv: a column mapping is needed, e.g. --columns user=user_id,item=item_id,time=timestamp,action=event")
    mapping, unit_from_map = parse_columns(columns)
    cat_features, num_features = parse_feature_options(features, numeric_features, "csv")
    mapping.update({FEATURE_PREFIX + n: n for n in [*cat_features, *num_features]})
    fmt = parse_format(format)
    if sep is not None:
        fmt = Format(sep, fmt.header)
    unit = time_unit or unit_from_map
    if unit is not None and unit not in TIME_UNITS:
        raise ValueError(f"csv: time_unit must be one of {list(TIME_UNITS)}, got {unit!r}")
    files = log_files(data_dir)
    frames, skipped, encodings = _read_files(files, mapping, unit, fmt, skip_bad_rows, list(num_features))
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    order_only = "time" not in mapping
    if order_only:
        df["time"] = np.zeros(len(df), np.int64)  # the file order is the order (a stable sort keeps it)
    out = to_event_log(
        df, name=name, action_names=None, exclude_history=exclude_history, skipped=skipped, source=files, feature_buckets=num_features
    )
    if len(frames) > 1:
        out.facts["files"] = len(frames)
    if any(e != "utf-8" for e in encodings.values()):
        out.facts["encodings"] = encodings
    if order_only:
        out.facts["order_only"] = True
        log.info("%s: no time column: order-only data (the file order is the order; the time bias is off)", name)
    return out


def _read_files(
    files: list[Path], mapping: dict[str, str], unit: str | None, fmt: Format, skip_bad_rows: bool, numeric: list[str]
) -> tuple[list[pd.DataFrame], int, dict[str, str]]:
    """(one frame per file, skipped rows, file name -> encoding). ``action=@file``: each file's
    events have the file's name without its suffix as their action (one file per action type).
    ``numeric``: the numeric side features, checked per file (:func:`_numeric_checks`)."""
    by_file = mapping.get("action") == FILE_ACTION
    cols = {k: v for k, v in mapping.items() if not (by_file and k == "action")}
    frames, skipped, encodings = [], 0, {}
    for path in files:
        if path.suffix.lower() in (".parquet", ".pq"):
            df, n = _read_parquet(path, cols, unit, skip_bad_rows)
        else:
            encodings[path.name] = text_encoding(path)
            df, n = read_delimited(path, cols, unit, fmt, skip_bad_rows, encodings[path.name])
        if by_file:
            df["action"] = path.name.split(".")[0]
        _numeric_checks(path, df, numeric)
        frames.append(df)
        skipped += n
    return frames, skipped, encodings


def _numeric_checks(path: Path, df: pd.DataFrame, numeric: list[str]) -> None:
    """A numeric side feature's values in one file: DataFormatError when some are given but none is a
    number (a text column, whose events would all get the unknown bucket: a ``--feature``); a warning
    when some are no numbers (those events get the unknown bucket, :func:`hstu.data.features.numeric_column`)."""
    for name in numeric:
        col = df[FEATURE_PREFIX + name]
        given = (col.notna() & (col.astype(str).str.strip() != "")).to_numpy()
        odd = given & np.isnan(numeric_column(col))
        if not odd.any():
            continue
        first = str(col[odd].iloc[0])[:40]
        if odd.sum() == given.sum():
            raise DataFormatError(
                path,
                None,
                f"--numeric-feature {name}: no value of column {name!r} is a number (e.g. {first!r}); a text column is a --feature",
            )
        log.warning(
            "%s: numeric feature %r: %d of %d values are not numbers (first %r): their events get the unknown bucket",
            path, name, int(odd.sum()), int(given.sum()), first,
        )  # fmt: skip


def _keys(mapping: dict[str, str]) -> list[str]:
    """The mapping's keys in frame order: MAPPING_KEYS, then the side features in option order."""
    return [k for k in MAPPING_KEYS if k in mapping] + [k for k in mapping if k.startswith(FEATURE_PREFIX)]


def _labels(path: Path, mapping: dict[str, str], names: list[str] | None, width: int) -> dict[str, str]:
    """Mapping values -> column labels of the frame: header names, or '#k' for position k."""
    out = {}
    for k, v in mapping.items():
        if names is not None and v in names:
            out[k] = v
        elif v.isdigit() and int(v) < width:
            out[k] = names[int(v)] if names is not None else f"#{int(v)}"
        elif names is not None:
            raise DataFormatError(path, 1, f"column {v!r} (for {k}) not in the header; columns: {names}")
        else:
            what = "not a position (no header: columns by 0-based position)" if not v.isdigit() else f"past the last field (#{width - 1})"
            raise DataFormatError(path, 1, f"column {v!r} (for {k}) is {what}")
    return _one_role_each(path, 1, out)


def _one_role_each(path: Path, line: int | None, labels: dict[str, str]) -> dict[str, str]:
    """``labels`` (mapping key -> the frame's column) when no column has two roles (a name and its
    position count as one column), else DataFormatError naming the column and the options."""
    seen: dict[str, str] = {}
    for k, label in labels.items():
        if label in seen:
            roles = [f"the feature {r[len(FEATURE_PREFIX) :]!r}" if r.startswith(FEATURE_PREFIX) else r for r in (seen[label], k)]
            opts = "--columns" + ("/--feature" if any(r.startswith(FEATURE_PREFIX) for r in (seen[label], k)) else "")
            raise DataFormatError(
                path, line, f"{opts}: column {label!r} is mapped to both {roles[0]} and {roles[1]}; a column has one role"
            )
        seen[label] = k
    return labels


def read_delimited(
    path: Path, mapping: dict[str, str], unit: str | None, fmt: Format, skip_bad_rows: bool, encoding: str = "utf-8"
) -> tuple[pd.DataFrame, int]:
    """One delimited file in ``encoding`` -> (frame with the mapping's keys as columns + subsecond_ns, skipped rows)."""
    keys = _keys(mapping)
    sep, hdr = fmt.sep_for(path), 0 if fmt.header else None
    try:
        head = pd.read_csv(path, sep=sep, nrows=1 if hdr is None else 0, header=hdr, encoding=encoding)
    except pd.errors.EmptyDataError:
        raise DataFormatError(path, None, "empty file") from None
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        check_quotes(path, sep=sep, encoding=encoding)  # pandas reads a small file whole: an unclosed quote, named where it opens
        raise DataFormatError(path, 1, f"cannot read the {'header' if fmt.header else 'first row'}: {exc}") from None
    names = [str(c).strip() for c in head.columns] if fmt.header else None
    labels = _labels(path, mapping, names, head.shape[1])
    given = names or [f"#{i}" for i in range(head.shape[1])]  # the header's names trimmed, as the mapping matched them
    read = dict(sep=sep, engine="c", skip_blank_lines=False, header=hdr, names=given, encoding=encoding)
    try:
        # blank lines kept as all-NaN rows, so frame index i is record i + header (records: parsing.records)
        # no usecols: with it pandas silently accepts rows with extra fields (shifted columns)
        # ids as written ("042" is a text id, not 42: parsing.exact_ids); numeric features: coerced later
        texts = {labels[k]: str for k in labels if k in ("action", "user", "item") or k.startswith(FEATURE_PREFIX)}
        raw = pd.read_csv(path, dtype=texts, **read)[[labels[k] for k in keys]]
        c = labels.get("category")  # a category column pandas did not read as int64 (one id past int64 makes it
        if c is not None and not pd.api.types.is_signed_integer_dtype(raw[c]):  # float64, rounding every id above 2^53):
            raw[c] = pd.read_csv(path, usecols=[c], dtype=str, **read)[c]  # again as text, parsed exactly
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError):
        raw = None
    if raw is not None:
        raw = raw.dropna(how="all")
        rec = raw.index.to_numpy() + int(fmt.header)
        raw = raw.reset_index(drop=True)

        def where(i: int) -> tuple[int | None, str]:  # the line a record starts on, sought only for a message
            return record_line(path, int(rec[i]), sep=sep, encoding=encoding), ""

        try:
            return _frame_checks(raw, labels, unit, where, path, skip_bad_rows)
        except DataFormatError as exc:  # a short row reads as missing values: name its fields instead
            short = exc.line and row_width_error(path, exc.line, sep=sep, width=head.shape[1], header=fmt.header, encoding=encoding)
            raise (short or exc) from None
    # a row with too many fields stops the C parser: the line-by-line pass names it
    cols = [Column(k, labels[k] if fmt.header else int(labels[k][1:]), text=k in ("user", "item")) for k in keys]
    return parse_lines(
        path,
        cols,
        header=fmt.header,
        sep=sep,
        time_unit=TIME_UNITS[unit] if unit else None,
        skip_bad_rows=skip_bad_rows,
        width=head.shape[1],
        encoding=encoding,
    )


def _read_parquet(path: Path, mapping: dict[str, str], unit: str | None, skip_bad_rows: bool) -> tuple[pd.DataFrame, int]:
    import pyarrow.parquet as pq

    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError
        raise DataFormatError(path, None, f"not a readable Parquet file: {exc}") from None
    labels = {k: v for k, v in mapping.items()}
    for k, v in mapping.items():
        if v not in names:
            if not v.isdigit() or int(v) >= len(names):
                raise DataFormatError(path, None, f"column {v!r} (for {k}) not in the file; columns: {names}")
            labels[k] = names[int(v)]
    keys = _keys(_one_role_each(path, None, labels))
    raw = pd.read_parquet(path, columns=[labels[k] for k in keys]).reset_index(drop=True)
    return _frame_checks(raw, labels, unit, lambda i: (None, f"row {i} (0-based): "), path, skip_bad_rows)  # as pandas / pyarrow count
