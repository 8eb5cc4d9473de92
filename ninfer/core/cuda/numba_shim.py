"""The one import shim for numba-cuda: every numba.cuda import goes through here, so the
workaround below lives in one place.

numba-cuda 0.30 still calls `np.row_stack`, which numpy 2.5 removed; alias it to `np.vstack`
before the first `numba.cuda` import. Only the kernel compiler (cache miss) imports numba.
"""
from __future__ import annotations

from ...errors import DeviceError


def import_numba_cuda():
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    try:
        from numba import cuda, types
    except ImportError as exc:
        raise DeviceError(f"backend 'cuda' needs numba-cuda to compile kernels ({exc})") from exc
    return cuda, types
