"""Runs a command line as users do: `python -m <module> <args>` in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys


def run(*args: str, check_rc: int = 0, timeout: float = 600, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    """`run("sharkport.tools.dump_gguf", "--gguf-file", ...)`; asserts the exit status. `env`: variables
    set for this process on top of the environment's."""
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env} if env else None)
    assert proc.returncode == check_rc, proc.stderr
    return proc
