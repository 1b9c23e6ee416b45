"""GPU targets (docs/devices.md): `--target backend[:chip]` resolves to complete iree-compile flag
sets, every recipe compiles for ROCm, CUDA and Vulkan on a machine without a GPU, IREE's runtime
reads the modules back with the ABI's functions, and the runner picks (or refuses) the device
from the module's own executables.

The quick suite compiles the tiny llama for each backend; the slow one gemma3 and SmolLM2
for cuda:sm_90 (the chip tools/gpu_check.sh runs); `extended` every recipe and SmolLM2 for all
three. Running on a GPU is tools/gpu_check.sh's job.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sharkport.compile import GPU_BACKENDS, compile_flags, compile_mlir, resolve_target
from sharkport.errors import SharkportError
from tiny_models import RECIPE_KINDS, TINY_EXPORT, TinyRecipes

BACKENDS = {"rocm:gfx942": "hip", "cuda:sm_90": "cuda", "vulkan": "vulkan"}
ABI_FUNCTIONS = {"prefill_bs1", "decode_bs1"}  # every export has batch 1


@pytest.mark.parametrize("spec, name, flags", [
    ("llvm-cpu-lean", "llvm-cpu-lean", ["--iree-hal-target-device=local"]),
    ("rocm", "rocm:gfx942", ["--iree-hal-target-device=hip", "--iree-hip-target=gfx942"]),
    ("rocm:gfx1100", "rocm:gfx1100", ["--iree-hal-target-device=hip", "--iree-hip-target=gfx1100"]),
    ("cuda", "cuda:sm_80", ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"]),
    ("vulkan:rdna3", "vulkan:rdna3", ["--iree-hal-target-device=vulkan", "--iree-vulkan-target=rdna3"]),
])
def test_targets_are_complete_flag_sets(spec, name, flags):
    target = resolve_target(spec)
    assert target.name == name
    assert all(f in target.flags for f in flags)


def test_sm_90_names_the_whole_device():
    """IREE 3.9 has no sm_90 in its chip table: the preset gives the device target itself."""
    flag, _ = resolve_target("cuda:sm_90").flags
    assert flag.startswith("--iree-hal-target-device=#hal.device.target<\"cuda\"")
    assert 'arch = "sm_90"' in flag and 'features = "+ptx80"' in flag


@pytest.mark.parametrize("spec, words", [
    ("cuda:sm_99", ["sm_99", "sm_80"]), ("rocm:mi300", ["mi300", "gfx942"]), ("metal", ["unknown", "cuda[:chip]"]),
])
def test_unknown_targets_are_refused(spec, words):
    with pytest.raises(SharkportError) as e:
        resolve_target(spec)
    assert all(w in str(e.value) for w in words)


def test_tensor_parallel_flags_per_device():
    assert compile_flags("rocm", devices=2)[:2] == ["--iree-hal-target-device=hip[0]", "--iree-hal-target-device=hip[1]"]
    with pytest.raises(SharkportError, match="one device"):
        compile_flags("cuda:sm_90", devices=2)


def test_cpu_kernels_never_enter_a_gpu_module(tmp_path):
    mlir = tmp_path / "m.mlir"
    mlir.write_text("func.func private @sharkport_matvec_q4_1(%a: i64)\n")
    with pytest.raises(SharkportError, match="x86-64"):
        compile_mlir(mlir, tmp_path / "m.vmfb", "cuda")
    assert not (tmp_path / "m.vmfb").exists()


def test_kernels_by_default_only_where_they_apply():
    """An export not told takes the x86-64 kernels for a CPU target on one device, where this
    machine builds them; never for a GPU target or a tensor-parallel export."""
    from sharkport import kernels
    from sharkport.compile.build import kernels_apply

    assert kernels_apply("llvm-cpu", True) == kernels_apply("llvm-cpu-lean", True) == kernels.available()
    assert not kernels_apply("llvm-cpu", False)
    assert not any(kernels_apply(spec, True) for spec in ("cuda", "rocm:gfx942", "vulkan"))


def test_export_cli_refuses_bad_targets(tmp_path):
    base = [sys.executable, "-m", "sharkport.export", "--gguf-file", str(tmp_path / "x.gguf"),
            "--output-mlir", str(tmp_path / "x.mlir"), "--output-config", str(tmp_path / "x.json")]
    proc = subprocess.run(base + ["--target", "cuda:sm_99"], capture_output=True, text=True)
    assert proc.returncode == 2 and "sm_99" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(base + ["--target", "rocm", "--matvec-kernels"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--matvec-kernels" in proc.stderr
    assert not list(tmp_path.iterdir())


def _check_module(vmfb: Path, driver: str) -> None:
    """IREE's runtime verifies the module and lists the ABI's functions; the runner reads its driver."""
    import iree.runtime as rt

    from sharkport.runtime.vmfb import module_driver

    instance = rt.VmInstance()  # outlives the module: IREE's objects do not keep their makers
    module = rt.VmModule.mmap(instance, str(vmfb))
    assert ABI_FUNCTIONS <= set(module.function_names)
    assert "decode_bs1(0rrrrr_r)" in str(module.lookup_function("decode_bs1"))  # 4 inputs + cache -> logits
    assert module_driver(vmfb) == driver


def _export(irpa: Path, out: Path, config=TINY_EXPORT) -> Path:
    """The model's MLIR as a target keeping the weights as stored has it exported (once per folder)."""
    from sharkport.archive import Dataset
    from sharkport.export import export_model, save_export

    if not (out / "model.mlir").exists():
        output, service = export_model(Dataset.load(irpa), dataclasses.replace(config, dequant_in_products=True))
        save_export(output, service, out / "model.mlir", out / "model.json")
    return out / "model.mlir"


@pytest.mark.parametrize("spec", BACKENDS)
def test_tiny_llama_compiles_for_each_backend(irpa_of, spec, tmp_path):
    irpa = irpa_of("gqa-untied")
    mlir = _export(irpa, irpa.parent / "gpu-export")
    vmfb = tmp_path / "model.vmfb"
    compile_mlir(mlir, vmfb, spec)
    _check_module(vmfb, BACKENDS[spec])


def test_runner_refuses_the_wrong_device(irpa_of, tmp_path):
    """A CUDA module on a CPU device is refused before it loads; without a GPU here, its default
    device (the first CUDA GPU) is one line saying so."""
    from sharkport.runtime.session import IreeSession

    irpa = irpa_of("gqa-untied")
    mlir = _export(irpa, irpa.parent / "gpu-export")
    vmfb = tmp_path / "model.vmfb"
    compile_mlir(mlir, vmfb, "cuda")
    config = mlir.with_suffix(".json")
    with pytest.raises(SharkportError, match="compiled for cuda GPUs; run it with --device cuda"):
        IreeSession(vmfb, irpa, config, device="local-task")
    try:
        IreeSession(vmfb, irpa, config)
    except SharkportError as e:
        assert str(e).startswith("--device cuda: not available here")


def test_cpu_module_refuses_a_gpu_device(compiled_of):
    from sharkport.runtime.session import IreeSession
    from sharkport.runtime.vmfb import module_driver

    vmfb, irpa, config = compiled_of("gqa-untied")
    assert module_driver(vmfb) is None
    with pytest.raises(SharkportError, match="compiled for the CPU; run it with --device local-task"):
        IreeSession(vmfb, irpa, config, device="hip://0")


def test_device_memory_copies_back():
    """What a GPU's results take: a device-to-host copy on the queue (here on a CPU device)."""
    import iree.runtime as rt

    from sharkport.runtime.session import _copy_to_host, _uploader

    device = rt.get_device("local-task")
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    view = _uploader(rt, device, mapped=False)(a)
    b = _copy_to_host(rt, device, view, np.float32)
    del view
    np.testing.assert_array_equal(b, a)


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> TinyRecipes:
    return TinyRecipes(tmp_path_factory.mktemp("gpu_recipes"))


def _compile_recipe(recipes, kind: str, spec: str, tmp_path: Path) -> None:
    from sharkport.archive import import_gguf

    m = recipes[kind]
    irpa = m.gguf_path.parent / "model.irpa"
    if not irpa.exists():
        import_gguf(m.gguf_path, irpa, progress=False)
    vmfb = tmp_path / "model.vmfb"
    compile_mlir(_export(irpa, irpa.parent / "gpu-export"), vmfb, spec)
    _check_module(vmfb, BACKENDS[spec])


# In the suite, the recipe whose program differs most from llama's (sliding window, soft-capping,
# extra norms); the rest are `extended`.
SUITE_KINDS = ("gemma3-2l",)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param(k, marks=[] if k in SUITE_KINDS else [pytest.mark.extended])
                                  for k in RECIPE_KINDS])
def test_every_recipe_compiles_for_cuda(recipes, kind, tmp_path):
    _compile_recipe(recipes, kind, "cuda:sm_90", tmp_path)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("spec", [s for s in BACKENDS if not s.startswith("cuda")])
@pytest.mark.parametrize("kind", RECIPE_KINDS)
def test_every_recipe_compiles_for_rocm_and_vulkan(recipes, kind, spec, tmp_path):
    _compile_recipe(recipes, kind, spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [pytest.param(s, marks=[] if s.startswith("cuda") else [pytest.mark.extended])
                                  for s in BACKENDS])
def test_smollm2_compiles_for_gpus(smollm2_irpa, spec, tmp_path_factory, tmp_path):
    """SmolLM2 Q4_1 (Q4_1 and Q8_0 planes dequantized in the program; decode's products in one
    dispatch with it)."""
    from sharkport.export.abi import ExportConfig

    config = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=32, device_block_count=16, max_seq_len=512)
    mlir = _export(smollm2_irpa, tmp_path_factory.getbasetemp() / "smollm2-gpu-export", config)
    compile_mlir(mlir, tmp_path / "model.vmfb", spec)
    _check_module(tmp_path / "model.vmfb", BACKENDS[spec])


def test_every_backend_has_a_documented_default():
    docs = (Path(__file__).parent.parent / "docs" / "devices.md").read_text()
    for name, backend in GPU_BACKENDS.items():
        assert f"`{name}:{backend.default_chip}`" in docs
