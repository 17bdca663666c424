"""The checks of :meth:`hstu.generate.recommend.Recommender.rank`'s call arguments (the Python API's edge;
the CLI and the HTTP schema check theirs before they call it): the prepared histories, k and the
decoding options, each refused with one TypeError (a wrong kind of object) or ValueError (a bad
value) naming the argument.
"""

from __future__ import annotations

import dataclasses
from numbers import Integral

import numpy as np

from hstu.config import DecodeOptions, check_k
from hstu.generate.histories import History, Prepared


def check_preps(preps) -> None:
    """TypeError unless ``preps`` is a list (or tuple) of :class:`Prepared`; a :class:`History` is
    named: it is prepared first (``rec.prepare(history)``: its ids mapped and checked)."""
    if not isinstance(preps, (list, tuple)):
        raise TypeError(f"preps must be a list of prepared histories (Recommender.prepare), got {type(preps).__name__}")
    for i, p in enumerate(preps):
        if isinstance(p, History):
            raise TypeError(f"preps[{i}] is a History; call rec.prepare(history) first and pass what it returns")
        if not isinstance(p, Prepared):
            raise TypeError(f"preps[{i}] must be a Prepared history (from Recommender.prepare), got {type(p).__name__}")


def k_arg(k, max_output_len: int) -> int:
    """``k`` as an int: ValueError ``"k: must be an integer, got True"`` for a bool or a non-integer (as
    the config's ``[generate] k`` and the decoding fields are refused), then the range check of
    ``hstu generate -k`` and the HTTP service (:func:`hstu.config.check_k`)."""
    if isinstance(k, bool) or not isinstance(k, Integral):
        raise ValueError(f"k: must be an integer, got {k!r}")
    check_k(int(k), max_output_len)
    return int(k)


def decode_options(decoding, fields: dict) -> DecodeOptions:
    """The call's :class:`DecodeOptions`: ``decoding`` (its decoding fields alone: a GenerateConfig's
    k is not one), or one built from ``fields`` (strategy, top_k, temperature, beam_width, seed), both
    validated as at construction. TypeError for a ``decoding`` of another type (a strategy name, a
    dict) or an unknown field; ValueError for both given or a bad value (naming the field)."""
    if decoding is not None and fields:
        raise ValueError(f"give decoding or its fields {sorted(fields)}, not both")
    if decoding is None:
        valid = [f.name for f in dataclasses.fields(DecodeOptions)]
        if unknown := sorted(set(fields) - set(valid)):
            raise TypeError(f"unknown keyword argument(s) {unknown}; decoding fields: {valid}")
        return DecodeOptions(**fields)
    if not isinstance(decoding, DecodeOptions):
        raise TypeError(
            f"decoding must be a DecodeOptions (e.g. hstu.DecodeOptions('beam', beam_width=4)), or give its fields as "
            f"keywords (strategy='beam', beam_width=4); got {decoding!r}"
        )
    return decoding.options()  # a new DecodeOptions: validated again (fields may have been set since)


# the decoding fields each strategy reads (greedy reads none); DecodeOptions carries the others, unused
USED_BY = {"top_k": "topk", "temperature": "topk", "seed": "topk", "beam_width": "beam"}
_DEFAULTS = DecodeOptions()  # built once: every served request is compared with it


def ignored_decoding(d: DecodeOptions, flags: bool = False) -> str | None:
    """A warning naming the decoding fields that ``d`` sets away from their defaults but its strategy does not read
    (top_k, temperature, seed: topk only; beam_width: beam only), or None; as command-line flags (``--top-k 3``)
    with ``flags``, else as request fields (``decoding.top_k=3``). They were ignored without a word."""
    off = [(n, getattr(d, n)) for n, s in USED_BY.items() if d.strategy != s and getattr(d, n) != getattr(_DEFAULTS, n)]
    named = [f"--{n.replace('_', '-')} {v}" if flags else f"decoding.{n}={v}" for n, v in off]
    return f"{', '.join(named)}: not used by strategy '{d.strategy}', ignored" if named else None


def flag_arg(value, name: str) -> bool | None:
    """A yes / no option of the API (``exclude_history``, ``allow_untrained``): None (the run's default) or a bool.
    TypeError naming ``name`` otherwise (a string such as "no" was truthy: it excluded the history; HTTP refuses it too)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be True, False or None, got {value!r}")
