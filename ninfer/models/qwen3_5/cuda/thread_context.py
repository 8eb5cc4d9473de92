"""ThreadContext: binds one device's driver context in each thread that uses it.

Driver contexts are per thread: the Engine worker calls forward from its own thread, and the pools
copy from whichever thread the context cache runs on. The model and its pools share one binding
(the pools get it as PoolDevice.bind, with no reference to the model).
"""
from __future__ import annotations

import threading


class ThreadContext:
    def __init__(self, device):
        self._device = device
        self._threads = threading.local()

    def __call__(self) -> None:
        """Make the context current in this thread, once per thread."""
        if not getattr(self._threads, "bound", False):
            self._device.make_current()
            self._threads.bound = True
