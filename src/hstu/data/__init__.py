"""Data: loaders, ID maps, per-user sequences, splits, padded batches."""

from hstu.data.batching import SequenceBatch, eval_batch, train_batch
from hstu.data.errors import DataFormatError
from hstu.data.sequences import EventLog, Split, make_split

__all__ = ["DataFormatError", "EventLog", "SequenceBatch", "Split", "eval_batch", "make_split", "train_batch", "load_dataset"]


def load_dataset(name: str, data_dir, skip_bad_rows: bool = False, **kwargs) -> EventLog:
    """Load a named data set ("ml-1m" | "taobao" | "retailrocket" | "csv") from ``data_dir``."""
    if name in ("ml-1m", "movielens", "ml1m"):
        from hstu.data.movielens import load_movielens

        return load_movielens(data_dir, skip_bad_rows=skip_bad_rows)
    try:
        from hstu.data import ecommerce
    except ImportError:  # pragma: no cover
        ecommerce = None
    if ecommerce is not None and name in getattr(ecommerce, "LOADERS", {}):
        return ecommerce.LOADERS[name](data_dir, skip_bad_rows=skip_bad_rows, **kwargs)
    valid = ["ml-1m"] + sorted(getattr(ecommerce, "LOADERS", {}) if ecommerce else [])
    raise ValueError(f"unknown dataset {name!r}; valid: {valid}")
