"""Running a compiled module loads neither torch nor IREE's compiler (nor iree-turbine): the
runtime and `python -m sharkport.run` work where those cannot be imported, and give the tokens
the API gives in a process that has them."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from sharkport.archive import Dataset, save_dataset
from sharkport.tokenizer import _bytes_to_unicode

VARIANT = "gqa-untied"  # vocabulary 256: every byte is a token
PROMPT = "hello, world"

# Makes torch, iree.compiler and iree.turbine unimportable, as in an environment without them.
_BLOCK = """
import importlib.abc

class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch" or name.startswith(("iree.compiler", "iree.turbine")):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, _Absent())
"""

# `python -m sharkport.run ARGS`, then which of the forbidden modules the process holds.
_RUN = """
import runpy
import sys
{block}
import sharkport.runtime
import sharkport.runtime.generate, sharkport.runtime.sampling, sharkport.runtime.session, sharkport.runtime.vmfb

sys.argv = ["sharkport.run", *sys.argv[1:]]
try:
    runpy.run_module("sharkport.run", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
loaded = sorted(m for m in ("torch", "iree.compiler", "iree.turbine") if m in sys.modules)
print("loaded:", loaded)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def module_with_tokenizer(compiled_of, tmp_path_factory):
    """The tiny compiled module, its archive given a byte-level BPE tokenizer (one token per byte,
    no merges, no EOS) so that the run CLI takes text prompts."""
    vmfb, irpa, config = compiled_of(VARIANT)
    dataset = Dataset.load(irpa)
    chars = _bytes_to_unicode()
    tokenizer = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [chars[b] for b in range(256)],
                 "tokenizer.ggml.merges": []}
    path = tmp_path_factory.mktemp("runtime_imports") / "model.irpa"
    save_dataset(Dataset(dataset.path, {**dataset.metadata, "tokenizer": tokenizer}, dataset.theta), path,
                 progress=False)
    return vmfb, path, config


@pytest.mark.slow
@pytest.mark.parametrize("absent", [True, False], ids=["without-torch", "with-torch"])
def test_run_loads_neither_torch_nor_the_compiler(module_with_tokenizer, absent):
    from sharkport.api import TextGenerator

    vmfb, irpa, config = module_with_tokenizer
    want = TextGenerator.from_files(vmfb, irpa, config).generate(PROMPT, max_new_tokens=8).generations[0].token_ids
    code = _RUN.format(block=_BLOCK if absent else "")
    proc = subprocess.run([sys.executable, "-c", code, "--vmfb", str(vmfb), "--irpa-file", str(irpa),
                           "--config", str(config), "--prompt", PROMPT, "--max-new-tokens", "8", "--show-ids"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "loaded: []"
    tokens = next(line for line in lines if line.startswith("tokens: "))
    assert ast.literal_eval(tokens.removeprefix("tokens: ")) == want
    assert len(want) == 8
