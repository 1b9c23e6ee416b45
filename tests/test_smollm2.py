"""The whole path on a real model: SmolLM2-135M-Instruct Q4_1 (llama, GQA 9/3, tied embeddings,
Q4_1 + Q8_0 + F32) against transformers reading the same GGUF (iree-run-module: test_dump_inputs.py)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from real_models import eager_prefill
from sharkport.archive import Dataset
from sharkport.runtime.generate import generate
from sharkport.runtime.session import IreeSession

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]
# Natural text for teacher forcing: every position is scored, not only generated ones.
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for "
    "wine. Within fifty years, presses were working in more than two hundred European cities, "
    "and the price of books fell sharply, which helped spread literacy and new ideas.\n\n"
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to make glucose and oxygen. It takes place mostly in the leaves, inside chloroplasts, where "
    "the pigment chlorophyll absorbs red and blue light and reflects green."
)
NEW_TOKENS = 32


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_archive_is_about_the_gguf_size(smollm2_gguf, smollm2_irpa):
    ratio = os.path.getsize(smollm2_irpa) / os.path.getsize(smollm2_gguf)
    assert 0.98 < ratio < 1.02
    ds = Dataset.load(smollm2_irpa)
    assert ds.metadata["tensors"]["blk.0.attn_q.weight"]["type"] == "Q4_1"
    assert ds.metadata["tensors"]["token_embd.weight"]["type"] == "Q8_0"


def test_eager_recipe_matches_transformers(smollm2_irpa, smollm2_hf):
    from sharkport.models import ModelConfig, build_model

    hf, tok = smollm2_hf
    model = build_model(Dataset.load(smollm2_irpa), ModelConfig(block_seq_stride=32))
    ids = tok(PASSAGE).input_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
    torch.testing.assert_close(eager_prefill(model, ids), ref[0], rtol=0, atol=2e-3)


@pytest.fixture(scope="module")
def hf_continuations(smollm2_hf):
    """transformers' greedy continuation of each prompt: (prompt ids, new ids)."""
    hf, tok = smollm2_hf
    return [(tok(p).input_ids, hf_greedy(hf, tok(p).input_ids, NEW_TOKENS)) for p in PROMPTS]


@pytest.fixture(scope="module")
def session(smollm2_compiled):
    vmfb, irpa, config = smollm2_compiled
    return IreeSession(vmfb, irpa, config)


def test_greedy_continuations_equal_transformers(session, smollm2_irpa, smollm2_hf, hf_continuations):
    _, tok = smollm2_hf
    ours_tok = Dataset.load(smollm2_irpa).tokenizer()
    prompts = [ours_tok.encode(p) for p in PROMPTS]
    assert prompts == [p for p, _ in hf_continuations]
    ours = generate(session, prompts, NEW_TOKENS)
    for (p, expected), got in zip(hf_continuations, ours):
        assert got == expected, f"{tok.decode(p)!r}: {tok.decode(got)!r} != {tok.decode(expected)!r}"


def test_teacher_forced_top1_agreement(session, smollm2_hf, hf_continuations):
    hf, tok = smollm2_hf
    sequences = [tok(PASSAGE).input_ids] + [p + new for p, new in hf_continuations]
    stride = session.config.block_seq_stride
    agree = total = 0
    for i, ids in enumerate(sequences):
        blocks = -(-len(ids) // stride)
        tokens = np.zeros((1, blocks * stride), np.int64)
        tokens[0, : len(ids)] = ids
        pages = np.arange(blocks, dtype=np.int64)[None] + i % 2  # differing page ids per sequence
        logits = session.prefill(tokens, np.array([len(ids)]), pages)[0, : len(ids)]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert total > 200
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"


def test_quickstart_runs_clean(tmp_path):
    """README's first command after the install: text, and not one warning on the way."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "tools" / "quickstart.py"), "--work-dir", str(tmp_path),
                           "--prompt", "The capital of France is", "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "Paris" in proc.stdout
    assert "warning" not in output.lower(), output


@pytest.mark.extended  # the IQ4 products stay in the suite: test_kernels' IQ4_XS layer and row kernels
def test_iq4_xs_file_runs_through_the_kernels_as_transformers(smollm2_gguf, tmp_path, capsys, monkeypatch):
    """SmolLM2 made an IQ4_XS file by llama.cpp's own quantizer (as a hub file: its 576-wide
    matrices fall back to IQ4_NL, ffn_down is IQ4_XS), imported, exported with the kernels (the
    CLI's default) and compiled: its products read IQ4_NL and IQ4_XS as stored (decode's layers
    the layer block of mixed types), and `verify` holds the module to the eager recipe and to
    transformers reading the same file."""
    pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer: pip install -e '.[bench]'")
    import re

    monkeypatch.syspath_prepend(Path(__file__).resolve().parents[1] / "tools")
    import llamacpp_reference
    from run_cli import run

    from sharkport.tools import verify

    gguf = llamacpp_reference.quantized_gguf(smollm2_gguf, "iq4_xs", tmp_path / "gguf")
    irpa, out = tmp_path / "m.irpa", tmp_path / "m"
    run("sharkport", "import", "--gguf-file", str(gguf), "--output-irpa", str(irpa))
    files = {k: out / f"m.{k}" for k in ("mlir", "json", "vmfb")}
    run("sharkport.export", "--irpa-file", str(irpa), "--bs-prefill", "1", "--bs-decode", "1",
        *(a for k in files for a in (f"--output-{'config' if k == 'json' else k}", str(files[k]))))
    text = files["mlir"].read_text()
    for kind in ("iq4_nlx8", "iq4_xsx8"):  # prefill's products (decode's are in the layer block)
        assert re.search(rf"@sharkport_\w+_{kind}_scratch\(", text), f"no {kind} kernel is called"
    assert re.search(r"@sharkport_layer_block_mixed_f16\(", text), "decode's layers are not the mixed layer block"
    status = verify.main(["--vmfb", str(files["vmfb"]), "--irpa-file", str(irpa), "--config", str(files["json"]),
                          "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "16",
                          "--gguf-file", str(gguf)])
    assert status == 0, capsys.readouterr().out
