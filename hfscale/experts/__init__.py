"""Mixture-of-experts models in less memory than their size: routed experts stay in safetensors files
and an LRU cache bounded by a byte budget holds the ones routing asks for (see offload.py).

    from hfscale.experts import from_pretrained, offload_
    model = from_pretrained("path/to/moe", ram_budget="2GB", prefetch=True)
    model.hfscale_experts.stats()   # hits, misses, bytes read, evictions, read-ahead use
"""

from .cache import CacheStats, ExpertCache
from .offload import ExpertOffload, find_experts, from_pretrained, offload_, parse_budget, top_k
from .store import LAYOUTS, READERS

__all__ = ["CacheStats", "ExpertCache", "ExpertOffload", "LAYOUTS", "READERS", "find_experts", "from_pretrained",
           "offload_", "parse_budget", "top_k"]
