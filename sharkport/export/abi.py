"""The exported ABI in one place (docs/abi.md): argument names and shapes, dynamic dims, the
service config JSON. The exporter builds from it and the runner checks inputs against it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SharkportError

MODULE_NAME = "module"
ABI_VERSION = 1
PREFILL_ARGS = ("tokens", "seq_lens", "seq_block_ids", "cache_state")
DECODE_ARGS = ("tokens", "seq_lens", "start_positions", "seq_block_ids", "cache_state")
# Bounds of what a service config may claim: far beyond any model, short of sizes that
# would overflow or exhaust memory when the runner sizes its arrays from them.
MAX_SEQ_LEN = 1 << 24
MAX_BATCH = 4096
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
    # the products (every quantized weight type, F16 and BF16) and attention through sharkport.kernels
    # (x86-64 CPUs)
    matvec_kernels: bool = False
    # where the kernels do not: a product of one row by a Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 matrix
    # dequantizes its weights inside the product (export.stored), for targets that keep the weights
    # as stored (compile.Target.as_stored); llvm-cpu packs them at load and multiplies them faster apart
    dequant_in_products: bool = False
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

    def checked(self, source: str = "config") -> "ServiceConfig":
        """This config, if every field has the type and range the runner sizes things from and the
        page size agrees with the cache's geometry; else one line naming `source` and the field."""
        def fail(message: str):
            raise SharkportError(f"{source}: {message}; re-export the model with `sharkport export`")

        def whole(name: str, value, high: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                fail(f"{name} is {value!r}, not a whole number in 1..{high}")

        for name, high in (("max_seq_len", MAX_SEQ_LEN), ("attn_head_dim", 1 << 16),
                           ("transformer_block_count", 1 << 16), ("attention_head_count_kv", 1 << 16),
                           ("block_seq_stride", MAX_SEQ_LEN), ("device_block_count", 1 << 31),
                           ("page_elems", 1 << 40), ("tensor_parallelism_size", 1 << 10)):
            whole(name, getattr(self, name), high)
        for name in ("prefill_batch_sizes", "decode_batch_sizes"):
            sizes = getattr(self, name)
            if not isinstance(sizes, list) or not sizes:
                fail(f"{name} is {sizes!r}, not a list of batch sizes")
            for size in sizes:
                whole(name, size, MAX_BATCH)
        if self.vocab_size is not None:
            whole("vocab_size", self.vocab_size, 1 << 31)
        if self.top_k is not None:
            whole("top_k", self.top_k, 1 << 31)
        if self.kv_cache_dtype not in ("float32", "float16"):
            fail(f"kv_cache_dtype is {self.kv_cache_dtype!r}, not float32 or float16")
        if self.logits_normalization not in ("none", "softmax", "log_softmax"):
            fail(f"logits_normalization is {self.logits_normalization!r}, not none, softmax or log_softmax")
        if not isinstance(self.has_prefill_position, bool):
            fail(f"has_prefill_position is {self.has_prefill_position!r}, not true or false")
        if self.module_abi_version != ABI_VERSION:
            fail(f"module_abi_version is {self.module_abi_version!r}; this sharkport reads version {ABI_VERSION}")
        if self.max_seq_len % self.block_seq_stride:
            fail(f"max_seq_len {self.max_seq_len} is not a multiple of block_seq_stride {self.block_seq_stride}")
        n = self.tensor_parallelism_size
        if self.attention_head_count_kv % n:
            fail(f"attention_head_count_kv {self.attention_head_count_kv} does not split among "
                 f"tensor_parallelism_size {n} devices")
        page = self.transformer_block_count * 2 * self.block_seq_stride * self.attention_head_count_kv // n \
            * self.attn_head_dim
        if page != self.page_elems:
            fail(f"paged_kv_block_size_elements_per_device is {self.page_elems}, but {self.transformer_block_count} "
                 f"layers x 2 x block_seq_stride {self.block_seq_stride} x {self.attention_head_count_kv} kv heads"
                 f"{f' / {n} devices' if n > 1 else ''} x attn_head_dim {self.attn_head_dim} make {page}")
        return self

    @classmethod
    def load(cls, path) -> "ServiceConfig":
        """The service config JSON file at `path`, checked (one line naming the file if it is not one)."""
        import json
        from pathlib import Path

        path = Path(path)
        try:
            if path.stat().st_size > 1 << 24:
                raise SharkportError(f"{path}: {path.stat().st_size} bytes is no service config (they are a few "
                                     "hundred); pass the JSON written by `sharkport export --output-config`")
            d = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise SharkportError(f"{path}: no such file; pass the JSON written by --output-config") from None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise SharkportError(f"{path}: not a service config JSON ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]})") from None
        return cls.from_json(d, str(path))

    @classmethod
    def from_json(cls, d: dict, source: str = "config") -> "ServiceConfig":
        if not isinstance(d, dict) or not isinstance(d.get("paged_kv_cache"), dict):
            raise SharkportError(f"{source}: not a service config (a JSON object with paged_kv_cache); "
                                 "pass the JSON written by `sharkport export --output-config`")
        pages = d["paged_kv_cache"].get("paged_kv_block_size_elements_per_device")
        if not isinstance(pages, list) or not pages or len(set(map(repr, pages))) != 1:
            raise SharkportError(f"{source}: paged_kv_block_size_elements_per_device is {pages!r}, not one page "
                                 "size per device, all equal; re-export the model with `sharkport export`")
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
            ).checked(source)
        except (KeyError, IndexError, TypeError) as e:
            raise SharkportError(
                f"{source}: service config lacks field {e}; re-export with `python -m sharkport.export`"
            ) from None


# The ABI facts a module carries about itself, in each exported function's reflection
# (`iree.reflection`, which the runtime reads back): the runner trusts these over the config.
REFLECTION_KEY = "sharkport.abi"
MODULE_FACTS = ("max_seq_len", "block_seq_stride", "page_elems", "kv_cache_dtype", "tensor_parallelism_size",
                "vocab_size")


def module_facts(config: ServiceConfig) -> dict:
    return {name: getattr(config, name) for name in MODULE_FACTS}


def dtype_name(dtype) -> str:
    """torch.float16 → "float16", as the service config spells dtypes."""
    return str(dtype).removeprefix("torch.")
