"""Fixes to numba-cuda's CPU simulator that the sim_*.py scripts apply before running kernels.

`FakeCUDAShared.array` (numba-cuda 0.30) finds a block's shared array by its call site with a
check-then-set on a dict: when the GIL switches between the check and the set, two threads of
one block each make their own array, and one thread's writes never reach the others. That is
rare at the default 5 ms switch interval and was seen once in CI at sim_sample.py's 0.1 ms
(one wrong argmax). Here the lookup and the insertion happen under one lock.

The simulator has no libdevice: `fake_libdevice` gives it the two bit casts kernels/sample.py
uses (the device sampler's).
"""
import sys
import threading
import traceback

import numpy as np


def fix_shared_array_race():
    import numba.cuda.simulator.kernelapi as fake
    from numba.core import types
    from numba.np import numpy_support
    cls = fake.FakeCUDAShared
    if getattr(cls, "_ninfer_locked", False):
        return
    original = cls.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        # the caller's (file, line), as the original keys it
        caller = tuple(traceback.extract_stack(sys._getframe())[-2][0:2])
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    cls.array = array
    cls._ninfer_locked = True


def fake_libdevice():
    from types import SimpleNamespace
    import numba.cuda.simulator.kernelapi as fake
    fake.FakeCUDAModule.libdevice = SimpleNamespace(
        double_as_longlong=lambda x: np.array([x], np.float64).view(np.int64)[0],
        hiloint2double=lambda hi, lo: np.array([lo, hi], np.int32).view(np.float64)[0])
