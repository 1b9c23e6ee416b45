#!/usr/bin/env python
"""How fast IREE runs a quantized matrix-vector product when the weights stay quantized in
memory, for several ways of writing it in torch (docs/performance.md, "What bounds decode"):

    python tools/bench_quant_matvec.py [--rows 1] [--repeat 10]

Each form is traced with iree-turbine, compiled with the `llvm-cpu-lean` preset (weights are
function arguments, so nothing is hoisted to load time), checked against torch, and timed
(median of --repeat calls). Matrices: a Q4_1 one of 12288x576 (SmolLM2's FFN at 8 layers) and
the Q8_0 output projection of SmolLM2, 49152x576, with its float32 `mm` for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from iree.turbine import aot

from sharkport.compile import compile_mlir

K = 576
BLOCKS = K // 32


def nibbles(qs):  # [N, B, 16] uint8 → [N, B, 2, 16]: low nibbles are values 0..15, high 16..31
    return torch.stack([qs & 15, qs >> 4], dim=-2)


def q4_1_forms(m: int):
    def dequant_mm(x, qs, d, mn):
        w = d.float().unsqueeze(-1) * nibbles(qs).flatten(-2).float() + mn.float().unsqueeze(-1)
        return torch.mm(x, w.reshape(-1, K).t())

    def block_sums(x, qs, d, mn, parts):  # Σ_b d·(Σ_j x·q) + Σ_b m·(Σ_j x)
        xs = x.reshape(m, 1, BLOCKS, 32).sum(-1)
        return (parts(x.reshape(m, 1, BLOCKS, 2, 16), qs) * d.float() + xs * mn.float()).sum(-1)

    def stacked(xb, qs):
        return (xb * nibbles(qs).float()).sum((-1, -2))

    def halves(xb, qs):
        return (xb[..., 0, :] * (qs & 15).float()).sum(-1) + (xb[..., 1, :] * (qs >> 4).float()).sum(-1)

    def arithmetic(xb, qs):  # nibbles by float floor/mod: one elementwise producer
        t = torch.floor(qs.float().unsqueeze(-2) * torch.tensor([[1.0], [1.0 / 16]]))
        return (xb * (t - 16 * torch.floor(t * (1.0 / 16)))).sum((-1, -2))

    return {
        "dequantize to f32, then mm (llvm-cpu-lean)": dequant_mm,
        "per-block sums, nibbles stacked, scales after": lambda *a: block_sums(*a, stacked),
        "per-block sums, nibble halves summed apart": lambda *a: block_sums(*a, halves),
        "per-block sums, nibbles by float arithmetic": lambda *a: block_sums(*a, arithmetic),
    }


def q8_0_forms(m: int):
    def dequant_mm(x, qs, d):
        return torch.mm(x, (d.float().unsqueeze(-1) * qs.float()).reshape(-1, K).t())

    def scales_after(x, qs, d):
        return ((x.reshape(m, 1, BLOCKS, 32) * qs.float()).sum(-1) * d.float()).sum(-1)

    return {"dequantize to f32, then mm (llvm-cpu-lean)": dequant_mm,
            "per-block sums, scales after": scales_after}


class Traced(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def run(fn, args, work: Path, repeat: int) -> tuple[float, float]:
    """(median seconds, max abs error against eager torch) of fn compiled by IREE."""
    import iree.runtime as rt

    mlir, vmfb = work / "f.mlir", work / "f.vmfb"
    aot.export(Traced(fn), args=args).save_mlir(mlir)
    compile_mlir(mlir, vmfb, "llvm-cpu-lean")
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(vmfb)))
    f = ctx.modules.module["main"]
    device_args = [rt.asdevicearray(config.device, a.numpy()) for a in args]
    out = np.array(f(*device_args).to_host(), copy=True)
    err = float(np.abs(out - fn(*args).numpy()).max())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.array(f(*device_args).to_host(), copy=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1, help="rows of x (the batch at decode; default 1)")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    m, g = args.rows, torch.Generator().manual_seed(0)
    x = torch.randn(m, K, generator=g)
    n4, n8 = 12288, 49152
    q4 = (x, torch.randint(0, 256, (n4, BLOCKS, 16), dtype=torch.uint8, generator=g),
          (torch.rand(n4, BLOCKS, generator=g) * 0.01).half(), (torch.rand(n4, BLOCKS, generator=g) * 0.01).half())
    q8 = (x, torch.randint(-127, 128, (n8, BLOCKS, 32), dtype=torch.int8, generator=g),
          (torch.rand(n8, BLOCKS, generator=g) * 0.01).half())
    cases = [(f"Q4_1 {n4}x{K}", name, fn, q4, n4 * BLOCKS * 20) for name, fn in q4_1_forms(m).items()]
    cases += [(f"Q8_0 {n8}x{K}", name, fn, q8, n8 * BLOCKS * 34) for name, fn in q8_0_forms(m).items()]
    w32 = torch.randn(n8, K, generator=g)
    cases.append((f"F32 {n8}x{K}", "mm", lambda x, w: torch.mm(x, w.t()), (x, w32), w32.numel() * 4))

    print(f"| matrix | form | time | GB/s of weights read | max abs error |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for matrix, name, fn, fn_args, nbytes in cases:
            secs, err = run(fn, fn_args, Path(tmp), args.repeat)
            print(f"| {matrix} | {name} | {secs * 1e3:.1f} ms | {nbytes / secs / 1e9:.2f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
