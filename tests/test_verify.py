"""verify: passes a compiled tiny llama against its eager recipe and transformers, and fails it
against a different transformers model; passes SmolLM2 Q4_1 exported with the kernels and fails
it against transformers reading the same GGUF with two layers swapped (slow: compiled modules)."""

import re

import numpy as np
import pytest

from sharkport.tools import verify

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def token_ids(n: int, seed: int) -> str:
    return ",".join(str(t) for t in np.random.default_rng(seed).integers(0, 256, n))


ROW = re.compile(r"^(\w+ vs \w+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)/\d+\s+(\d+)/(\d+)\s+\(.*\)\s+(PASS|FAIL)$", re.M)


def table(out: str) -> dict[str, tuple]:
    """verify's rows: name -> (positions, max |diff|, in sigmas, top-1 agreeing, decisive positions,
    agreeing of those, verdict)."""
    return {m[1]: (int(m[2]), float(m[3]), float(m[4]), int(m[5]), int(m[7]), int(m[6]), m[8])
            for m in ROW.finditer(out)}


def run_verify(compiled, hf_dir, capsys):
    vmfb, irpa, config = compiled
    status = verify.main(["--vmfb", str(vmfb), "--irpa-file", str(irpa), "--config", str(config),
                          "--token-ids", token_ids(5, 0), "--token-ids", token_ids(40, 1),
                          "--model-dir", str(hf_dir), "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    rows = {name: (r[0], r[1], r[3], r[6]) for name, r in table(out).items()}
    return status, rows, out


def test_faithful_module_passes(tiny, compiled_of, capsys):
    status, rows, out = run_verify(compiled_of("gqa-untied"), tiny["gqa-untied"].hf_dir, capsys)
    assert status == 0 and out.rstrip().splitlines()[-1].startswith("PASS")
    assert set(rows) == {"compiled vs eager", "compiled vs transformers", "eager vs transformers"}
    for positions, diff, agree, verdict in rows.values():
        # positions: every prompt position plus the generated ones but the last: 5 + 40 + 2 * 5
        assert positions == 55 and diff < 1e-3 and agree == positions and verdict == "PASS"


def test_other_model_fails(tiny, compiled_of, capsys):
    status, rows, _ = run_verify(compiled_of("mha-tied"), tiny["mha-untied"].hf_dir, capsys)
    assert status == 1
    assert rows["compiled vs eager"][3] == "PASS"
    assert rows["compiled vs transformers"][3] == rows["eager vs transformers"][3] == "FAIL"


def test_float16_cache_module_passes_within_its_rounding(tiny, irpa_of, tmp_path, capsys):
    """A module exported with the default float16 KV cache passes against its recipe (with the same
    cache) and transformers with --atol's default for that cache, 0.05: rounding K and V moves
    decode's logits by more than float32's 0.01 allows on real models (verify.ATOL), and here its
    differences are still found (above the float32 cache's)."""
    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from tiny_models import TINY_EXPORT

    output, service = export_model(Dataset.load(irpa_of("gqa-untied")), TINY_EXPORT)
    assert service.kv_cache_dtype == "float16"
    save_export(output, service, tmp_path / "m.mlir", tmp_path / "m.json")
    compile_mlir(tmp_path / "m.mlir", tmp_path / "m.vmfb")
    status, rows, out = run_verify((tmp_path / "m.vmfb", irpa_of("gqa-untied"), tmp_path / "m.json"),
                                   tiny["gqa-untied"].hf_dir, capsys)
    assert status == 0 and out.rstrip().splitlines()[-1] == "PASS (atol 0.05, top-1 agreement >= 99%)", out
    diff = rows["eager vs transformers"][1]
    assert 1e-4 < diff < verify.ATOL["float16"], diff


@pytest.mark.skipif(not __import__("sharkport.kernels").kernels.available(), reason="no C compiler for the kernels")
def test_default_export_through_the_kernels_passes(tiny, tmp_path, capsys):
    """`sharkport export` with no performance flag multiplies through the x86-64 kernels on a CPU
    target, x quantized to 8 bits by Q4_1 weights; verify compares the module with the recipe
    computing as the kernels do and with transformers whose linear layers take inputs quantized
    by gguf.quants, and it passes."""
    from run_cli import run

    from sharkport import kernels

    irpa, gguf, out = tmp_path / "q.irpa", tmp_path / "gguf" / "q.gguf", tmp_path / "m"
    gguf.parent.mkdir()
    run("sharkport.tools.quantize", "--gguf-file", str(tiny["gqa-untied"].gguf_path), "--type", "q4_1",
        "--output-irpa", str(irpa), "--output-gguf", str(gguf))
    files = {k: out / f"m.{k}" for k in ("mlir", "json", "vmfb")}
    run("sharkport.export", "--irpa-file", str(irpa), "--bs-prefill", "1", "--bs-decode", "1",
        *(a for k in files for a in (f"--output-{'config' if k == 'json' else k}", str(files[k]))))
    assert kernels.referenced_by(files["vmfb"])
    status = verify.main(["--vmfb", str(files["vmfb"]), "--irpa-file", str(irpa), "--config", str(files["json"]),
                          "--token-ids", token_ids(40, 1), "--gguf-file", str(gguf), "--max-new-tokens", "6"])
    text = capsys.readouterr().out
    assert "exported with the x86-64 kernels" in text and "so do transformers' linear layers" in text, text
    assert status == 0, text


@pytest.mark.skipif(not __import__("sharkport.kernels").kernels.available(), reason="no C compiler for the kernels")
def test_real_model_with_kernels_passes_and_swapped_layers_fail(smollm2_irpa, smollm2_hf):
    """SmolLM2 Q4_1 exported with the kernels passes at verify's default bounds for such a module
    (verify.SIGMAS, top-1 where transformers is decisive) against its recipe and transformers
    reading the same GGUF, whose logits the 8-bit activations move by about 1.5 (more than any
    atol a float module meets); against that transformers model with layers 20 and 21's v_proj
    swapped it fails. The model is the session's (verify_files' hf_model), left as it was."""
    import torch
    from real_models import compiled_module

    from sharkport.export.abi import ExportConfig
    from sharkport.verify import ATOL, DECISIVE, SIGMAS, Tolerance, verify_files

    config = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=32, device_block_count=16,
                          max_seq_len=512, matvec_kernels=True)
    vmfb, irpa, config_json = compiled_module(smollm2_irpa, "smollm2-kernels", config)
    hf = smollm2_hf[0]
    v20, v21 = (hf.model.layers[i].self_attn.v_proj.weight for i in (20, 21))
    before = v20.clone(), v21.clone()

    def run():
        rows, tol = verify_files(vmfb, irpa, config_json, prompts=["The capital of France is", "def fibonacci(n):"],
                                 max_new_tokens=24, hf_model=hf, log=lambda line: None)
        return {r.name: r for r in rows}, tol

    rows, tol = run()
    assert tol == Tolerance(sigmas=SIGMAS, decisive=DECISIVE)
    assert all(r.passed for r in rows.values()), rows
    assert max(r.max_abs_diff for r in rows.values()) > ATOL["float16"] * 10, rows  # what an atol would fail
    assert all(r.decisive >= 10 for r in rows.values()), rows  # decisive positions were counted
    with torch.no_grad():
        v20.copy_(before[1]), v21.copy_(before[0])
    try:
        rows, _ = run()
    finally:
        with torch.no_grad():
            v20.copy_(before[0]), v21.copy_(before[1])
    assert rows["compiled vs eager"].passed
    assert not rows["compiled vs transformers"].passed and not rows["eager vs transformers"].passed, rows
    assert all(not h._forward_pre_hooks for h in hf.modules())  # verify's hooks are gone
