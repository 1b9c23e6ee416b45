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

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from sharkport.export.abi import ExportConfig
from sharkport.formats.names import hf_to_gguf_name, permute_qk

# How tiny models are exported and compiled (fixture `compiled_of`): batch sizes 1 and 4,
# 16-token pages, 64 pages, up to 256 positions.
TINY_EXPORT = ExportConfig(bs_prefill=(1, 4), bs_decode=(1, 4), block_seq_stride=16,
                           device_block_count=64, max_seq_len=256)


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


class TinyModels:
    """Builds each variant on first use under `root/<name>` and keeps it for the session."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._models: dict[str, TinyLlama] = {}

    def __getitem__(self, name: str) -> TinyLlama:
        if name not in self._models:
            self._models[name] = make_tiny_llama(VARIANTS[name], self.root / name)
        return self._models[name]
