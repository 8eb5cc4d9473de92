"""`--backend auto` (the CLI's default): cuda when a GPU is usable, else numpy, said on stderr.

Usable means the [cuda] extra is importable (cuda-bindings, numba-cuda) and the driver reports a
device with the asked ordinal. The device check runs in a child process: initialising CUDA here
would leave a CUDA-initialised parent for `serve`'s gunicorn fork, which CUDA does not survive.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

CHOICES = ("auto", "numpy", "cuda")

# the child's whole program: the device count, or the driver's complaint, on stdout
_PROBE = ("from cuda.bindings import driver as d\n"
          "r = d.cuInit(0)\n"
          "print(int(d.cuDeviceGetCount()[1]) if int(r[0]) == 0 else 'cuInit failed')\n")


def cuda_extra_missing() -> list:
    """The [cuda] extra's modules that cannot be imported (numba-cuda's, cuda-bindings')."""
    missing = []
    for module in ("cuda.bindings", "numba_cuda"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):       # a parent package absent or broken
            found = False
        if not found:
            missing.append(module)
    return missing


def cuda_device_count(timeout_s: float = 30.0) -> tuple:
    """(number of CUDA devices, why none) from a child process; (0, reason) when it fails."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return 0, f"the device probe failed ({exc})"
    text = out.stdout.strip()
    if out.returncode != 0 or not text.isdigit():
        return 0, "no usable NVIDIA driver" if "cuInit" in text or not text else text
    return int(text), "no CUDA device found" if text == "0" else ""


def probe(device_id: int = 0) -> tuple:
    """(is the GPU usable, the reason in words)."""
    missing = cuda_extra_missing()
    if missing:
        return False, "the [cuda] extra is not installed"
    count, why = cuda_device_count()
    if count <= device_id:
        return False, why or f"no CUDA device {device_id} ({count} found)"
    return True, f"CUDA device {device_id} of {count}"


def choose_backend(requested, device_id: int = 0, *, probe_fn=None) -> tuple:
    """(backend, note): `requested` unless it is "auto" (or None), which becomes "cuda" when the
    GPU is usable, else "numpy"; `note` is the line saying so (None for an explicit backend),
    which the CLI prints on stderr once the rest of the flags are known to be good."""
    if requested not in (None, "auto"):
        return requested, None
    usable, why = (probe_fn or probe)(device_id)
    choice = "cuda" if usable else "numpy"
    return choice, f"backend {choice} (auto: {why}; --backend numpy|cuda sets it)"
