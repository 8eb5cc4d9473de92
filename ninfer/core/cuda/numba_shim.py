"""The one import shim for numba-cuda: every numba.cuda import goes through here, so the
workarounds below live in one place. Only the kernel compiler (cache miss) imports numba.

- numba-cuda 0.30 still calls `np.row_stack`, which numpy 2.5 removed; alias it to `np.vstack`
  before the first `numba.cuda` import.
- A device function declared `forceinline=True` (inlined by NVVM, cheap to compile; numba's own
  IR-level `inline="always"` copies and re-types the callee's IR at every call site, which made
  one sampler kernel take ~13 s to compile) is compiled on its first call with the compute
  capability of numba's *current device*: no GPU, no compile. `target_device(cc)` answers that
  question with the cc the kernel is compiled for, so PTX for any architecture compiles on a
  machine without a GPU (CI, the wheel's build, `ninfer warmup --arch`).
"""
from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

from ...errors import DeviceError

_TARGET_LOCK = threading.Lock()


def import_numba_cuda():
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    try:
        from numba import cuda, types
    except ImportError as exc:
        raise DeviceError(f"backend 'cuda' needs numba-cuda to compile kernels ({exc})") from exc
    return cuda, types


@contextlib.contextmanager
def target_device(cc: tuple):
    """While compiling for `cc`: numba's device-function compiles see a device of that cc."""
    from numba.cuda import dispatcher
    with _TARGET_LOCK:
        saved = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=tuple(cc))
        try:
            yield
        finally:
            dispatcher.get_current_device = saved
