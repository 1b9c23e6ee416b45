"""Service configs and modules a stranger hands over (docs/reliability.md): every damaged or
mismatched one is one line naming the file and the field before anything is sized from it. The
module is the authority: its functions and the ABI facts it carries in their reflection
(read back by IREE's runtime) decide, and a config that disagrees is refused naming both values.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest

from sharkport.errors import SharkportError
from sharkport.runtime.session import IreeSession
from sharkport.tools import check


@pytest.fixture(scope="module")
def module(compiled_of):
    return compiled_of("gqa-untied")  # block_seq_stride 16, max_seq_len 256, vocab 256


def _edited(config, tmp_path, edit) -> object:
    d = json.loads(config.read_text())
    edit(d)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    return path


def _kv(**fields):
    return lambda d: d["paged_kv_cache"].update(fields)


def _top(**fields):
    return lambda d: d.update(fields)


def _stride_32(d):  # stride and page size edited together: consistent, but not the module's
    kv = d["paged_kv_cache"]
    kv["block_seq_stride"] = 32
    kv["paged_kv_block_size_elements_per_device"] = [kv["paged_kv_block_size_elements_per_device"][0] * 2]


@pytest.mark.parametrize("edit, words", [
    pytest.param(_kv(block_seq_stride=32), ["paged_kv_block_size_elements_per_device", "make"], id="stride-alone"),
    pytest.param(_stride_32, ["block_seq_stride is 32", "exported with 16"], id="stride-and-page"),
    pytest.param(_top(max_seq_len=10**6), ["max_seq_len is 1000000", "exported with 256"], id="max-seq-len-1e6"),
    pytest.param(_top(max_seq_len=10**12), ["max_seq_len is 1000000000000", "whole number"], id="max-seq-len-1e12"),
    pytest.param(_top(max_seq_len="256"), ["max_seq_len is '256'"], id="string"),
    pytest.param(_top(transformer_block_count=True), ["transformer_block_count is True"], id="bool"),
    pytest.param(_top(prefill_batch_sizes=[8]), ["prefill batch size 8 is not in", "prefill_bs1, prefill_bs4"],
                 id="batch-not-exported"),
    pytest.param(_top(decode_batch_sizes=[]), ["decode_batch_sizes is []"], id="no-batches"),
    pytest.param(_top(decode_batch_sizes=[10**9]), ["decode_batch_sizes is 1000000000"], id="huge-batch"),
    pytest.param(_kv(kv_cache_dtype="int8"), ["kv_cache_dtype is 'int8'"], id="cache-dtype"),
    pytest.param(lambda d: d["paged_kv_cache"].update(
        kv_cache_dtype={"float32": "float16", "float16": "float32"}[d["paged_kv_cache"]["kv_cache_dtype"]]),
        ["kv_cache_dtype is", "but", "exported with"], id="cache-dtype-other"),
    pytest.param(_kv(paged_kv_block_size_elements_per_device=[4096, 8192]), ["all equal"], id="pages-unequal"),
    pytest.param(_top(vocab_size=1_000_000), ["vocab_size is 1000000", "exported with 256"], id="vocab"),
    pytest.param(_top(module_abi_version=7), ["module_abi_version is 7"], id="abi-version"),
    pytest.param(lambda d: d.pop("paged_kv_cache"), ["not a service config"], id="no-cache"),
])
def test_config_disagreeing_or_damaged_is_refused(module, tmp_path, edit, words):
    vmfb, irpa, config = module
    path = _edited(config, tmp_path, edit)
    with pytest.raises(SharkportError) as e:
        IreeSession(vmfb, irpa, path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    for w in words:
        assert w in message


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[]", b"null", b"[" * 100000])
def test_config_that_is_no_json_object_is_refused(module, tmp_path, content):
    vmfb, irpa, _ = module
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(SharkportError, match="bad.json: not a service config"):
        IreeSession(vmfb, irpa, path)


def _member_range(vmfb, suffix: str) -> tuple[int, int]:
    """(start, end) of the bytes of the module's ZIP member whose name ends with `suffix`."""
    with zipfile.ZipFile(vmfb) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
        with z.open(info) as f:
            f.read(1)
            start = f._fileobj.tell() - 1  # where the member's data begins in the file
    return start, start + info.file_size


def _damaged(vmfb, damage: str) -> bytes:
    data = bytearray(vmfb.read_bytes())
    if damage in ("executable", "flatbuffer"):
        start, end = _member_range(vmfb, ".so" if damage == "executable" else "module.fb")
        at = (start + end) // 2
        data[at:at + 16] = bytes(b ^ 0x5A for b in data[at:at + 16])
        return bytes(data)
    return {"truncated": bytes(data[: len(data) // 3]), "garbage": bytes(range(256)) * 64, "empty": b""}[damage]


@pytest.mark.parametrize("damage, words", [
    ("truncated", "damaged"), ("garbage", "not a compiled IREE module"), ("empty", "not a compiled IREE module"),
    ("executable", "embedded_elf_x86_64.so is damaged (CRC-32 mismatch)"),
    ("flatbuffer", "module.fb is damaged (CRC-32 mismatch)"),
])
def test_damaged_module_is_refused_before_iree_reads_it(module, tmp_path, damage, words):
    """Flipped bytes in the embedded executable used to reach IREE, which maps and runs it as it
    is; every member of the module's ZIP carries a CRC-32, checked first."""
    vmfb, irpa, config = module
    bad = tmp_path / "bad.vmfb"
    bad.write_bytes(_damaged(vmfb, damage))
    with pytest.raises(SharkportError) as e:
        IreeSession(bad, irpa, config)
    assert f"{bad}: " in str(e.value) and words in str(e.value) and "compile it again" in str(e.value)


def test_check_vmfb_reports_the_module_and_its_config(module, tmp_path, capsys):
    """`check --vmfb` reads the module in a child process: its functions, its facts, and a config
    that disagrees with it; a damaged module is one line, exit 2."""
    vmfb, _, config = module
    assert check.main(["--vmfb", str(vmfb), "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "functions: decode_bs1, decode_bs4, prefill_bs1, prefill_bs4" in out and f"{vmfb}: OK" in out
    assert check.main(["--vmfb", str(vmfb), "--config", str(_edited(config, tmp_path, _stride_32))]) == 1
    assert "problem: " in capsys.readouterr().out
    bad = tmp_path / "bad.vmfb"
    bad.write_bytes(_damaged(vmfb, "executable"))
    proc = subprocess.run([sys.executable, "-m", "sharkport.tools.check", "--vmfb", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "CRC-32 mismatch" in proc.stderr


def test_config_for_another_device_count_is_refused_by_the_signature(module, tmp_path):
    """A config for two devices (consistent in itself) against a one-device module: the functions'
    calling convention has one cache argument, not two."""
    vmfb, irpa, config = module

    def two_devices(d):  # the model's one kv head claimed as two, split one per device
        kv = d["paged_kv_cache"]
        kv["paged_kv_block_size_elements_per_device"] *= 2
        kv["attention_head_count_kv"] = 2
        d["tensor_parallelism_size"] = 2

    with pytest.raises(SharkportError, match="takes 4 arguments and gives 1 results; sharkport's ABI"):
        IreeSession(vmfb, irpa, _edited(config, tmp_path, two_devices))


def test_module_carries_its_facts(module):
    """What the runner trusts: IREE's runtime reads the facts back from the functions' reflection."""
    import iree.runtime as rt

    vmfb, _, config = module
    instance = rt.VmInstance()  # each outlives what it made: IREE's objects do not keep their makers
    module = rt.VmModule.mmap(instance, str(vmfb))
    fn = module.lookup_function("decode_bs4")
    facts = json.loads(fn.reflection["sharkport.abi"])
    kv = json.loads(config.read_text())["paged_kv_cache"]
    assert facts == {"max_seq_len": 256, "block_seq_stride": 16, "kv_cache_dtype": kv["kv_cache_dtype"],
                     "vocab_size": 256, "tensor_parallelism_size": 1,
                     "page_elems": kv["paged_kv_block_size_elements_per_device"][0]}


def test_run_cli_refuses_a_mismatched_config_in_one_line(module, tmp_path):
    vmfb, irpa, config = module
    path = _edited(config, tmp_path, _stride_32)
    proc = subprocess.run([sys.executable, "-m", "sharkport.run", "--vmfb", str(vmfb), "--irpa-file", str(irpa),
                           "--config", str(path), "--prompt", "hi"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "block_seq_stride is 32" in proc.stderr
