"""One device allocation made at start, carved into weights, pools and workspace.

    [ weights ............ | KV pools | state slots | workspace ]
      first-fit regions; freed regions coalesce; nothing is allocated after start.

`Arena.take()` is the only way device memory is handed out after start; it raises DeviceError when
the plan does not fit, never calls cuMemAlloc.
"""
from __future__ import annotations

import numpy as np

from ...errors import DeviceError
from . import driver as _d

ALIGN = 256


def _round_up(n: int, a: int = ALIGN) -> int:
    return (int(n) + a - 1) // a * a


class DeviceArray:
    """A typed view of an arena region: pointer, shape, dtype (row-major, contiguous)."""

    __slots__ = ("ptr", "shape", "dtype", "nbytes", "_region")

    def __init__(self, ptr: int, shape, dtype, region=None):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._region = region

    def at(self, *index) -> int:
        """Device address of element `index` (leading dims)."""
        off, stride = 0, self.dtype.itemsize
        strides = []
        for s in reversed(self.shape):
            strides.append(stride)
            stride *= s
        strides.reverse()
        for i, st in zip(index, strides):
            off += int(i) * st
        return self.ptr + off

    def __repr__(self):
        return f"DeviceArray(0x{self.ptr:x}, {self.shape}, {self.dtype})"


class Arena:
    def __init__(self, nbytes: int):
        self.capacity = _round_up(nbytes)
        self.base = _d.mem_alloc(self.capacity)
        self._free = [(0, self.capacity)]        # sorted (offset, size) holes
        # arrays whose owner was dropped without give() (a pool's finalizer appends them, at
        # whatever point the garbage collector runs); take/give return them first, so the hole
        # list is only ever changed by the thread calling take/give
        self._dropped = []
        self._closed = False

    @property
    def free_bytes(self) -> int:
        self._return_dropped()
        return sum(s for _, s in self._free)

    def give_later(self, arrays) -> None:
        """Return `arrays` at the next take/give (safe from a finalizer)."""
        self._dropped.extend(arrays)

    def _return_dropped(self) -> None:
        while self._dropped:
            self._give(self._dropped.pop())

    def take(self, shape, dtype, what: str) -> DeviceArray:
        self._return_dropped()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = _round_up(max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1))
        for i, (off, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + nbytes, size - nbytes)
                return DeviceArray(self.base + off, shape, dtype, region=(off, nbytes))
        raise DeviceError(
            f"backend 'cuda': too little device memory for {what}: needs {nbytes / 2**20:.1f} MiB, "
            f"largest free arena region {max((s for _, s in self._free), default=0) / 2**20:.1f} MiB "
            f"(arena {self.capacity / 2**30:.2f} GiB)")

    def give(self, arr: DeviceArray) -> None:
        """Return a region (pool close); neighbours coalesce."""
        self._return_dropped()
        self._give(arr)

    def _give(self, arr: DeviceArray) -> None:
        if arr._region is None:
            return
        off, size = arr._region
        arr._region = None
        holes = sorted(self._free + [(off, size)])
        merged = []
        for o, s in holes:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _d.mem_free(self.base)
