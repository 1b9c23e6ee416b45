"""Layers built from a sub-Theta: products and norms, the paged KV cache, attention over it, and
feed-forward blocks."""

from .attention import AttentionConfig, PagedAttention
from .ffn import GeGLU, GeluMLP, MixtureOfExperts, SwiGLU
from .linear import LayerNorm, Linear, RMSNorm
from .paged_cache import PagedCache

__all__ = ["AttentionConfig", "GeGLU", "GeluMLP", "LayerNorm", "Linear", "MixtureOfExperts", "PagedAttention",
           "PagedCache", "RMSNorm", "SwiGLU"]
