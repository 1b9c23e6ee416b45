"""Small valid GGUF files to break on purpose (hostile-input and fuzz tests), and a map of where
each header field of a GGUF file sits, so that a test can overwrite exactly one field.

Test helpers, not tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from gguf_fixtures import random_tensor

# A one-layer llama small enough that a mutation often lands in the header: hidden 32, 2 heads
# of 16, 1 kv head, feed-forward 64, vocabulary 32, every supported tensor type once.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB = 32, 2, 1, 16, 64, 32
SEED_TENSORS = {  # name → (ggml type, numpy shape)
    "token_embd.weight": ("Q8_0", (VOCAB, HIDDEN)),
    "output_norm.weight": ("F32", (HIDDEN,)),
    "blk.0.attn_norm.weight": ("F32", (HIDDEN,)),
    "blk.0.attn_q.weight": ("Q4_1", (HEADS * HEAD_DIM, HIDDEN)),
    "blk.0.attn_k.weight": ("Q5_0", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "blk.0.attn_v.weight": ("Q4_0", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "blk.0.attn_output.weight": ("F16", (HIDDEN, HEADS * HEAD_DIM)),
    "blk.0.ffn_norm.weight": ("F32", (HIDDEN,)),
    "blk.0.ffn_gate.weight": ("Q5_1", (FF, HIDDEN)),
    "blk.0.ffn_up.weight": ("BF16", (FF, HIDDEN)),
    "blk.0.ffn_down.weight": ("Q8_0", (HIDDEN, FF)),
}

# A byte-level BPE vocabulary the tokenizer can build: "t", "a".."i" merged into "ta".."ti", the
# digits and the space ("Ġ").
SEED_TOKENS = ["<s>", "</s>", "t", *"abcdefghi", *(f"t{c}" for c in "abcdefghi"), *"0123456789", "Ġ"]
SEED_MERGES = [f"t {c}" for c in "abcdefghi"]
assert len(SEED_TOKENS) == VOCAB


def write_seed(path: Path, seed: int = 0, drop_keys: tuple[str, ...] = (),
               tensors: dict[str, tuple[str, tuple[int, ...]]] | None = None,
               alignment: int | None = None, big_endian: bool = False) -> Path:
    """A valid tiny llama GGUF with hyperparameters, a tokenizer (string, float and int arrays)
    and quantized tensors; `drop_keys` leaves metadata keys out, `alignment` sets
    general.alignment."""
    rng = np.random.default_rng(seed)
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    keys = {
        "llama.context_length": (writer.add_context_length, 128),
        "llama.embedding_length": (writer.add_embedding_length, HIDDEN),
        "llama.block_count": (writer.add_block_count, 1),
        "llama.feed_forward_length": (writer.add_feed_forward_length, FF),
        "llama.attention.head_count": (writer.add_head_count, HEADS),
        "llama.attention.head_count_kv": (writer.add_head_count_kv, KV_HEADS),
        "llama.rope.freq_base": (writer.add_rope_freq_base, 10000.0),
        "llama.attention.layer_norm_rms_epsilon": (writer.add_layer_norm_rms_eps, 1e-5),
        "llama.vocab_size": (writer.add_vocab_size, VOCAB),
    }
    for key, (add, value) in keys.items():
        if key not in drop_keys:
            add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(SEED_TOKENS)
    writer.add_token_merges(SEED_MERGES)
    writer.add_token_scores([float(-i) for i in range(VOCAB)])
    writer.add_token_types([3, 3] + [1] * (VOCAB - 2))  # control tokens, then normal ones
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    # A byte array: gguf.GGUFReader loops forever on one whose length runs past the file.
    writer.add_key_value("sharkport.test.bytes", list(range(8)), gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.UINT8)
    for name, (type_name, shape) in (tensors or SEED_TENSORS).items():
        data = random_tensor(type_name, shape, rng, std=0.1)
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Slot:
    """One integer field of a GGUF header: where it is, how wide, what it means."""

    offset: int
    width: int  # bytes
    what: str


def header_slots(path: Path) -> list[Slot]:
    """Every integer field of the header (counts, lengths, value types, dims, tensor types and
    offsets), located with gguf.GGUFReader's own parse of the file."""
    reader = gguf.GGUFReader(path)
    slots = [Slot(4, 4, "version"), Slot(8, 8, "tensor count"), Slot(16, 8, "kv count")]
    for field in list(reader.fields.values())[3:]:  # after GGUF.version / tensor_count / kv_count
        slots += _integer_parts(field, field.name)
    for t in reader.tensors:
        slots += _integer_parts(t.field, f"tensor {t.name}")
    return slots


def _integer_parts(field, name: str) -> list[Slot]:
    """The 4- and 8-byte integers of a reader field, named after what they hold."""
    if name.startswith("tensor "):  # [name length, name, n_dims, dims, type, offset]
        labels = {0: "name length", 2: "n_dims", 4: "type", 5: "offset"}
    elif field.types[0] == gguf.GGUFValueType.ARRAY:  # [key length, key, type, item type, count, items...]
        labels = {0: "key length", 2: "value type", 3: "item type", 4: "count"}
    elif field.types[0] == gguf.GGUFValueType.STRING:  # [key length, key, type, length, text]
        labels = {0: "key length", 2: "value type", 3: "string length"}
    else:  # [key length, key, type, value]
        labels = {0: "key length", 2: "value type", 3: "value"}
    out, offset = [], field.offset
    for i, part in enumerate(field.parts):
        if i == 3 and name.startswith("tensor "):  # the dims array
            out += [Slot(offset + 8 * d, 8, f"{name} dim {d}") for d in range(part.size)]
        elif part.dtype.kind in "ui" and part.size == 1 and part.dtype.itemsize in (4, 8):
            out.append(Slot(offset, part.dtype.itemsize, f"{name} {labels.get(i, 'item length')}"))
        offset += part.nbytes
    return out


def slot(path: Path, what: str) -> Slot:
    """The header slot called `what`, e.g. "tensor blk.0.attn_q.weight offset"."""
    return next(s for s in header_slots(path) if s.what == what)
