"""Archive integrity (`sharkport.tools.check`): archives broken in one or several ways report
every problem at once and exit 1; good imports pass; `dump_gguf --check` finds NaN/inf values
and scales where gguf.quants' own dequantization shows them."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from iree.turbine.aot import ParameterArchive

from sharkport.archive import import_gguf
from sharkport.archive.irpa import METADATA_KEY, Entry, write_archive
from sharkport.check import LLAMA_SHAPES
from sharkport.formats.names import LLAMA_NAMES
from sharkport.tools import check, dump_gguf

from gguf_seeds import write_seed

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check")
    irpa = folder / "good.irpa"
    import_gguf(write_seed(folder / "seed.gguf"), irpa, progress=False)
    return irpa


def _read(irpa):
    """(metadata, {key: (dtype name, shape, bytes as numpy)}) of an archive, via turbine."""
    entries = dict(ParameterArchive(irpa).items())
    metadata = json.loads(bytes(np.asarray(entries.pop(METADATA_KEY).raw.file_view)))
    out = {}
    for key, e in entries.items():
        if key.startswith("__"):  # sharktank's entries, written anew with the metadata
            continue
        desc = json.loads(e.raw.metadata.decode().removeprefix("PYTORCH:"))
        out[key] = (desc["dtype"], tuple(desc["shape"]), np.array(np.asarray(e.raw.file_view), copy=True))
    return metadata, out


def _write(path, metadata, entries):
    items = [Entry(k, _TORCH[dt], shape, data=data) for k, (dt, shape, data) in entries.items()]
    write_archive(path, items, metadata)
    return path


def drop_tensor(meta, entries, name="blk.0.ffn_up.weight"):
    del meta["tensors"][name]
    for key in [k for k in entries if k == name or k.startswith(name + ":")]:
        del entries[key]


def drop_entry(meta, entries):
    del entries["blk.0.attn_q.weight:m:x8"]


def wrong_shape(meta, entries):
    meta["tensors"]["output_norm.weight"]["shape"] = [16]
    entries["output_norm.weight"] = ("float32", (16,), entries["output_norm.weight"][2][:64])


def wrong_plane_size(meta, entries):
    dt, shape, data = entries["token_embd.weight:qs:x8"]
    entries["token_embd.weight:qs:x8"] = (dt, (32, 1, 16), data.reshape(32, 32)[:, :16].copy())


def wrong_plane_list(meta, entries):
    meta["tensors"]["blk.0.attn_v.weight"]["planes"] = ["qs", "d"]


def missing_key(meta, entries):
    del meta["hparams"]["llama.feed_forward_length"]


def incoherent_hparams(meta, entries):
    meta["hparams"]["llama.attention.head_count_kv"] = 3   # does not divide 2 heads
    meta["hparams"]["llama.rope.dimension_count"] = 33     # odd, and more than the head dim 16


def negative_layers(meta, entries):
    meta["hparams"]["llama.block_count"] = -1


def extra_block(meta, entries):
    meta["tensors"]["blk.7.attn_norm.weight"] = {"type": "F32", "shape": [32]}
    entries["blk.7.attn_norm.weight"] = entries["blk.0.attn_norm.weight"]


def vocab_mismatch(meta, entries):
    meta["hparams"]["llama.vocab_size"] = 64


def bpe_without_merges(meta, entries):
    del meta["tokenizer"]["tokenizer.ggml.merges"]


BREAKS = {  # name → (edits, the messages every one of which must appear)
    "drop-tensor": ([drop_tensor], [r"blk\.0\.ffn_up\.weight is missing"]),
    "drop-entry": ([drop_entry], [r"archive entry blk\.0\.attn_q\.weight:m:x8 is missing"]),
    "wrong-shape": ([wrong_shape], [r"output_norm\.weight has shape \[16\]; the hyperparameters give \[32\]"]),
    "wrong-plane-size": ([wrong_plane_size], [r"token_embd\.weight:qs:x8 is int8 \[32, 1, 16\]; its layout needs int8 \[32, 1, 32\]",
                                              r"token_embd\.weight:qs:x8 holds 512 bytes; .* needs 1024"]),
    "wrong-plane-list": ([wrong_plane_list], [r"blk\.0\.attn_v\.weight: Q4_0 has planes \['d', 'qs'\]"]),
    "missing-key": ([missing_key], [r"missing the required key llama\.feed_forward_length"]),
    "incoherent-hparams": ([incoherent_hparams], [r"head_count \(2\) is not a multiple of .*head_count_kv \(3\)",
                                                  r"rope\.dimension_count \(33\) must be even"]),
    "negative-layers": ([negative_layers], [r"llama\.block_count is -1; it must be a positive integer"]),
    "block-past-count": ([extra_block], [r"blk\.7\.attn_norm\.weight belongs to block 7, but llama\.block_count is 1"]),
    "vocab-mismatch": ([vocab_mismatch], [r"llama\.vocab_size is 64 but token_embd\.weight has 32 rows"]),
    "unbuildable-tokenizer": ([bpe_without_merges], [r"the tokenizer cannot be built: .*no tokenizer\.ggml\.merges"]),
    "all-at-once": ([drop_tensor, drop_entry, wrong_shape, wrong_plane_size, wrong_plane_list],
                    [r"ffn_up\.weight is missing", r"attn_q\.weight:m:x8 is missing", r"output_norm\.weight has shape",
                     r"token_embd\.weight:qs:x8 is int8", r"attn_v\.weight: Q4_0 has planes"]),
}


@pytest.mark.parametrize("case", BREAKS, ids=BREAKS)
def test_broken_archive_reports_every_problem(good, tmp_path, capsys, case):
    edits, messages = BREAKS[case]
    meta, entries = _read(good)
    for edit in edits:
        edit(meta, entries)
    bad = _write(tmp_path / f"{case}.irpa", meta, entries)
    assert check.main(["--irpa-file", str(bad)]) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if ": problem: " in line]
    for message in messages:
        assert any(__import__("re").search(message, p) for p in problems), (message, out)
    assert len(problems) >= len(messages)


def test_good_archive_rewritten_unchanged_passes(good, tmp_path, capsys):
    """The rewrite used by the broken cases changes nothing by itself."""
    meta, entries = _read(good)
    assert check.main(["--irpa-file", str(_write(tmp_path / "same.irpa", meta, entries))]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")


@pytest.mark.parametrize("variant", ["gqa-untied", "mha-tied", "mha-bias"])
def test_tiny_imports_pass(irpa_of, variant, capsys):
    assert check.main(["--irpa-file", str(irpa_of(variant)), "--values"]) == 0, capsys.readouterr().out


def test_hf_import_passes(tiny, tmp_path, capsys):
    from sharkport.archive import import_hf

    irpa = tmp_path / "hf.irpa"
    import_hf(tiny["mha-bias"].hf_dir, irpa, dtype=torch.bfloat16, progress=False)
    assert check.main(["--irpa-file", str(irpa), "--values"]) == 0, capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_import_passes(smollm2_irpa, capsys):
    assert check.main(["--irpa-file", str(smollm2_irpa), "--values"]) == 0, capsys.readouterr().out


def test_shape_table_covers_every_llama_name():
    assert set(LLAMA_SHAPES) == set(LLAMA_NAMES.values())


def test_unreadable_archive_exits_2(tmp_path, capsys):
    bad = tmp_path / "x.irpa"
    bad.write_bytes(b"\0" * 64)
    assert check.main(["--irpa-file", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}: not a readable parameter archive")


def _poison(path, tensor, byte_offset, raw: bytes):
    """Overwrites bytes inside one tensor's data, located with gguf.GGUFReader."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor)
    data = bytearray(path.read_bytes())
    at = int(t.data_offset) + byte_offset
    data[at:at + len(raw)] = raw
    path.write_bytes(data)
    return t


def test_dump_gguf_check_finds_nan_and_inf(tmp_path, capsys):
    path = write_seed(tmp_path / "nan.gguf")
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_1][1]
    _poison(path, "blk.0.attn_q.weight", 3 * block + 2, np.float16(np.nan).tobytes())  # m of block 3
    _poison(path, "output_norm.weight", 4 * 5, np.float32(np.inf).tobytes())
    _poison(path, "token_embd.weight", 0, np.float16(-np.inf).tobytes())  # d of block 0
    # gguf's own dequantization agrees that these three tensors (and no others) hold non-finite values.
    reader = gguf.GGUFReader(path)
    poisoned = {t.name for t in reader.tensors
                if not np.isfinite(quants.dequantize(t.data, t.tensor_type)).all()}
    assert poisoned == {"blk.0.attn_q.weight", "output_norm.weight", "token_embd.weight"}

    irpa = tmp_path / "nan.irpa"
    assert dump_gguf.main(["--gguf-file", str(path), "--check", "--quiet", "--output-irpa", str(irpa)]) == 1
    out = capsys.readouterr().out
    assert "blk.0.attn_q.weight:m holds 1 NaN/inf values" in out
    assert "output_norm.weight holds 1 NaN/inf values" in out
    assert "token_embd.weight:d holds 1 NaN/inf values" in out
    assert out.count(": problem: ") == 3
    assert not irpa.exists()  # a failed check writes nothing

    # tools.check finds the same in the GGUF and, with --values, in an archive made without --check.
    assert check.main(["--gguf-file", str(path), "--values"]) == 1
    assert capsys.readouterr().out.count(": problem: ") == 3
    import_gguf(path, irpa, progress=False)
    assert check.main(["--irpa-file", str(irpa)]) == 0
    capsys.readouterr()
    assert check.main(["--irpa-file", str(irpa), "--values"]) == 1
    assert capsys.readouterr().out.count("NaN/inf") == 3


def test_dump_gguf_check_passes_a_good_file(tmp_path, capsys):
    path = write_seed(tmp_path / "good.gguf")
    assert dump_gguf.main(["--gguf-file", str(path), "--check", "--quiet"]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")
