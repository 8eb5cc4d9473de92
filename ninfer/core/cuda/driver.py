"""The CUDA driver layer: every driver call goes through `check()`, which raises DeviceError naming
the CUDA error. One `Device` per process holds the primary context and the compute stream.

Counters in `STATS` let tests prove what the decode hot path does (no allocation, no sync, no
kernel launch outside the graph).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ...errors import DeviceError

_drv = None


def driver():
    """The `cuda.bindings.driver` module, imported on first use (the [cuda] extra is optional)."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:
            raise DeviceError(
                "backend 'cuda' needs the [cuda] extra (cuda-python): pip install 'ninfer[cuda]' "
                f"({exc})") from exc
        _drv = drv
    return _drv


def check(result, what: str = "CUDA driver call"):
    """Unwrap a cuda-python result tuple `(CUresult, *values)`; raise DeviceError on failure."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        raise DeviceError(f"{what} failed: {error_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def error_name(err) -> str:
    drv = driver()
    try:
        code, name = drv.cuGetErrorName(err)
        if int(code) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:   # noqa: BLE001 - best-effort naming of an error we are already raising
        pass
    return f"CUresult {int(err)}"


@dataclass
class Stats:
    """Counts of driver work issued by this process (tests read deltas)."""
    allocs: int = 0
    launches: int = 0
    graph_launches: int = 0
    syncs: int = 0
    copies: int = 0

    def snapshot(self) -> dict:
        return dict(allocs=self.allocs, launches=self.launches, graph_launches=self.graph_launches,
                    syncs=self.syncs, copies=self.copies)


STATS = Stats()


class Device:
    """One GPU: primary context, compute stream, properties."""

    def __init__(self, device_id: int = 0):
        drv = driver()
        try:
            res = drv.cuInit(0)
        except Exception as exc:   # noqa: BLE001 - cuda-python raises its own types when libcuda is absent
            raise DeviceError(f"backend 'cuda': no NVIDIA driver found ({exc})") from exc
        if int(res[0]) != 0:
            raise DeviceError(f"backend 'cuda': cuInit failed ({error_name(res[0])}): "
                              "no usable NVIDIA driver/device")
        count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if count == 0:
            raise DeviceError("backend 'cuda': no CUDA device found")
        if not 0 <= device_id < count:
            raise DeviceError(f"backend 'cuda': device_id {device_id} out of range ({count} devices)")
        self.device_id = device_id
        self.dev = check(drv.cuDeviceGet(device_id), "cuDeviceGet")
        self.ctx = check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        try:
            self._open(drv)
        except BaseException:
            drv.cuDevicePrimaryCtxRelease(self.dev)     # the retain would outlive this object
            raise
        self._released = False

    def _open(self, drv) -> None:
        """Bind the context, read the properties, make the stream (undone by the caller)."""
        check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        attr = drv.CUdevice_attribute
        get = lambda a: check(drv.cuDeviceGetAttribute(a, self.dev), "cuDeviceGetAttribute")  # noqa: E731
        self.cc = (get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                   get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.num_sms = get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        name = check(drv.cuDeviceGetName(128, self.dev), "cuDeviceGetName")
        self.name = name.split(b"\0")[0].decode()
        # the model's steps before other work on the device (the vision tower's stream): their
        # kernels' blocks take the SMs first as the tower's blocks finish
        self.stream = Stream(priority=stream_priorities()[1])

    def make_current(self) -> None:
        check(driver().cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def mem_info(self) -> tuple:
        """(free_bytes, total_bytes) of the device."""
        return check(driver().cuMemGetInfo(), "cuMemGetInfo")

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        if not self._released:
            self._released = True
            try:
                self.stream.destroy()
            finally:
                check(driver().cuDevicePrimaryCtxRelease(self.dev), "cuDevicePrimaryCtxRelease")


class Stream:
    def __init__(self, priority: int = 0):
        # priority: lower runs first where both streams have blocks waiting for an SM (0, the
        # default, is the least; stream_priorities() gives the range)
        drv = driver()
        self.handle = check(drv.cuStreamCreateWithPriority(
            drv.CUstream_flags.CU_STREAM_NON_BLOCKING, priority), "cuStreamCreateWithPriority")

    def synchronize(self) -> None:
        STATS.syncs += 1
        check(driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: "Event") -> None:
        """Work queued on this stream after this call starts after `event` (the device waits,
        not the host)."""
        check(driver().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def destroy(self) -> None:
        if self.handle is not None:
            check(driver().cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


class SmStream(Stream):
    """A stream whose kernels run on at most `sm_count` SMs, rounded up to the device's
    granularity (`.sm_count`: what the driver granted): a green context's (CUDA 12.4+). Work
    beside the model's steps (the vision tower) that must leave them the other SMs: a stream
    priority only orders blocks that wait, it does not stop long blocks taking every SM."""

    def __init__(self, device: "Device", sm_count: int, priority: int = 0):
        drv = driver()
        self.handle = self.green = None
        sm = check(drv.cuDeviceGetDevResource(
            device.dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
        groups, _, _ = check(drv.cuDevSmResourceSplitByCount(1, sm, 0, int(sm_count)),
                             "cuDevSmResourceSplitByCount")
        desc = check(drv.cuDevResourceGenerateDesc([groups[0]], 1), "cuDevResourceGenerateDesc")
        self.green = check(drv.cuGreenCtxCreate(
            desc, device.dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
            "cuGreenCtxCreate")
        self.sm_count = int(groups[0].sm.smCount)
        try:
            self.handle = check(drv.cuGreenCtxStreamCreate(
                self.green, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, priority),
                "cuGreenCtxStreamCreate")
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        try:
            super().destroy()
        finally:
            if self.green is not None:
                check(driver().cuGreenCtxDestroy(self.green), "cuGreenCtxDestroy")
                self.green = None


def stream_priorities() -> tuple:
    """(least, greatest) stream priority of the current context (greatest the lower number)."""
    return tuple(check(driver().cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange"))


class Event:
    def __init__(self, timing: bool = True):
        drv = driver()
        flags = 0 if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(drv.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        check(driver().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        STATS.syncs += 1
        check(driver().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        """Whether the work recorded before the event has completed (never blocks)."""
        drv = driver()
        result = drv.cuEventQuery(self.handle)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) == int(drv.CUresult.CUDA_ERROR_NOT_READY):
            return False
        check(result, "cuEventQuery")
        return True

    def elapsed_ms(self, later: "Event") -> float:
        return float(check(driver().cuEventElapsedTime(self.handle, later.handle),
                           "cuEventElapsedTime"))

    def destroy(self) -> None:
        if self.handle is not None:
            check(driver().cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


def mem_alloc(nbytes: int) -> int:
    STATS.allocs += 1
    return int(check(driver().cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes} bytes)"))


def mem_free(ptr: int) -> None:
    check(driver().cuMemFree(ptr), "cuMemFree")


class PinnedBuffer:
    """Page-locked host memory (staging for async copies), viewed as a numpy byte array."""

    def __init__(self, nbytes: int):
        import numpy as np
        STATS.allocs += 1
        self.nbytes = int(nbytes)
        self.ptr = int(check(driver().cuMemHostAlloc(max(self.nbytes, 1), 0),
                             f"cuMemHostAlloc({nbytes} bytes)"))
        buf = (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr)
        self.array = np.frombuffer(buf, dtype=np.uint8)[: self.nbytes]

    def view(self, dtype, offset: int = 0, count: int = None):
        import numpy as np
        dt = np.dtype(dtype)
        if count is None:
            count = (self.nbytes - offset) // dt.itemsize
        return self.array[offset: offset + count * dt.itemsize].view(dt)

    def free(self) -> None:
        if self.ptr:
            check(driver().cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0
            self.array = None


def copy_htod_async(dst: int, src_host_ptr: int, nbytes: int, stream: Stream) -> None:
    STATS.copies += 1
    check(driver().cuMemcpyHtoDAsync(dst, src_host_ptr, nbytes, stream.handle), "cuMemcpyHtoDAsync")


def copy_dtoh_async(dst_host_ptr: int, src: int, nbytes: int, stream: Stream) -> None:
    STATS.copies += 1
    check(driver().cuMemcpyDtoHAsync(dst_host_ptr, src, nbytes, stream.handle), "cuMemcpyDtoHAsync")


def copy_dtod_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    STATS.copies += 1
    check(driver().cuMemcpyDtoDAsync(dst, src, nbytes, stream.handle), "cuMemcpyDtoDAsync")


MAX_PITCH = 2**31 - 1       # cuMemcpy2D's pitch limit (CU_DEVICE_ATTRIBUTE_MAX_PITCH on sm_80+)


def copy2d_dtod_async(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                      height: int, stream: Stream) -> None:
    """`height` rows of `width` bytes, row i from src + i * src_pitch to dst + i * dst_pitch,
    device to device in one driver call (pitches at most MAX_PITCH): a State slot's row of
    every layer at once (device_pools.DeviceStatePool.copy)."""
    drv = driver()
    STATS.copies += 1
    m = drv.CUDA_MEMCPY2D()
    m.srcMemoryType = m.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcDevice, m.srcPitch = int(src), int(src_pitch)
    m.dstDevice, m.dstPitch = int(dst), int(dst_pitch)
    m.WidthInBytes, m.Height = int(width), int(height)
    check(drv.cuMemcpy2DAsync(m, stream.handle), "cuMemcpy2DAsync")


def memset_d8_async(dst: int, value: int, nbytes: int, stream: Stream) -> None:
    check(driver().cuMemsetD8Async(dst, value, nbytes, stream.handle), "cuMemsetD8Async")


def memset_d32_async(dst: int, value: int, count: int, stream: Stream) -> None:
    check(driver().cuMemsetD32Async(dst, value, count, stream.handle), "cuMemsetD32Async")


def upload(dst: int, array, stream: Stream, staging: PinnedBuffer = None) -> None:
    """Synchronous host -> device copy of a numpy array (load time only, never on the hot path)."""
    import numpy as np
    a = np.ascontiguousarray(array)
    if staging is None or staging.nbytes < a.nbytes:
        tmp = PinnedBuffer(a.nbytes)
        try:
            tmp.array[:] = a.reshape(-1).view(np.uint8)
            copy_htod_async(dst, tmp.ptr, a.nbytes, stream)
            stream.synchronize()
        finally:
            tmp.free()
        return
    staging.array[: a.nbytes] = a.reshape(-1).view(np.uint8)
    copy_htod_async(dst, staging.ptr, a.nbytes, stream)
    stream.synchronize()


def download(src: int, shape, dtype, stream: Stream):
    """Synchronous device -> host copy into a new numpy array (tests, snapshots)."""
    import numpy as np
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    tmp = PinnedBuffer(n)
    try:
        copy_dtoh_async(tmp.ptr, src, n, stream)
        stream.synchronize()
        return tmp.array.view(dt).reshape(shape).copy()
    finally:
        tmp.free()
