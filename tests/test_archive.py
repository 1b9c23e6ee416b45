"""GGUF → .irpa import: every value survives bit-exactly (checked with gguf.quants), quantized
tensors stay packed, turbine reads the entries, and bad input leaves nothing behind."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from iree.turbine.aot import ParameterArchive

from sharkport.archive import Dataset, QuantizedTensor, import_gguf
from sharkport.archive.irpa import METADATA_KEY
from sharkport.formats.irpa import metadata_blobs
from sharkport.errors import SharkportError

from gguf_fixtures import random_blocks, random_tensor, write_gguf

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
SHAPE = (16, 256)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {f"t.{t.lower()}": (t, SHAPE, random_tensor(t, SHAPE, rng)) for t in TYPES}
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    meta = {"llama.block_count": 1, "tokenizer.ggml.model": "gpt2"}
    return write_gguf(path, tensors, meta)


def _expected(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return quants.dequantize(t.data, t.tensor_type).reshape(SHAPE).astype(np.float32)


def _values(w):
    return (w.dequant() if isinstance(w, QuantizedTensor) else w.to(torch.float32)).numpy()


@pytest.fixture(scope="module")
def imported(mixed_gguf):
    irpa = mixed_gguf.with_suffix(".irpa")
    import_gguf(mixed_gguf, irpa, progress=False)
    return irpa


@pytest.mark.parametrize("type_name", TYPES, ids=TYPES)
def test_values_survive_import(mixed_gguf, imported, type_name):
    reader = gguf.GGUFReader(mixed_gguf)
    name = f"t.{type_name.lower()}"
    expected = _expected(reader, name)
    for source in (imported, mixed_gguf):  # the archive, and the in-memory GGUF path
        w = Dataset.load(source).theta[name]
        assert isinstance(w, QuantizedTensor) == (type_name not in ("F32", "F16", "BF16"))
        np.testing.assert_array_equal(_values(w).view(np.uint32), expected.view(np.uint32))
        if isinstance(w, QuantizedTensor):  # rows gathered as an embedding gathers them, rows interleaved or not
            ids = torch.tensor([[13, 0, 7], [8, 15, 13]])
            np.testing.assert_array_equal(w.rows(ids).numpy().view(np.uint32), expected[ids.numpy()].view(np.uint32))


def test_archive_layout(imported):
    entries = dict(ParameterArchive(imported).items())
    # Quantized tensors are stored as their planes, readable with turbine's own API; their matrices
    # with their rows interleaved eight at a time, under keys of their own.
    assert "t.q4_1" not in entries and "t.q4_1:qs" not in entries
    assert entries["t.q4_1:qs:x8"].as_tensor().shape == (16, 8, 16)
    assert entries["t.q6_k:scales:x8"].as_tensor().dtype == torch.int8
    assert entries["t.q4_1:d:x8"].as_tensor().dtype == torch.float16
    assert entries["t.f16"].as_tensor().dtype == torch.float16
    meta = json.loads(bytes(np.asarray(entries[METADATA_KEY].raw.file_view)))
    assert meta["hparams"]["llama.block_count"] == 1
    assert meta["tokenizer"]["tokenizer.ggml.model"] == "gpt2"
    assert meta["rope_layout"] == "interleaved"
    assert meta["tensors"]["t.q6_k"] == {"type": "Q6_K", "shape": list(SHAPE),
                                         "planes": ["ql", "qh", "scales", "d"], "interleaved_rows": 8}
    assert meta["tensors"]["t.q3_k"] == {"type": "Q3_K", "shape": list(SHAPE),
                                         "planes": ["hmask", "qs", "scales", "d"], "interleaved_rows": 8}
    assert meta["tensors"]["t.q5_1"] == {"type": "Q5_1", "shape": list(SHAPE), "planes": ["d", "m", "qh", "qs"],
                                         "interleaved_rows": 8}


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_rows_are_interleaved_eight_at_a_time(mixed_gguf, imported, type_name):
    """Per group of eight rows and block b, the archive's qs holds 4 bytes of each row's block at
    a time (chunk j of row r at byte 4 (8 j + r) of the group's block), then the eight rows'
    scales (and fifth bits) of block b side by side: byte for byte what the GGUF holds, but for
    the fifth bits' places in a row's 32 (value 16 h + 4 j + t's at bit 8 t + 2 j + h)."""
    name = f"t.{type_name.lower()}"
    raw = next(t for t in gguf.GGUFReader(mixed_gguf).tensors if t.name == name).data  # [rows, bytes]
    block = raw.reshape(SHAPE[0], SHAPE[1] // 32, -1)  # [rows, blocks, block bytes]
    entries = dict(ParameterArchive(imported).items())
    plane = lambda p: np.asarray(entries[f"{name}:{p}:x8" + "p" * (p == "qh")].raw.file_view).reshape(-1)  # noqa: E731
    qs_at = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[type_name]  # qs's offset in the block struct
    size = block.shape[2] - qs_at
    row, b, j = 13, 2, 3  # row 13 is lane 5 of the second group
    group = plane("qs")[8 * size * block.shape[1]:]  # the second group's bytes
    start = b * 8 * size + 4 * (8 * j + 5)
    np.testing.assert_array_equal(group[start:start + 4], block[row, b, qs_at + 4 * j:qs_at + 4 * j + 4])
    d = plane("d").view(np.uint8).reshape(2, block.shape[1], 8, 2)  # [groups, blocks, lanes, f16 bytes]
    np.testing.assert_array_equal(d[1, b, 5], block[row, b, :2])
    if type_name == "Q5_0":
        placed = int.from_bytes(plane("qh").reshape(2, block.shape[1], 8, 4)[1, b, 5].tobytes(), "little")
        stored = int.from_bytes(block[row, b, 2:6].tobytes(), "little")
        assert [placed >> (8 * t + 2 * j + h) & 1 for h in range(2) for j in range(4) for t in range(4)] == \
            [stored >> v & 1 for v in range(32)]


def test_an_archive_of_fifth_bits_in_value_order_is_refused(imported, tmp_path):
    """An archive whose interleaved Q5 fifth bits are in value order (`:qh:x8`, as older sharkport
    wrote them) is refused in one line saying to re-import, not read as the placed ones."""
    import iree.runtime as rt

    from sharkport.archive import read_archive

    index, old = rt.ParameterIndex(), rt.ParameterIndex()
    index.load(str(imported))
    for key, entry in index.items():
        old.add_buffer(key.removesuffix(":x8p") + ":x8" if key.endswith(":x8p") else key,
                       bytes(np.asarray(entry.file_view)), metadata=entry.metadata.decode() or None)
    old.create_archive_file(str(tmp_path / "old.irpa"))
    with pytest.raises(SharkportError, match=r"old\.irpa: holds t\.q5_[01]:qh:x8, Q5 fifth bits .*; re-import"):
        read_archive(tmp_path / "old.irpa")


def test_unsupported_type_names_tensor_and_writes_nothing(tmp_path):
    rng = np.random.default_rng(0)
    shape = (2, 256)
    path = write_gguf(tmp_path / "iq.gguf", {"blk.0.ffn_up.weight": ("IQ2_XXS", shape, random_blocks("IQ2_XXS", shape, rng))})
    with pytest.raises(SharkportError, match=r"blk\.0\.ffn_up\.weight.*IQ2_XXS"):
        import_gguf(path, tmp_path / "out.irpa", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iq.gguf"]


def test_truncated_gguf_is_an_error(mixed_gguf, tmp_path):
    data = mixed_gguf.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 7):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(SharkportError, match=f"cut{cut}.gguf"):
            import_gguf(bad, tmp_path / "out.irpa", progress=False)
    assert not (tmp_path / "out.irpa").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.irpa")]


def test_refuses_to_overwrite_its_input(mixed_gguf, tmp_path):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(mixed_gguf.read_bytes())
    with pytest.raises(SharkportError, match="overwrite"):
        import_gguf(copy, copy, progress=False)
    assert copy.read_bytes() == mixed_gguf.read_bytes()


def test_not_an_archive(tmp_path):
    bad = tmp_path / "x.irpa"
    bad.write_bytes(b"\0" * 100)
    with pytest.raises(SharkportError, match="x.irpa"):
        Dataset.load(bad)


def test_sigkill_mid_write_leaves_the_old_archive(tmp_path):
    """A kill while the archive is being written (seen as its hidden temporary file growing)
    leaves the previous archive byte for byte; the new one only ever appears whole."""
    import signal
    import subprocess
    import sys
    import time

    big = np.zeros((4096, 4096), np.float32)  # 64 MiB per tensor
    write_gguf(tmp_path / "big.gguf", {f"t{i}": ("F32", big.shape, big) for i in range(4)})
    target = tmp_path / "out.irpa"
    target.write_bytes(b"the previous archive")
    code = ("from sharkport.archive import import_gguf; import sys; "
            "import_gguf(sys.argv[1], sys.argv[2], progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "big.gguf"), str(target)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        partial = [p for p in tmp_path.glob(".out.irpa.*") if p.stat().st_size > 0]
        if partial:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the import finished before it could be killed"
    assert target.read_bytes() == b"the previous archive"
    # the killed writer's temporary stays until the next write of the same file removes it
    assert list(tmp_path.glob(".out.irpa.*"))
    import_gguf(tmp_path / "big.gguf", target, progress=False)
    assert not list(tmp_path.glob(".out.irpa.*")) and target.stat().st_size > 4 * big.nbytes


def test_a_live_writers_temporary_is_kept(tmp_path):
    from sharkport.fileio import atomic_output, remove_stale_temporaries

    target = tmp_path / "x.bin"
    with atomic_output(target) as tmp:
        tmp.write_bytes(b"half")
        assert remove_stale_temporaries(target) == [] and tmp.exists()  # this process is alive
    assert target.read_bytes() == b"half"


def _iree_archive(gguf_path, irpa, metadata):
    """The archive IREE's own builder writes for a GGUF: plain tensors as file ranges of the GGUF,
    quantized ones split into planes with numpy structured views (gguf.GGUFReader's data), whole
    matrices' rows interleaved at once (test_rows_are_interleaved_eight_at_a_time pins how)."""
    import iree.runtime as rt

    from sharkport.archive.irpa import entry_metadata
    from sharkport.quant import BLOCK_TYPES, interleave_planes, interleaves, plane_key

    reader = gguf.GGUFReader(gguf_path)
    index, keys = rt.ParameterIndex(), []
    with open(gguf_path, "rb") as f:
        handle = rt.FileHandle.wrap_fd(f.fileno())
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            name = t.tensor_type.name
            if name in ("F32", "F16", "BF16"):
                dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
                keys.append(t.name)
                index.add_from_file_handle(t.name, handle, int(t.n_bytes), int(t.data_offset),
                                           metadata=entry_metadata(dtype, shape))
                continue
            blocks = np.asarray(t.data).reshape(-1).view(BLOCK_TYPES[name].struct)
            planes = {field: np.ascontiguousarray(blocks[field]).reshape(*shape[:-1], -1, *([count] if count > 1 else []))
                      for field, _, count in BLOCK_TYPES[name].fields}
            x8 = interleaves(name, shape)
            for field, plane in (interleave_planes(name, planes) if x8 else planes).items():
                keys.append(plane_key(t.name, field, x8, name))
                index.add_buffer(keys[-1], plane.tobytes(),
                                 metadata=entry_metadata(torch.from_numpy(plane).dtype, plane.shape))
        for key, blob in metadata_blobs(metadata, keys):
            index.add_buffer(key, blob)
        index.create_archive_file(str(irpa))


def test_archive_bytes_match_irees_builder(mixed_gguf, tmp_path, monkeypatch):
    """import_gguf lays the archive out itself (kernel copies, planes split a chunk at a time):
    the file is byte for byte the one IREE's archive builder writes from the same entries. The
    plane chunk is cut to 3 blocks so every quantized tensor is split over many chunks."""
    import sharkport.formats.irpa as irpa

    monkeypatch.setattr(irpa, "PLANE_CHUNK_BYTES", 3 * 34)
    metadata = import_gguf(mixed_gguf, tmp_path / "ours.irpa", progress=False)
    _iree_archive(mixed_gguf, tmp_path / "iree.irpa", metadata)
    assert (tmp_path / "ours.irpa").read_bytes() == (tmp_path / "iree.irpa").read_bytes()


def test_write_archive_bytes_match_irees_builder(tmp_path):
    """write_archive (arrays spooled, then copied into place), with odd lengths and an entry of
    zero bytes, against IREE's builder."""
    import iree.runtime as rt

    from sharkport.archive.irpa import Entry, entry_metadata, write_archive

    rng = np.random.default_rng(1)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float32), "empty": np.zeros((0, 4), np.float16),
              "b.odd": rng.integers(0, 255, (7, 13), dtype=np.uint8), "c": rng.integers(-9, 9, (129,), dtype=np.int8)}
    entries = [Entry(k, torch.from_numpy(a).dtype, a.shape, data=a) for k, a in arrays.items()]
    metadata = {"hparams": {"x": 1}, "tensors": {}}
    write_archive(tmp_path / "ours.irpa", entries, metadata)
    index = rt.ParameterIndex()
    for e in entries:
        index.add_buffer(e.key, e.data.tobytes(), metadata=entry_metadata(e.dtype, e.shape))
    for key, blob in metadata_blobs(metadata, list(arrays)):
        index.add_buffer(key, blob)
    index.create_archive_file(str(tmp_path / "iree.irpa"))
    assert (tmp_path / "ours.irpa").read_bytes() == (tmp_path / "iree.irpa").read_bytes()


@pytest.mark.parametrize("copier", ["_copy_file_range", "_sendfile", "_pread_pwrite"])
def test_copy_range_each_way(tmp_path, copier):
    """Each way of copying a file range (and so each fallback) copies the right bytes between
    unaligned offsets; a source that ends early is a one-line error naming it."""
    import sharkport.formats.irpa as irpa

    src, dst = tmp_path / "src", tmp_path / "dst"
    data = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    src.write_bytes(data)
    dst.write_bytes(b"\xff" * 100)
    way = (getattr(irpa, copier),)
    with open(src, "rb") as s, open(dst, "r+b") as d, open(tmp_path / "other", "wb") as other:
        irpa.copy_range(s.fileno(), 1001, d.fileno(), 7, len(data) - 2000, "src", copiers=way)
        with pytest.raises(SharkportError, match="src: the file ended 1000 bytes early"):
            irpa.copy_range(s.fileno(), 1000, other.fileno(), 0, len(data), "src", copiers=way)
    assert dst.read_bytes()[:7 + len(data) - 2000] == b"\xff" * 7 + data[1001:-999]


def test_tensor_metadata_matches_torch():
    """The torch-free tensor descriptions carry torch's own dtype attributes."""
    from sharkport.formats.irpa import DTYPES, tensor_metadata

    for name in DTYPES:
        dtype = getattr(torch, name)
        desc = json.loads(tensor_metadata(name, (2, 3)).removeprefix("PYTORCH:"))
        assert desc["dtype_desc"] == {"class_name": type(dtype).__name__, "is_complex": dtype.is_complex,
                                      "is_floating_point": dtype.is_floating_point, "is_signed": dtype.is_signed,
                                      "itemsize": dtype.itemsize}


def test_dump_gguf_save_loads_neither_torch_nor_iree(mixed_gguf, tmp_path):
    """`dump_gguf --output-irpa` imports without torch or IREE (about a second of start-up between
    them), and turbine reads what it wrote."""
    import subprocess
    import sys

    code = ("import sys; from sharkport.tools.dump_gguf import main; "
            "assert main(['--gguf-file', sys.argv[1], '--output-irpa', sys.argv[2], '--quiet']) == 0; "
            "print(sorted(m for m in ('torch', 'iree.runtime', 'iree.turbine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(mixed_gguf), str(tmp_path / "x.irpa")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert entries_shape(tmp_path / "x.irpa", "t.q8_0:qs:x8") == (16, 8, 32)


def entries_shape(irpa, key):
    return tuple(dict(ParameterArchive(irpa).items())[key].as_tensor().shape)


def test_atomic_output_over_an_existing_file(tmp_path):
    """Publishing over an existing file swaps the names (RENAME_EXCHANGE) and deletes the old
    one: the new bytes are in place, nothing else is left, hard links to the old file keep the
    old bytes (it was replaced, not rewritten), and a directory in the way is still an error."""
    from sharkport.fileio import atomic_output

    target = tmp_path / "x.irpa"
    target.write_bytes(b"old")
    (tmp_path / "link").hardlink_to(target)
    with atomic_output(target, swap=True) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and (tmp_path / "link").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "x.irpa"]
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        with atomic_output(tmp_path / "d", swap=True) as tmp:
            tmp.write_bytes(b"new")
    assert (tmp_path / "d").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["d", "link", "x.irpa"]
