"""CUDA graph capture and replay on our stream."""
from __future__ import annotations

from . import driver as _d


class Graph:
    """Capture `fn(stream)` once; `launch()` replays it (one driver call)."""

    def __init__(self, stream: _d.Stream, fn):
        drv = _d.driver()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _d.check(drv.cuStreamBeginCapture(stream.handle, mode), "cuStreamBeginCapture")
        try:
            fn(stream)
        except BaseException:
            res = drv.cuStreamEndCapture(stream.handle)
            if int(res[0]) == 0 and res[1] is not None:
                drv.cuGraphDestroy(res[1])
            raise
        self.graph = _d.check(drv.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
        try:
            self.exec = _d.check(drv.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        except BaseException:
            drv.cuGraphDestroy(self.graph)
            raise
        self.stream = stream

    def launch(self) -> None:
        _d.STATS.graph_launches += 1
        _d.check(_d.driver().cuGraphLaunch(self.exec, self.stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        drv = _d.driver()
        if self.exec is not None:
            _d.check(drv.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            self.exec = None
        if self.graph is not None:
            _d.check(drv.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.graph = None
