"""Data options and preparation: what a run trains on (:class:`DataSpec`, config.json ``data``)
and how it is read (:func:`prepare_data`: load → first ``max_users`` users → leave-one-out split).

Also the data facts every job derives from a prepared log: training-item counts (popularity,
cold start), the model sizes the data fixes (:func:`model_config_for`) and the protocol's
minimum (:func:`check_trainable`). Symbols: U users, E events, I items (dense ids 1..I, 0 is
padding).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hstu.config import ModelConfig
from hstu.data import EventLog, Split, load_dataset, make_split
from hstu.data.features import apply_features, feature_sizes, parse_feature_options
from hstu.data.times import TIME_UNITS

log = logging.getLogger(__name__)
PROTOCOLS = ("clean", "paper")


@dataclass
class DataSpec:
    """What a run trains on (config.json ``data``): a named data set in ``data_dir``, the split
    protocol, the first ``max_users`` users (None: all), loader ``options`` (e.g. ``columns``),
    the candidate policy ``exclude_history`` (None: the data set's default, on for MovieLens /
    Amazon ratings, off for e-commerce event logs; used by validation, test, generate and serve),
    an ``items`` file of item metadata (:mod:`hstu.data.items`; None: none)."""

    dataset: str = "ml-1m"
    data_dir: str | list[str] = ""  # a list: several files of one csv log, read in order
    protocol: str = "clean"  # leave-one-out split, see hstu.data.sequences.make_split
    max_users: int | None = None
    skip_bad_rows: bool = False
    options: dict = field(default_factory=dict)  # loader options (e.g. column mapping)
    exclude_history: bool | None = None  # drop history items from the candidates; None: EventLog.exclude_history_default
    items: str | None = None  # item metadata file (hstu train --items), copied into idmap.json
    # the side-feature maps (hstu.data.features) the run was trained with: set by prepare_data from the training
    # events, stored in config.json, reused by every later prepare_data (eval under any protocol bucketises alike)
    feature_maps: list | None = None

    def validate(self) -> None:
        if not self.dataset:
            raise ValueError("DataSpec.dataset must be a data set name, got ''")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"DataSpec.protocol must be one of {list(PROTOCOLS)}, got {self.protocol!r}")
        maps = self.feature_maps
        if maps is not None and not (isinstance(maps, list) and all(isinstance(m, dict) for m in maps)):
            raise ValueError(f"DataSpec.feature_maps must be a list of feature maps (hstu.data.features) or null, got {maps!r}")
        if self.max_users is not None and self.max_users < 1:
            raise ValueError(f"DataSpec.max_users must be >= 1 or null, got {self.max_users}")
        is_list = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731 - e.g. features = ["brand"]
        bad = [k for k, v in self.options.items() if not isinstance(k, str) or not (isinstance(v, (str, dict)) or is_list(v))]
        if bad:
            raise ValueError(f"DataSpec.options: {bad[0]!r} must be a text, a list of texts or a table, got {self.options[bad[0]]!r}")


def absolute_data_dir(data_dir: str | Path | list) -> str | list[str]:
    """``data_dir`` (a path, or a list of them: DataSpec.data_dir) made absolute, as a run records it."""
    return [str(Path(p).resolve()) for p in data_dir] if isinstance(data_dir, list) else str(Path(data_dir).resolve())


def data_dir_exists(data_dir: str | list | None) -> bool:
    """Whether ``data_dir`` (a path, or each of a list's) exists; False for None or ""."""
    return bool(data_dir) and all(Path(p).exists() for p in (data_dir if isinstance(data_dir, list) else [data_dir]))


def prepare_data(spec: DataSpec) -> tuple[EventLog, Split]:
    """The event log named by ``spec`` (its first ``max_users`` users) and its split under
    ``spec.protocol``, side features encoded through ``spec.feature_maps`` (the run's), else through
    maps from the training events (quantile edges), which are then set on ``spec``
    (:func:`hstu.data.features.apply_features`). Raises FileNotFoundError / DataFormatError from
    the loaders, ValueError for an unknown data set or ``max_users`` <= 0."""
    log_ = load_dataset(spec.dataset, spec.data_dir, skip_bad_rows=spec.skip_bad_rows, **spec.options)
    if spec.max_users is not None:  # 0 is an error (subset_users), not "all users"
        log_, n = subset_users(log_, spec.max_users), log_.num_users
        log.info("%s: the first %d of %d users (max_users); %d events", log_.name, log_.num_users, n, log_.num_events)
    split = make_split(log_, spec.protocol)
    log_ = apply_features(log_, split.train_end, spec.feature_maps)
    if spec.feature_maps is None and log_.feature_maps:
        spec.feature_maps = log_.feature_maps  # recorded with the spec (config.json data): later reads reuse them
    return with_options(log_, spec), split


def with_options(log_: EventLog, spec: DataSpec) -> EventLog:
    """``log_`` with ``spec``'s data options applied, a shallow copy (``log_`` itself when there
    are none): ``exclude_history`` as its candidate policy (``exclude_history_default``, which every
    evaluation and idmap.json read) and the ``items`` file's metadata (``item_meta``,
    :func:`hstu.data.items.read_item_meta`; FileNotFoundError / DataFormatError naming the file)."""
    changes: dict = {}
    if spec.exclude_history is not None and spec.exclude_history != log_.exclude_history_default:
        changes["exclude_history_default"] = bool(spec.exclude_history)
    if spec.items:
        from hstu.data.items import read_item_meta

        changes["item_meta"] = read_item_meta(spec.items, log_)
    return replace(log_, **changes) if changes else log_


def subset_users(log_: EventLog, n: int) -> EventLog:
    """The first ``n`` users (ascending original id); the item vocabulary is kept whole.
    Raises ValueError for ``n`` <= 0."""
    if n <= 0:
        raise ValueError(f"max_users must be > 0, got {n}")
    n = min(n, log_.num_users)
    e = int(log_.offsets[n])
    cut = {k: getattr(log_, k)[:e] for k in ("items", "timestamps", "actions", "categories", "values")}
    cut["feature_raw"] = {k: v[:e] for k, v in log_.feature_raw.items()}
    if log_.features is not None:
        cut["features"] = log_.features[:e]
    return EventLog(**{**log_.__dict__, **cut, "users": log_.users[:n], "offsets": log_.offsets[: n + 1]})


PROTOCOL_NEEDS = {"clean": (3, "a training, a validation and a test event"), "paper": (2, "a training and a test event")}


def _users_by_length(lengths: np.ndarray, need: int) -> str:
    """'80 users have 1 event, 40 have 2, 0 have >= 3' for per-user event counts ``lengths``."""
    parts = [f"{int((lengths == n).sum())} have {n} event{'s' if n > 1 else ''}" for n in range(1, need) if (lengths == n).any()]
    parts.append(f"{int((lengths >= need).sum())} have >= {need}")
    return f"of {len(lengths)} users, " + ", ".join(parts)


def check_trainable(log_: EventLog, split: Split, max_seq_len: int) -> None:
    """ValueError (one line) when the data cannot train and evaluate a model under the split's
    protocol: no user has enough events to be evaluated (clean: >= 3, paper: >= 2), or there is
    no training position (a user needs >= 2 training events, within ``max_seq_len``, for one).
    ``fit`` calls it before anything is written to the run directory."""
    need, what = PROTOCOL_NEEDS[split.protocol]
    lengths = np.diff(log_.offsets)
    if not (lengths >= need).any():
        raise ValueError(
            f"too little data for --protocol {split.protocol} in {log_.name}: {_users_by_length(lengths, need)} events; "
            f"a user needs >= {need} ({what}) to be evaluated, and no user does"
        )
    if max_seq_len < 2:  # a training position is an event predicted from an earlier one in the same window
        raise ValueError(f"[model] max_seq_len = {max_seq_len} leaves no training position: a window needs >= 2 events")
    train_len = np.minimum(split.train_end - log_.offsets[:-1], max_seq_len)
    positions = int(np.clip(train_len - 1, 0, None).sum())
    if positions == 0:
        who = "a user with 2 events (too few to evaluate: all trained on) or >= 4" if split.protocol == "clean" else "a user with >= 3"
        raise ValueError(
            f"too little data for --protocol {split.protocol} in {log_.name}: 0 training positions "
            f"({_users_by_length(lengths, need + 1)} events; a training position needs {who} events)"
        )


def train_item_counts(log_: EventLog, split: Split) -> np.ndarray:
    """(I+1,) int64 number of training events per dense item (popularity, cold-start serving)."""
    keep = np.zeros(log_.num_events, dtype=bool)
    for s, e in zip(log_.offsets[:-1], split.train_end):
        keep[s:e] = True
    return np.bincount(log_.items[keep], minlength=log_.num_items + 1).astype(np.int64)


def model_config_for(log_: EventLog, cfg: ModelConfig, use_features: bool) -> ModelConfig:
    """``cfg`` with what the data fixes (in place): num_items and, with ``use_features``,
    num_actions (0 for a single action type), num_categories and the side features' sizes
    (``features``: name -> values, :func:`hstu.data.features.feature_sizes`). Order-only data
    (``facts["order_only"]``: no time column, the position is the order) turns the time bias off
    (``use_time_bias = False``, logged): its timestamps carry nothing, and the time term of the
    relative bias (Zhai et al. 2024, §3, rab^{p,t}) would only repeat the position term."""
    if cfg.num_items and cfg.num_items != log_.num_items:  # e.g. a [model] num_items: the data decides, said aloud
        log.warning("%s: %d items in the data; [model] num_items = %d is replaced by it", log_.name, log_.num_items, cfg.num_items)
    cfg.num_items = log_.num_items
    if log_.facts.get("order_only") and cfg.use_time_bias:
        log.info("%s: order-only data (no time column): the time bias is off (use_time_bias = false)", log_.name)
        cfg.use_time_bias = False
    if use_features:
        for name, n in (("num_actions", log_.num_actions if log_.num_actions > 1 else 0), ("num_categories", log_.num_categories)):
            if getattr(cfg, name) and getattr(cfg, name) != n:  # as num_items: the data decides, said aloud
                log.warning("%s: the data gives %s = %d; [model] %s = %d is replaced by it", log_.name, name, n, name, getattr(cfg, name))
            setattr(cfg, name, n)
        sizes = feature_sizes(log_.feature_maps)
        if cfg.features and cfg.features != sizes:  # as num_items: the data (its --feature columns) decides, said aloud
            log.warning("%s: the data's side features are %s; [model] features = %s is replaced by them", log_.name, sizes, cfg.features)
        cfg.features = sizes
    return cfg


def check_loader_options(opts: dict, where: str) -> None:
    """The loader options a config file's ``[data]`` table sets (``features``, ``numeric_features``, ``time_unit``),
    checked as it is read (:func:`hstu.config.data_spec_from_table`): ValueError naming ``where`` (the file and table)
    and the option; the loaders' own errors named neither."""
    if "features" in opts or "numeric_features" in opts:
        parse_feature_options(opts.get("features"), opts.get("numeric_features"), where)
    if opts.get("time_unit") is not None and opts["time_unit"] not in TIME_UNITS:
        raise ValueError(f"{where} time_unit must be one of {list(TIME_UNITS)}, got {opts['time_unit']!r}")
