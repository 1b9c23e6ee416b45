"""The inputs of a prompt's prefill and first decode call as .npy files, and the
iree-run-module command lines that replay them (`python -m sharkport.tools.dump_inputs`).

The calls are the runner's own (`python -m sharkport.run`, greedy): the same batch size, page
table and padding. The decode call's cache_state is the cache after the prefill, and its token
the one the runner chooses. The runner's outputs are saved beside the inputs as
expected_logits.npy, so the output of each command can be compared with them.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SharkportError
from .export.abi import DECODE_ARGS, PREFILL_ARGS
from .runtime.generate import PageAllocator, next_token_logits
from .runtime.inputs import decode_inputs, pick_batch_size, prefill_inputs


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

    bs = pick_batch_size(config.prefill_batch_sizes, 1, "prefill")
    inputs = prefill_inputs([prompt_ids], [pages], bs, stride, scratch)
    cache = session.cache_to_host()
    logits = session.prefill(*inputs)
    named = dict(zip(PREFILL_ARGS, (*inputs, cache)))
    calls.append(_write_call(out / "prefill", f"prefill_bs{bs}", named, logits, vmfb, irpa, device))

    next_token = int(np.argmax(next_token_logits(logits, 0, n)))
    bs = pick_batch_size(config.decode_batch_sizes, 1, "decode")
    inputs = decode_inputs([next_token], [n], [pages], bs, stride, scratch)
    cache = session.cache_to_host()  # after the prefill
    logits = session.decode(*inputs)
    named = dict(zip(DECODE_ARGS, (*inputs, cache)))
    calls.append(_write_call(out / "decode", f"decode_bs{bs}", named, logits, vmfb, irpa, device))
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


def dump_prompt(irpa: Path, config_path: Path, output_dir: Path, vmfb: Path | None = None,
                prompt: str | None = None, token_ids: str | None = None, chat: bool = False,
                device: str | None = None, pages: int | None = None) -> tuple[list[int], list[DumpedCall], Path]:
    """`dump_inputs` for a prompt given as text (`prompt`, encoded with the archive's tokenizer,
    in its chat template with `chat`) or as comma-separated `token_ids`, on the compiled module
    (default: `config_path` with suffix .vmfb) with a cache of `pages` pages (default: just
    enough for the prompt). Also writes the commands to output_dir/commands.sh. Returns the
    prompt's ids, the calls and the script."""
    vmfb = vmfb or config_path.with_suffix(".vmfb")
    if not vmfb.is_file():
        raise SharkportError(f"{vmfb}: no such file; pass the compiled module with --vmfb")

    from .api import encode_prompt
    from .archive import Dataset  # torch loads only once the module is known to exist
    from .export.abi import ServiceConfig
    from .runtime.session import IreeSession

    if token_ids is not None:
        try:
            ids = [int(t) for t in token_ids.split(",") if t.strip()]
        except ValueError:
            raise SharkportError(f"--token-ids takes comma-separated integers, got {token_ids!r}") from None
    else:
        ids = None
    if not config_path.is_file():
        raise SharkportError(f"{config_path}: no such file; pass the JSON written by --output-config")
    config = ServiceConfig.load(config_path)
    if ids is None:
        ids = encode_prompt(Dataset.load(irpa).tokenizer(), prompt, chat)
    pages = pages or math.ceil((len(ids) + 1) / config.block_seq_stride) + 1  # + the scratch page
    session = IreeSession(vmfb, irpa, config, pages=max(pages, 2), device=device)
    calls = dump_inputs(session, ids, output_dir, vmfb, irpa, session.device_name)
    script = Path(output_dir) / "commands.sh"
    script.write_text("#!/bin/sh\nset -e\n" + "\n".join(shlex.join(c.command) for c in calls) + "\n")
    return ids, calls, script
