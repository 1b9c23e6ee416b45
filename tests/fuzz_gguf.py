"""GGUF fuzzing: hypothesis mutates small valid GGUF files (byte flips, truncations, insertions,
deletions, header fields overwritten with extreme integers) and each result goes through
`read_gguf` and `import_gguf`. A case may succeed or raise SharkportError; anything else (another
exception, a case past its time limit, a crash) is a bug.

Used in-process by tests/test_fuzz.py (quick suite) and as a program for the long run, so that
a crash ends the child process, not pytest:

    python tests/fuzz_gguf.py --cases 10000 --json result.json

tools/fuzz_report.py runs it and writes docs/reliability.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import json
import re
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from gguf_seeds import Slot, header_slots, write_seed  # noqa: E402

from sharkport.archive import import_gguf  # noqa: E402
from sharkport.errors import SharkportError  # noqa: E402
from sharkport.formats.gguf import read_gguf  # noqa: E402

CASE_SECONDS = 10.0  # a case still running after this is a hang
# Integers at the edges of every width a GGUF field can have.
EXTREMES = [0, 1, 2, 3, 4, 5, 7, 8, 31, 32, 33, 63, 64, 255, 256, 2**15 - 1, 2**16 - 1, 2**31 - 1,
            2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 33, 2**64 - 1]


class CaseTimeout(BaseException):
    """Raised by the alarm in a case that runs too long (a BaseException, so no `except
    Exception` in the code under test can swallow it)."""


@dataclass(frozen=True)
class Seed:
    name: str
    data: bytes
    slots: list[Slot]
    header_end: int  # where tensor data starts; most structure lives before it


def make_seeds(folder: Path) -> list[Seed]:
    """Three valid files: the tiny llama, the same with general.alignment 64, and big-endian."""
    import gguf

    seeds = []
    for name, kwargs in (("llama", {}), ("aligned64", {"alignment": 64}), ("big-endian", {"big_endian": True})):
        path = write_seed(folder / f"{name}.gguf", **kwargs)
        slots = header_slots(path) if not kwargs.get("big_endian") else []
        seeds.append(Seed(name, path.read_bytes(), slots, int(gguf.GGUFReader(path).data_offset)))
    return seeds


# --- mutations: each is (kind, arguments) and applies to bytes ---------------------------------

def _position(seed: Seed):
    # Half the positions fall in the header, where a flipped byte changes the file's structure.
    return st.one_of(st.integers(0, seed.header_end - 1), st.integers(0, len(seed.data) - 1))


def mutation(seed: Seed):
    pos = _position(seed)
    kinds = [
        st.tuples(st.just("flip"), pos, st.integers(1, 255)),
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("delete"), pos, st.integers(1, 64)),
    ]
    if seed.slots:
        value = st.one_of(st.sampled_from(EXTREMES), st.integers(0, 2**64 - 1))
        kinds.append(st.tuples(st.just("field"), st.sampled_from(seed.slots), value))
    return st.one_of(*kinds)


def mutations(seeds: list[Seed]):
    """(seed name, one to three mutations of that seed); `apply` makes the bytes. The strategy
    is built once: building strategies per draw was half of the run time."""
    return st.one_of(*[st.tuples(st.just(s.name), st.lists(mutation(s), min_size=1, max_size=3))
                       for s in seeds])


def apply(data: bytes, ops) -> bytes:
    out = bytearray(data)
    for op in ops:
        kind, *args = op
        if kind == "flip":
            at, mask = args
            if at < len(out):
                out[at] ^= mask
        elif kind == "truncate":
            del out[args[0]:]
        elif kind == "insert":
            out[args[0]:args[0]] = args[1]
        elif kind == "delete":
            del out[args[0]:args[0] + args[1]]
        elif kind == "field":
            slot, value = args
            out[slot.offset:slot.offset + slot.width] = (value % 2 ** (8 * slot.width)).to_bytes(slot.width, "little")
    return bytes(out)


def describe(ops) -> str:
    parts = []
    for kind, *args in ops:
        if kind == "field":
            parts.append(f"field {args[0].what} @{args[0].offset} = {args[1]}")
        elif kind == "insert":
            parts.append(f"insert {len(args[1])} bytes @{args[0]}")
        else:
            parts.append(f"{kind} {' '.join(map(str, args))}")
    return "; ".join(parts)


# --- one case ----------------------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise CaseTimeout(f"case still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(data: bytes, folder: Path) -> tuple[str, str]:
    """Reads and imports `data` as a GGUF: ("ok", ""), ("rejected-on-read", message),
    ("rejected-on-import", message). Other exceptions and CaseTimeout propagate."""
    path, out = folder / "case.gguf", folder / "case.irpa"
    path.write_bytes(data)
    with time_limit(CASE_SECONDS):
        try:
            read_gguf(path)
        except SharkportError as e:
            return "rejected-on-read", str(e)
        try:
            import_gguf(path, out, progress=False)
        except SharkportError as e:
            if out.exists():
                raise AssertionError(f"{out} was written although the import failed")
            return "rejected-on-import", str(e)
    out.unlink()
    return "ok", ""


# What each of sharkport's GGUF errors says, as (kind, pattern), to count rejections by kind.
ERROR_KINDS = [
    ("not GGUF (magic)", r"the magic is|not a GGUF file"),
    ("unsupported GGUF version", r"GGUF version \d+ is not supported"),
    ("shorter than the 24-byte header", r"shorter than a GGUF header"),
    ("count or length larger than the rest of the file", r"more than the .* can hold"),
    ("field cut off by the end of the file", r"needs \d+ bytes but the file ends"),
    ("invalid UTF-8 in a key or string", r"not valid UTF-8"),
    ("unknown metadata value type", r"not a GGUF value type"),
    ("array of arrays", r"array of arrays"),
    ("duplicate key or tensor name", r"appears twice"),
    ("bad general.alignment", r"general\.alignment"),
    ("more than 4 dimensions", r"dimensions; GGUF allows"),
    ("unknown ggml tensor type", r"which no known ggml type"),
    ("rows not whole quantization blocks", r"not a whole number of"),
    ("zero-size tensor", r"holds no values"),
    ("tensor data misaligned", r"not a multiple of the file's alignment"),
    ("tensor data past the end of the file", r"past the end of the"),
    ("tensors overlap", r"overlap"),
    ("tensor type sharkport cannot import", r"cannot import yet"),
]


def error_kind(message: str) -> str:
    """The kind of a SharkportError message (the first of ERROR_KINDS it matches)."""
    for kind, pattern in ERROR_KINDS:
        if re.search(pattern, message):
            return kind
    return "other: " + " ".join(re.sub(r"\d+", "N", message.split(": ", 1)[-1]).split())[:80]


# --- the long run (a separate process) ----------------------------------------------------------

def fuzz(cases: int, folder: Path, progress_file: Path | None = None) -> dict:
    seeds = make_seeds(folder)
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}  # kind → the first message of that kind
    bugs: list[dict] = []
    slowest = 0.0
    t_start = time.perf_counter()

    data_of = {s.name: s.data for s in seeds}

    @settings(max_examples=cases, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(mutations(seeds))
    def one(case):
        nonlocal slowest
        name, ops = case
        data = apply(data_of[name], ops)
        if progress_file is not None:  # the case a crash happened in, for the parent to report
            progress_file.write_text(f"{name}: {describe(ops)}\n")
        t0 = time.perf_counter()
        try:
            outcome, message = run_case(data, folder)
        except CaseTimeout:
            outcome, message = "timeout", describe(ops)
        except Exception as e:
            outcome, message = f"other-exception:{type(e).__name__}", describe(ops)
            bugs.append({"seed": name, "mutations": describe(ops), "error": traceback.format_exc(limit=4)})
        slowest = max(slowest, time.perf_counter() - t0)
        outcomes[outcome] += 1
        if outcome.startswith("rejected"):
            kinds[error_kind(message)] += 1
            examples.setdefault(error_kind(message), message.split(": ", 1)[-1])
        elif outcome == "timeout":
            bugs.append({"seed": name, "mutations": message, "error": "timeout"})

    one()
    return {
        "cases": sum(outcomes.values()),
        "seconds": round(time.perf_counter() - t_start, 1),
        "slowest_case_s": round(slowest, 3),
        "case_time_limit_s": CASE_SECONDS,
        "seeds": {s.name: len(s.data) for s in seeds},
        "outcomes": dict(outcomes.most_common()),
        "error_kinds": dict(kinds.most_common()),
        "error_examples": examples,
        "bugs": bugs[:20],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--progress-file", type=Path, help="holds the case being run")
    args = parser.parse_args(argv)
    faulthandler.enable()  # a crash prints where it happened
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        result = fuzz(args.cases, Path(tmp), args.progress_file)
    text = json.dumps(result, indent=2)
    args.json.write_text(text) if args.json else print(text)
    return 1 if result["bugs"] else 0


if __name__ == "__main__":
    sys.exit(main())
