"""Generation: one engine for every path, and the model-level oracle.

``hstu generate``, the Python API and ``hstu serve`` generate through
:meth:`hstu.generate.recommend.Recommender.recommend`, and the slice reports through
:meth:`hstu.train.slices.ModelScorer.generate`; both run :class:`hstu.generate.engine.Engine`. The
sampler (scores, exclusion, top-k) is :mod:`hstu.generate.sampler`. :mod:`hstu.generate.decode`
(``generate``, ``generate_recompute``, with :mod:`hstu.generate.kv_cache`) is the engine's test
oracle: no module in src imports it; the names below resolve lazily (PEP 562) for tests and
benchmarks that still import them from this package, so importing ``hstu.generate`` loads no oracle.
"""

from hstu.generate.sampler import GenerationResult, exclusion_mask

_ORACLE = {"generate": "hstu.generate.decode", "generate_recompute": "hstu.generate.decode", "KVCache": "hstu.generate.kv_cache"}
_ENGINE = {"Recommender": "hstu.generate.recommend", "History": "hstu.generate.recommend", "Engine": "hstu.generate.engine"}


def __getattr__(name: str):
    if name in _ORACLE or name in _ENGINE:
        import importlib

        return getattr(importlib.import_module({**_ORACLE, **_ENGINE}[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engine", "GenerationResult", "History", "KVCache", "Recommender", "exclusion_mask", "generate", "generate_recompute"]
