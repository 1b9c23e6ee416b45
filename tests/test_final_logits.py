"""Export with --prefill-final-logits: prefill returns only each sequence's last logits
[N, 1, V], and everything built on prefill (generation, verify) gives what the full-logits module
gives.

References: the same tiny llama compiled with full prefill logits (`compiled_of`, itself checked
against transformers in test_llama_tiny.py), through the same IREE runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sharkport.archive import Dataset
from sharkport.runtime.generate import generate
from sharkport.runtime.session import IreeSession
from test_generation import prompts_for
from test_verify import run_verify
from tiny_models import TINY_EXPORT, exact_cache

VARIANT = "gqa-untied"
PAGES = TINY_EXPORT.device_block_count

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def final_module(irpa_of, tmp_path_factory):
    """The tiny llama exported with prefill_final_logits and compiled: (vmfb, irpa, config)."""
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export

    irpa = irpa_of(VARIANT)
    out = tmp_path_factory.mktemp("final_logits")
    model_config = exact_cache(prefill_final_logits=True)
    output, service = export_model(Dataset.load(irpa), TINY_EXPORT, model_config)
    save_export(output, service, out / "model.mlir", out / "model.json")
    compile_mlir(out / "model.mlir", out / "model.vmfb")
    return out / "model.vmfb", irpa, out / "model.json"


def test_service_config_is_unchanged(final_module, compiled_of):
    """Readers tell the two kinds apart by the logits' shape, as shortfin does, so the config
    (which shortfin parses strictly) is the same as the full-logits module's."""
    assert json.loads(final_module[2].read_text()) == json.loads(compiled_of(VARIANT)[2].read_text())


def test_prefill_returns_the_last_rows_and_the_same_cache(final_module, compiled_of):
    full, final = (IreeSession(*m, pages=PAGES) for m in (compiled_of(VARIANT), final_module))
    lengths = np.array([5, 33, 17, 1], np.int64)
    tokens = np.zeros((4, 48), np.int64)
    for r, p in enumerate(prompts_for(lengths)):
        tokens[r, :len(p)] = p
    pages = np.array([(3, 9, 0), (7, 1, 4), (2, 8, 6), (5, 11, 10)], np.int64)
    want, got = full.prefill(tokens, lengths, pages), final.prefill(tokens, lengths, pages)
    assert got.shape == (4, 1, want.shape[-1])
    np.testing.assert_allclose(got[:, 0], want[np.arange(4), lengths - 1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(final.cache_to_host(), full.cache_to_host(), rtol=0, atol=1e-6)


def test_generation_equals_the_full_logits_module(final_module, compiled_of):
    prompts = prompts_for([3, 20, 9, 40, 1], seed=5)
    full, final = (generate(IreeSession(*m, pages=PAGES), prompts, 8) for m in (compiled_of(VARIANT), final_module))
    assert final == full and all(len(t) == 8 for t in final)


def test_verify_checks_every_position(final_module, tiny, capsys):
    """verify prefills one token and decodes the rest, so it still compares every position
    with the eager recipe and transformers."""
    status, rows, out = run_verify(final_module, tiny[VARIANT].hf_dir, capsys)
    assert status == 0, out
    for positions, diff, agree, verdict in rows.values():
        assert positions == 55 and diff < 1e-3 and agree == positions and verdict == "PASS"
