"""Helpers for tests on real models from PyPI packages (SmolLM2, Gemma-3-270M): transformers'
reading of the same GGUF, a compiled module, and the eager recipe's prefill. Test helpers, not
tests; the session fixtures in conftest.py and the real-model test files use them."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import torch


def hf_from_gguf(gguf: Path):
    """transformers' own reading of a GGUF (it dequantizes to float32): (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf.parent, gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def shared_folder(tmp_path_factory, name: str) -> Path:
    """A folder of this test run that each of its xdist workers sees (in the run's base temporary
    folder, above each worker's own), for what one worker makes and the others reuse (made_once)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def made_once(path: Path):
    """Held while `path` is made or found made: one process at a time (a lock beside it), so that
    the first worker of a run to need it makes it and the others wait for it and reuse it."""
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def compiled_module(irpa: Path, name: str, config) -> tuple[Path, Path, Path]:
    """`irpa` exported with ExportConfig `config` and compiled for the host CPU, beside it as
    name.mlir/.json/.vmfb: (vmfb, irpa, config json). Made once per folder and name (made_once):
    in a shared_folder, once per test run."""
    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from tiny_models import exact_cache

    mlir, json_path, vmfb = (irpa.parent / f"{name}.{e}" for e in ("mlir", "json", "vmfb"))
    with made_once(vmfb):
        if not vmfb.exists():  # compile_mlir writes it whole or not at all
            output, service = export_model(Dataset.load(irpa), config, exact_cache(config.block_seq_stride))
            save_export(output, service, mlir, json_path)
            compile_mlir(mlir, vmfb)
    return vmfb, irpa, json_path


def eager_prefill(model, ids: list[int], stride: int = 32) -> torch.Tensor:
    """The recipe's prefill logits [len(ids), V] of one prompt, its blocks on pages in reverse
    order (page 0 included), so a wrong page lookup shows."""
    blocks = -(-len(ids) // stride)
    tokens = torch.zeros(1, blocks * stride, dtype=torch.long)
    tokens[0, : len(ids)] = torch.tensor(ids)
    pages = torch.arange(blocks).flip(0)[None]
    with torch.no_grad():
        return model.prefill(tokens, torch.tensor([len(ids)]), pages, model.new_cache(blocks))[0, : len(ids)]
