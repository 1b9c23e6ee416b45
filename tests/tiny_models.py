"""Tiny random-weight llama models for tests: a `transformers` model, its `save_pretrained`
directory, and the same weights as a GGUF written the way llama.cpp's converter writes one
(GGUF names, Q/K rows permuted into the interleaved rotary layout, F32 tensors, `llama.*` keys).

Test helpers, not tests. Session-scoped fixtures use `TinyModels(tmp_path_factory.mktemp(...))`
so each variant is built once per session:

    @pytest.fixture(scope="session")
    def tiny_models(tmp_path_factory):
        return TinyModels(tmp_path_factory.mktemp("tiny"))

    model = tiny_models["gqa-untied"]   # TinyLlama: .spec, .hf, .hf_dir, .gguf_path
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sharkport.export.abi import ExportConfig
from sharkport.formats.names import hf_to_gguf_name, permute_qk
from sharkport.models import ModelConfig

# How tiny models are exported and compiled (fixture `compiled_of`): batch sizes 1 and 4,
# 16-token pages, 64 pages, up to 256 positions.
TINY_EXPORT = ExportConfig(bs_prefill=(1, 4), bs_decode=(1, 4), block_seq_stride=16,
                           device_block_count=64, max_seq_len=256)


def assert_same_hparams(a, b, rel: float = 1e-6) -> None:
    """Two hyperparameter dataclasses agree: floats to `rel` (GGUF stores them as float32), every
    other field exactly."""
    a, b = dataclasses.asdict(a), dataclasses.asdict(b)
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], float) or isinstance(b[key], float):
            assert a[key] == pytest.approx(b[key], rel=rel), key
        else:
            assert a[key] == b[key], key


def exact_cache(block_seq_stride: int = TINY_EXPORT.block_seq_stride, **fields) -> ModelConfig:
    """A ModelConfig whose KV cache is float32: for the tests that check a recipe's logits against
    transformers' (or two forms of one model against each other) to 1e-4, which rounding K and V
    to the default float16 cache would move by up to a few 1e-3 of the largest (its own tests,
    test_kernels.py and test_llama_tiny.py, check it within that)."""
    return ModelConfig(block_seq_stride=block_seq_stride, kv_cache_dtype=torch.float32, **fields)


@dataclass(frozen=True)
class TinySpec:
    """The shape of one tiny llama. Every variant shares hidden 64, 4 heads of 16, 2 layers."""

    name: str
    kv_heads: int
    tied: bool
    attention_bias: bool = False
    seed: int = 0
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 512


VARIANTS: dict[str, TinySpec] = {s.name: s for s in (
    TinySpec("mha-tied", kv_heads=4, tied=True, seed=1),
    TinySpec("mha-untied", kv_heads=4, tied=False, seed=2),
    TinySpec("gqa-tied", kv_heads=2, tied=True, seed=3),     # 2 query heads per kv head
    TinySpec("gqa-untied", kv_heads=1, tied=False, seed=4),  # all 4 query heads on one kv head
    TinySpec("mha-bias", kv_heads=4, tied=False, attention_bias=True, seed=5),  # q/k/v/o biases
)}


@dataclass
class TinyLlama:
    spec: TinySpec
    hf: "torch.nn.Module"  # transformers LlamaForCausalLM, float32, eval mode
    hf_dir: Path           # save_pretrained output (config.json + model.safetensors)
    gguf_path: Path        # the same weights as a llama.cpp-style GGUF


def make_hf_llama(spec: TinySpec):
    """A seeded LlamaForCausalLM (float32, eager attention) with weights far from their
    defaults: projections ~N(0, 0.1²), norms ~U(0.5, 1.5), biases ~N(0, 0.05²), so logits
    differ clearly between tokens and a wrong permutation or mask shows up in every logit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length, rms_norm_eps=spec.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tied, attention_bias=spec.attention_bias,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.1)
    if spec.tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def write_gguf(spec: TinySpec, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Writes an HF llama state dict as llama.cpp's convert_hf_to_gguf.py would: GGUF names,
    Q rows permuted per query head and K rows per kv head, F32 data, the `llama.*` keys, and no
    `output.weight` when the embeddings are tied."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-{spec.name}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for hf_name, tensor in state_dict.items():
        if spec.tied and hf_name == "lm_head.weight":
            continue
        data = tensor.detach().to(torch.float32).numpy()
        if ".q_proj." in hf_name:
            data = permute_qk(data, spec.heads)
        elif ".k_proj." in hf_name:
            data = permute_qk(data, spec.kv_heads)
        writer.add_tensor(hf_to_gguf_name(hf_name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_tiny_llama(spec: TinySpec, directory: Path) -> TinyLlama:
    """Builds the HF model for `spec`, saves it under `directory/hf` and its GGUF as
    `directory/gguf/model.gguf` (a directory of its own, so that transformers' GGUF loader is
    not pointed at the HF config.json)."""
    hf = make_hf_llama(spec)
    hf_dir, gguf_dir = directory / "hf", directory / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(hf_dir)
    gguf_path = gguf_dir / "model.gguf"
    write_gguf(spec, hf.state_dict(), gguf_path)
    return TinyLlama(spec, hf, hf_dir, gguf_path)


def make_tiny_llama_with_bpe(spec: TinySpec, root: Path) -> TinyLlama:
    """make_tiny_llama, with a byte-level BPE tokenizer.json of spec.vocab_size tokens trained
    here (EOS `<|endoftext|>`, in tokenizer_config.json) in its HF folder."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from test_tokenizer import _corpus

    m = make_tiny_llama(spec, root)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=spec.vocab_size, show_progress=False, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tk.get_vocab_size() <= spec.vocab_size
    tk.save(str(m.hf_dir / "tokenizer.json"))
    (m.hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return m


class TinyModels:
    """Builds each variant on first use under `root/<name>` and keeps it for the session."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._models: dict[str, TinyLlama] = {}

    def __getitem__(self, name: str) -> TinyLlama:
        if name not in self._models:
            self._models[name] = make_tiny_llama(VARIANTS[name], self.root / name)
        return self._models[name]


# ---------------------------------------------------------------------------------------------
# Tiny models of the other recipes (Mistral, Qwen2, Gemma-3, Mixtral, GPT-2): each built with its
# own transformers class, saved with save_pretrained, and converted to GGUF from the saved
# safetensors the way llama.cpp's convert_hf_to_gguf.py converts that architecture.
# ---------------------------------------------------------------------------------------------

RECIPE_KINDS = ("mistral", "qwen2", "gemma3", "gemma3-2l", "mixtral", "gpt2")
WINDOW = 8  # sliding window of the tiny Mistral and Gemma-3: every test prompt is longer


def _recipe_config(kind: str):
    """A tiny config of `kind`: hidden 64, vocab 256, 2 layers. `gemma3` has 6, so that llama.cpp's
    fixed pattern (5 local layers, then 1 global) holds both kinds; `gemma3-2l` is the same with
    2 layers (local, global), a third of the compile time, its pattern stated in the GGUF."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=WINDOW, head_dim=16, tie_word_embeddings=False)
    if kind == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if kind == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                tie_word_embeddings=False)
    if kind == "gemma3-2l":
        return _recipe_config("gemma3").__class__(**{
            **_recipe_config("gemma3").to_dict(), "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"]})
    if kind == "gemma3":
        # head_dim 256 as in the released models: not hidden / heads, and equal to
        # query_pre_attn_scalar (a GGUF file cannot say otherwise; llama.cpp assumes it).
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6, "num_attention_heads": 2,
                                      "num_key_value_heads": 1}, head_dim=256, query_pre_attn_scalar=256,
                                   sliding_window=WINDOW, tie_word_embeddings=True)
    if kind == "gpt2":
        # n_positions 1024: transformers reads a GPT-2 GGUF context_length as n_ctx, not n_positions.
        return tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                             bos_token_id=None, eos_token_id=None)
    raise KeyError(kind)


_RECIPE_CLASSES = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                   "gemma3-2l": "Gemma3ForCausalLM",
                   "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}


def make_hf_recipe(kind: str, seed: int = 0):
    """A seeded float32 model of `kind` with weights far from their defaults (as make_hf_llama):
    matrices ~N(0, 0.1²), norm scales ~U(0.5, 1.5) (Gemma: its 1 + w), biases ~N(0, 0.05²), and
    Mixtral's router ~N(0, 1) so that its top-2 choices are clear-cut."""
    import transformers

    cls = getattr(transformers, _RECIPE_CLASSES[kind])
    torch.manual_seed(seed)
    model = cls._from_config(_recipe_config(kind), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:  # norms (GPT-2: ln_1, ln_2, ln_f weight and bias)
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.05)
                else:
                    p.uniform_(-0.5, 0.5) if kind.startswith("gemma3") else p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif name.endswith(".gate.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def write_recipe_gguf(kind: str, hf_dir: Path, path: Path) -> None:
    """Converts the save_pretrained folder `hf_dir` to GGUF as convert_hf_to_gguf.py does:
    * mistral, mixtral: architecture `llama`, Q/K rows permuted (interleaved rotary pairs);
      Mixtral's experts stacked into `ffn_{gate,up,down}_exps` [experts, ...] with
      `expert_count` / `expert_used_count`. llama.cpp writes no sliding window for a llama; we add
      the standard `llama.attention.sliding_window` key, without which no reader can know it.
    * qwen2: its own architecture, Q/K/V biases, Q/K not permuted.
    * gemma3: every `*norm.weight` stored as 1 + w, Q/K not permuted, key/value length written,
      sliding window written (llama.cpp fixes the local/global pattern at 6 and the local rope
      base at 10000, so neither is written; `gemma3-2l` states its 2-layer pattern with the
      standard `gemma3.attention.sliding_window_pattern` key, which llama.cpp does not write).
    * gpt2: Conv1D weights transposed to [out, in], `output.weight` a copy of the embeddings.
    """
    import json

    from safetensors.torch import load_file

    from sharkport.formats.names import hf_to_gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    arch = {"mistral": "llama", "mixtral": "llama", "gemma3-2l": "gemma3"}.get(kind, kind)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{kind}")  # transformers reads a `llama` file named *mistral* as Mistral
    if kind == "gpt2":
        w.add_block_count(config["n_layer"])
        w.add_context_length(config["n_positions"])
        w.add_embedding_length(config["n_embd"])
        w.add_feed_forward_length(4 * config["n_embd"])
        w.add_head_count(config["n_head"])
        w.add_layer_norm_eps(config["layer_norm_epsilon"])
    else:
        w.add_context_length(config["max_position_embeddings"])
        w.add_embedding_length(config["hidden_size"])
        w.add_block_count(config["num_hidden_layers"])
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_head_count(config["num_attention_heads"])
        w.add_head_count_kv(config["num_key_value_heads"])
        w.add_rope_freq_base(config["rope_parameters"].get("rope_theta")
                             or config["rope_parameters"]["full_attention"]["rope_theta"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        if arch == "llama":
            w.add_vocab_size(config["vocab_size"])
            w.add_rope_dimension_count(config["head_dim"])
        if config.get("sliding_window"):
            w.add_sliding_window(config["sliding_window"])
        if kind == "mixtral":
            w.add_expert_count(config["num_local_experts"])
            w.add_expert_used_count(config["num_experts_per_tok"])
        if arch == "gemma3":
            w.add_key_length(config["head_dim"])
            w.add_value_length(config["head_dim"])
        if kind == "gemma3-2l":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # llama.cpp always writes the vocabulary; readers size the model from it when the
    # architecture has no vocab_size key. Placeholder tokens: these models have no tokenizer.
    vocab = config["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges([])

    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, t in tensors.items():
        name, expert = hf_to_gguf(hf_name, arch)
        data = t.to(torch.float32).numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = permute_qk(data, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            data = permute_qk(data, config["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1
        elif kind == "gpt2" and name.startswith("blk.") and data.ndim == 2:
            data = data.T
        if expert is not None:
            experts.setdefault(name, {})[expert] = data
            continue
        w.add_tensor(name, np.ascontiguousarray(data))
        if kind == "gpt2" and name == "token_embd.weight":
            w.add_tensor("output.weight", np.ascontiguousarray(data))
    for name, by_expert in experts.items():
        w.add_tensor(name, np.ascontiguousarray(np.stack([by_expert[x] for x in sorted(by_expert)])))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass
class TinyRecipe:
    kind: str
    hf: "torch.nn.Module"  # transformers model of the kind, float32, eager attention
    hf_dir: Path
    gguf_path: Path


class TinyRecipes:
    """Builds each kind on first use under `root/<kind>` and keeps it for the session."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._models: dict[str, TinyRecipe] = {}

    def __getitem__(self, kind: str) -> TinyRecipe:
        if kind not in self._models:
            hf = make_hf_recipe(kind, seed=RECIPE_KINDS.index(kind) + 10)
            d = self.root / kind
            hf_dir, gguf_dir = d / "hf", d / "gguf"
            gguf_dir.mkdir(parents=True, exist_ok=True)
            hf.save_pretrained(hf_dir)
            write_recipe_gguf(kind, hf_dir, gguf_dir / "model.gguf")
            self._models[kind] = TinyRecipe(kind, hf, hf_dir, gguf_dir / "model.gguf")
        return self._models[kind]


def decode_ms(module: tuple[Path, Path, Path], pages: int, calls: int = 30) -> float:
    """Median ms of a tiny-llama decode step at batch 4 (positions 19, two pages a row) through
    the compiled `module` (vmfb, irpa, config json) with `pages` pages allocated: the cache tests'
    probe for a copy of cache_state, which would grow with the pages."""
    import time

    from sharkport.runtime.session import IreeSession

    session = IreeSession(*module, pages=pages)
    tokens, lengths, ids = np.zeros((4, 1), np.int64), np.full(4, 20, np.int64), np.arange(8).reshape(4, 2)
    times = []
    for _ in range(calls + 3):
        t0 = time.perf_counter()
        session.decode(tokens, lengths, lengths - 1, ids)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[3:])) * 1e3
