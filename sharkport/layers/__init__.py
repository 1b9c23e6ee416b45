"""Layers built from a sub-Theta: the paged KV cache, attention over it, and feed-forward blocks."""

from .attention import PagedAttention
from .ffn import SwiGLU
from .paged_cache import PagedCache

__all__ = ["PagedAttention", "PagedCache", "SwiGLU"]
