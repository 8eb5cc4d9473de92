"""Fixes to numba-cuda's CPU simulator that the sim_*.py scripts apply before running kernels.

`FakeCUDAShared.array` (numba-cuda 0.30) finds a block's shared array by its call site with a
check-then-set on a dict: when the GIL switches between the check and the set, two threads of
one block each make their own array, and one thread's writes never reach the others. That is
rare at the default 5 ms switch interval and was seen once in CI at sim_sample.py's 0.1 ms
(one wrong argmax). Here the lookup and the insertion happen under one lock.

`BlockManager.run` (numba-cuda 0.30) runs a block as one Python thread per CUDA thread and
polls them in a loop without ever giving up the GIL: the threads it waits for get it only at
the interpreter's switch interval, so a 1,024-thread block costs seconds per barrier, worse on
a many-core CI machine. `yield_while_polling` keeps the loop (the same barrier rule, the same
exception handling) and gives up the GIL after each pass so the block's threads run (a
1,024-thread rmsnorm: 23 s -> 6 s; sim_mtp.py's step 195 s -> 54 s).

The simulator has no libdevice: `fake_libdevice` gives it the two bit casts kernels/sample.py
uses (the device sampler's). Nor warp shuffles: `warp_shuffles` gives it shfl_xor_sync and
shfl_sync over the 32 lanes of a warp.
"""
import sys
import threading
import time
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


def yield_while_polling():
    import numba.cuda.simulator.kernel as sim
    cls = sim.BlockManager
    if getattr(cls, "_ninfer_yielding", False):
        return

    def run(self, grid_point, *args):
        threads, live, blocked = set(), set(), set()
        for block_point in np.ndindex(*self._block_dim):
            def target():
                self._f(*args)
            t = sim.BlockThread(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.add(t)
            live.add(t)
        while live:
            for t in live:
                if t.syncthreads_blocked:
                    blocked.add(t)
                elif t.exception:
                    # as the original: stop the others, raise the first exception found
                    for other in threads:
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    raise t.exception[0].with_traceback(t.exception[1])
            if live == blocked:                  # every live thread at the barrier: release
                for t in blocked:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blocked = set()
            live = {t for t in live if t.is_alive()}
            if live:
                time.sleep(0)                    # the GIL to the block's threads
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    cls.run = run
    cls._ninfer_yielding = True


def fake_libdevice():
    from types import SimpleNamespace
    import numba.cuda.simulator.kernelapi as fake
    fake.FakeCUDAModule.libdevice = SimpleNamespace(
        double_as_longlong=lambda x: np.array([x], np.float64).view(np.int64)[0],
        hiloint2double=lambda hi, lo: np.array([lo, hi], np.int32).view(np.float64)[0])


_WARPS, _WARPS_LOCK = {}, threading.Lock()


def _shuffle(value, source):
    """The 32 lanes of a warp (Python threads of one block) meet at a barrier, each reads the
    value of lane source(lane). Every kernel here shuffles with whole warps, as on the GPU."""
    t = threading.current_thread()
    key = (id(t._manager), tuple(t.blockIdx), t.thread_id // 32)
    with _WARPS_LOCK:
        # (a loaded host can keep a 1,024-thread block's lanes apart for minutes: a lane that
        # never comes still ends the run, at the subprocess's own timeout at the latest)
        bar, vals = _WARPS.setdefault(key, (threading.Barrier(32, timeout=900), [None] * 32))
    lane = t.thread_id % 32
    vals[lane] = value
    bar.wait()
    out = vals[source(lane) % 32]
    bar.wait()
    return out


def warp_shuffles():
    import numba.cuda.simulator.kernelapi as fake
    fake.FakeCUDAModule.shfl_xor_sync = \
        lambda self, mask, value, offset: _shuffle(value, lambda lane: lane ^ offset)
    fake.FakeCUDAModule.shfl_sync = \
        lambda self, mask, value, src_lane: _shuffle(value, lambda lane: src_lane)


def warp_barrier():
    """The calling thread's warp meets (syncwarp)."""
    _shuffle(0, lambda lane: lane)
