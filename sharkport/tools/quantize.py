"""Quantize a model's weights to a ggml type, into a parameter archive and/or a GGUF file.

    python -m sharkport.tools.quantize --irpa-file in.irpa --type q8_0 --output-irpa out.irpa
    python -m sharkport.tools.quantize --gguf-file in.gguf --type q4_1 \\
        --type-map 'output\\.weight=q8_0' --type-map 'ffn_down=f16' --output-gguf out.gguf

Matrices whose rows fill whole blocks get --type; norms, biases and other 1-D tensors keep
their type; --type-map rules (first match wins) override both, but give a 1-D tensor only a
float type (f16, bf16, f32). Values are quantized from
float32 with gguf.quants (llama.cpp's reference algorithm), one tensor at a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from ..errors import SharkportError, cli_main, prog
from ._cli import add_model_source, add_verbose, model_path, parse_args


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.quantize"),
        description="Quantize a model's matrices to a ggml type (q8_0, q4_0, q4_1, q5_0, q5_1, or "
                    "f16/bf16/f32) and write a parameter archive (--output-irpa) and/or a GGUF (--output-gguf).")
    add_model_source(parser)
    parser.add_argument("--type", metavar="TYPE",
                        help="the type of every matrix whose rows fill whole blocks: q8_0, q4_0, q4_1, "
                             "q5_0, q5_1, f16, bf16 or f32 (default: keep each tensor's type)")
    parser.add_argument("--type-map", action="append", default=[], metavar="REGEX=TYPE",
                        help="tensors whose name matches REGEX (re.search) get TYPE (1-D tensors, such as "
                             "norms and biases, only f16, bf16 or f32); repeatable, first match wins, e.g. "
                             "--type-map 'output\\.weight=q8_0'")
    parser.add_argument("--output-irpa", type=Path, metavar="OUT.irpa", help="write the quantized parameter archive")
    parser.add_argument("--output-gguf", type=Path, metavar="OUT.gguf", help="write the quantized GGUF file")
    add_verbose(parser)
    args = parse_args(parser, argv, {"--save": "--output-irpa"})
    if not args.output_irpa and not args.output_gguf:
        parser.error("nothing to write: pass --output-irpa OUT.irpa and/or --output-gguf OUT.gguf")

    from ..archive import Dataset, save_dataset
    from ..archive.quantize import TypeRule, parse_type, plan_types, requantized

    default = parse_type(args.type) if args.type else None
    rules = [TypeRule.parse(text) for text in args.type_map]
    if default is None and not rules:
        raise SharkportError("nothing to change: pass --type TYPE and/or --type-map REGEX=TYPE")
    source = model_path(args)
    dataset = Dataset.load(source)
    if args.output_gguf:  # what the GGUF writer needs, checked before anything is written
        from ..formats.keys import LlamaHParams

        try:
            LlamaHParams.from_metadata(dataset.hparams)
        except SharkportError as e:
            raise SharkportError(f"{source}: cannot be written as GGUF: {e}") from None
    plan = plan_types(dataset.metadata["tensors"], default, rules)
    quantized = requantized(dataset, plan)
    progress = sys.stderr.isatty()

    t0 = time.perf_counter()
    if args.output_irpa:
        save_dataset(quantized, args.output_irpa, progress=progress)
        print(f"wrote {args.output_irpa}", file=sys.stderr)
    if args.output_gguf:
        from ..formats.gguf_write import write_gguf

        write_gguf(quantized, args.output_gguf, progress=progress)
        print(f"wrote {args.output_gguf}", file=sys.stderr)
    counts = Counter(plan.values())
    summary = ", ".join(f"{n} {t.lower()}" for t, n in sorted(counts.items()))
    print(f"{len(plan)} tensors ({summary}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
