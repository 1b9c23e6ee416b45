"""The exported ABI in one place (docs/abi.md): argument names and shapes, dynamic dims, the
service config JSON. The exporter builds from it and the runner checks inputs against it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SharkportError

MODULE_NAME = "module"
ABI_VERSION = 1
PREFILL_ARGS = ("tokens", "seq_lens", "seq_block_ids", "cache_state")
DECODE_ARGS = ("tokens", "seq_lens", "start_positions", "seq_block_ids", "cache_state")
# torch dtype names as the service config spells them (torch.float16 is "float16").
DTYPE_NAMES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ExportConfig:
    """What to export: batch sizes, page geometry and the longest sequence served."""

    bs_prefill: tuple[int, ...] = (1, 4)
    bs_decode: tuple[int, ...] = (1, 4)
    block_seq_stride: int = 32
    device_block_count: int = 256
    max_seq_len: int = 2048
    # decode's products with Q8_0/Q4_0/Q4_1/F16 weights through sharkport.kernels (x86-64 CPUs)
    matvec_kernels: bool = False
    # trace every layer's transformer block (the slow path, for comparison); by default a recipe's
    # blocks are traced once per function and called for every layer (export/blocks.py)
    unroll_blocks: bool = False

    def __post_init__(self):
        for flag, sizes in (("--bs-prefill", self.bs_prefill), ("--bs-decode", self.bs_decode)):
            if any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
                raise SharkportError(f"{flag} takes distinct positive batch sizes, got {list(sizes)}")
        if not self.bs_prefill and not self.bs_decode:
            raise SharkportError("nothing to export: give --bs-prefill and/or --bs-decode")
        if self.max_seq_len % self.block_seq_stride:
            raise SharkportError(
                f"max_seq_len ({self.max_seq_len}) must be a multiple of --block-seq-stride "
                f"({self.block_seq_stride})"
            )
        if self.device_block_count < 1:
            raise SharkportError("--device-block-count must be at least 1")

    @property
    def max_blocks(self) -> int:
        return self.max_seq_len // self.block_seq_stride


def dynamic_shapes(config: ExportConfig, kind: str) -> dict:
    """torch.export dims: prefill's S is `stride * blocks`; the page count P is always dynamic."""
    import torch

    blocks = torch.export.Dim("blocks", min=1, max=config.max_blocks)
    pages = torch.export.Dim("pages", min=2)
    if kind == "prefill":
        seq = config.block_seq_stride * blocks
        return {"tokens": {1: seq}, "seq_lens": {}, "seq_block_ids": {1: blocks},
                "cache_state": {0: pages}}
    return {"tokens": {}, "seq_lens": {}, "start_positions": {}, "seq_block_ids": {1: blocks},
            "cache_state": {0: pages}}


def example_args(config: ExportConfig, kind: str, batch: int, page_elems: int, cache_dtype):
    """Example tensors for tracing one function (`cache_dtype` a torch dtype)."""
    import torch

    # Example sizes are chosen distinct from each other and from 1, so that torch.export does
    # not specialize a dynamic dim to a constant.
    blocks, pages = 2, 7
    i64 = torch.int64
    cache = torch.zeros(pages, page_elems, dtype=cache_dtype)
    ids = torch.arange(batch * blocks, dtype=i64).reshape(batch, blocks) % pages
    lens = torch.full((batch,), blocks * config.block_seq_stride - 3, dtype=i64)
    if kind == "prefill":
        tokens = torch.zeros(batch, blocks * config.block_seq_stride, dtype=i64)
        return tokens, lens, ids, cache
    tokens = torch.zeros(batch, 1, dtype=i64)
    return tokens, lens, lens - 1, ids, cache


@dataclass(frozen=True)
class ServiceConfig:
    """The JSON a serving engine (and sharkport's runner) reads beside the module.

    `to_json` writes only fields shortfin's LLM server knows (it rejects any other top-level
    field), so `vocab_size` is not written: a config read back has None there and IreeSession
    takes it from the parameter archive (the rows of token_embd.weight)."""

    max_seq_len: int
    attn_head_dim: int
    prefill_batch_sizes: list[int]
    decode_batch_sizes: list[int]
    transformer_block_count: int
    attention_head_count_kv: int
    block_seq_stride: int
    device_block_count: int
    kv_cache_dtype: str
    page_elems: int  # of one device's cache_state
    vocab_size: int | None = None
    module_name: str = MODULE_NAME
    module_abi_version: int = ABI_VERSION
    logits_normalization: str = "none"
    top_k: int | None = None
    has_prefill_position: bool = False
    # Devices the module runs on (one cache_state argument each); written as the length of
    # paged_kv_block_size_elements_per_device. See docs/parallel.md.
    tensor_parallelism_size: int = 1

    def to_json(self) -> dict:
        return {
            "module_name": self.module_name,
            "module_abi_version": self.module_abi_version,
            "max_seq_len": self.max_seq_len,
            "attn_head_dim": self.attn_head_dim,
            "prefill_batch_sizes": self.prefill_batch_sizes,
            "decode_batch_sizes": self.decode_batch_sizes,
            "transformer_block_count": self.transformer_block_count,
            "logits_normalization": self.logits_normalization,
            "top_k": self.top_k,
            "has_prefill_position": self.has_prefill_position,
            "paged_kv_cache": {
                "attention_head_count_kv": self.attention_head_count_kv,
                "block_seq_stride": self.block_seq_stride,
                "device_block_count": self.device_block_count,
                "kv_cache_dtype": self.kv_cache_dtype,
                "paged_kv_block_size_elements_per_device": [self.page_elems] * self.tensor_parallelism_size,
            },
        }

    @classmethod
    def from_json(cls, d: dict, source: str = "config") -> "ServiceConfig":
        try:
            kv = d["paged_kv_cache"]
            return cls(
                max_seq_len=d["max_seq_len"], attn_head_dim=d["attn_head_dim"],
                prefill_batch_sizes=list(d["prefill_batch_sizes"]),
                decode_batch_sizes=list(d["decode_batch_sizes"]),
                transformer_block_count=d["transformer_block_count"],
                attention_head_count_kv=kv["attention_head_count_kv"],
                block_seq_stride=kv["block_seq_stride"],
                device_block_count=kv["device_block_count"],
                kv_cache_dtype=kv["kv_cache_dtype"],
                page_elems=kv["paged_kv_block_size_elements_per_device"][0],
                tensor_parallelism_size=len(kv["paged_kv_block_size_elements_per_device"]),
                vocab_size=d.get("vocab_size"),  # configs written before shortfin interop have it
                module_name=d.get("module_name", MODULE_NAME),
                module_abi_version=d.get("module_abi_version", ABI_VERSION),
                logits_normalization=d.get("logits_normalization", "none"),
                top_k=d.get("top_k"), has_prefill_position=d.get("has_prefill_position", False),
            )
        except (KeyError, IndexError, TypeError) as e:
            raise SharkportError(
                f"{source}: service config lacks field {e}; re-export with `python -m sharkport.export`"
            ) from None


def dtype_name(dtype) -> str:
    """torch.float16 → "float16", as the service config spells dtypes."""
    return str(dtype).removeprefix("torch.")
