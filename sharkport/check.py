"""A model file's integrity: its metadata against its tensors, all problems at once.

Checks that the hyperparameters are present and coherent (heads divide the embedding, kv heads
divide heads, rotary dims fit the head), that every tensor the llama recipe needs is present
with the shape the hyperparameters give (llama family: llama, mistral, qwen2; the hyperparameters
alone for other architectures), that quantized tensors have whole blocks and the planes
their block type has, and (for an .irpa) that every entry has the dtype, shape and byte size its
layout says. With `values` it also scans for NaN/inf values and quantization scales. A compiled
module is checked by runtime/vmfb.py. `python -m sharkport.tools.check` and `dump_gguf --check`
print what these functions find.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .archive.irpa import is_shape
from .errors import SharkportError, is_number, is_whole, short
from .formats import keys
from .formats.gguf import GgufFile
from .formats.keys import HPARAMS, LLAMA_KEYS, LlamaHParams
from .formats.names import LLAMA_NAMES, block_indices
from .quant import BLOCK_TYPES, PLAIN_TYPES, SUPPORTED_TYPES, plane_key

# Shape of every llama tensor (numpy order), keyed by its GGUF name template in LLAMA_NAMES.
# E embedding, F feed-forward, V vocabulary, H heads, Hkv kv heads, D head dim.
LLAMA_SHAPES: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("V", "E"),
    "output_norm.weight": ("E",),
    "output.weight": ("V", "E"),
    "blk.{bid}.attn_norm.weight": ("E",),
    "blk.{bid}.attn_q.weight": ("H*D", "E"),
    "blk.{bid}.attn_k.weight": ("Hkv*D", "E"),
    "blk.{bid}.attn_v.weight": ("Hkv*D", "E"),
    "blk.{bid}.attn_output.weight": ("E", "H*D"),
    "blk.{bid}.attn_q.bias": ("H*D",),
    "blk.{bid}.attn_k.bias": ("Hkv*D",),
    "blk.{bid}.attn_v.bias": ("Hkv*D",),
    "blk.{bid}.attn_output.bias": ("E",),
    "blk.{bid}.ffn_norm.weight": ("E",),
    "blk.{bid}.ffn_gate.weight": ("F", "E"),
    "blk.{bid}.ffn_up.weight": ("F", "E"),
    "blk.{bid}.ffn_down.weight": ("E", "F"),
}
assert set(LLAMA_SHAPES) == set(LLAMA_NAMES.values()), "LLAMA_SHAPES must cover formats.names.LLAMA_NAMES"


def _optional(template: str) -> bool:
    """Biases are optional, and so is output.weight (tied embeddings: the recipe reuses token_embd)."""
    return template.endswith(".bias") or template == "output.weight"


_INT_FIELDS = ("block_count", "embedding_length", "feed_forward_length", "head_count", "head_count_kv",
               "head_dim", "rope_dim", "context_length", "vocab_size")
_FLOAT_FIELDS = ("rope_freq_base", "rms_eps")


def check_hparams(hparams: dict[str, Any]) -> tuple[list[str], LlamaHParams | None]:
    """Problems with the hyperparameters, and the parsed hyperparameters when they are usable."""
    arch = hparams.get("general.architecture")
    if not arch:
        return ["metadata has no general.architecture key; is this a model file?"], None
    if not isinstance(arch, str) or arch not in HPARAMS:
        return [f"architecture {arch!r} has no recipe (known: {', '.join(sorted(HPARAMS))})"], None
    if HPARAMS[arch] is not LlamaHParams:  # shapes are known for the llama family only
        try:
            HPARAMS[arch].from_metadata(hparams, vocab_size=0)
        except SharkportError as e:
            return [str(e)], None
        return [], None
    problems = []
    for field, (suffix, default) in LLAMA_KEYS.items():
        key = f"{arch}.{suffix}"
        value = hparams.get(key)
        if value is None:
            if default is keys._REQUIRED:
                problems.append(f"metadata is missing the required key {key}")
        elif field in _INT_FIELDS and not (is_whole(value) and value > 0):
            problems.append(f"{key} is {value!r}; it must be a positive integer")
        elif field in _FLOAT_FIELDS and not (is_number(value) and value > 0):
            problems.append(f"{key} is {value!r}; it must be a positive number")
    if problems:
        return problems, None

    def get(field):
        return hparams.get(f"{arch}.{LLAMA_KEYS[field][0]}")

    heads, kv_heads = get("head_count"), get("head_count_kv") or get("head_count")
    if heads % kv_heads:
        problems.append(f"{arch}.attention.head_count ({heads}) is not a multiple of "
                        f"{arch}.attention.head_count_kv ({kv_heads})")
    head_dim = get("head_dim")
    if head_dim is None:
        if get("embedding_length") % heads:
            problems.append(f"{arch}.embedding_length ({get('embedding_length')}) is not a multiple of "
                            f"{arch}.attention.head_count ({heads}), so the head dim is undefined")
        head_dim = get("embedding_length") // heads
    rope_dim = get("rope_dim") or head_dim
    if rope_dim % 2 or rope_dim > head_dim:
        problems.append(f"{arch}.rope.dimension_count ({rope_dim}) must be even and at most the "
                        f"head dim ({head_dim})")
    if problems:
        return problems, None
    try:
        return [], LlamaHParams.from_metadata(hparams, vocab_size=0)
    except SharkportError as e:  # what the recipe itself would refuse
        return [str(e)], None


def _template_of(name: str) -> tuple[str, int | None] | None:
    """`blk.3.attn_q.weight` → (`blk.{bid}.attn_q.weight`, 3); None for unknown names."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    template, bid = (f"blk.{{bid}}.{m.group(2)}", int(m.group(1))) if m else (name, None)
    return (template, bid) if template in LLAMA_SHAPES else None


def check_tensors(hparams: dict[str, Any], layouts: dict[str, dict[str, Any]],
                  tokenizer: dict[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes) for tensor layouts {name: {type, shape, planes}} against the hyperparameters."""
    problems, notes = tokenizer_problems(tokenizer) if tokenizer else [], []
    for name, layout in layouts.items():
        type_name, shape = layout.get("type"), tuple(layout.get("shape", ()))
        if type_name not in SUPPORTED_TYPES:
            problems.append(f"{name} has type {type_name}, which sharkport cannot use "
                            f"(supported: {', '.join(SUPPORTED_TYPES)})")
        elif type_name in BLOCK_TYPES:
            block = BLOCK_TYPES[type_name]
            if not shape or shape[-1] % block.block_size:
                problems.append(f"{name}: {type_name} rows must hold whole blocks of {block.block_size} "
                                f"values, but its shape is {list(shape)}")
            expected_planes = [f for f, _, _ in block.fields]
            if "planes" in layout and layout["planes"] != expected_planes:
                problems.append(f"{name}: {type_name} has planes {expected_planes}, the metadata lists "
                                f"{layout['planes']}")

    hp_problems, hp = check_hparams(hparams)
    problems += hp_problems
    if hp is None or hp.expert_count:
        if not hp_problems:
            notes.append(f"tensor names and shapes are checked for dense llama-family models only, "
                         f"not {hparams.get('general.architecture')}"
                         f"{' with experts' if hp is not None and hp.expert_count else ''}")
        return problems, notes
    vocab = hp.vocab_size
    if "token_embd.weight" in layouts:
        vocab = layouts["token_embd.weight"]["shape"][0]
        if f"{hp.arch}.vocab_size" in hparams and hparams[f"{hp.arch}.vocab_size"] != vocab:
            problems.append(f"{hp.arch}.vocab_size is {hparams[f'{hp.arch}.vocab_size']} but "
                            f"token_embd.weight has {vocab} rows")
    tokens = (tokenizer or {}).get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:
        problems.append(f"the tokenizer has {len(tokens)} tokens but the embedding only {vocab} rows; "
                        "token ids past the table would read out of bounds")
    dims = {"E": hp.embedding_length, "F": hp.feed_forward_length, "V": vocab,
            "H*D": hp.head_count * hp.head_dim, "Hkv*D": hp.head_count_kv * hp.head_dim}
    present = len(block_indices(layouts))
    if hp.block_count > present:  # one line, not one per missing tensor of a count the file only claims
        problems.append(f"{hp.arch}.block_count is {hp.block_count}, but the tensors hold {present} blocks")
    for template, symbols in LLAMA_SHAPES.items():
        for bid in range(min(hp.block_count, present)) if "{bid}" in template else [None]:
            name = template.format(bid=bid)
            expected = [dims[s] for s in symbols]
            if name not in layouts:
                if not _optional(template):
                    problems.append(f"{name} is missing; the llama recipe needs it")
            elif list(layouts[name]["shape"]) != expected:
                problems.append(f"{name} has shape {list(layouts[name]['shape'])}; the hyperparameters "
                                f"give {expected} ({', '.join(symbols)})")
    for name in layouts:
        known = _template_of(name)
        if known is None:
            notes.append(f"{name} is not a llama tensor the recipe uses; it is ignored")
        elif known[1] is not None and known[1] >= hp.block_count:
            problems.append(f"{name} belongs to block {known[1]}, but {hp.arch}.block_count is "
                            f"{hp.block_count}")
    return problems, notes


def well_formed(layouts: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(the layouts that have a type name and a shape of whole numbers, a problem for each other)."""
    good, problems = {}, []
    for name, layout in layouts.items():
        kind, shape = (layout.get("type"), layout.get("shape")) if isinstance(layout, dict) else (None, None)
        if not isinstance(kind, str):
            problems.append(f"{short(name)}: the metadata gives it no type name ({short(kind)})")
        elif not is_shape(shape):
            problems.append(f"{short(name)}: the metadata gives it the shape {short(shape)}, not a list of whole "
                            "numbers")
        else:
            good[name] = layout
    return good, problems


def tokenizer_problems(tokenizer: dict[str, Any]) -> list[str]:
    """A problem line if no tokenizer can be built from the `tokenizer.*` metadata."""
    from .tokenizer import Tokenizer

    try:
        Tokenizer.from_gguf_metadata(tokenizer)
    except SharkportError as e:
        return [f"the tokenizer cannot be built: {e}"]
    return []


def expected_entries(layouts: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
    """(tensor, entry key, dtype name, shape) of every archive entry the layouts describe."""
    for name, layout in layouts.items():
        type_name, shape = layout.get("type"), tuple(layout.get("shape", ()))
        if type_name in PLAIN_TYPES:
            yield name, name, PLAIN_TYPES[type_name][1], shape
        elif type_name in BLOCK_TYPES and shape and shape[-1] % BLOCK_TYPES[type_name].block_size == 0:
            for plane, (plane_shape, dtype) in BLOCK_TYPES[type_name].plane_shapes(shape).items():
                yield name, plane_key(name, plane, "interleaved_rows" in layout, type_name), dtype.name, plane_shape


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int16": 2, "int32": 4}


def check_entries(layouts: dict[str, dict[str, Any]], entries: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(problems, notes): archive entries (turbine ParameterArchiveEntry by key) against the layouts."""
    problems, notes, used = [], [], set()
    for tensor, key, dtype, shape in expected_entries(layouts):
        used.add(key)
        if key not in entries:
            problems.append(f"{tensor}: archive entry {key} is missing")
            continue
        raw = entries[key].raw
        try:
            meta = json.loads(raw.metadata.decode().removeprefix("PYTORCH:"))
            stored_dtype, stored_shape = meta["dtype"], tuple(meta["shape"])
        except (ValueError, KeyError, TypeError):
            problems.append(f"{tensor}: archive entry {key} has no readable tensor description")
            continue
        if (stored_dtype, stored_shape) != (dtype, shape):
            problems.append(f"{tensor}: archive entry {key} is {stored_dtype} {list(stored_shape)}; "
                            f"its layout needs {dtype} {list(shape)}")
        n_bytes = math.prod(shape) * _ITEMSIZE[dtype]
        if raw.length != n_bytes:
            problems.append(f"{tensor}: archive entry {key} holds {raw.length} bytes; {dtype} "
                            f"{list(shape)} needs {n_bytes}")
    for key in entries:
        if key not in used and not key.startswith("__"):
            notes.append(f"archive entry {key} is not described by the metadata; it is ignored")
    return problems, notes


def nonfinite(name: str, array: np.ndarray, dtype: str) -> str | None:
    """A problem line if a float plane (`dtype` float32/float16/bfloat16) holds NaN or inf."""
    if dtype == "bfloat16":  # raw bits: exponent all ones is inf or NaN
        bad = int(np.count_nonzero((array.view(np.uint16) & 0x7F80) == 0x7F80))
    elif dtype in ("float32", "float16"):
        floats = array.view(dtype)
        bad = int(floats.size - np.count_nonzero(np.isfinite(floats)))
    else:
        return None
    return f"{name} holds {bad} NaN/inf values" if bad else None


def check_archive(path: str | Path, values: bool = False) -> tuple[list[str], list[str]]:
    """(problems, notes) of an .irpa; raises SharkportError only when it cannot be read at all."""
    from iree.turbine.aot import ParameterArchive

    from .archive.irpa import METADATA_KEY, parse_metadata

    path = Path(path)
    if not path.is_file():
        raise SharkportError(f"{path}: no such file; pass an .irpa made by `sharkport.tools.dump_gguf --output-irpa`")
    try:
        entries = dict(ParameterArchive(path, mmap=True).items())
    except Exception as e:
        raise SharkportError(f"{path}: not a readable parameter archive ({e}); re-create it") from None
    if METADATA_KEY not in entries:
        raise SharkportError(f"{path}: has no {METADATA_KEY} entry, so sharkport did not write it; "
                             "re-import the model with `python -m sharkport.tools.dump_gguf --output-irpa`")
    metadata = parse_metadata(bytes(np.asarray(entries[METADATA_KEY].raw.file_view)), path, tensors=False)
    layouts, layout_problems = well_formed(metadata["tensors"])
    problems, notes = check_tensors(metadata["hparams"], layouts, metadata.get("tokenizer"))
    problems = layout_problems + problems
    entry_problems, entry_notes = check_entries(layouts, entries)
    problems, notes = problems + entry_problems, notes + entry_notes
    if values:
        for tensor, key, dtype, _ in expected_entries(layouts):
            if key in entries and not any(key in p for p in entry_problems):
                problem = nonfinite(key, np.asarray(entries[key].raw.file_view), dtype)
                problems += [problem] if problem else []
    return problems, notes


def check_gguf(gg: GgufFile, values: bool = False) -> tuple[list[str], list[str]]:
    """(problems, notes) of a GGUF file opened with read_gguf (which checked its layout)."""
    layouts = {t.name: {"type": t.type_name, "shape": list(t.shape)} for t in gg.tensors}
    hparams = {k: v for k, v in gg.metadata.items() if not k.startswith("tokenizer.")}
    tokenizer = {k: v for k, v in gg.metadata.items() if k.startswith("tokenizer.")}
    problems, notes = check_tensors(hparams, layouts, tokenizer)
    if values:
        for t in gg.tensors:
            raw = t.data.reshape(-1).view(np.uint8)
            if t.type_name in PLAIN_TYPES:
                problem = nonfinite(t.name, raw.view(PLAIN_TYPES[t.type_name][0]), PLAIN_TYPES[t.type_name][1])
                problems += [problem] if problem else []
            elif t.type_name in BLOCK_TYPES and t.shape[-1] % BLOCK_TYPES[t.type_name].block_size == 0:
                for plane, array in BLOCK_TYPES[t.type_name].unpack(raw, t.shape).items():
                    problem = nonfinite(f"{t.name}:{plane}", array, array.dtype.name)
                    problems += [problem] if problem else []
    return problems, notes


def print_findings(path: Path, problems: list[str], notes: list[str]) -> int:
    """Prints notes and problems, one per line; returns the exit code (1 if any problem)."""
    for note in notes:
        print(f"{path}: note: {note}")
    for problem in problems:
        print(f"{path}: problem: {problem}")
    if problems:
        print(f"{path}: {len(problems)} problem(s); re-import the model or fix its metadata", file=sys.stderr)
        return 1
    print(f"{path}: OK")
    return 0
