"""Pieces shared by the command-line tools: model-source flags, generation flags and result printing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SharkportError


def add_model_source(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """--gguf-file | --irpa-file | --hf-dataset (read them back with `model_path`)."""
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument("--gguf-file", type=Path, help="a GGUF model file (converted in memory)")
    src.add_argument("--irpa-file", type=Path, help="a parameter archive made by dump_gguf --output-irpa or import_hf")
    add_hf_dataset(src)


def model_path(args: argparse.Namespace) -> Path | None:
    """The model file or folder named by add_model_source's flags (a dataset is fetched first)."""
    if getattr(args, "hf_dataset", None):
        return hf_dataset_path(args.hf_dataset)
    return args.gguf_file or args.irpa_file


def add_archive_source(parser: argparse.ArgumentParser) -> None:
    """--irpa-file | --hf-dataset, for tools that run a compiled module over its parameters (read
    them back with `archive_path`)."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--irpa-file", type=Path, help="the parameter archive the module was exported from")
    add_hf_dataset(src)


def archive_path(args: argparse.Namespace) -> Path:
    """The archive named by add_archive_source's flags (a dataset's is imported once, cached)."""
    return args.irpa_file or hf_dataset_path(args.hf_dataset, "irpa")


def add_device(parser: argparse.ArgumentParser) -> None:
    """--device: the IREE device a compiled module runs on (IreeSession's default where not given)."""
    parser.add_argument("--device", help="IREE device: local-task (the default for a CPU module), local-sync, "
                                          "cuda://0, hip://0 or vulkan://0 (a GPU module's default is the first "
                                          "GPU of its kind: docs/devices.md); for a tensor-parallel module N "
                                          "local-sync devices, or give N comma-separated URIs: docs/parallel.md")


def add_module_files(parser: argparse.ArgumentParser, vmfb_required: bool = True) -> None:
    """--vmfb and --config: a compiled module and the service config exported with it."""
    parser.add_argument("--vmfb", type=Path, required=vmfb_required,
                        help="the compiled module (written by the export's --output-vmfb)"
                             + ("" if vmfb_required else "; default: --config with suffix .vmfb"))
    parser.add_argument("--config", type=Path, required=True,
                        help="the service config JSON (written by the export's --output-config)")


def add_hf_dataset(group) -> None:
    """Adds `--hf-dataset NAME` to a parser or (usually) a mutually exclusive source group."""
    group.add_argument("--hf-dataset", metavar="NAME",
                       help="a model registered in datasets.yaml (`python -m sharkport.datasets list`), "
                            "fetched into the Hugging Face cache on first use")


def hf_dataset_path(name: str, kind: str = "model") -> Path:
    """The local path of a registered dataset, fetched first if needed: kind "model" gives its
    GGUF file or checkpoint folder, "gguf" its GGUF file, "hf" its checkpoint folder and
    "irpa" a parameter archive imported from it once (cached)."""
    from ..datasets import dataset_archive, fetch

    if kind == "irpa":
        return dataset_archive(name)
    fetched = fetch(name)
    if kind != "model" and (kind == "gguf") != ("gguf" in fetched.paths):
        other = "import_hf" if kind == "gguf" else "dump_gguf"
        raise SharkportError(
            f"dataset {name} has no {'GGUF file' if kind == 'gguf' else 'safetensors checkpoint'}; "
            f"use `python -m sharkport.tools.{other} --hf-dataset {name}` instead"
        )
    return fetched.model_path


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None,
               renamed: dict[str, str]) -> argparse.Namespace:
    """parser.parse_args, with the flags' older names (`renamed`: old → new) still accepted but
    left out of --help."""
    args = sys.argv[1:] if argv is None else list(argv)
    end = args.index("--") if "--" in args else len(args)
    for i, arg in enumerate(args[:end]):
        flag, eq, value = arg.partition("=")
        if flag in renamed:
            args[i] = renamed[flag] + eq + value
    return parser.parse_args(args)


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """The prompt and GenerationConfig flags shared by run and tools.generate."""
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt; repeat for a batch (prompts may differ in length)")
    parser.add_argument("--chat", action="store_true",
                        help="format each prompt as a user message with the archive's chat template")
    g = parser.add_argument_group("generation (greedy unless --do-sample)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    g.add_argument("--temperature", type=float, default=1.0, help="with --do-sample: divide logits by this (0: greedy)")
    g.add_argument("--top-k", type=int, default=0, help="with --do-sample: keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="with --do-sample: keep the smallest set of likeliest tokens with probability >= p")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="with --do-sample: keep tokens at least this share as likely as the likeliest (0: off)")
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="hold off EOS and the other stop tokens until this many tokens are generated")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalize tokens already in the sequence (1.0: off; 1.1-1.3 typical)")
    g.add_argument("--seed", type=int, help="with --do-sample: make the draws repeat")
    g.add_argument("--num-return-sequences", type=int, default=1, help="samples per prompt (needs --do-sample)")
    g.add_argument("--stop", action="append", default=[], help="stop when the text contains this string (repeatable)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--no-continuous-batching", action="store_true",
                   help="start new prompts only when the whole running batch has finished")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")


def generation_options(args: argparse.Namespace) -> dict:
    """TextGenerator.generate's options from add_generation_args' flags."""
    return dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, min_new_tokens=args.min_new_tokens,
                repetition_penalty=args.repetition_penalty,
                seed=args.seed, num_return_sequences=args.num_return_sequences, stop=tuple(args.stop))


def load_dataset(args: argparse.Namespace):
    from ..archive import Dataset  # torch loads only once the arguments are known to be good

    return Dataset.load(model_path(args))


def batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type for '1,4' → (1, 4); '' → ()."""
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4, got {text!r}")
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes
