"""Generation: one engine for every path, and the model-level oracle.

``hstu generate``, the Python API and ``hstu serve`` generate through
:meth:`hstu.generate.recommend.Recommender.recommend`, which runs :class:`hstu.generate.engine.Engine`;
the sampler (scores, exclusion, top-k) is :mod:`hstu.generate.sampler`. :func:`generate` and
:func:`generate_recompute` (:mod:`hstu.generate.decode`) are the test oracle of the engine, kept
importable here for tests and benchmarks; no user path calls them.
"""

from hstu.generate.decode import generate, generate_recompute
from hstu.generate.kv_cache import KVCache
from hstu.generate.sampler import GenerationResult, exclusion_mask

__all__ = ["GenerationResult", "KVCache", "exclusion_mask", "generate", "generate_recompute"]
