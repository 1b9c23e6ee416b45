"""Hostile safetensors input: a checkpoint folder whose model.safetensors is damaged (header
length, header JSON, tensor offsets, truncation) fails with one SharkportError naming the file,
and the import writes nothing."""

import json
import shutil
import struct

import pytest

from sharkport.archive import Dataset, import_hf
from sharkport.errors import SharkportError
from sharkport.formats.hf import read_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

U64_MAX = 2**64 - 1


def _split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _edit_header(edit):
    def mutate(data: bytes) -> bytes:
        header, body = _split(data)
        edit(header)
        return _join(header, body)
    return mutate


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


def _last_tensor(header: dict) -> dict:
    return max((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1])


def _set(field, value, which=_first_tensor):
    def edit(header):
        which(header)[field] = value
    return edit


def _overlap(header):
    tensors = sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
    tensors[1]["data_offsets"] = list(tensors[0]["data_offsets"])


CASES = {
    "empty-file": lambda d: b"",
    "header-length-cut": lambda d: d[:5],
    "header-length-absurd": lambda d: struct.pack("<Q", 2**60) + d[8:],
    "header-length-u64-max": lambda d: struct.pack("<Q", U64_MAX) + d[8:],
    "header-length-zero": lambda d: struct.pack("<Q", 0) + d[8:],
    "header-cut": lambda d: d[:40],
    "header-json-garbage": lambda d: d[:8] + b"x" + d[9:],
    "header-not-an-object": lambda d: _join([1, 2, 3], _split(d)[1]),
    "truncated-data": lambda d: d[:-100],
    "extra-trailing-bytes": lambda d: d + b"\0" * 64,
    "offsets-past-end": _edit_header(_set("data_offsets", [0, 2**40], _last_tensor)),
    "offsets-u64-max": _edit_header(_set("data_offsets", [U64_MAX - 8, U64_MAX], _last_tensor)),
    "offsets-reversed": _edit_header(lambda h: _first_tensor(h).update(data_offsets=_first_tensor(h)["data_offsets"][::-1])),
    "offsets-overlap": _edit_header(_overlap),
    "shape-disagrees-with-bytes": _edit_header(_set("shape", [3, 5])),
    "shape-absurd": _edit_header(_set("shape", [2**40, 2**40])),
    "unknown-dtype": _edit_header(_set("dtype", "F128")),
}


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return tiny["gqa-untied"].hf_dir


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_damaged_safetensors_is_one_clear_error(checkpoint, tmp_path, case):
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(CASES[case](weights.read_bytes()))
    out = tmp_path / "out.irpa"
    with pytest.raises(SharkportError, match="model.safetensors") as info:
        import_hf(folder, out, progress=False)
    assert "\n" not in str(info.value)
    assert not [p for p in tmp_path.iterdir() if p.name != "model"], "the failed import left a file"


def test_undamaged_copy_imports(checkpoint, tmp_path):
    """The damage above is the only difference: the same copy, untouched, imports and loads."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(_join(*_split(weights.read_bytes())))  # re-serialized header, as the cases do
    assert read_hf(folder).plan(None)
    import_hf(folder, tmp_path / "out.irpa", progress=False)
    assert "token_embd.weight" in Dataset.load(tmp_path / "out.irpa").theta
