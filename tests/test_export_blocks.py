"""The exporter traces a llama's transformer block once per function and calls it for every layer
(sharkport/export/blocks.py). The module must compute what the unrolled trace's module computes,
and still write the KV cache in place.

References: the same tiny llama exported with `unroll_blocks` (every layer traced, the exporter's
earlier path), through the same IREE runtime. The block-once module itself is the one
test_llama_tiny.py's compiled tests check against transformers (`compiled_of` exports with the
default path), and test_kernels.py / test_quant_compiled.py check quantized ones."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from sharkport.archive import Dataset
from sharkport.export.abi import DECODE_ARGS
from sharkport.runtime.session import IreeSession
from tiny_models import TINY_EXPORT, decode_ms, exact_cache

VARIANT = "gqa-untied"
PAGES = TINY_EXPORT.device_block_count
STRIDE = TINY_EXPORT.block_seq_stride
FUNCTIONS = [f"{kind}_bs{bs}" for kind in ("prefill", "decode") for bs in (1, 4)]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def unrolled(irpa_of, tmp_path_factory):
    """The tiny llama exported with every layer traced, compiled: (vmfb, irpa, config)."""
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export

    irpa = irpa_of(VARIANT)
    out = tmp_path_factory.mktemp("unrolled")
    output, service = export_model(Dataset.load(irpa), replace(TINY_EXPORT, unroll_blocks=True),
                                   exact_cache())  # as compiled_of's
    save_export(output, service, out / "model.mlir", out / "model.json")
    compile_mlir(out / "model.mlir", out / "model.vmfb")
    return out / "model.vmfb", irpa, out / "model.json"


def test_one_block_function_per_function(compiled_of, unrolled, tiny):
    """Each exported function calls its own block function once per layer, and the module holds
    far fewer torch ops than the unrolled one."""
    text = compiled_of(VARIANT)[0].with_suffix(".mlir").read_text()
    layers = tiny[VARIANT].spec.layers
    for fn in FUNCTIONS:
        block = f"sharkport_block_{fn}_0"
        assert len(re.findall(rf"func\.func private @{block}\(", text)) == 1
        assert len(re.findall(rf"call @{block}\(", text)) == layers
    # every layer's weights are parameters of the module, as in the unrolled export
    unrolled_text = unrolled[0].with_suffix(".mlir").read_text()
    params = set(re.findall(r'#flow\.parameter\.named<"model"::"([^"]+)">', text))
    assert params == set(re.findall(r'#flow\.parameter\.named<"model"::"([^"]+)">', unrolled_text))
    assert text.count("torch.aten.") < unrolled_text.count("torch.aten.")


def _run(session: IreeSession, seed: int = 0) -> list[np.ndarray]:
    """Prefill at batch 1 and 4 (lengths in 1..3 pages), then decode steps; every call's logits
    and the cache at the end."""
    rng = np.random.default_rng(seed)
    outs = []
    for pages in ([(5, 0, 9)], [(0, 37, 5), (22, 9, 51), (14, 3, 60), (41, 28, 7)]):
        page_table = np.array(pages, np.int64)
        bs = len(pages)
        lengths = np.array([33, 3, 17, 30][:bs], np.int64)
        blocks = int(lengths.max() + STRIDE - 1) // STRIDE
        tokens = rng.integers(0, 256, (bs, blocks * STRIDE)).astype(np.int64)
        outs.append(session.prefill(tokens, lengths, page_table[:, :blocks]))
        for _ in range(4):
            blocks = int(lengths.max()) // STRIDE + 1
            outs.append(session.decode(rng.integers(0, 256, (bs, 1)).astype(np.int64), lengths + 1, lengths,
                                       page_table[:, :blocks]))
            lengths = lengths + 1
    return outs + [session.cache_to_host()]


def test_same_logits_and_cache_as_unrolled(compiled_of, unrolled):
    got = _run(IreeSession(*compiled_of(VARIANT), pages=PAGES))
    want = _run(IreeSession(*unrolled, pages=PAGES))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=f"output {i}")


def test_decode_writes_the_cache_in_place(compiled_of):
    """A decode step costs the same with 16 pages as with 65536 (268 MB of cache): a copy of the
    cache_state argument (block calls thread it through as a value) would cost tens of ms."""
    assert DECODE_ARGS[-1] == "cache_state"
    module = compiled_of(VARIANT)
    small, large = decode_ms(module, 16), decode_ms(module, 65536)
    assert large < 3 * small + 1.0, (small, large)
