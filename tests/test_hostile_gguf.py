"""Hostile GGUF input: every kind of damage ends in one SharkportError that names the file and
the offset or tensor, quickly and without a large allocation, and nothing is written."""

import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest

from sharkport.archive import Dataset, import_gguf
from sharkport.errors import SharkportError
from sharkport.formats.gguf import read_gguf
from sharkport.tools import dump_gguf

from gguf_seeds import SEED_TENSORS, header_slots, slot, write_seed

U64_MAX, U32_MAX = 2**64 - 1, 2**32 - 1


def _put(data: bytearray, at: int, width: int, value: int) -> bytearray:
    data[at:at + width] = value.to_bytes(width, "little")
    return data


def overwrite(what: str, value: int):
    """A mutation that sets the header field `what` (see gguf_seeds.header_slots) to `value`."""
    def mutate(path, data):
        s = slot(path, what)
        return _put(data, s.offset, s.width, value)
    return mutate


def truncate(at):
    return lambda path, data: data[:at(path, data)]


def same_offset_as(name, other):
    def mutate(path, data):
        src = slot(path, f"tensor {other} offset")
        value = int.from_bytes(data[src.offset:src.offset + 8], "little")
        return overwrite(f"tensor {name} offset", value)(path, data)
    return mutate


def replace(old: bytes, new: bytes):
    def mutate(path, data):
        assert len(old) == len(new) and old in data
        return bytearray(bytes(data).replace(old, new, 1))
    return mutate


# (mutation of the seed file, what the message must say)
CASES = {
    "wrong-magic": (replace(b"GGUF", b"GGML"), r"offset 0: the magic is b'GGML'.*not a GGUF file"),
    "empty-file": (truncate(lambda p, d: 0), r"shorter than a GGUF header"),
    "version-1": (overwrite("version", 1), r"offset 4: GGUF version 1 is not supported"),
    "version-99": (overwrite("version", 99), r"GGUF version 99 is not supported"),
    "truncated-in-counts": (truncate(lambda p, d: 20), r"shorter than a GGUF header"),
    "truncated-in-metadata": (truncate(lambda p, d: 500), r"at offset \d+: .* the file (ends )?at 500"),
    "truncated-in-tensor-infos": (truncate(lambda p, d: slot(p, "tensor blk.0.attn_q.weight n_dims").offset + 2),
                                  r"the dimension count of tensor blk\.0\.attn_q\.weight needs 4 bytes"),
    "truncated-tensor-data": (truncate(lambda p, d: len(d) - 100),
                              r"tensor blk\.0\.ffn_down\.weight .* past the end"),
    "tensor-offset-past-end": (overwrite("tensor blk.0.attn_k.weight offset", 2**40),
                               r"tensor blk\.0\.attn_k\.weight .* past the end"),
    "tensor-offset-u64-max": (overwrite("tensor blk.0.attn_k.weight offset", U64_MAX - 63),
                              r"tensor blk\.0\.attn_k\.weight .* past the end"),
    "tensors-overlap": (same_offset_as("blk.0.attn_v.weight", "blk.0.attn_k.weight"),
                        r"tensors blk\.0\.attn_(k|v)\.weight .* and blk\.0\.attn_(k|v)\.weight .* overlap"),
    "misaligned-offset": (overwrite("tensor blk.0.attn_q.weight offset", 1), r"not a multiple of the file's alignment 64"),
    "absurd-tensor-count": (overwrite("tensor count", U64_MAX), r"offset 8: the tensor count is 18446744073709551615"),
    "absurd-kv-count": (overwrite("kv count", 2**62), r"offset 16: the metadata key count is 4611686018427387904"),
    "absurd-key-length": (overwrite("llama.block_count key length", U64_MAX), r"length of the name of metadata key \d+ is 18446744073709551615"),
    "absurd-string-length": (overwrite("tokenizer.ggml.model string length", 2**40), r"length of the string value of tokenizer\.ggml\.model"),
    "absurd-string-array": (overwrite("tokenizer.ggml.tokens count", 2**61), r"item count of array tokenizer\.ggml\.tokens is 2305843009213693952"),
    "absurd-byte-array": (overwrite("sharkport.test.bytes count", 2**61), r"item count of array sharkport\.test\.bytes"),
    "absurd-float-array": (overwrite("tokenizer.ggml.scores count", U64_MAX), r"item count of array tokenizer\.ggml\.scores"),
    "absurd-tensor-name": (overwrite("tensor output_norm.weight name length", 2**63), r"length of the name of tensor 1"),
    "absurd-dims": (overwrite("tensor blk.0.attn_q.weight dim 1", 2**62), r"tensor blk\.0\.attn_q\.weight .* past the end"),
    "zero-dim": (overwrite("tensor blk.0.ffn_up.weight dim 1", 0), r"tensor blk\.0\.ffn_up\.weight .*shape \[32, 0\] holds no values"),
    "too-many-dims": (overwrite("tensor blk.0.attn_q.weight n_dims", U32_MAX), r"tensor blk\.0\.attn_q\.weight has 4294967295 dimensions"),
    "unknown-tensor-type": (overwrite("tensor blk.0.attn_v.weight type", 200), r"tensor blk\.0\.attn_v\.weight has ggml type 200"),
    "removed-tensor-type": (overwrite("tensor blk.0.attn_v.weight type", 4), r"ggml type 4, which no known"),  # old Q4_2
    "row-not-whole-blocks": (overwrite("tensor blk.0.attn_q.weight dim 0", 33), r"blk\.0\.attn_q\.weight .*rows of 33 values are not a whole number of Q4_1 blocks of 32"),
    "unknown-value-type": (overwrite("llama.block_count value type", 99), r"value type of llama\.block_count is 99"),
    "unknown-array-item-type": (overwrite("tokenizer.ggml.scores item type", 77), r"item type of array tokenizer\.ggml\.scores is 77"),
    "nested-array": (overwrite("tokenizer.ggml.scores item type", gguf.GGUFValueType.ARRAY), r"array of arrays"),
    "bad-utf8-key": (replace(b"llama.block_count", b"llama.block\xffcount"), r"name of metadata key \d+ is not valid UTF-8"),
    "bad-utf8-value": (replace(b"gpt2", b"gp\xfe2"), r"string value of tokenizer\.ggml\.model is not valid UTF-8"),
    "duplicate-key": (replace(b"general.architecture", b"llama.context_length"), r"metadata key llama\.context_length appears twice"),
    "duplicate-tensor": (replace(b"blk.0.ffn_up.weight", b"blk.0.attn_v.weight"), r"tensor blk\.0\.attn_v\.weight appears twice"),
    "alignment-zero": (overwrite("general.alignment value", 0), r"general\.alignment is 0, not a power of two"),
    "alignment-not-power-of-2": (overwrite("general.alignment value", 48), r"general\.alignment is 48"),
    "alignment-not-u32": (overwrite("general.alignment value type", gguf.GGUFValueType.INT32),
                          r"general\.alignment has type INT32, not UINT32"),
}


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """A valid tiny llama with general.alignment 64 (so the alignment key can be damaged too)."""
    return write_seed(tmp_path_factory.mktemp("seed") / "seed.gguf", alignment=64)


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_damage_is_one_clear_error(seed, tmp_path, case):
    mutate, message = CASES[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(seed, bytearray(seed.read_bytes())))
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(SharkportError, match=message) as info:
            read_gguf(bad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value).startswith(f"{bad}: ")  # names the file first
    assert time.perf_counter() - t0 < 2.0 and peak < 16 * 2**20, "a hostile length was trusted"
    # The import stops at the same point and leaves nothing behind.
    with pytest.raises(SharkportError, match=message):
        import_gguf(bad, tmp_path / "out.irpa", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_the_seed_is_valid_and_read_as_gguf_reads_it(seed):
    """The layout check accepts what gguf.GGUFReader reads, and places every tensor where it does."""
    ours = {t.name: t for t in read_gguf(seed).tensors}
    theirs = gguf.GGUFReader(seed).tensors
    assert sorted(ours) == sorted(SEED_TENSORS)
    for t in theirs:
        assert (ours[t.name].offset, ours[t.name].n_bytes) == (int(t.data_offset), int(t.n_bytes))
    assert struct.unpack_from("<I", seed.read_bytes(), 4)[0] == 3


def test_real_file_reads_as_gguf_reader_reads_it(smollm2_gguf):
    """Our single-pass header walk decodes every metadata value (49,152-token vocabulary,
    merges, scores, scalars of each type) and places every tensor as gguf.GGUFReader does."""
    ours = read_gguf(smollm2_gguf)
    reader = gguf.GGUFReader(smollm2_gguf)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(theirs)
    for key, value in theirs.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert len(ours.tensors) == len(reader.tensors) == 272
    for mine, t in zip(ours.tensors, reader.tensors):
        assert (mine.name, mine.type_name, mine.offset, mine.n_bytes) == \
            (t.name, t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(mine.data, t.data.reshape(-1).view(np.uint8))


def test_big_endian_file_reads_like_little_endian(tmp_path):
    little = read_gguf(write_seed(tmp_path / "le.gguf"))
    big = read_gguf(write_seed(tmp_path / "be.gguf", big_endian=True))
    assert big.metadata == little.metadata
    assert [(t.name, t.shape, t.type_name) for t in big.tensors] == \
        [(t.name, t.shape, t.type_name) for t in little.tensors]


def test_every_header_field_is_mapped(seed):
    """The slot map used here and by the fuzz test covers the header's counts and lengths."""
    kinds = {s.what.rsplit(" ", 1)[-1] for s in header_slots(seed)}
    assert {"count", "length", "type", "offset", "n_dims", "value"} <= kinds


def test_missing_required_key_is_named(tmp_path):
    path = write_seed(tmp_path / "nokey.gguf", drop_keys=("llama.embedding_length",))
    from sharkport.models import build_model

    with pytest.raises(SharkportError, match=r"missing the required key llama\.embedding_length"):
        build_model(Dataset.load(path))


def test_cli_prints_one_line_and_exits_2(seed, tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(overwrite("tokenizer.ggml.tokens count", 2**61)(seed, bytearray(seed.read_bytes())))
    assert dump_gguf.main(["--gguf-file", str(bad), "--output-irpa", str(tmp_path / "x.irpa")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: at offset ") and "Traceback" not in err
    assert not (tmp_path / "x.irpa").exists()
