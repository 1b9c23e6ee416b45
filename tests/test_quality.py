"""Perplexity and KL-divergence (sharkport/quality.py, `sharkport perplexity`) against numpy over
transformers' logits for the same weights, torch's kl_div, and llama.cpp's chunking rules; the
compiled SmolLM2 module against transformers' reading of its GGUF (slow)."""

import json
import math

import numpy as np
import pytest
import torch

from run_cli import run
from sharkport import quality
from sharkport.errors import SharkportError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CTX = 32


def reference_nll(hf, chunk_tokens: np.ndarray) -> np.ndarray:
    """llama.cpp's scoring in numpy over transformers' logits: each chunk's positions ctx/2 ..
    ctx-2 predict the token after them."""
    out = []
    with torch.no_grad():
        for tokens in chunk_tokens:
            logits = hf(torch.tensor(tokens[None])).logits[0].double().numpy()
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            ctx = len(tokens)
            out += [-logp[j, tokens[j + 1]] for j in range(ctx // 2, ctx - 1)]
    return np.array(out)


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    """A tiny llama with a trained byte-level BPE tokenizer, imported from its HF folder:
    (TinyLlama with .hf, irpa path)."""
    from sharkport.archive import import_hf
    from tiny_models import TinySpec, make_tiny_llama_with_bpe

    root = tmp_path_factory.mktemp("quality")
    m = make_tiny_llama_with_bpe(TinySpec("ppl", kv_heads=2, tied=True, vocab_size=320, seed=5), root / "hf")
    irpa = root / "ppl.irpa"
    import_hf(m.hf_dir, irpa, progress=False)
    return m, irpa


@pytest.fixture(scope="module")
def eager_prefill(tok_model):
    from sharkport.api import TextGenerator

    session = TextGenerator.eager(tok_model[1], block_seq_stride=16, batch_size=4, max_seq_len=CTX, pages=8).session
    return quality.session_prefill(session, CTX)


def test_chunks_follow_llama_cpp():
    ids = list(range(100, 200))
    c = quality.chunks(ids, 32, bos_id=1)
    assert c.shape == (3, 32) and (c[:, 0] == 1).all()  # 100 // 32 chunks, each starting with BOS
    assert c[1, 1:].tolist() == ids[33:64] and c[2, -1] == ids[95]
    assert quality.chunks(ids, 32, None, max_chunks=2)[1, 0] == ids[32]
    with pytest.raises(SharkportError, match="at least 128"):
        quality.chunks(ids, 64, 1)
    assert quality.scored(32) == slice(16, 31)  # 15 positions, as llama.cpp's n_ctx - 1 - n_ctx/2


def test_perplexity_matches_numpy_over_transformers_logits(tok_model, eager_prefill):
    m, _ = tok_model
    ids = np.random.default_rng(0).integers(0, 320, 5 * CTX + 7).tolist()
    chunk_tokens = quality.chunks(ids, CTX, bos_id=None)
    prefill, batch = eager_prefill
    nll, _ = quality.evaluate(prefill, chunk_tokens, batch)
    expected = reference_nll(m.hf, chunk_tokens)
    np.testing.assert_allclose(nll, expected, rtol=1e-4, atol=1e-5)
    result = quality.Result(len(ids), len(chunk_tokens), CTX, nll)
    assert result.ppl == pytest.approx(math.exp(expected.mean()), rel=1e-5)
    assert result.ppl_error == pytest.approx(math.sqrt(expected.var() / (len(expected) - 1)) * result.ppl, rel=1e-3)


def test_kl_divergence_matches_torch(tok_model, eager_prefill):
    """Against a perturbed copy of the model's logits: with the whole vocabulary saved the KLD is
    torch's kl_div exactly; with the top 16 it is a lower bound close to it; a model against
    itself is 0 with every top-1 token the same."""
    prefill, batch = eager_prefill
    chunk_tokens = quality.chunks(np.random.default_rng(1).integers(0, 320, 2 * CTX).tolist(), CTX, None)
    rng = np.random.default_rng(2)

    def perturbed(rows):
        logits = np.array(prefill(rows))
        return logits + rng.normal(0, 0.3, logits.shape).astype(np.float32)

    nll, full = quality.evaluate(prefill, chunk_tokens, batch, save_top_k=0)
    _, top16 = quality.evaluate(prefill, chunk_tokens, batch, save_top_k=16)
    bases = [quality.BaseLogits(chunk_tokens, s["top_ids"], s["top_logprobs"], nll, 320) for s in (full, top16)]
    rng = np.random.default_rng(2)
    _, exact = quality.evaluate(perturbed, chunk_tokens, batch, bases[0])
    rng = np.random.default_rng(2)  # the same noise again
    _, bounded = quality.evaluate(perturbed, chunk_tokens, batch, bases[1])

    rng = np.random.default_rng(2)
    p_logp, q_logp = [], []
    for start in range(0, len(chunk_tokens), batch):
        rows = chunk_tokens[start:start + batch]
        for logits in perturbed(rows)[:len(rows)]:
            q_logp.append(torch.log_softmax(torch.from_numpy(logits[quality.scored(CTX)]).double(), -1))
        for logits in np.array(prefill(rows))[:len(rows)]:
            p_logp.append(torch.log_softmax(torch.from_numpy(logits[quality.scored(CTX)]).double(), -1))
    expected = torch.nn.functional.kl_div(torch.cat(q_logp), torch.cat(p_logp), log_target=True,
                                          reduction="none").sum(-1).numpy()
    np.testing.assert_allclose(exact["kld"], expected, rtol=1e-5, atol=1e-7)  # base saved as float32
    # top 16: KL over those 16 ids and the rest of the vocabulary as one outcome (a lower bound)
    p_all, q_all = torch.cat(p_logp).exp(), torch.cat(q_logp).exp()
    ids = torch.from_numpy(top16["top_ids"]).long()
    p16, q16 = p_all.gather(1, ids), q_all.gather(1, ids)
    p_grouped = torch.cat([p16, 1 - p16.sum(1, keepdim=True)], 1)
    q_grouped = torch.cat([q16, 1 - q16.sum(1, keepdim=True)], 1)
    grouped = (p_grouped * (p_grouped.log() - q_grouped.log())).sum(1).numpy()
    np.testing.assert_allclose(bounded["kld"], grouped, rtol=1e-4, atol=1e-7)
    assert (bounded["kld"] <= expected + 1e-7).all() and (bounded["kld"] > 0).all()
    assert exact["same_top1"].mean() < 1.0

    _, same = quality.evaluate(prefill, chunk_tokens, batch, bases[1])
    assert np.abs(same["kld"]).max() < 1e-9 and same["same_top1"].all()


def _text(tmp_path, words: int = 900):
    rng = np.random.default_rng(3)
    vocab = ["the", "family", "of", "student", "had", "a", "house", "and", "cat", "in", "garden", "."]
    path = tmp_path / "text.txt"
    path.write_text(" ".join(rng.choice(vocab, words)))
    return path


def test_cli_json_save_and_kl(tok_model, tmp_path):
    _, irpa = tok_model
    text = _text(tmp_path)
    base = tmp_path / "base.npz"
    common = ["--irpa-file", str(irpa), "--eager", "--text-file", str(text), "--ctx", str(CTX), "--json"]
    first = json.loads(run("sharkport.tools.perplexity", *common, "--save-logits", str(base)).stdout)
    assert first["chunks"] >= 2 and first["scored_positions"] == first["chunks"] * (CTX - 1 - CTX // 2)
    again = json.loads(run("sharkport.tools.perplexity", *common, "--kl-divergence", str(base)).stdout)
    assert again["ppl"] == pytest.approx(first["ppl"], rel=1e-9) and again["kld_max"] < 1e-9
    assert again["delta_ppl"] == pytest.approx(0, abs=1e-9) and again["same_top1"] == 1.0


@pytest.mark.parametrize("case, message", [
    ("empty", "is empty"), ("short", "needs at least"), ("vocab", "vocabulary of 999"), ("tokens", "other tokens"),
    ("not-npz", "not a base-logits file"),
])
def test_cli_errors_are_one_line(tok_model, tmp_path, case, message):
    _, irpa = tok_model
    text = _text(tmp_path)
    args = ["--irpa-file", str(irpa), "--eager", "--ctx", str(CTX)]
    if case in ("vocab", "tokens"):
        base = tmp_path / "base.npz"
        run("sharkport.tools.perplexity", *args, "--text-file", str(text), "--save-logits", str(base))
        with np.load(base) as f:
            saved = dict(f)
        if case == "vocab":
            saved["vocab_size"] = np.int64(999)
        else:
            saved["tokens"] = saved["tokens"][:1]
        np.savez(base, **saved)
        args += ["--kl-divergence", str(base)]
    elif case == "not-npz":
        (tmp_path / "bad.npz").write_text("no")
        args += ["--kl-divergence", str(tmp_path / "bad.npz")]
    if case == "empty":
        text.write_text("  \n")
    elif case == "short":
        text.write_text("the cat")
    proc = run("sharkport.tools.perplexity", *args, "--text-file", str(text), check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_reference_text_is_english_prose():
    text = quality.reference_text()
    assert len(text) > 300_000 and text.count(" the ") > 1000


@pytest.mark.slow
def test_compiled_smollm2_perplexity_matches_transformers(smollm2_compiled, smollm2_hf, tmp_path):
    """The compiled SmolLM2 Q4_1 module over a slice of the reference text: perplexity within
    1% of numpy over transformers' logits for the same GGUF, and close to the eager recipe."""
    from sharkport.archive import Dataset
    from sharkport.runtime.session import IreeSession

    vmfb, irpa, config = smollm2_compiled
    tokenizer = Dataset.load(irpa).tokenizer()
    ids = tokenizer.encode(quality.reference_text()[:20_000])
    chunk_tokens = quality.chunks(ids, 128, tokenizer.bos_id if tokenizer.add_bos else None, max_chunks=3)
    session = IreeSession(vmfb, irpa, config, pages=4)
    prefill, batch = quality.session_prefill(session, 128)
    nll, _ = quality.evaluate(prefill, chunk_tokens, batch)
    expected = reference_nll(smollm2_hf[0], chunk_tokens)
    assert math.exp(nll.mean()) == pytest.approx(math.exp(expected.mean()), rel=0.01)
