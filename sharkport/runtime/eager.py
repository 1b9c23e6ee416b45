"""The eager session: the PyTorch recipe run directly, behind the Session interface of
runtime/session.py (the reference for the compiled module)."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import torch

from ..export.abi import ServiceConfig
from .session import Session, cache_pages


class EagerSession(Session):
    """The PyTorch recipe run directly: the reference for the compiled module."""

    def __init__(self, model, config: ServiceConfig, pages: int | None = None):
        if config.vocab_size is None:  # a config read from JSON
            config = replace(config, vocab_size=model.vocab_size)
        self.model, self.config = model, config
        self.pages = cache_pages(pages, config)
        self._calls = threading.Lock()
        self._cache = model.new_cache(self.pages)

    @torch.no_grad()
    def _prefill(self, tokens, seq_lens, seq_block_ids):
        t = [torch.from_numpy(a) for a in (tokens, seq_lens, seq_block_ids)]
        return self.model.prefill(*t, self._cache).numpy()

    @torch.no_grad()
    def _decode(self, tokens, seq_lens, start_positions, seq_block_ids):
        t = [torch.from_numpy(a) for a in (tokens, seq_lens, start_positions, seq_block_ids)]
        return self.model.decode(*t, self._cache).numpy()

    def cache_to_host(self) -> np.ndarray:
        return self._cache.numpy().copy()
