"""Per-sequence inference state: one layer's packed caches with a single position and atomic
commit, trimming, byte counts, and prompt-cache files.
"""

from .layer import CacheError, LayerCache, cache_bytes, trim_cache
from .persistence import copy_cache, load_prompt_cache, save_prompt_cache

__all__ = ["CacheError", "LayerCache", "cache_bytes", "trim_cache", "copy_cache",
           "load_prompt_cache", "save_prompt_cache"]
