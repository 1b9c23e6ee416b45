"""The `sharkport` command (also `python -m sharkport`): one subcommand per tool.

    sharkport import --gguf-file x.gguf --output-irpa x.irpa     # or --model-dir DIR, --hf-dataset NAME
    sharkport export --irpa-file x.irpa --output-mlir x.mlir --output-config x.json --output-vmfb x.vmfb
    sharkport run --vmfb x.vmfb --irpa-file x.irpa --config x.json --prompt "..."

Each subcommand is the `python -m` tool of the same name with the same flags; `sharkport CMD
--help` prints them. Tools load only when their subcommand runs, so `sharkport --help` is quick.
"""

from __future__ import annotations

import importlib
import sys

from . import errors
from .errors import SharkportError, cli_main

# subcommand → (module whose main(argv) runs it, one line for --help)
COMMANDS = {
    "import": ("", "a GGUF file or a Hugging Face checkpoint → a parameter archive (.irpa)"),
    "export": ("sharkport.export.__main__", "export prefill/decode to MLIR, compile to a .vmfb, write the service config"),
    "run": ("sharkport.run", "generate text with a compiled module"),
    "generate": ("sharkport.tools.generate", "generate text with the eager PyTorch recipe (the reference)"),
    "verify": ("sharkport.tools.verify", "compare a compiled module with the eager recipe (and transformers)"),
    "perplexity": ("sharkport.tools.perplexity", "perplexity over a text, KL-divergence against a base model"),
    "check": ("sharkport.tools.check", "check a model's metadata against its tensors, a module against its config"),
    "quantize": ("sharkport.tools.quantize", "quantize an archive's matrices (gguf.quants bytes)"),
    "dump-gguf": ("sharkport.tools.dump_gguf", "print what a GGUF file holds; dump or import its tensors"),
    "import-hf": ("sharkport.tools.import_hf", "import a Hugging Face checkpoint folder"),
    "to-gguf": ("sharkport.tools.to_gguf", "write an archive or a Hugging Face checkpoint as a GGUF file"),
    "dump-inputs": ("sharkport.tools.dump_inputs", "write a prompt's prefill/decode inputs for iree-run-module"),
    "datasets": ("sharkport.datasets.__main__", "list or fetch the registered models (--hf-dataset NAME)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return ("usage: sharkport COMMAND [flags]   (sharkport COMMAND --help for its flags)\n\n"
            "Port LLMs to IREE: import, export, compile, run.\n\ncommands:\n" + "\n".join(lines))


def _import_tool(argv: list[str]) -> str:
    """The tool behind `sharkport import`: dump_gguf for a GGUF file, import_hf for a checkpoint."""
    if any(a in ("-h", "--help") for a in argv):
        return "help"
    if any(a.split("=")[0] == "--model-dir" for a in argv):
        return "sharkport.tools.import_hf"
    if any(a.split("=")[0] == "--gguf-file" for a in argv):
        return "sharkport.tools.dump_gguf"
    if "--hf-dataset" in (a.split("=")[0] for a in argv):
        from .datasets import load_registry

        i = next(i for i, a in enumerate(argv) if a.split("=")[0] == "--hf-dataset")
        name = argv[i].partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
        entry = load_registry().get(name)
        if entry is None:
            raise SharkportError(f"--hf-dataset {name!r} is not registered (`sharkport datasets list`)")
        return "sharkport.tools.dump_gguf" if "gguf" in entry.files else "sharkport.tools.import_hf"
    raise SharkportError("sharkport import needs --gguf-file FILE, --model-dir DIR or --hf-dataset NAME "
                         "(and --output-irpa X.irpa)")


@cli_main
def _import(argv: list[str]) -> int:
    module = _import_tool(argv)
    if module == "help":
        print("usage: sharkport import (--gguf-file FILE | --model-dir DIR | --hf-dataset NAME) "
              "--output-irpa X.irpa [flags]\n\n"
              "A GGUF file is imported by `sharkport dump-gguf --output-irpa` (quantized tensors stay packed),\n"
              "a Hugging Face checkpoint folder by `sharkport import-hf`; see their --help for the other flags.")
        return 0
    if module.endswith("dump_gguf"):
        if not any(a.split("=")[0] in ("--output-irpa", "--save") for a in argv):
            raise SharkportError("sharkport import needs --output-irpa X.irpa (where to write the archive)")
        if "--quiet" not in argv:
            argv = [*argv, "--quiet"]  # the import alone, without dump_gguf's report
    return importlib.import_module(module).main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    errors._command = name
    if name == "import":
        return _import(rest)
    return importlib.import_module(COMMANDS[name][0]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
