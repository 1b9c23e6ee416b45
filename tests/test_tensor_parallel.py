"""Tensor parallelism (sharkport.parallel, docs/parallel.md) on tiny llamas.

* eager: the sharded model (N ranks, transfers as copies) gives the unsharded recipe's logits
  and transformers' own, for prefill and decode steps, MHA/GQA, tied/untied, with biases, N=2/4,
  Mistral and Qwen2; and on Q8_0 weights, split by whole blocks.
* archives: rank r holds exactly `<name>.shard.{r}` entries (read back with turbine's
  ParameterArchive), whose pieces reassemble the original tensors; the root holds only metadata.
* errors: head counts that do not divide, quantized columns that do not split into whole blocks,
  the export CLI's flag checks (one line, nothing written), and unsharded tools given the archives.
* compiled (slow): `python -m sharkport.export --tensor-parallelism-size 2 ... --output-vmfb`
  run on 2 local-task devices, and on 2 local-sync devices (the runner's default for N devices),
  gives the unsharded module's logits (and transformers'), and `iree-run-module` with two
  --device=local-task and two --parameters flags reproduces them; (extended) a 30-layer model,
  too deep for IREE 3.9's local-task devices, matches transformers on local-sync devices.
"""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest
import torch

from run_cli import run
from sharkport.archive import Dataset
from sharkport.errors import SharkportError
from sharkport.export.__main__ import main as export_main
from sharkport.export import service_config
from sharkport.export.abi import ExportConfig
from sharkport.models import build_model
from sharkport.parallel import ShardedLlama, rank_path, save_sharded, shard_in_memory
from sharkport.parallel.sharding import RULES, rule
from sharkport.archive.quantize import plan_types, requantized
from sharkport.runtime.eager import EagerSession
from sharkport.runtime.session import IreeSession
from tiny_models import TINY_EXPORT, TinyRecipes, exact_cache

STRIDE = 16
ATOL = 1e-4
DECODE_STEPS = 4
PAGES = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_steps(session, lengths: tuple[int, ...], pages: list[list[int]], vocab: int, seed: int = 0):
    """Prefill right-padded random prompts of `lengths`, then DECODE_STEPS decode steps feeding
    fixed random tokens. Returns the token sequences and every call's logits."""
    rng = np.random.default_rng(seed)
    seqs = [list(rng.integers(0, vocab, n)) for n in lengths]
    table = np.array(pages, np.int64)
    blocks = math.ceil(max(lengths) / STRIDE)
    tokens = np.zeros((len(seqs), blocks * STRIDE), np.int64)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = s
    outputs = [session.prefill(tokens, np.array(lengths, np.int64), table[:, :blocks])]
    for _ in range(DECODE_STEPS):
        new = rng.integers(0, vocab, len(seqs))
        for s, t in zip(seqs, new):
            s.append(int(t))
        positions = np.array([len(s) - 1 for s in seqs], np.int64)
        outputs.append(session.decode(new.reshape(-1, 1).astype(np.int64), positions + 1, positions,
                                      table[:, :int(positions.max()) // STRIDE + 1]))
    return seqs, outputs


def assert_same_steps(got: list[np.ndarray], want: list[np.ndarray], lengths, what: str) -> None:
    """Every call's logits at every real position (prefill: the prompt; decode: the new token)."""
    for step, (g, w) in enumerate(zip(got, want)):
        for r, n in enumerate(lengths):
            rows = slice(0, n) if step == 0 else slice(0, 1)
            np.testing.assert_allclose(g[r, rows], w[r, rows], rtol=0, atol=ATOL,
                                       err_msg=f"{what}: {'prefill' if step == 0 else f'decode {step}'}, row {r}")


def assert_matches_hf(hf, seqs, outputs, lengths) -> None:
    """Logits equal transformers' forward over each full sequence (prefill positions and decodes)."""
    for r, s in enumerate(seqs):
        with torch.no_grad():
            want = hf(torch.tensor([s])).logits[0].numpy()
        n = lengths[r]
        np.testing.assert_allclose(outputs[0][r, :n], want[:n], rtol=0, atol=ATOL, err_msg=f"prefill row {r}")
        for step, out in enumerate(outputs[1:]):
            np.testing.assert_allclose(out[r, 0], want[n + step], rtol=0, atol=ATOL, err_msg=f"decode {step} row {r}")


def eager_pair(dataset: Dataset, size: int):
    """(unsharded, sharded) eager sessions over the same weights."""
    config = exact_cache(STRIDE)
    plain = build_model(dataset, config)
    service = service_config(plain, ExportConfig(bs_prefill=(2,), bs_decode=(2,), block_seq_stride=STRIDE,
                                                 device_block_count=PAGES, max_seq_len=64))
    return (EagerSession(plain, service, pages=PAGES),
            EagerSession(ShardedLlama(shard_in_memory(dataset, size), config), service, pages=PAGES))


# ---------------------------------------------------------------------------------------------
# Eager
# ---------------------------------------------------------------------------------------------

LENGTHS = (30, 17)
BATCH_PAGES = [[3, 0, 5], [1, 6, 2]]  # distinct, out of order, page 0 included


@pytest.mark.parametrize("variant,size", [
    pytest.param("mha-untied", 2, id="mha-untied-tp2"),
    pytest.param("gqa-tied", 2, id="gqa-tied-tp2"),     # 1 kv head and 2 query heads per rank
    pytest.param("mha-bias", 2, id="mha-bias-tp2"),     # q/k/v biases split, o bias on rank 0 only
    pytest.param("mha-untied", 4, id="mha-untied-tp4"),
])
def test_eager_sharded_matches_unsharded_and_transformers(tiny, irpa_of, variant, size):
    plain, sharded = eager_pair(Dataset.load(irpa_of(variant)), size)
    vocab = tiny[variant].spec.vocab_size
    seqs, want = run_steps(plain, LENGTHS, BATCH_PAGES, vocab)
    _, got = run_steps(sharded, LENGTHS, BATCH_PAGES, vocab)
    assert_same_steps(got, want, LENGTHS, f"{variant} tp{size} vs unsharded")
    assert_matches_hf(tiny[variant].hf, seqs, got, LENGTHS)
    # Each device's cache holds its kv heads only: together they are the unsharded cache's size.
    assert sum(c.numel() for c in sharded._cache) == plain._cache.numel()


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> TinyRecipes:
    return TinyRecipes(tmp_path_factory.mktemp("tiny_recipes"))


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])  # sliding window; Q/K/V biases, HF rotary layout
def test_eager_sharded_llama_family(recipes, kind):
    plain, sharded = eager_pair(Dataset.load(recipes[kind].gguf_path), 2)
    seqs, want = run_steps(plain, LENGTHS, BATCH_PAGES, 256)
    _, got = run_steps(sharded, LENGTHS, BATCH_PAGES, 256)
    assert_same_steps(got, want, LENGTHS, f"{kind} tp2 vs unsharded")
    assert_matches_hf(recipes[kind].hf, seqs, got, LENGTHS)


def q8_0(dataset: Dataset) -> Dataset:
    """The dataset with every matrix requantized to Q8_0 (32-value blocks), by gguf.quants."""
    return requantized(dataset, plan_types(dataset.metadata["tensors"], "Q8_0"))


def test_eager_sharded_q8_0_matches_unsharded(tiny, irpa_of):
    dataset = q8_0(Dataset.load(irpa_of("mha-untied")))
    assert dataset.metadata["tensors"]["blk.0.attn_output.weight"]["type"] == "Q8_0"
    plain, sharded = eager_pair(dataset, 2)  # attn_output / ffn_down split into 1 / 2 blocks per row
    _, want = run_steps(plain, LENGTHS, BATCH_PAGES, 256)
    _, got = run_steps(sharded, LENGTHS, BATCH_PAGES, 256)
    assert_same_steps(got, want, LENGTHS, "q8_0 tp2 vs unsharded")


def test_quantized_columns_must_be_whole_blocks(irpa_of):
    # At 4 ranks attn_output's 64 input columns give 16 per rank: half a Q8_0 block.
    dataset = q8_0(Dataset.load(irpa_of("mha-untied")))
    with pytest.raises(SharkportError, match=r"tensor blk\.0\.attn_output\.weight \(Q8_0, 32-value blocks\) "
                                             r"cannot be split by columns at 0\.\.16"):
        shard_in_memory(dataset, 4)


@pytest.mark.parametrize("variant,size,key,count", [
    pytest.param("gqa-tied", 3, "head_count", 4, id="heads"),
    pytest.param("gqa-tied", 4, "head_count_kv", 2, id="kv-heads"),
    pytest.param("gqa-untied", 2, "head_count_kv", 1, id="one-kv-head"),
])
def test_indivisible_heads_are_an_error(irpa_of, variant, size, key, count):
    with pytest.raises(SharkportError, match=rf"llama\.attention\.{key} \({count}\) does not divide by "
                                             rf"--tensor-parallelism-size {size}"):
        shard_in_memory(Dataset.load(irpa_of(variant)), size)


# ---------------------------------------------------------------------------------------------
# Archives
# ---------------------------------------------------------------------------------------------

def test_archives_hold_each_rank_under_its_own_names(irpa_of, tmp_path):
    from iree.turbine.aot import ParameterArchive

    source = Dataset.load(irpa_of("mha-bias"))
    root = tmp_path / "tp.irpa"
    save_sharded(source, 2, root, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp.irpa", "tp.rank0.irpa", "tp.rank1.irpa"]
    assert all(k.startswith("__") for k, _ in ParameterArchive(root).items())  # metadata only

    pieces = {}
    for r in range(2):
        entries = {k: e.as_tensor() for k, e in ParameterArchive(rank_path(root, r)).items() if not k.startswith("__")}
        assert entries and all(k.endswith(f".shard.{r}") for k in entries)
        pieces[r] = {k.removesuffix(f".shard.{r}"): t for k, t in entries.items()}
    assert "blk.0.attn_output.bias" in pieces[0] and "blk.0.attn_output.bias" not in pieces[1]

    for name in source.metadata["tensors"]:
        want, how = source.theta[name], rule(name)
        if how == "first":
            assert torch.equal(pieces[0][name], want)
        elif how == "replicated":
            assert all(torch.equal(pieces[r][name], want) for r in range(2)), name
        else:
            got = torch.cat([pieces[r][name] for r in range(2)], dim=0 if how == "rows" else 1)
            assert torch.equal(got, want), name
    # Heads split evenly: each rank has 2 of the 4 query heads (2 x 16 rows).
    assert pieces[1]["blk.1.attn_q.weight"].shape == (32, 64)
    assert set(RULES.values()) == {"rows", "cols", "replicated", "first"}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def export_cli(*args: str):
    """The export command line in a fresh process, as users run it."""
    return run("sharkport.export", *args)


@pytest.mark.parametrize("flags,message", [
    pytest.param(["--tensor-parallelism-size", "3", "--output-irpa", "{out}/tp.irpa"],
                 "llama.attention.head_count (4) does not divide by --tensor-parallelism-size 3; "
                 "choose a size that divides 4", id="indivisible"),
    pytest.param(["--tensor-parallelism-size", "2"],
                 "--tensor-parallelism-size 2 writes the sharded archives: give --output-irpa", id="no-output-irpa"),
    pytest.param(["--output-irpa", "{out}/tp.irpa"],
                 "--output-irpa writes tensor-parallel archives: give --tensor-parallelism-size N (N > 1)",
                 id="output-irpa-alone"),
    pytest.param(["--tensor-parallelism-size", "0"], "--tensor-parallelism-size must be at least 1, got 0",
                 id="zero"),
])
def test_cli_flag_errors_are_one_line(irpa_of, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    status = export_main(["--irpa-file", str(irpa_of("gqa-tied")), "--output-mlir", str(out / "x.mlir"),
                          "--output-config", str(out / "x.json"), *[f.format(out=out) for f in flags]])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not out.exists()


@pytest.mark.parametrize("flags,message", [
    pytest.param(["--tensor-parallelism-size", "4"], "is sharded for 2 devices, not --tensor-parallelism-size 4",
                 id="other-size"),
    pytest.param(["--output-irpa", "{out}/again.irpa"], "is sharded already; drop --output-irpa", id="reshard"),
])
def test_cli_sharded_root_flag_errors(irpa_of, tmp_path, capsys, flags, message):
    root = tmp_path / "tp.irpa"
    save_sharded(Dataset.load(irpa_of("gqa-tied")), 2, root, progress=False)
    out = tmp_path / "out"
    if "--output-irpa" in flags:
        flags = ["--tensor-parallelism-size", "2", *flags]
    status = export_main(["--irpa-file", str(root), "--output-mlir", str(out / "x.mlir"),
                          "--output-config", str(out / "x.json"), *[f.format(out=out) for f in flags]])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not out.exists()


def test_unsharded_tools_refuse_the_archives(irpa_of, tmp_path):
    root = tmp_path / "tp.irpa"
    save_sharded(Dataset.load(irpa_of("gqa-tied")), 2, root, progress=False)
    with pytest.raises(SharkportError, match="is a tensor-parallel root archive \\(2 ranks\\)"):
        build_model(Dataset.load(root))
    with pytest.raises(SharkportError, match="is rank 1 of a tensor-parallel archive"):
        build_model(Dataset.load(rank_path(root, 1)))


# ---------------------------------------------------------------------------------------------
# Compiled: two local-task devices
# ---------------------------------------------------------------------------------------------

VARIANT = "mha-tied"  # compiled unsharded by other tests too (fixture compiled_of)
TP_EXPORT = ["--bs-prefill", "1", "--bs-decode", "1", "--block-seq-stride", str(STRIDE),
             "--device-block-count", str(PAGES), "--max-seq-len", "64"]


@pytest.fixture(scope="module")
def compiled_tp2(irpa_of, tmp_path_factory):
    """VARIANT exported by the CLI with --tensor-parallelism-size 2 and compiled for 2 devices, with
    compiled_of's float32 cache (tests/tiny_models.py: exact_cache)."""
    out = tmp_path_factory.mktemp("tp2")
    export_cli("--irpa-file", str(irpa_of(VARIANT)), "--tensor-parallelism-size", "2", "--kv-cache-dtype", "float32",
               "--output-irpa", str(out / "tp.irpa"), "--output-mlir", str(out / "tp.mlir"),
               "--output-config", str(out / "tp.json"), "--output-vmfb", str(out / "tp.vmfb"), *TP_EXPORT)
    return out / "tp.vmfb", out / "tp.irpa", out / "tp.json"


@pytest.mark.slow
@pytest.mark.parametrize("device", [
    pytest.param("local-task,local-task", id="local-task"),  # one URI per device
    pytest.param(None, id="default-local-sync"),             # the runner's default for N devices
])
def test_compiled_tp2_matches_unsharded_module(tiny, compiled_of, compiled_tp2, device):
    import json

    config = json.loads(compiled_tp2[2].read_text())
    page_elems = 2 * 2 * (4 // 2) * STRIDE * 16  # layers, K|V, kv heads per device, stride, head dim
    assert config["paged_kv_cache"]["paged_kv_block_size_elements_per_device"] == [page_elems] * 2
    lengths, pages = (30,), [[5, 0, 2]]
    sharded = IreeSession(*compiled_tp2, pages=PAGES, device=device)
    assert sharded.device_name == (device or "local-sync")
    plain = IreeSession(*compiled_of(VARIANT), pages=TINY_EXPORT.device_block_count)
    seqs, got = run_steps(sharded, lengths, pages, 256)
    _, want = run_steps(plain, lengths, pages, 256)
    assert_same_steps(got, want, lengths, "compiled tp2 vs unsharded")
    assert_matches_hf(tiny[VARIANT].hf, seqs, got, lengths)


@pytest.mark.slow
def test_iree_run_module_with_two_devices_reproduces_the_session(compiled_tp2, tmp_path):
    assert shutil.which("iree-run-module"), "iree-run-module is installed with iree-base-runtime"
    vmfb, root, config = compiled_tp2
    session = IreeSession(vmfb, root, config, pages=PAGES)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 256, (1, 2 * STRIDE)).astype(np.int64)
    inputs = {"tokens": tokens, "seq_lens": np.array([27], np.int64), "seq_block_ids": np.array([[4, 1]], np.int64)}
    for r, cache in enumerate(session.caches_to_host()):
        inputs[f"cache_state_{r}"] = cache
    want = session.prefill(*list(inputs.values())[:3])

    command = ["iree-run-module", f"--module={vmfb}", "--device=local-task", "--device=local-task",
               f"--parameters=model={rank_path(root, 0)}", f"--parameters=model={rank_path(root, 1)}",
               "--function=prefill_bs1"]
    for name, value in inputs.items():
        np.save(tmp_path / f"{name}.npy", value)
        command.append(f"--input=@{tmp_path / name}.npy")
    subprocess.run(command + [f"--output=@{tmp_path / 'logits.npy'}"], check=True, capture_output=True, timeout=300)
    got = np.load(tmp_path / "logits.npy")
    assert got.shape == (1, 2 * STRIDE, 256)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_device_list_must_name_every_device(compiled_tp2):
    with pytest.raises(SharkportError, match="device 'local-task,local-task,local-task' names 3 devices; "
                                             "the module runs on 2"):
        IreeSession(*compiled_tp2, device="local-task,local-task,local-task")


@pytest.mark.slow
@pytest.mark.extended  # about 3 minutes: tracing and compiling 30 layers
def test_deep_model_runs_on_local_sync_devices(tmp_path):
    """30 layers over 2 devices: past what IREE 3.9's local-task devices hold (docs/parallel.md),
    so the runner's default local-sync devices must carry it, with transformers' logits."""
    from dataclasses import replace

    from sharkport.archive import import_gguf
    from sharkport.compile import compile_mlir
    from sharkport.export import save_export
    from sharkport.parallel.export import export_sharded
    from tiny_models import VARIANTS, make_tiny_llama

    model = make_tiny_llama(replace(VARIANTS["mha-untied"], layers=30), tmp_path / "deep")
    import_gguf(model.gguf_path, tmp_path / "deep.irpa", progress=False)
    sharded = save_sharded(Dataset.load(tmp_path / "deep.irpa"), 2, tmp_path / "tp.irpa", progress=False)
    output, service = export_sharded(sharded, ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=STRIDE,
                                                           device_block_count=PAGES, max_seq_len=64),
                                     exact_cache(STRIDE))
    save_export(output, service, tmp_path / "tp.mlir", tmp_path / "tp.json")
    compile_mlir(tmp_path / "tp.mlir", tmp_path / "tp.vmfb", devices=2)
    session = IreeSession(tmp_path / "tp.vmfb", tmp_path / "tp.irpa", tmp_path / "tp.json", pages=PAGES)
    seqs, got = run_steps(session, (30,), [[5, 0, 2]], 256)
    assert_matches_hf(model.hf, seqs, got, (30,))
