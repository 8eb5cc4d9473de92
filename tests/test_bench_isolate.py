"""bench/isolate.py: a benchmark's run in a process of its own ends with its bench."""
import os
import pathlib
import signal
import subprocess
import sys
import time

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from isolate import run_child  # noqa: E402


def test_the_childs_exit_status_comes_back():
    assert run_child(["-c", "raise SystemExit(3)"]) == 3
    assert run_child(["-c", "pass"]) == 0


def test_a_terminated_bench_ends_its_child(tmp_path):
    """`timeout` sends SIGTERM to the bench alone: its child (a model on the GPU) must not run
    on beside the next command."""
    pidfile = tmp_path / "child.pid"
    child = (f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
             "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); from isolate import run_child; "
        f"run_child(['-c', {child!r}])")])
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 128 + signal.SIGTERM
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"the child {pid} outlived its bench")
