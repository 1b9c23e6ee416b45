"""The one error type of sharkport, and the wrapper that turns it into a one-line CLI exit.

Every message names the file (and the offset or tensor where it helps) and says what to do,
so a user who sees only the message can act on it.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from typing import Callable


class SharkportError(Exception):
    """A problem with the user's input or environment, reported as one line without traceback."""


def is_whole(value) -> bool:
    """A whole number as a file holds one (JSON's true and false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite number as a file holds one (not a boolean, not NaN or infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def json_type(value) -> str:
    """What JSON calls the type of a value parsed from it (for messages about a file's contents)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(
        type(value), type(value).__name__)


def short(value, limit: int = 40) -> str:
    """repr(value) cut to `limit` characters: a value from a file, quoted in a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cli_main(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Wraps a tool's `main(argv)`: a SharkportError (or a missing file) becomes one line on
    stderr and exit code 2; `--verbose` in argv or SHARKPORT_VERBOSE=1 keeps the traceback."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        args = sys.argv[1:] if argv is None else argv
        verbose = "--verbose" in args or os.environ.get("SHARKPORT_VERBOSE") == "1"
        try:
            return main(argv) or 0
        except (SharkportError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
            if verbose:
                raise
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapper


# the `sharkport` subcommand running now (set by sharkport.cli), for the tools' usage lines
_command: str | None = None


def prog(module: str) -> str:
    """A tool's name in its usage line: `sharkport export` when run as that subcommand,
    else `python -m <module>`."""
    return f"sharkport {_command}" if _command else f"python -m {module}"


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    return " ".join(str(e).split())
