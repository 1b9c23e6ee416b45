"""The Mistral, Qwen2, Gemma-3, Mixtral and GPT-2 recipes end to end on tiny random-weight
models made with each architecture's own transformers class, against transformers.

References are code we did not write: the HF model's forward pass over the whole sequence so far
(prefill and every decode step, as in test_llama_tiny.py), and transformers' GGUF loader reading
the fixture GGUFs (written as llama.cpp's converter writes each architecture, tiny_models.py).

* registry: an unknown architecture is one error listing the known ones.
* fixtures: the fixture GGUFs load in transformers and reproduce the HF logits.
* hparams: an HF import and a GGUF import of the same model give the same hyperparameters.
* eager: both imports (HF safetensors, GGUF) match transformers on prefill and 8 decode steps at
  batch 1 and 4; prompts are longer than the sliding window (8) of Mistral and Gemma-3, and
  the tiny Mixtral routes each token to 2 of 4 experts. The two imports agree with each other.
* compiled (slow): one module per architecture (prefill/decode at batch 1 and 4, GGUF import),
  the same checks through IREE, exported the CLI's default way (the kernels: attention in
  hand-written kernels, Gemma-3's own query scale and Q/K norms among them) and, for Gemma-3 (the
  others' are extended), with IREE's code alone. Gemma-3 is compiled as `gemma3-2l` (2 layers:
  local, global): the 6-layer one, whose GGUF leaves the pattern implicit as llama.cpp does, takes
  3x longer.
* quantized (slow): each tiny model with Q8_0 matrices through the default path decodes as the
  eager recipe over the same weights, each linear's input quantized as the kernels do (gguf.quants).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sharkport.archive import Dataset, Theta
from sharkport.errors import SharkportError
from sharkport.formats.keys import HPARAMS
from sharkport.models import RECIPES, build_model
from sharkport.runtime.session import IreeSession
from test_llama_tiny import BATCHES, PAGES, check_prefill_decode, eager_session, hf_logits, params, prompts_for
from tiny_models import RECIPE_KINDS, assert_same_hparams, TINY_EXPORT, WINDOW, TinyRecipes, exact_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SOURCES = ("hf", "gguf")


@pytest.fixture(scope="session")
def recipes(tmp_path_factory) -> TinyRecipes:
    return TinyRecipes(tmp_path_factory.mktemp("tiny_recipes"))


@pytest.fixture(scope="session")
def recipe_irpa(recipes):
    """(kind, source) → .irpa imported from the tiny model's HF folder or GGUF, once per session."""
    from sharkport.archive import import_gguf, import_hf

    made: dict[tuple[str, str], Path] = {}

    def get(kind: str, source: str) -> Path:
        if (kind, source) not in made:
            m = recipes[kind]
            path = m.hf_dir.parent / f"{source}.irpa"
            if source == "hf":
                import_hf(m.hf_dir, path, progress=False)
            else:
                import_gguf(m.gguf_path, path, progress=False)
            made[kind, source] = path
        return made[kind, source]

    return get


@pytest.fixture(scope="session")
def recipe_compiled(recipe_irpa):
    """(kind, matvec_kernels) → (vmfb, irpa, service config): the GGUF import exported with
    TINY_EXPORT (batch 1 and 4 in one module; with the kernels if asked, checking the prefill
    attention kernel is called) and compiled for the host CPU, once per session."""
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export

    made: dict[tuple[str, bool], tuple[Path, Path, Path]] = {}

    def get(kind: str, matvec_kernels: bool = False):
        if (kind, matvec_kernels) not in made:
            irpa = recipe_irpa(kind, "gguf")
            out = irpa.parent / ("compiled-kernels" if matvec_kernels else "compiled")
            config = dataclasses.replace(TINY_EXPORT, matvec_kernels=matvec_kernels)
            output, service = export_model(Dataset.load(irpa), config, exact_cache())
            save_export(output, service, out / "model.mlir", out / "model.json")
            if matvec_kernels:
                text = (out / "model.mlir").read_text()
                assert "sharkport_prefill_attention(" in text
                if kind.startswith("gemma3"):  # its local layers' decode attends in the kernel, windowed
                    assert f"_sw{WINDOW}" in text
            compile_mlir(out / "model.mlir", out / "model.vmfb")
            made[kind, matvec_kernels] = (out / "model.vmfb", irpa, out / "model.json")
        return made[kind, matvec_kernels]

    return get


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

def test_unknown_architecture_lists_known_ones():
    dataset = Dataset(Path("model.gguf"), {"hparams": {"general.architecture": "mamba"}}, Theta({}))
    with pytest.raises(SharkportError, match=r"model\.gguf: architecture 'mamba'") as e:
        build_model(dataset)
    for arch in RECIPES:
        assert arch in str(e.value)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# The fixtures, checked by transformers' GGUF loader
# ---------------------------------------------------------------------------------------------

# Mixtral is left out: transformers reads a `llama` GGUF with experts as a dense llama (it finds
# no ffn_gate/ffn_up/ffn_down and leaves them random). Mistral is read as a llama without a
# window (transformers maps no sliding-window key for `llama`), so only prompts within the
# window can agree.
LOADER_PROMPTS = {"mistral": (1, 5, WINDOW), "qwen2": (1, 7, 40), "gemma3": (1, 7, 40), "gpt2": (1, 7, 40)}


@pytest.mark.parametrize("kind", params(LOADER_PROMPTS))
def test_fixture_gguf_loads_in_transformers(recipes, kind):
    from transformers import AutoModelForCausalLM

    m = recipes[kind]
    loaded = AutoModelForCausalLM.from_pretrained(m.gguf_path.parent, gguf_file=m.gguf_path.name,
                                                  dtype=torch.float32).eval()
    for p in prompts_for(LOADER_PROMPTS[kind], 256, seed=5):
        np.testing.assert_allclose(hf_logits(loaded, p), hf_logits(m.hf, p), rtol=0, atol=1e-4,
                                   err_msg=f"prompt of {len(p)}")


# ---------------------------------------------------------------------------------------------
# Hyperparameters: HF config.json and GGUF keys say the same
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", params(RECIPE_KINDS))
def test_hparams_same_from_hf_and_gguf(recipe_irpa, kind):
    hf_ds, gguf_ds = Dataset.load(recipe_irpa(kind, "hf")), Dataset.load(recipe_irpa(kind, "gguf"))
    assert hf_ds.architecture == gguf_ds.architecture
    hp_class = HPARAMS[hf_ds.architecture]
    hf_hp, gguf_hp = (hp_class.from_metadata(d.hparams) for d in (hf_ds, gguf_ds))
    if kind.startswith("gemma3"):  # HF lists each layer's kind; llama.cpp's files imply every 6th is global
        layers = range(hf_hp.block_count)
        assert [hf_hp.is_sliding(i) for i in layers] == [gguf_hp.is_sliding(i) for i in layers]
        assert hf_hp.is_sliding(0) and not hf_hp.is_sliding(layers[-1])
        hf_hp, gguf_hp = (dataclasses.replace(h, sliding_window_pattern=1) for h in (hf_hp, gguf_hp))
    assert_same_hparams(hf_hp, gguf_hp)
    assert hf_ds.metadata["tensors"].keys() == gguf_ds.metadata["tensors"].keys() - {"output.weight"} \
        if kind == "gpt2" else hf_ds.metadata["tensors"].keys() == gguf_ds.metadata["tensors"].keys()
    expected = {"mistral": ("sliding_window", WINDOW), "mixtral": ("expert_count", 4), "gemma3": ("head_dim", 256),
                "gemma3-2l": ("block_count", 2)}
    if kind in expected:
        field, value = expected[kind]
        assert getattr(gguf_hp, field) == value


# ---------------------------------------------------------------------------------------------
# Eager recipe
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", params(BATCHES))
@pytest.mark.parametrize("source", params(SOURCES))
@pytest.mark.parametrize("kind", params(RECIPE_KINDS))
def test_eager_matches_transformers(recipes, recipe_irpa, kind, source, batch):
    check_prefill_decode(eager_session(recipe_irpa(kind, source)), recipes[kind].hf, BATCHES[batch])


@pytest.mark.parametrize("kind", params(RECIPE_KINDS))
def test_eager_hf_import_equals_gguf_import(recipe_irpa, kind):
    """Both imports hold the same model: the same prefill and decode logits, closer than either
    is to transformers (which sums in another order)."""
    sessions = [eager_session(recipe_irpa(kind, s)) for s in SOURCES]
    lengths = (5, 33, 17, 1)
    pages = np.array([(3, 9, 0), (7, 1, 4), (2, 8, 6), (5, 11, 10)], np.int64)
    tokens = np.zeros((4, 48), np.int64)
    for r, p in enumerate(prompts_for(lengths, 256, seed=7)):
        tokens[r, :len(p)] = p
    seq_lens = np.array(lengths, np.int64)
    prefill = [s.prefill(tokens, seq_lens, pages) for s in sessions]
    np.testing.assert_allclose(prefill[0], prefill[1], rtol=0, atol=1e-5)
    new = np.array([[11], [200], [0], [255]], np.int64)
    decode = [s.decode(new, seq_lens + 1, seq_lens, pages) for s in sessions]
    np.testing.assert_allclose(decode[0], decode[1], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Compiled module (one per architecture)
# ---------------------------------------------------------------------------------------------

# Each recipe through the CLI's default path (the kernels) and through IREE's own code alone: the
# default suite has every recipe's default path and Gemma-3's (the recipe furthest from llama)
# other; the others' are extended.
COMPILED_KINDS = [pytest.param(k, kernels, id=f"{k}-kernels" if kernels else k,
                               marks=() if kernels or k == "gemma3-2l" else pytest.mark.extended)
                  for k in ("mistral", "qwen2", "gemma3-2l", "mixtral", "gpt2") for kernels in (True, False)]


@pytest.mark.slow
@pytest.mark.parametrize("batch", params(BATCHES))
@pytest.mark.parametrize("kind, matvec_kernels", COMPILED_KINDS)
def test_compiled_matches_transformers(recipes, recipe_compiled, kind, matvec_kernels, batch):
    vmfb, irpa, config = recipe_compiled(kind, matvec_kernels)
    check_prefill_decode(IreeSession(vmfb, irpa, config, pages=PAGES), recipes[kind].hf, BATCHES[batch])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma3-2l", "mixtral", "gpt2"])
def test_quantized_default_path_computes_as_the_recipe(recipe_irpa, kind, tmp_path):
    """Each recipe's tiny model with every matrix Q8_0 (sharkport's quantizer), exported the CLI's
    default way (the kernels read the weights as stored: Mixtral's experts and router, GPT-2's
    fused qkv and biases, Qwen2's q/k/v biases, Gemma-3's norms) and compiled: its decode at batch
    4 over two pages gives the logits of the eager recipe over the same weights dequantized, each
    linear's input quantized to Q8_0 by gguf.quants as the kernels quantize x. Where x differs from
    the eager one by float rounding, a value on a rounding boundary of its quantization can land on
    the other side (a 1e-6 change of x moves these models' logits by about 1e-2 of their largest),
    so most steps agree to 1e-4 and none is further than that moves it."""
    from sharkport.archive import save_dataset
    from sharkport.archive.quantize import plan_types, requantized
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from sharkport.layers.linear import Linear
    from sharkport.verify import quantize_linear_inputs

    source = Dataset.load(recipe_irpa(kind, "gguf"))
    irpa = tmp_path / "q8_0.irpa"
    save_dataset(requantized(source, plan_types(source.metadata["tensors"], "Q8_0", [])), irpa, progress=False)
    output, service = export_model(Dataset.load(irpa), dataclasses.replace(TINY_EXPORT, matvec_kernels=True),
                                   exact_cache())
    save_export(output, service, tmp_path / "m.mlir", tmp_path / "m.json")
    assert re.search(r"@sharkport_\w*q8_0", (tmp_path / "m.mlir").read_text()), "no Q8_0 kernel is called"
    compile_mlir(tmp_path / "m.mlir", tmp_path / "m.vmfb")
    session = IreeSession(tmp_path / "m.vmfb", irpa, tmp_path / "m.json", pages=TINY_EXPORT.device_block_count)

    model = build_model(Dataset.load(irpa), exact_cache())
    quantize_linear_inputs(model, linear=Linear)
    cache = model.new_cache(TINY_EXPORT.device_block_count)
    ids = [3, 99, 14, 200, 7, 7, 51, 128, 60, 2, 31, 90, 17, 5, 250, 33, 8, 64, 101, 12]  # two pages of 16
    pages = np.arange(4, dtype=np.int64)[:, None] * 2 + np.arange(2)
    tokens = np.zeros((4, TINY_EXPORT.block_seq_stride), np.int64)
    tokens[:, :5] = ids[:5]
    session.prefill(tokens, np.full(4, 5), pages[:, :1].copy())
    errors = []
    with torch.no_grad():
        model.prefill(torch.from_numpy(tokens), torch.full((4,), 5), torch.from_numpy(pages[:, :1].copy()), cache)
        for pos in range(5, len(ids)):
            args = (np.full((4, 1), ids[pos]), np.full(4, pos + 1), np.full(4, pos), pages[:, :pos // 16 + 1].copy())
            got = np.array(session.decode(*args), copy=True)
            want = model.decode(*(torch.from_numpy(a) for a in args), cache).numpy().reshape(got.shape)
            errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
    assert np.median(errors) <= 1e-4 and max(errors) <= 0.05, \
        "steps' largest error / largest logit: " + ", ".join(f"{e:.1e}" for e in errors)


# ---------------------------------------------------------------------------------------------
# HF folders the new readers refuse: one line naming the problem, nothing written
# ---------------------------------------------------------------------------------------------

def _drop_expert(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _edit(d: Path, **changes) -> None:
    import json

    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


BROKEN = {
    "mixtral-missing-expert": ("mixtral", _drop_expert, r"no expert 3 of blk\.1\.ffn_down_exps\.weight"),
    "qwen2-sliding-layers": ("qwen2", lambda d: _edit(d, use_sliding_window=True, sliding_window=8),
                             r"config\.json: use_sliding_window is true"),
    "gemma3-rope-scaling": ("gemma3", lambda d: _edit(d, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        r"config\.json: rope scaling type 'linear' \(full_attention layers\)"),
    "gpt2-activation": ("gpt2", lambda d: _edit(d, activation_function="relu"),
                        r"config\.json: activation_function 'relu'"),
}


@pytest.mark.parametrize("case", params(BROKEN))
def test_bad_hf_folder_is_one_line_error(recipes, tmp_path, capsys, case):
    import shutil

    from test_hf_import import check_import_refused

    kind, breaker, message = BROKEN[case]
    d = shutil.copytree(recipes[kind].hf_dir, tmp_path / "hf")
    breaker(d)
    check_import_refused(d, tmp_path, capsys, message)


# ---------------------------------------------------------------------------------------------
# prefill_final_logits: prefill returns only each sequence's last logits
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", params(RECIPE_KINDS))
def test_prefill_final_logits_are_the_last_rows(recipe_irpa, kind):
    """With ModelConfig.prefill_final_logits every recipe's prefill returns [B, 1, V]: row r is
    the full prefill's logits at seq_lens[r] - 1, and the cache it writes is the same."""
    from sharkport.models import ModelConfig

    dataset = Dataset.load(recipe_irpa(kind, "gguf"))
    stride = TINY_EXPORT.block_seq_stride
    full, final = (build_model(dataset, ModelConfig(block_seq_stride=stride, prefill_final_logits=f))
                   for f in (False, True))
    lengths = (5, 33, 17, 1)
    tokens = torch.zeros(4, 48, dtype=torch.int64)
    for r, p in enumerate(prompts_for(lengths, 256, seed=3)):
        tokens[r, :len(p)] = torch.tensor(p)
    seq_lens, pages = torch.tensor(lengths), torch.tensor([(3, 9, 0), (7, 1, 4), (2, 8, 6), (5, 11, 10)])
    caches = [m.new_cache(12) for m in (full, final)]
    with torch.no_grad():
        want = full.prefill(tokens, seq_lens, pages, caches[0])
        got = final.prefill(tokens, seq_lens, pages, caches[1])
    assert got.shape == (4, 1, want.shape[-1])
    torch.testing.assert_close(got[:, 0], want[torch.arange(4), seq_lens - 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(caches[1], caches[0], rtol=0, atol=0)
