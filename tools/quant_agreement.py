#!/usr/bin/env python
"""SmolLM2-135M requantized by sharkport to each 32-value block type, run through the whole path
(quantize → export → compile → generate), against transformers on the same quantized GGUF:

    python tools/quant_agreement.py [--types q8_0,q4_0,q4_1,q5_0,q5_1] [--work-dir artifacts/quant]
                                    [--markdown docs/quantize.md]

For each type: `python -m sharkport.tools.quantize --type T` writes an .irpa and a .gguf from the
packaged Q4_1 GGUF; the .irpa is exported at batch 1 and compiled; the compiled module greedily
continues 3 prompts by 32 tokens; then each prompt + its continuation, and a natural passage, are
teacher-forced through the compiled prefill and through transformers (loading the .gguf), and
the top-1 agreement over every position is reported. Target: >= 98% for every type.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sharkport.archive import Dataset
from sharkport.compile import compile_mlir
from sharkport.export import ExportConfig, export_model, save_export
from sharkport.packaged import packaged_gguf
from sharkport.runtime.generate import generate
from sharkport.runtime.session import IreeSession

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for "
    "wine. Within fifty years, presses were working in more than two hundred European cities, "
    "and the price of books fell sharply, which helped spread literacy and new ideas."
)
NEW_TOKENS = 32
TARGET = 0.98
EXPORT = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=32, device_block_count=16, max_seq_len=512)


def run_type(type_name: str, source: Path, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    irpa, gguf_path = work / "model.irpa", work / f"smollm2-{type_name}.gguf"
    times = {}
    t0 = time.perf_counter()
    if not (irpa.exists() and gguf_path.exists()):
        subprocess.run([sys.executable, "-m", "sharkport.tools.quantize", "--gguf-file", str(source),
                        "--type", type_name, "--output-irpa", str(irpa), "--output-gguf", str(gguf_path)], check=True)
    times["quantize"] = time.perf_counter() - t0

    vmfb, config = work / "model.vmfb", work / "model.json"
    t0 = time.perf_counter()
    if not vmfb.exists():
        output, service = export_model(Dataset.load(irpa), EXPORT)
        save_export(output, service, work / "model.mlir", config)
        compile_mlir(work / "model.mlir", vmfb)
    times["export+compile"] = time.perf_counter() - t0

    session = IreeSession(vmfb, irpa, config)
    tok = Dataset.load(irpa).tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    continuations = generate(session, prompts, NEW_TOKENS)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    sequences = [tok.encode(PASSAGE)] + [p + c for p, c in zip(prompts, continuations)]
    agree = total = greedy_equal = 0
    stride = EXPORT.block_seq_stride
    for i, ids in enumerate(sequences):
        blocks = -(-len(ids) // stride)
        tokens = np.zeros((1, blocks * stride), np.int64)
        tokens[0, :len(ids)] = ids
        ours = session.prefill(tokens, np.array([len(ids)]), np.arange(blocks, dtype=np.int64)[None])[0, :len(ids)]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
        if i > 0:  # does transformers pick our continuation at every generated position?
            n = len(prompts[i - 1])
            greedy_equal += int((ref[n - 1:-1].argmax(-1) == np.array(ids[n:])).all())
    return {
        "type": type_name, "agreement": agree / total, "positions": total,
        "greedy_equal": f"{greedy_equal}/{len(prompts)}",
        "irpa_mb": irpa.stat().st_size / 1e6, "gguf_mb": gguf_path.stat().st_size / 1e6,
        "sample": tok.decode(continuations[0]), **times,
    }


def table(rows: list[dict]) -> str:
    lines = ["| type | .irpa MB | .gguf MB | top-1 agreement | positions | greedy = transformers | continuation of prompt 1 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        sample = r["sample"].replace("\n", "\\n").replace("|", "\\|")
        lines.append(f"| {r['type']} | {r['irpa_mb']:.1f} | {r['gguf_mb']:.1f} | {100 * r['agreement']:.1f}% | "
                     f"{r['positions']} | {r['greedy_equal']} | {PROMPTS[0]}{sample} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="q8_0,q4_0,q4_1,q5_0,q5_1")
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/quant"))
    parser.add_argument("--markdown", type=Path, help="replace the table between the markers in this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # transformers' reference on a shared machine; IREE uses its own threads

    source = packaged_gguf("smollm2")
    rows = []
    for type_name in args.types.split(","):
        row = run_type(type_name, source, args.work_dir / type_name)
        print(f"{type_name}: agreement {100 * row['agreement']:.1f}% over {row['positions']} positions, "
              f"greedy equal {row['greedy_equal']} (quantize {row['quantize']:.0f} s, "
              f"export+compile {row['export+compile']:.0f} s)", flush=True)
        rows.append(row)
    md = table(rows)
    print(md)
    if args.markdown:
        text = args.markdown.read_text()
        start, end = "<!-- quant_agreement:start -->", "<!-- quant_agreement:end -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        args.markdown.write_text(f"{head}{start}\n{md}\n{end}{tail}")
    return 0 if all(r["agreement"] >= TARGET for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
