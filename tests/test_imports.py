"""The package's imports, read from the source: no cycle, and none against the flow of data.

Every `import` and `from ... import` of a sharkport module counts, inside functions too (a lazy
import is still a dependency); only those under `if TYPE_CHECKING:` do not. A module may import
its own stage's modules and earlier stages' (STAGES), never a later stage's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sharkport"

# The flow: quant → formats → archive → ops → layers → models → kernels → export → compile →
# runtime → tools. quant comes first: it holds the ggml block layouts the file formats are
# read and written by. Each entry: (stage, module prefixes); a module takes the stage of its
# longest matching prefix (command-line modules are tools wherever they live).
STAGES = [
    ("base", ["sharkport.errors", "sharkport.fileio", "sharkport.packaged", "sharkport.mlir_ops"]),
    ("quant", ["sharkport.quant"]),
    ("formats", ["sharkport.formats", "sharkport.tokenizer", "sharkport.chat_template"]),
    ("archive", ["sharkport.archive", "sharkport.parallel.sharding", "sharkport.parallel.archive",
                 "sharkport.datasets"]),
    ("ops", ["sharkport.ops", "sharkport.parallel.comm"]),
    ("layers", ["sharkport.layers"]),
    ("models", ["sharkport.models", "sharkport.parallel.llama"]),
    ("kernels", ["sharkport.kernels"]),
    ("export", ["sharkport.export", "sharkport.parallel"]),
    ("compile", ["sharkport.compile"]),
    ("runtime", ["sharkport.runtime", "sharkport.quality"]),
    ("tools", ["sharkport.tools", "sharkport.api", "sharkport.run", "sharkport.cli", "sharkport.__main__",
               "sharkport.export.__main__", "sharkport.datasets.__main__", "sharkport"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _stage(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} has no stage in STAGES"
    return rank


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The sharkport modules `module` imports (a name imported from a package counts as its
    submodule where there is one)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(node) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
               for node in ast.walk(n)}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()

    def resolve(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "sharkport"}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "sharkport":
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else resolve(target))
    found.discard(module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_no_import_runs_against_the_flow(graph):
    against = [f"{m} ({STAGES[_stage(m)][0]}) imports {t} ({STAGES[_stage(t)][0]})"
               for m, targets in sorted(graph.items()) for t in sorted(targets) if _stage(t) > _stage(m)]
    assert not against, "\n".join(against)


def test_no_import_cycle(graph):
    done, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in done:
            return
        stack.append(m)
        for t in sorted(graph[m]):
            visit(t)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_graph_sees_imports():
    """The reader finds what it should (a test of the test): relative, absolute and lazy imports."""
    modules = _modules()
    assert "sharkport.errors" in _imports("sharkport.formats.gguf", modules["sharkport.formats.gguf"], modules)
    assert "sharkport.export.kernels" in _imports("sharkport.export.exporter", modules["sharkport.export.exporter"],
                                                  modules)
