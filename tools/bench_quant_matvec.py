#!/usr/bin/env python
"""How fast IREE runs a quantized matrix-vector product, for several ways of writing it
(docs/performance.md, what bounds decode):

    python tools/bench_quant_matvec.py [--rows 1] [--repeat 10] [--only-kernels]

First table: forms traced from torch with the weights kept quantized, compiled with the
`llvm-cpu-lean` preset (weights are function arguments, so nothing is hoisted to load time).
Second table: `layers.Linear` as decode exports it, the weights module constants, compiled
with the default `llvm-cpu` preset: the traced dequantize-and-`mm` (hoisted: dequantized and
packed as float32 once, at load) against the hand-written kernels of `export --matvec-kernels`,
which read the weights as stored. Every form is checked against torch and timed (median of
--repeat calls). Matrices: a Q4_1 one of 12288x576 (SmolLM2's FFN at 8 layers) and the Q8_0
output projection of SmolLM2, 49152x576, with its float32 `mm` for comparison.
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

from sharkport import layers
from sharkport.export.kernels import KernelLinear
from sharkport.archive.tensors import QuantizedTensor
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


class Linear(torch.nn.Module):
    """x @ w.T as decode exports it (layers.Linear, or with `kernels` the export's KernelLinear),
    w's planes module constants."""

    def __init__(self, w):
        super().__init__()
        self.w, self.kernels = w, False
        for name, plane in w.planes.items():
            self.register_buffer(name, plane)

    def forward(self, x):
        product = layers.Linear(QuantizedTensor(self.w.type_name, self.w.shape,
                                                {n: getattr(self, n) for n in self.w.planes}, self.w.interleaved))
        return (KernelLinear(product) if self.kernels else product)(x)


def run(fn, args, work: Path, repeat: int, preset: str = "llvm-cpu-lean",
        use_kernels: bool = False) -> tuple[float, float]:
    """(median seconds, max abs error against eager torch) of fn compiled by IREE."""
    import iree.runtime as rt

    from sharkport.runtime.session import tune_local_task

    tune_local_task(rt)  # as the runner does: a local-task worker per CPU, spinning between dispatches
    mlir, vmfb = work / "f.mlir", work / "f.vmfb"
    module = fn if isinstance(fn, torch.nn.Module) else Traced(fn)
    if isinstance(module, Linear):
        module.kernels = use_kernels
    aot.export(module, args=args).save_mlir(mlir)
    compile_mlir(mlir, vmfb, preset)
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


def smollm2_decode(x: torch.Tensor, repeat: int) -> None:
    """The kernels' share of a SmolLM2 Q4_1 decode step at batch 1: every product timed alone
    (weights as module constants, `llvm-cpu`), summed over 30 layers plus the Q8_0 output."""
    g = torch.Generator().manual_seed(1)
    layer = {"attn_q": (576, 576), "attn_k": (192, 576), "attn_v": (192, 576), "attn_output": (576, 576),
             "ffn_gate": (1536, 576), "ffn_up": (1536, 576), "ffn_down": (576, 1536)}
    total = 0.0
    print("| product | shape | type | time |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (n, k), type_name, count in [(n, s, "Q4_1", 30) for n, s in layer.items()] + \
                [("output (tied token_embd)", (49152, 576), "Q8_0", 1)]:
            blocks = k // 32
            planes = {"qs": torch.randint(0, 256, (n, blocks, 16 if type_name == "Q4_1" else 32), dtype=torch.uint8,
                                          generator=g),
                      "d": (torch.rand(n, blocks, generator=g) * 0.01).half()}
            if type_name == "Q4_1":
                planes["m"] = (torch.rand(n, blocks, generator=g) * 0.01).half()
            else:
                planes["qs"] = planes["qs"].view(torch.int8)
            xs = torch.randn(1, k, generator=g)
            secs, _ = run(Linear(QuantizedTensor(type_name, (n, k), planes)), (xs,), Path(tmp), repeat,
                          "llvm-cpu", True)
            total += count * secs
            print(f"| {name} x{count} | {n}x{k} | {type_name} | {secs * 1e6:.0f} us |", flush=True)
    print(f"\nsum over one decode step: {total * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1, help="rows of x (the batch at decode; default 1)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only-kernels", action="store_true", help="only the second table")
    parser.add_argument("--smollm2-decode", action="store_true",
                        help="instead: each product of one SmolLM2 Q4_1 decode step through the kernels, "
                             "timed alone, and their sum over the model")
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

    if args.smollm2_decode:
        return smollm2_decode(x, args.repeat)
    header = "| matrix | form | time | GB/s of weights read | max abs error |\n|---|---|---|---|---|"
    with tempfile.TemporaryDirectory() as tmp:
        if not args.only_kernels:
            print(header)
            for matrix, name, fn, fn_args, nbytes in cases:
                secs, err = run(fn, fn_args, Path(tmp), args.repeat)
                print(f"| {matrix} | {name} | {secs * 1e3:.1f} ms | {nbytes / secs / 1e9:.2f} | {err:.1e} |", flush=True)
        print("\n" + header)
        for type_name, n, (_, *planes), fields in (("Q4_1", n4, q4, ("qs", "d", "m")), ("Q8_0", n8, q8, ("qs", "d"))):
            module = Linear(QuantizedTensor(type_name, (n, K), dict(zip(fields, planes))))
            nbytes = sum(p.numel() * p.element_size() for p in planes)
            for name, preset, use in (("dequantize + mm, packed f32 at load (llvm-cpu)", "llvm-cpu", False),
                                      ("--matvec-kernels (llvm-cpu)", "llvm-cpu", True)):
                secs, err = run(module, (x,), Path(tmp), args.repeat, preset, use)
                print(f"| {type_name} {n}x{K} | {name} | {secs * 1e3:.2f} ms | {nbytes / secs / 1e9:.2f} | {err:.1e} |",
                      flush=True)


if __name__ == "__main__":
    main()
