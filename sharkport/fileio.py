"""Safe file output: whole files or nothing."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "", swap: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside `path`; renames it onto `path` only if the block succeeds,
    so a failure or a kill leaves the old file (or none), never a partial one. With `swap`, an
    existing file is swapped out rather than renamed over (see `swap_in`: faster for big files)."""
    path = Path(path)
    with _temporary(path, suffix) as tmp:
        yield tmp
        if swap:
            swap_in(tmp, path)
        else:
            os.replace(tmp, path)


@contextlib.contextmanager
def atomic_outputs(*paths: str | os.PathLike) -> Iterator[list[Path]]:
    """Temporary paths for outputs that belong together: renamed onto their paths, in the order
    given, only when the whole block succeeds. A failure or a kill before then leaves every old
    file; only a kill in the microseconds between two renames leaves the first ones new."""
    with contextlib.ExitStack() as stack:
        temporaries = [stack.enter_context(_temporary(Path(p))) for p in paths]
        yield temporaries
        for tmp, path in zip(temporaries, paths):
            os.replace(tmp, path)


@contextlib.contextmanager
def _temporary(path: Path, suffix: str = "") -> Iterator[Path]:
    """A new empty file beside `path`, named after it and this process, deleted on the way out
    unless renamed; a killed writer's are deleted by the next write (remove_stale_temporaries)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=suffix + ".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600; give the output a normal file's mode
    os.close(fd)
    try:
        yield Path(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Deletes the temporaries of `path` that a killed writer left (its process is gone); a
    temporary of a live process stays. Returns what was deleted."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\..*\.tmp$")
    removed = []
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        m = pattern.match(candidate.name)
        if m and not _alive(int(m.group(1))):
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


_RENAME_EXCHANGE = 2  # linux/fs.h


def swap_in(tmp: Path, path: Path) -> None:
    """Atomically puts `tmp` at `path`. Over an existing regular file it swaps the two names
    (renameat2 RENAME_EXCHANGE; `tmp` then names the old file, for the caller to delete) rather
    than renaming over it: on ext4 a rename over an existing file makes the kernel allocate and
    start writing back all of the new file's data inside the rename (auto_da_alloc), which took
    2.1 s for a 2.2 GB archive; the swap takes microseconds. Elsewhere: os.replace."""
    if path.is_file() and not path.is_symlink():
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.renameat2(-100, os.fsencode(tmp), -100, os.fsencode(path), _RENAME_EXCHANGE) == 0:  # AT_FDCWD
                return
        except (AttributeError, OSError):  # no renameat2 in this libc, or no libc to load
            pass
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
