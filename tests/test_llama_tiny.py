"""The llama recipe end to end on tiny random-weight models, against `transformers`.

Every reference here is code we did not write: the HF model's own forward pass over the whole
sequence so far (for prefill and for every decode step), transformers' GGUF loader (which undoes
llama.cpp's Q/K permutation independently of `sharkport.formats.names`), and a greedy argmax
loop over the HF model. Nothing is compared with stored numbers.

* names: HF ↔ GGUF names and the Q/K permutation (checked against transformers' inverse).
* fixtures: the fixture GGUF (and the save_pretrained dir) load in transformers and
  reproduce the HF logits.
* eager: the recipe from the GGUF and from an .irpa, prefill + 8 decode steps, batch 1 and 4,
  for MHA/GQA x tied/untied and an MHA model with q/k/v/o biases; greedy `generate`.
* compiled (slow): export → iree-compile → IreeSession over the .irpa, the same checks, plus
  greedy `generate` against HF greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from sharkport.archive import Dataset
from sharkport.errors import SharkportError
from sharkport.export import service_config
from sharkport.formats.names import LLAMA_NAMES, gguf_to_hf_name, hf_to_gguf_name, permute_qk, unpermute_qk
from sharkport.models import build_model
from sharkport.runtime.generate import generate
from sharkport.runtime.eager import EagerSession
from sharkport.runtime.session import IreeSession, Session
from tiny_models import TINY_EXPORT, exact_cache

EXPORT = TINY_EXPORT  # compiled_of (conftest.py) exports with it too
STRIDE = EXPORT.block_seq_stride
PAGES = EXPORT.device_block_count
ATOL = 1e-4
DECODE_STEPS = 8

MAIN_VARIANTS = ["mha-tied", "mha-untied", "gqa-tied", "gqa-untied"]
EAGER_VARIANTS = MAIN_VARIANTS + ["mha-bias"]
COMPILED_VARIANTS = ["mha-tied", "gqa-untied"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class Batch:
    """Prompt lengths and each sequence's page table: distinct pages, out of order, page 0
    included, so a mix-up between sequences or blocks corrupts some logits."""

    lengths: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]


BATCHES = {
    # 30 + 8 tokens: prefill fills two pages, decode crosses into the third.
    "bs1": Batch((30,), ((30, 0, 11),)),
    # Lengths in 1, 2 and 3 pages in one batch; each row must keep its own length.
    "bs4": Batch((3, 17, 33, 5), ((0, 37, 5), (22, 9, 51), (14, 3, 60), (41, 28, 7))),
}
GENERATE_LENGTHS = (3, 17, 33, 5, 9, 24)  # more prompts than rows: 2 wait for a finished one's row
GENERATE_NEW_TOKENS = 10


def params(names):
    """Parametrize values that are their own ids."""
    return [pytest.param(n, id=n) for n in names]


# ---------------------------------------------------------------------------------------------
# Fixtures: each model, archive and compiled module is built once per session (conftest.py).
# ---------------------------------------------------------------------------------------------

def eager_session(path: Path) -> EagerSession:
    model = build_model(Dataset.load(path), exact_cache(STRIDE))
    return EagerSession(model, service_config(model, EXPORT), pages=PAGES)


# ---------------------------------------------------------------------------------------------
# References and the shared check
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> np.ndarray:
    """transformers' logits [len(ids), V] for one unpadded sequence."""
    return hf(torch.tensor([ids], dtype=torch.int64)).logits[0].numpy()


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new_tokens):
        seq.append(int(np.argmax(hf_logits(hf, seq)[-1])))
    return seq[len(prompt):]


def prompts_for(lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def check_prefill_decode(session: Session, hf, batch: Batch, seed: int = 0, decode_atol: float = ATOL) -> None:
    """Prefill the batch right-padded, then DECODE_STEPS decode steps feeding fixed random
    tokens; after each call every row's logits must match HF's forward over that row's whole
    sequence so far (all prompt positions for prefill, the last position for decode, to
    `decode_atol`)."""
    vocab = hf.config.vocab_size
    prompts = prompts_for(batch.lengths, vocab, seed)
    page_table = np.array(batch.pages, np.int64)
    bs = len(prompts)
    assert max(batch.lengths) + DECODE_STEPS <= page_table.shape[1] * STRIDE

    blocks = math.ceil(max(batch.lengths) / STRIDE)
    tokens = np.zeros((bs, blocks * STRIDE), np.int64)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    logits = session.prefill(tokens, np.array(batch.lengths, np.int64), page_table[:, :blocks])
    assert logits.shape == (bs, blocks * STRIDE, vocab) and logits.dtype == np.float32
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(logits[r, :len(p)], hf_logits(hf, p), rtol=0, atol=ATOL,
                                   err_msg=f"prefill, row {r} (length {len(p)})")

    rng = np.random.default_rng(seed + 1)
    seqs = [list(p) for p in prompts]
    for step in range(DECODE_STEPS):
        new = rng.integers(0, vocab, bs)
        for s, t in zip(seqs, new):
            s.append(int(t))
        positions = np.array([len(s) - 1 for s in seqs], np.int64)
        blocks = int(positions.max()) // STRIDE + 1
        logits = session.decode(new.reshape(bs, 1).astype(np.int64), positions + 1, positions,
                                page_table[:, :blocks])
        assert logits.shape == (bs, 1, vocab)
        for r, s in enumerate(seqs):
            np.testing.assert_allclose(logits[r, 0], hf_logits(hf, s)[-1], rtol=0, atol=decode_atol,
                                       err_msg=f"decode step {step}, row {r} (position {len(s) - 1})")


def check_generate(session: Session, hf, seed: int = 2) -> None:
    prompts = prompts_for(GENERATE_LENGTHS, hf.config.vocab_size, seed)
    got = generate(session, prompts, GENERATE_NEW_TOKENS)
    want = [hf_greedy(hf, p, GENERATE_NEW_TOKENS) for p in prompts]
    assert got == want


# ---------------------------------------------------------------------------------------------
# names.py
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bid", [pytest.param(0, id="blk0"), pytest.param(11, id="blk11")])
def test_names_round_trip(bid):
    for hf_t, gg_t in LLAMA_NAMES.items():
        hf_name, gg_name = hf_t.format(bid=bid), gg_t.format(bid=bid)
        assert hf_to_gguf_name(hf_name) == gg_name
        assert gguf_to_hf_name(gg_name) == hf_name


@pytest.mark.parametrize("variant", params(["mha-untied", "mha-bias"]))
def test_names_cover_hf_state_dict(tiny, variant):
    """Every tensor of a real HF llama has a GGUF name, and those are the names the recipe reads."""
    m = tiny[variant]
    names = {hf_to_gguf_name(n) for n in m.hf.state_dict()}
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(m.spec.layers) for n in per_block}
    if m.spec.attention_bias:
        expected |= {f"blk.{i}.{n}.bias" for i in range(m.spec.layers)
                     for n in ("attn_q", "attn_k", "attn_v", "attn_output")}
    assert names == expected


@pytest.mark.parametrize("name", [
    pytest.param("model.layers.0.self_attn.rotary_emb.inv_freq", id="hf-inv_freq"),
    pytest.param("model.layers.x.mlp.up_proj.weight", id="hf-bad-bid"),
    pytest.param("model.embed_tokens.weight.extra", id="hf-suffix"),
    pytest.param("blk.0.attn_qkv.weight", id="gguf-fused-qkv"),
])
def test_names_unknown(name):
    with pytest.raises(SharkportError, match=name.replace(".", r"\.")):
        (gguf_to_hf_name if name.startswith("blk.") else hf_to_gguf_name)(name)


@pytest.mark.parametrize("shape", [pytest.param((4 * 16, 64), id="weight"),
                                   pytest.param((4 * 16,), id="bias")])
@pytest.mark.parametrize("n_head", [pytest.param(4, id="h4"), pytest.param(1, id="h1")])
def test_permute_qk_against_transformers(shape, n_head):
    """Our permutation is undone by transformers' own GGUF un-permutation and by unpermute_qk,
    numpy and torch give the same rows, and it pairs row i with row i + D/2 of each head."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    p = permute_qk(w, n_head)
    assert not np.array_equal(p, w)
    undo = LlamaTensorProcessor(config={})._reverse_permute_weights
    np.testing.assert_array_equal(undo(p, n_head, n_head), w)
    np.testing.assert_array_equal(unpermute_qk(p, n_head), w)
    np.testing.assert_array_equal(permute_qk(torch.from_numpy(w), n_head).numpy(), p)
    np.testing.assert_array_equal(unpermute_qk(torch.from_numpy(p), n_head).numpy(), w)
    d = w.shape[0] // n_head
    np.testing.assert_array_equal(p[1], w[d // 2])  # head 0: rows (0, D/2) become rows (0, 1)


def test_permute_qk_rejects_bad_head_count():
    with pytest.raises(SharkportError, match="3 heads"):
        permute_qk(np.zeros((64, 8), np.float32), 3)


# ---------------------------------------------------------------------------------------------
# The fixture GGUF, checked by transformers' GGUF loader
# ---------------------------------------------------------------------------------------------

# mha-bias is left out: transformers' llama GGUF loader drops attention biases.
@pytest.mark.parametrize("variant", params(MAIN_VARIANTS))
def test_fixture_gguf_loads_in_transformers(tiny, variant):
    from transformers import AutoModelForCausalLM

    m = tiny[variant]
    loaded = AutoModelForCausalLM.from_pretrained(m.gguf_path.parent, gguf_file=m.gguf_path.name,
                                                  dtype=torch.float32).eval()
    assert loaded.config.tie_word_embeddings == m.spec.tied
    assert loaded.config.num_key_value_heads == m.spec.kv_heads
    for p in prompts_for((1, 7, 40), m.spec.vocab_size, seed=5):
        np.testing.assert_allclose(hf_logits(loaded, p), hf_logits(m.hf, p), rtol=0, atol=ATOL)


@pytest.mark.parametrize("variant", params(["mha-tied", "mha-bias"]))
def test_fixture_hf_dir_reloads(tiny, variant):
    """The save_pretrained directory (input of HF importers) holds the same model."""
    from transformers import AutoModelForCausalLM

    m = tiny[variant]
    assert (m.hf_dir / "config.json").is_file() and (m.hf_dir / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(m.hf_dir, dtype=torch.float32).eval()
    p = prompts_for((12,), m.spec.vocab_size, seed=6)[0]
    # Not bit-exact: the reloaded model may pick another attention kernel (sdpa vs eager).
    np.testing.assert_allclose(hf_logits(loaded, p), hf_logits(m.hf, p), rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Eager recipe
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", params(BATCHES))
@pytest.mark.parametrize("source", params(["gguf", "irpa"]))
@pytest.mark.parametrize("variant", params(EAGER_VARIANTS))
def test_eager_matches_transformers(tiny, irpa_of, variant, source, batch):
    m = tiny[variant]
    path = m.gguf_path if source == "gguf" else irpa_of(variant)
    check_prefill_decode(eager_session(path), m.hf, BATCHES[batch])


@pytest.mark.parametrize("variant", params(EAGER_VARIANTS))
def test_eager_generate_matches_transformers_greedy(tiny, irpa_of, variant):
    check_generate(eager_session(irpa_of(variant)), tiny[variant].hf)


# ---------------------------------------------------------------------------------------------
# Compiled module
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("batch", params(BATCHES))
@pytest.mark.parametrize("variant", params(COMPILED_VARIANTS))
def test_compiled_matches_transformers(tiny, compiled_of, variant, batch):
    vmfb, irpa, config = compiled_of(variant)
    check_prefill_decode(IreeSession(vmfb, irpa, config, pages=PAGES), tiny[variant].hf, BATCHES[batch])


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_default_float16_cache_matches_transformers(tiny, irpa_of, backend, tmp_path):
    """With the default KV cache (float16: K and V rounded as llama.cpp's default cache rounds
    them), prefill, which attends to its own float32 K and V, still matches transformers to ATOL,
    and decode, which reads them back from the cache, to 3e-3 of the largest logit (the other
    tests check the recipes with a float32 cache: tiny_models.exact_cache)."""
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from sharkport.models import ModelConfig

    variant = "gqa-untied"
    dataset = Dataset.load(irpa_of(variant))
    if backend == "eager":
        model = build_model(dataset, ModelConfig(block_seq_stride=STRIDE))
        assert model.new_cache(1).dtype == torch.float16
        session = EagerSession(model, service_config(model, EXPORT), pages=PAGES)
    else:
        output, service = export_model(dataset, EXPORT)
        assert service.kv_cache_dtype == "float16"
        save_export(output, service, tmp_path / "m.mlir", tmp_path / "m.json")
        compile_mlir(tmp_path / "m.mlir", tmp_path / "m.vmfb")
        session = IreeSession(tmp_path / "m.vmfb", irpa_of(variant), tmp_path / "m.json", pages=PAGES)
    hf = tiny[variant].hf
    largest = float(np.abs(hf_logits(hf, list(range(40)))).max())
    check_prefill_decode(session, hf, BATCHES["bs4"], decode_atol=3e-3 * largest)


@pytest.mark.slow
@pytest.mark.parametrize("variant", params(COMPILED_VARIANTS))
def test_compiled_generate_matches_transformers_greedy(tiny, compiled_of, variant):
    vmfb, irpa, config = compiled_of(variant)
    check_generate(IreeSession(vmfb, irpa, config, pages=PAGES), tiny[variant].hf)


@pytest.mark.slow
def test_compiled_logits_outlive_their_call(compiled_of):
    """The session's logits are views of the module's result, not copies: a view kept (or a view
    of it) must keep its values after the caller drops the logits and later calls allocate and
    free their own results. A view of memory that is freed or reused (a result buffer let go,
    or one output buffer for every call) reads another call's logits, or crashes."""
    import gc

    vmfb, irpa, config = compiled_of("gqa-untied")
    session = IreeSession(vmfb, irpa, config, pages=PAGES)
    batch = BATCHES["bs4"]
    page_table = np.array(batch.pages, np.int64)
    tokens = np.ones((4, STRIDE * 3), np.int64)
    kept, expected = [], []
    prefill = session.prefill(tokens, np.array(batch.lengths, np.int64), page_table)
    kept.append(np.asarray(prefill[1:3, 2:9]))  # a plain array viewing a slice of the logits
    expected.append(kept[-1].copy())
    del prefill
    positions = np.array(batch.lengths, np.int64)
    for step in range(6):
        logits = session.decode(np.full((4, 1), step + 2, np.int64), positions + 1, positions, page_table)
        kept.append(logits[:, 0, ::3])
        expected.append(kept[-1].copy())
        positions += 1
    del logits
    gc.collect()
    for _ in range(3):  # more results allocated (and freed) where the dropped ones were
        session.prefill(tokens, np.array(batch.lengths, np.int64), page_table)
    for i, (view, copy) in enumerate(zip(kept, expected)):
        np.testing.assert_array_equal(view, copy, err_msg=f"logits of call {i}")
    assert len({c.tobytes() for c in expected}) == len(expected)  # the calls' logits all differ
