"""A benchmark's run in a Python process of its own: on the GPU a process's later model or
Engine decodes ~1.5-2% slower than its first (H100, 2026-12-07: docs/performance.md, "The
catch-up feed's first launches"), so configurations timed one after another in one process
favour the first."""
from __future__ import annotations

import signal
import subprocess
import sys


def run_child(argv: list) -> int:
    """`python *argv` to its end; its exit status. A SIGTERM to this process (`timeout` in
    bench/gpu_check.sh) kills the child too: no measurement outlives its bench to share the GPU
    with the next one."""
    old = signal.signal(signal.SIGTERM, _exit)
    try:
        # (subprocess.run kills its child on any exception, SystemExit included)
        return subprocess.run([sys.executable, *argv]).returncode
    finally:
        signal.signal(signal.SIGTERM, old)


def _exit(signum, frame):
    raise SystemExit(128 + signum)
