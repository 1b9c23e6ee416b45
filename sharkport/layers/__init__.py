"""Layers built from a sub-Theta: the paged KV cache, attention over it, and feed-forward blocks."""

from .attention import AttentionConfig, PagedAttention
from .ffn import GeGLU, GeluMLP, MixtureOfExperts, SwiGLU
from .paged_cache import PagedCache

__all__ = ["AttentionConfig", "GeGLU", "GeluMLP", "MixtureOfExperts", "PagedAttention", "PagedCache", "SwiGLU"]
