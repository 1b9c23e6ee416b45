"""python -m sharkport.tools.dump_inputs: the inputs of a prompt's prefill and first decode call as
.npy files, and the iree-run-module command lines that replay them.

    python -m sharkport.tools.dump_inputs --irpa-file x.irpa --config x.json [--vmfb x.vmfb] \\
        --prompt "The capital of France is" --output-npy-dir D

The calls are the runner's own (`python -m sharkport.run`, greedy): the same batch size, page
table and padding. The decode call's cache_state is the cache after the prefill, and its token
the one the runner chooses. The runner's outputs are saved beside the inputs as
expected_logits.npy, so the output of each command can be compared with them. The library is
sharkport/dump_inputs.py.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

from ..dump_inputs import dump_prompt
from ..errors import cli_main, prog
from ._cli import add_archive_source, add_device, add_module_files, add_verbose, archive_path, parse_args


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
    add_device(parser)
    parser.add_argument("--pages", type=int,
                        help="cache pages in the dumped cache_state (default: just enough for the prompt, its first "
                             "decode step and the scratch page)")
    add_verbose(parser)
    args = parse_args(parser, argv, {"--output-dir": "--output-npy-dir"})
    irpa = archive_path(args)
    ids, calls, script = dump_prompt(irpa, args.config, args.output_npy_dir, args.vmfb, args.prompt, args.token_ids,
                                     args.chat, args.device, args.pages)
    print(f"prompt: {len(ids)} tokens {ids}")
    for call in calls:
        print(f"\n# {call.function}: the runner's output is {call.expected}\n{shlex.join(call.command)}")
    print(f"\n(also in {script}; compare each logits.npy with expected_logits.npy beside it)")
    if shutil.which("iree-run-module") is None:
        print("note: iree-run-module is not on PATH; it comes with the iree-base-runtime package",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
