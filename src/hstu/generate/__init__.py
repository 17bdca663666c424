"""Generation: preallocated KV cache and next-k decoding."""

from hstu.generate.decode import GenerationResult, exclusion_mask, generate, generate_recompute
from hstu.generate.kv_cache import KVCache

__all__ = ["GenerationResult", "KVCache", "exclusion_mask", "generate", "generate_recompute"]
