"""python -m sharkport.tools.dump_inputs: the inputs of a prompt's prefill and first decode call as
.npy files, and the iree-run-module command lines that replay them.

    python -m sharkport.tools.dump_inputs --irpa-file x.irpa --config x.json [--vmfb x.vmfb] \\
        --prompt "The capital of France is" --output-npy-dir D

The calls are the runner's own (`python -m sharkport.run`, greedy): the same batch size, page
table and padding. The decode call's cache_state is the cache after the prefill, and its token
the one the runner chooses. The runner's outputs are saved beside the inputs as
expected_logits.npy, so the output of each command can be compared with them.
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SharkportError, cli_main, prog
from ._cli import add_archive_source, add_module_files, add_verbose, archive_path, parse_args


@dataclass(frozen=True)
class DumpedCall:
    """One module call written to `folder`: inputs in ABI order, the runner's output, the command."""

    function: str
    folder: Path
    inputs: tuple[Path, ...]
    expected: Path
    output: Path
    command: tuple[str, ...]


def dump_inputs(session, prompt_ids: list[int], output_dir: str | Path, vmfb: str | Path,
                irpa: str | Path, device: str = "local-task") -> list[DumpedCall]:
    """Runs the prompt's prefill and first greedy decode step on `session` (an IreeSession or
    EagerSession with a fresh cache), as the runner would, and writes every input and output."""
    from ..runtime.generate import PageAllocator, _pick, next_token_logits

    config = session.config
    stride = config.block_seq_stride
    n = len(prompt_ids)
    if not n:
        raise SharkportError("the prompt encodes to no tokens; give a non-empty prompt")
    if n + 1 > config.max_seq_len:
        raise SharkportError(f"the prompt has {n} tokens; the export serves at most {config.max_seq_len - 1} "
                             "before a decode step")
    # The runner's allocation: a scratch page for padding rows first, then the sequence's pages.
    allocator = PageAllocator(session.pages)
    scratch = allocator.alloc(1)[0]
    pages = allocator.alloc(math.ceil((n + 1) / stride))
    out = Path(output_dir)
    calls = []

    bs = _pick(config.prefill_batch_sizes, 1, "prefill")
    blocks = math.ceil(n / stride)
    tokens = np.zeros((bs, blocks * stride), np.int64)
    tokens[0, :n] = prompt_ids
    lens = np.ones(bs, np.int64)
    lens[0] = n
    ids = np.full((bs, blocks), scratch, np.int64)
    ids[0] = pages[:blocks]
    cache = session.cache_to_host()
    logits = session.prefill(tokens, lens, ids)
    inputs = {"tokens": tokens, "seq_lens": lens, "seq_block_ids": ids, "cache_state": cache}
    calls.append(_write_call(out / "prefill", f"prefill_bs{bs}", inputs, logits, vmfb, irpa, device))

    next_token = int(np.argmax(next_token_logits(logits, 0, n)))
    bs = _pick(config.decode_batch_sizes, 1, "decode")
    blocks = n // stride + 1
    tokens = np.zeros((bs, 1), np.int64)
    tokens[0, 0] = next_token
    positions = np.zeros(bs, np.int64)
    positions[0] = n
    ids = np.full((bs, blocks), scratch, np.int64)
    ids[0] = pages[:blocks]
    cache = session.cache_to_host()  # after the prefill
    logits = session.decode(tokens, positions + 1, positions, ids)
    inputs = {"tokens": tokens, "seq_lens": positions + 1, "start_positions": positions,
              "seq_block_ids": ids, "cache_state": cache}
    calls.append(_write_call(out / "decode", f"decode_bs{bs}", inputs, logits, vmfb, irpa, device))
    return calls


def _write_call(folder: Path, function: str, inputs: dict[str, np.ndarray], logits: np.ndarray,
                vmfb, irpa, device: str) -> DumpedCall:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, value in inputs.items():
        paths.append(folder / f"{name}.npy")
        np.save(paths[-1], value)
    expected, output = folder / "expected_logits.npy", folder / "logits.npy"
    np.save(expected, logits)
    command = ("iree-run-module", f"--module={Path(vmfb).resolve()}",
               f"--parameters=model={Path(irpa).resolve()}", f"--device={device}", f"--function={function}",
               *(f"--input=@{p.resolve()}" for p in paths), f"--output=@{output.resolve()}")
    return DumpedCall(function, folder, tuple(paths), expected, output, command)


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.dump_inputs"),
        description="Write the .npy inputs of a prompt's prefill and first decode call (the decode "
                    "cache_state is the cache after prefill), the runner's logits for each, and print "
                    "the iree-run-module command lines that replay the calls.")
    add_module_files(parser, vmfb_required=False)
    add_archive_source(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text, encoded with the archive's tokenizer")
    what.add_argument("--token-ids", help="the prompt as comma-separated token ids, e.g. 1,450,7")
    parser.add_argument("--chat", action="store_true", help="format --prompt with the archive's chat template")
    parser.add_argument("--output-npy-dir", type=Path, required=True, metavar="DIR",
                        help="where to write each call's inputs, the runner's outputs and commands.sh")
    parser.add_argument("--device", help="IREE device (default: local-task for a CPU module, the first GPU of its kind for a GPU module)")
    parser.add_argument("--pages", type=int,
                        help="cache pages in the dumped cache_state (default: just enough for the prompt)")
    add_verbose(parser)
    args = parse_args(parser, argv, {"--output-dir": "--output-npy-dir"})
    args.irpa_file = archive_path(args)
    vmfb = args.vmfb or args.config.with_suffix(".vmfb")
    if not vmfb.is_file():
        raise SharkportError(f"{vmfb}: no such file; pass the compiled module with --vmfb")

    from ..api import encode_prompt
    from ..archive import Dataset
    from ..export.abi import ServiceConfig
    from ..runtime.session import IreeSession

    if args.token_ids is not None:
        try:
            ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise SharkportError(f"--token-ids takes comma-separated integers, got {args.token_ids!r}") from None
    else:
        ids = None
    if not args.config.is_file():
        raise SharkportError(f"{args.config}: no such file; pass the JSON written by --output-config")
    config = ServiceConfig.load(args.config)
    stride = config.block_seq_stride
    if ids is None:
        ids = encode_prompt(Dataset.load(args.irpa_file).tokenizer(), args.prompt, args.chat)
    pages = args.pages or math.ceil((len(ids) + 1) / stride) + 1  # + the scratch page
    session = IreeSession(vmfb, args.irpa_file, config, pages=max(pages, 2), device=args.device)
    calls = dump_inputs(session, ids, args.output_npy_dir, vmfb, args.irpa_file, session.device_name)

    print(f"prompt: {len(ids)} tokens {ids}")
    script = args.output_npy_dir / "commands.sh"
    lines = []
    for call in calls:
        line = shlex.join(call.command)
        lines.append(line)
        print(f"\n# {call.function}: the runner's output is {call.expected}\n{line}")
    script.write_text("#!/bin/sh\nset -e\n" + "\n".join(lines) + "\n")
    print(f"\n(also in {script}; compare each logits.npy with expected_logits.npy beside it)")
    if shutil.which("iree-run-module") is None:
        print("note: iree-run-module is not on PATH; it comes with the iree-base-runtime package",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
