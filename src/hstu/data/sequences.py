"""Per-user chronological event sequences in a jagged layout, and leave-one-out splits.

Layout (TorchRec-style values + offsets), for U users and E events in total:

    user u's events are rows offsets[u] : offsets[u+1] of every per-event array
    users        (U,)   original user ids, ascending: int64, or object (str) for text ids
    offsets      (U+1,) int64
    items        (E,)   int64  dense item ids 1..I (0 is padding, never stored)
    timestamps   (E,)   int64  Unix seconds, non-decreasing within a user
    actions      (E,)   int64  action ids 1..A (0 = none)
    categories   (E,)   int64  dense category ids 1..C (0 = none)

Example: users [7, 9], offsets [0, 2, 5] → user 7 has events 0-1, user 9 has events 2-4.
Events are stably sorted by their exact time (before flooring to s), so equal times keep file order.

Original ids (users and items, each on its own) are integers (int64) or texts: a data file's column
is integer ids when every value is an int64 integer written canonically (:data:`CANONICAL_INT`), else
text ids. A text id is the
string with surrounding whitespace removed, case kept ("SKU-001" and "sku-001" are two items); an
empty id is refused. A text id map holds "" at row 0 (the padding entry), an integer one 0.
Lookups (:func:`as_ids`, :class:`IdIndex`) take either form: an int given to a text map is its
decimal text, a decimal string given to an integer map (ASCII digits, an optional sign) is that
integer; a bool is never an id.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hstu.data.features import numeric_column, text_column

log = logging.getLogger(__name__)
FEATURE_PREFIX = "feature:"  # a loader frame's side-feature column: "feature:price"

ID_MAX_CHARS = 256  # longest text id (the HTTP user_id limit); longer ones are refused with their position


def is_text(ids) -> bool:
    """Whether an id array (users or item_raw_ids) holds text ids (NumPy object / str dtype)."""
    return np.asarray(ids).dtype.kind in "OUS"


def same_item_ids(a, b) -> bool:
    """Whether two id maps (``item_raw_ids``: lists as idmap.json holds them, or arrays: int64,
    object or unicode text) hold the same ids in the same order; integer ids never equal text ids."""
    if len(a) != len(b) or is_text(a) != is_text(b):
        return False
    dtype = object if is_text(a) else np.int64
    return bool(np.array_equal(np.asarray(a, dtype=dtype), np.asarray(b, dtype=dtype)))


_ASCII_INT = re.compile(r"[+-]?[0-9]+")  # an integer id given as text: ASCII digits and a sign, nothing else
# an integer id as a data file writes it: the integer's own decimal text (str(int(s)) == s: no '+', no leading
# zero, no '-0'); a column with any other value holds text ids ("042" stays "042"), hstu.data.parsing.exact_ids
CANONICAL_INT = re.compile(r"0|-?[1-9][0-9]*")


def as_id(x, text: bool, where: str):
    """One original id as :func:`as_ids` reads it; ValueError starting with ``where``."""
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{where}: a boolean is not an id: {x!r}")
    if text:
        if not isinstance(x, (str, int, np.integer)):
            raise ValueError(f"{where}: not a text or integer id: {x!r}")
        s = str(x).strip()
        if not s or len(s) > ID_MAX_CHARS:
            raise ValueError(f"{where}: an id must be 1..{ID_MAX_CHARS} characters after trimming, got {x!r}")
        return s
    try:
        if isinstance(x, str) and not _ASCII_INT.fullmatch(x.strip()):
            raise ValueError  # int() would also read "1_097" and non-ASCII digits ("\uff11", Arabic-Indic) as integers
        v = int(x.strip()) if isinstance(x, str) else x
        if not isinstance(v, (int, np.integer)):
            raise ValueError
    except ValueError:
        raise ValueError(f"{where}: not an integer id: {x!r} (this run's ids are integers)") from None
    if not -(2**63) <= int(v) < 2**63:  # an integer, but none of this run's (int64) ids can be it
        raise ValueError(f"{where}: integer id {x!r} is outside int64 (this run's ids are int64 integers)")
    return int(v)


def as_ids(values, text: bool, where: str = "id") -> np.ndarray:
    """Original ids as an id map of that kind holds them (the rule in the module docstring).

    Args:
        values: a sequence of ids (int, str or NumPy scalars).
        text: the map's kind (:func:`is_text` of it).
        where: the name of the field in messages, with the index at ``{i}`` (e.g.
            ``"history[{i}].item_id"``) or appended (``where[3]``).
    Returns:
        (n,) object array of trimmed str when ``text``, else (n,) int64.
    Raises:
        ValueError naming ``where[i]`` and the value: a bool, an empty or over-long text, a
        non-integer for an integer map, or a value of another type.
    """
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu" and not text:
        return values.astype(np.int64).reshape(-1)
    vals = list(values)
    if not text and set(map(type, vals)) <= {int}:  # the common case (a type scan in C): no per-item parse
        try:
            return np.asarray(vals, dtype=np.int64).reshape(-1)
        except OverflowError:
            pass
    out = np.empty(len(vals), dtype=object if text else np.int64)
    for i, x in enumerate(vals):
        out[i] = as_id(x, text, where.format(i=i) if "{i}" in where else f"{where}[{i}]")
    return out


def _id_column(col: pd.Series, name: str, what: str) -> np.ndarray:
    """A frame's id column as int64 (integer ids) or trimmed str (object; any text in it)."""
    if pd.api.types.is_bool_dtype(col):
        raise ValueError(f"{name}: column {what} holds booleans, not ids")
    if pd.api.types.is_integer_dtype(col):
        return col.to_numpy(np.int64)
    if pd.api.types.is_float_dtype(col):
        return col.to_numpy().astype(np.int64)
    vals = col.to_numpy(dtype=object)
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in vals):
        return vals.astype(np.int64)
    return as_ids(vals, text=True, where=f"{name}: {what} row")


class IdIndex:
    """Original id -> dense id over an id map whose row 0 is the padding entry (one binary
    search over the sorted ids, not a dict lookup per event). ``raw``: (I+1,) int64 or text ids
    (idmap.json ``item_raw_ids``, ``EventLog.item_raw_ids``). When raw[1:] is already ascending (the
    loaders number integer ids in ascending order) it is searched as it is, a view of ``raw``:
    no argsort and no sorted copy (at 120M ids 3 GB less); dense id = position + 1."""

    def __init__(self, raw) -> None:
        raw = np.asarray(raw, dtype=object) if is_text(raw) else np.asarray(raw, dtype=np.int64)
        self.text = raw.dtype == object
        if _ascending(raw[1:]):
            self.sorted, self.dense_sorted = raw[1:], None  # dense id of self.sorted[p]: p + 1
        else:
            order = np.argsort(raw[1:], kind="stable")
            self.sorted, self.dense_sorted = raw[1:][order], (order + 1).astype(np.int64)

    def dense(self, values, where: str = "item_id") -> np.ndarray:
        """(n,) int64 dense ids of original ids ``values`` (0 where unknown, an integer past int64
        too); ValueError as :func:`as_ids`."""
        big = None
        if not self.text and not isinstance(values, np.ndarray):
            values = list(values)
            try:
                raw = as_ids(values, self.text, where)
            except ValueError:  # an integer past int64 is an unknown id here, not an error: found only on this path
                big = [i for i, x in enumerate(values) if type(x) is int and not -(2**63) <= x < 2**63]
                for i in big:
                    values[i] = 0  # looked up as the padding id, which is never a match, then set to 0 below
                raw = as_ids(values, self.text, where)
        else:
            raw = as_ids(values, self.text, where)
        if not len(self.sorted) or not len(raw):
            return np.zeros(len(raw), np.int64)
        pos = np.searchsorted(self.sorted, raw).clip(max=len(self.sorted) - 1)
        dense = pos + 1 if self.dense_sorted is None else self.dense_sorted[pos]
        out = np.where(self.sorted[pos] == raw, dense, 0).astype(np.int64)
        if big:
            out[big] = 0
        return out


def _ascending(a: np.ndarray, block: int = 1 << 22) -> bool:
    """Whether ``a`` (n,) never decreases; compared in blocks (a bool temporary of ``block``, not n)."""
    last = len(a) - 1  # pairs (a[i], a[i + 1]) for i < last
    for s in range(0, max(last, 0), block):
        e = min(s + block, last)
        if not (a[s + 1 : e + 1] >= a[s:e]).all():
            return False
    return True


@dataclass
class EventLog:
    name: str
    users: np.ndarray
    offsets: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    actions: np.ndarray
    categories: np.ndarray
    values: np.ndarray
    item_raw_ids: np.ndarray  # (I+1,) original id of each dense id (int64, or object str); [0] = 0 or "" (padding)
    item_category: np.ndarray  # (I+1,) dense category of each item (0 = none)
    action_names: list[str] = field(default_factory=list)  # action id a -> action_names[a - 1]
    category_raw_ids: np.ndarray | None = None  # (C+1,) original category ids
    titles: dict[int, str] = field(default_factory=dict)  # original item id -> title
    item_genres: dict[int, list[str]] = field(default_factory=dict)
    exclude_history_default: bool = True
    skipped_rows: int = 0
    facts: dict = field(default_factory=dict)  # how the files were read, e.g. {"encodings": {"movies.dat": "utf-8"}}
    item_meta: dict[str, dict] = field(default_factory=dict)  # str(original item id) -> {column: value} (hstu.data.items)
    # side features (hstu.data.features): raw per-event columns (name -> (E,) object texts or float64), numeric
    # name -> quantile buckets; after the split (features.apply_features) the (E, 1+F) token columns
    # [category, features...], the items' (I+1, 1+F) last values and the maps written to idmap.json
    feature_raw: dict[str, np.ndarray] = field(default_factory=dict)
    feature_buckets: dict[str, int] = field(default_factory=dict)
    features: np.ndarray | None = None
    item_features: np.ndarray | None = None
    feature_maps: list[dict] = field(default_factory=list)

    @property
    def num_users(self) -> int:
        return len(self.users)

    @property
    def num_items(self) -> int:
        return len(self.item_raw_ids) - 1

    @property
    def num_events(self) -> int:
        return len(self.items)

    @property
    def num_actions(self) -> int:
        return len(self.action_names)

    @property
    def num_categories(self) -> int:
        return 0 if self.category_raw_ids is None else len(self.category_raw_ids) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def token_categories(self) -> np.ndarray:
        """What batches carry as ``categories``: (E,) category ids, or with side features the (E, 1+F)
        token columns (:mod:`hstu.data.features`)."""
        return self.categories if self.features is None else self.features

    @property
    def item_tokens(self) -> np.ndarray:
        """(I+1,) item category, or with side features the (I+1, 1+F) item token columns."""
        return self.item_category if self.item_features is None else self.item_features

    def user_index(self, raw_user_id: int | str) -> int:
        """Row of an original user id (int or text, as :func:`as_ids` reads it); KeyError names the
        id (also one of the wrong kind, e.g. "abc" for integer user ids)."""
        try:
            u = as_ids([raw_user_id], is_text(self.users), "user").tolist()[0]
        except ValueError:
            u = None
        i = 0 if u is None else int(np.searchsorted(self.users, u))
        if u is None or i >= len(self.users) or self.users[i] != u:
            shown = raw_user_id if u is None else u
            raise KeyError(f"unknown user id {shown!r}: not among the {len(self.users)} users of {self.name} in this run")
        return i

    def user_id(self, raw_user_id: int | str) -> int | str:
        """The data set's form of an original user id (int, or trimmed text); KeyError as :meth:`user_index`."""
        i = self.user_index(raw_user_id)
        return self.users[i : i + 1].tolist()[0]

    def item_dense(self, raw_ids) -> np.ndarray:
        """Original item ids (int or text) -> (n,) int64 dense ids; unknown ids map to 0 (callers
        decide the policy). ValueError as :func:`as_ids` for a value that is no id (a bool)."""
        return IdIndex(self.item_raw_ids).dense(raw_ids)

    @classmethod
    def from_frame(
        cls,
        df: pd.DataFrame,
        *,
        name: str,
        titles: dict | None = None,
        item_genres: dict | None = None,
        action_names: list[str] | None = None,
        exclude_history_default: bool = True,
        skipped_rows: int = 0,
        feature_buckets: dict[str, int] | None = None,
    ) -> "EventLog":
        """Build from a frame with columns user_id, item_id (int64, or text: trimmed str, see the
        module docstring), timestamp (int64 Unix s) and optional
        action (str or int), category (int), value, subsecond_ns (int64, the part of the source's
        exact time below the second, 0..1e9-1: events are sorted on timestamp then it, so ms / ns
        times keep their order after flooring to s) and ``feature:NAME`` side-feature columns (texts;
        numeric where ``feature_buckets`` names them, :mod:`hstu.data.features`). Dense ids follow
        ascending original ids.
        Raises ValueError naming the column and row of an empty or boolean id."""
        if df.empty:
            raise ValueError(f"{name}: no events")
        df = df.reset_index(drop=True)
        user_col, item_col = _id_column(df["user_id"], name, "user_id"), _id_column(df["item_id"], name, "item_id")
        users, user_code = np.unique(user_col, return_inverse=True)
        sub = df["subsecond_ns"].to_numpy() if "subsecond_ns" in df else np.zeros(len(df), np.int64)
        order = np.lexsort((np.arange(len(df)), sub, df["timestamp"].to_numpy(), user_code))
        df = df.iloc[order].reset_index(drop=True)  # by user, then exact time, ties in file order
        counts = np.bincount(user_code, minlength=len(users))
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        item_raw, items = np.unique(item_col[order], return_inverse=True)
        item_raw_ids = np.concatenate([np.array(["" if is_text(item_raw) else 0], dtype=item_raw.dtype), item_raw])
        items = (items + 1).astype(np.int64)
        n = len(df)
        actions = np.zeros(n, np.int64)
        names: list[str] = list(action_names or [])
        if "action" in df:
            col = df["action"].astype(str).to_numpy()
            for a in pd.unique(col):
                if a not in names:
                    names.append(a)
            lut = {a: i + 1 for i, a in enumerate(names)}
            actions = np.array([lut[a] for a in col], dtype=np.int64) if n < 10_000 else pd.Series(col).map(lut).to_numpy(np.int64)
        categories = np.zeros(n, np.int64)
        cat_raw = None
        item_category = np.zeros(len(item_raw_ids), np.int64)
        if "category" in df:
            cat_raw_vals, cat_inv = np.unique(df["category"].to_numpy(), return_inverse=True)
            categories = (cat_inv + 1).astype(np.int64)
            cat_raw = np.concatenate([[0], cat_raw_vals]).astype(np.int64)
            item_category[items] = categories  # last seen category per item
        elif item_genres:
            genre_names = sorted({g for gs in item_genres.values() for g in gs})
            glut = {g: i + 1 for i, g in enumerate(genre_names)}
            first = np.array([glut[item_genres[r][0]] if item_genres.get(r) else 0 for r in item_raw_ids[1:].tolist()], np.int64)
            item_category[1:] = first
        values = df["value"].to_numpy(np.int64) if "value" in df else np.zeros(n, np.int64)
        feature_raw = _feature_columns(df, feature_buckets or {})
        log.info("%s: %d events, %d users, %d items", name, n, len(users), len(item_raw))
        return cls(
            name=name,
            users=users,
            offsets=offsets,
            items=items,
            timestamps=df["timestamp"].to_numpy(np.int64),
            actions=actions,
            categories=categories,
            values=values,
            item_raw_ids=item_raw_ids,
            item_category=item_category,
            action_names=names,
            category_raw_ids=cat_raw,
            titles=dict(titles or {}),
            item_genres=dict(item_genres or {}),
            exclude_history_default=exclude_history_default,
            skipped_rows=skipped_rows,
            feature_raw=feature_raw,
            feature_buckets={k: v for k, v in (feature_buckets or {}).items() if k in feature_raw},
        )


def _feature_columns(df: pd.DataFrame, buckets: dict[str, int]) -> dict[str, np.ndarray]:
    """A sorted loader frame's ``feature:NAME`` columns -> name -> (E,) raw values: float64 (NaN =
    missing) for the numeric ones (``buckets``' names), else object texts (None = missing)."""
    names = [str(c)[len(FEATURE_PREFIX) :] for c in df.columns if str(c).startswith(FEATURE_PREFIX)]
    return {n: (numeric_column if n in buckets else text_column)(df[FEATURE_PREFIX + n]) for n in names}


@dataclass
class Split:
    """Leave-one-out split, as event ranges into an EventLog (all arrays (U,) int64).

    Training sequence of user u: events [offsets[u], train_end[u]).
    Evaluation on split s: target event index s_target[u] (-1: user not evaluated), history =
    the events before it.
    protocol "clean": train on all but the last two, valid = second-to-last, test = last.
    protocol "paper": train on all but the last, valid = test = last (Zhai et al. 2024 setup).
    """

    protocol: str
    train_end: np.ndarray
    valid_target: np.ndarray
    test_target: np.ndarray

    def targets(self, split: str) -> np.ndarray:
        if split not in ("valid", "test"):
            raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
        return self.valid_target if split == "valid" else self.test_target


def make_split(log_: EventLog, protocol: str = "clean") -> Split:
    """Leave-one-out split. Users too short to hold out (< 3 events clean, < 2 paper) train on
    all their events and are not evaluated (count logged)."""
    if protocol not in ("clean", "paper"):
        raise ValueError(f"protocol must be 'clean' or 'paper', got {protocol!r}")
    start, end = log_.offsets[:-1], log_.offsets[1:]
    n = end - start
    hold = 2 if protocol == "clean" else 1
    ok = n >= hold + 1
    train_end = np.where(ok, end - hold, end)
    test_t = np.where(ok, end - 1, -1)
    valid_t = np.where(ok, end - 2, -1) if protocol == "clean" else test_t.copy()
    if (~ok).any():
        log.info("%s: %d users with <= %d events are trained on but not evaluated", log_.name, int((~ok).sum()), hold)
    return Split(protocol, train_end.astype(np.int64), valid_t.astype(np.int64), test_t.astype(np.int64))
