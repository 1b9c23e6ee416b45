"""Archives open in SHARK's sharktank (`sharktank.types.Dataset.load`, installed beside our pins
with --no-deps as README says): its properties are the model's GGUF hyperparameters, and its
tensors are our plain tensors, value for value. Quantized tensors are ours alone (docs/archive.md)."""

import json

import numpy as np
import pytest
import torch
from sharktank.types import Dataset as SharktankDataset

from gguf_fixtures import random_blocks, write_gguf
from sharkport.archive import Dataset, import_gguf, import_hf

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # inside turbine


def _sharktank_tensors(path):
    ds = SharktankDataset.load(path, mmap=False)
    return ds.properties, {name: t.as_torch() for name, t in ds.root_theta.flatten().items()}


def test_unquantized_archive_is_a_whole_sharktank_dataset(tiny, tmp_path):
    irpa = tmp_path / "hf.irpa"
    metadata = import_hf(tiny["gqa-untied"].hf_dir, irpa, progress=False)
    properties, tensors = _sharktank_tensors(irpa)
    assert properties["SHARK_DATASET_VERSION"] == 1
    assert {k: v for k, v in properties.items() if k != "SHARK_DATASET_VERSION"} == \
        json.loads(json.dumps(metadata["hparams"]))
    ours = Dataset.load(irpa).theta
    assert set(tensors) == set(metadata["tensors"])
    for name, t in tensors.items():
        torch.testing.assert_close(t, ours[name], rtol=0, atol=0)


def test_quantized_archive_opens_with_its_plain_tensors(tmp_path):
    rng = np.random.default_rng(0)
    gguf_path = write_gguf(tmp_path / "m.gguf", {
        "token_embd.weight": ("Q8_0", (8, 64), random_blocks("Q8_0", (8, 64), rng)),
        "output_norm.weight": ("F32", (64,), rng.standard_normal(64).astype(np.float32)),
        "blk.0.attn_norm.weight": ("F16", (64,), rng.standard_normal(64).astype(np.float16)),
    }, {"general.architecture": "llama", "llama.block_count": 1})
    irpa = tmp_path / "m.irpa"
    import_gguf(gguf_path, irpa, progress=False)
    properties, tensors = _sharktank_tensors(irpa)
    assert properties["llama.block_count"] == 1 and properties["general.architecture"] == "llama"
    assert set(tensors) == {"output_norm.weight", "blk.0.attn_norm.weight"}
    ours = Dataset.load(irpa).theta
    for name, t in tensors.items():
        torch.testing.assert_close(t, ours[name], rtol=0, atol=0)
