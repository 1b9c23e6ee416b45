"""Archives whose metadata or entry descriptions are damaged: every reader (Dataset.load, the
export and the runner's session) stops with one line naming the archive, never a traceback."""

import json

import numpy as np
import pytest

from run_cli import run
from sharkport.archive import Dataset
from sharkport.archive.irpa import METADATA_KEY
from sharkport.errors import SharkportError


def _rewrite(source, target, metadata_blob=None, entry_description=None):
    """`source` copied entry by entry with IREE's own archive builder into `target`, the metadata
    entry replaced by `metadata_blob` (bytes) and/or token_embd.weight's description by
    `entry_description` (str)."""
    import iree.runtime as rt
    from iree.turbine.aot import ParameterArchive

    index = rt.ParameterIndex()
    for key, entry in ParameterArchive(source).items():
        data = bytes(np.asarray(entry.raw.file_view))
        if key == METADATA_KEY and metadata_blob is not None:
            data = metadata_blob
        description = entry.raw.metadata.decode()
        if key == "token_embd.weight" and entry_description is not None:
            description = entry_description
        index.add_buffer(key, data, metadata=description or None)
    index.create_archive_file(str(target))
    return target


def _metadata(irpa):
    from iree.turbine.aot import ParameterArchive

    entries = dict(ParameterArchive(irpa).items())
    return json.loads(bytes(np.asarray(entries[METADATA_KEY].raw.file_view)))


def _cases(meta):
    def edited(**changes):
        m = json.loads(json.dumps(meta))
        for path, value in changes.items():
            *parents, leaf = path.split("/")
            target = m
            for p in parents:
                target = target[p]
            if value is None:
                del target[leaf]
            else:
                target[leaf] = value
        return json.dumps(m).encode()

    return {
        "not-json": (b"{not json", None, "is not JSON"),
        "not-utf8": (b"\xff\xfe\x00", None, "is not JSON"),
        "a-list": (b"[1, 2]", None, "is not a JSON object"),
        "no-tensors": (edited(tensors=None), None, "has no tensors object"),
        "bad-type": (edited(**{"tensors/token_embd.weight/type": "Q9_9"}), None, "no known type"),
        "bad-shape": (edited(**{"tensors/token_embd.weight/shape": [-1, "x"]}), None, "not a list of whole numbers"),
        "bad-rope": (edited(rope_layout="sideways"), None, "unknown rope_layout"),
        "entry-dtype": (None, 'PYTORCH:{"dtype": "complex64", "shape": [1]}', "no valid tensor description"),
        "entry-shape": (None, 'PYTORCH:{"dtype": "float32", "shape": [3, 3]}', "no valid tensor description"),
        "entry-not-json": (None, "PYTORCH:{", "no valid tensor description"),
    }


CASES = ["not-json", "not-utf8", "a-list", "no-tensors", "bad-type", "bad-shape", "bad-rope", "entry-dtype",
         "entry-shape", "entry-not-json"]


@pytest.mark.parametrize("case", CASES)
def test_damaged_archive_is_one_clear_error(irpa_of, tmp_path, case):
    source = irpa_of("gqa-untied")
    blob, description, message = _cases(_metadata(source))[case]
    bad = _rewrite(source, tmp_path / "bad.irpa", blob, description)
    with pytest.raises(SharkportError, match=message) as e:
        Dataset.load(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["not-json", "bad-shape", "entry-dtype"])
def test_export_of_damaged_archive_is_one_line(irpa_of, tmp_path, case):
    source = irpa_of("gqa-untied")
    blob, description, message = _cases(_metadata(source))[case]
    bad = _rewrite(source, tmp_path / "bad.irpa", blob, description)
    proc = run("sharkport.export", "--irpa-file", str(bad), "--output-mlir", str(tmp_path / "x.mlir"),
               "--output-config", str(tmp_path / "x.json"), check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "x.mlir").exists()


@pytest.mark.parametrize("count", [10**12, 1, 0], ids=["huge", "fewer", "zero"])
def test_block_count_must_be_the_blocks_present(irpa_of, tmp_path, count):
    """A block count the tensors do not back (the tiny model has 2 blocks) is refused before a
    model is built from it, and `check` reports it in one problem line, at once."""
    import time

    from sharkport.models import build_model

    source = irpa_of("gqa-untied")
    meta = _metadata(source)
    meta["hparams"]["llama.block_count"] = count
    bad = _rewrite(source, tmp_path / "bad.irpa", json.dumps(meta).encode())
    with pytest.raises(SharkportError, match=f"block_count is {count}, but the tensors hold 2 blocks"):
        build_model(Dataset.load(bad))
    t0 = time.perf_counter()
    proc = run("sharkport.tools.check", "--irpa-file", str(bad), check_rc=1)
    assert time.perf_counter() - t0 < 60
    found = sum("block_count" in line for line in proc.stdout.splitlines())
    assert found == 1 if count > 2 else 1 <= found <= 20, proc.stdout  # one line, or one per extra tensor


@pytest.mark.parametrize("tokenizer", [
    {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]},
    {"tokenizer.ggml.model": "nonsense", "tokenizer.ggml.tokens": ["a"]},
    {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1]},
], ids=["no-merges", "unknown-model", "types-mismatch"])
def test_broken_tokenizer_is_an_error_not_no_tokenizer(irpa_of, tmp_path, tokenizer):
    """Tokenizer metadata the runner cannot build from: loading the model says so (naming the
    archive) instead of treating it as a model without a tokenizer."""
    from sharkport.api import _tokenizer_or_none

    source = irpa_of("gqa-untied")
    assert _tokenizer_or_none(Dataset.load(source)) is None  # none at all: prompts are token ids
    meta = _metadata(source)
    meta["tokenizer"] = tokenizer
    bad = _rewrite(source, tmp_path / "bad.irpa", json.dumps(meta).encode())
    with pytest.raises(SharkportError, match="its tokenizer metadata is broken") as e:
        _tokenizer_or_none(Dataset.load(bad))
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def _hparams(**changes):
    return lambda meta: meta["hparams"].update(changes)


@pytest.mark.parametrize("edit, message", [
    (_hparams(**{"llama.embedding_length": {"a": 1}}), "llama.embedding_length is {'a': 1}; it must be a whole number"),
    (_hparams(**{"llama.feed_forward_length": 2.5}), "llama.feed_forward_length is 2.5; it must be a whole number"),
    (_hparams(**{"llama.context_length": True}), "llama.context_length is True; it must be a whole number"),
    (_hparams(**{"llama.attention.sliding_window": 2**40}), "sizes and counts above 2147483647"),
    (_hparams(**{"llama.embedding_length": None}), "missing the required key llama.embedding_length"),
    (_hparams(**{"general.architecture": ["llama"]}), "architecture ['llama'] (general.architecture) has no recipe"),
    (_hparams(**{"llama.attention.key_length": 32, "llama.rope.dimension_count": 32}),
     "blk.0.attn_q.weight has shape [64, 64], but the llama hyperparameters give [128, 64]"),
    (_hparams(**{"llama.vocab_size": 300}), "token_embd.weight has shape [256, 64], but the llama hyperparameters "
                                            "give [300, 64]"),
    (lambda meta: meta.update(tokenizer={"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", 7]}),
     "its tokenizer metadata is broken (GGUF key tokenizer.ggml.tokens[1] holds 7, not a string"),
], ids=["size-a-dict", "size-a-fraction", "size-a-bool", "window-past-int32", "size-null", "arch-a-list",
        "head-dim-against-tensors", "vocab-against-embedding", "token-not-a-string"])
def test_metadata_that_disagrees_with_itself_or_the_tensors_is_one_line(irpa_of, tmp_path, edit, message):
    """Cases the fuzzing of archive metadata (tests/fuzz_inputs.py) found: each hyperparameter is
    typed and in range before anything is derived from it, and every tensor's shape is the one the
    hyperparameters give before a layer is built."""
    from sharkport.api import TextGenerator

    source = irpa_of("gqa-untied")
    meta = _metadata(source)
    edit(meta)
    bad = _rewrite(source, tmp_path / "bad.irpa", json.dumps(meta).encode())
    with pytest.raises(SharkportError) as e:
        TextGenerator.eager(bad)
    assert message in str(e.value) and str(bad) in str(e.value) and "\n" not in str(e.value)
