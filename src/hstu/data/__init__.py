"""Data: loaders, ID maps, per-user sequences, splits, padded batches."""

from hstu.data.batching import SequenceBatch, eval_batch, train_batch
from hstu.data.errors import DataFormatError
from hstu.data.sequences import EventLog, Split, make_split

__all__ = ["DataFormatError", "EventLog", "SequenceBatch", "Split", "eval_batch", "make_split", "train_batch", "load_dataset"]


def load_dataset(name: str, data_dir, skip_bad_rows: bool = False, **kwargs) -> EventLog:
    """Load a named data set from ``data_dir``: a MovieLens release (``ml-100k`` | ``ml-1m`` (alias
    ``movielens``, ``ml1m``) | ``ml-10m`` | ``ml-20m`` | ``ml-25m`` | ``ml-latest`` | ``ml-latest-small``,
    :mod:`hstu.data.movielens`, no options) or one of ``hstu.data.ecommerce.LOADERS`` (``taobao``,
    ``retailrocket``, ``csv``) or ``hstu.data.reviews.LOADERS`` (``amazon``, ``sequences``); ``kwargs``
    are their options). ValueError for an unknown name."""
    from hstu.data.movielens import ALIASES, LAYOUTS, load_movielens

    if name in LAYOUTS or name in ALIASES:
        if kwargs:
            raise ValueError(f"{name}: unknown option(s) {sorted(kwargs)} (MovieLens has a fixed layout)")
        return load_movielens(data_dir, skip_bad_rows=skip_bad_rows, dataset=name)
    try:
        from hstu.data import ecommerce
    except ImportError:  # pragma: no cover
        ecommerce = None
    from hstu.data.reviews import LOADERS as REVIEWS

    loaders = {**(getattr(ecommerce, "LOADERS", {}) if ecommerce else {}), **REVIEWS}
    if name in loaders:
        return loaders[name](data_dir, skip_bad_rows=skip_bad_rows, **kwargs)
    valid = sorted(LAYOUTS) + sorted(loaders)
    raise ValueError(f"unknown dataset {name!r}; valid: {valid}")
