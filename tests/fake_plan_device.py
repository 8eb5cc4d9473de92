"""A fake CUDA device for CPU tests of CudaModel's load-time plan: `install` replaces the driver's
Device (its free memory settable) and the model's Arena, whose allocation raises ArenaReached
with the bytes asked: a load runs up to its plan and stops there, with `memory_plan` set."""
from types import SimpleNamespace


class ArenaReached(Exception):
    pass


def install(monkeypatch, free_bytes: int = 1 << 30) -> dict:
    """Returns {"free": bytes}: set "free" to change what mem_info reports."""
    from ninfer.core.cuda import driver as d
    from ninfer.models.qwen3_5 import cuda_model as cm
    memory = {"free": free_bytes}

    class Dev:
        cc, num_sms, name = (9, 0), 132, "FakeGPU"
        stream = SimpleNamespace(synchronize=lambda: None)

        def __init__(self, device_id):
            pass

        def mem_info(self):
            return memory["free"], 80 << 30

        def make_current(self):
            pass

        def close(self):
            pass

    def arena(nbytes):
        raise ArenaReached(nbytes)
    monkeypatch.setattr(d, "Device", Dev)
    monkeypatch.setattr(cm, "Arena", arena)
    return memory


def record_kernel_specs(monkeypatch) -> dict:
    """The model's KernelSet replaced by one that records its specs ({"specs": ...}) and loads
    nothing."""
    from ninfer.models.qwen3_5 import cuda_model as cm
    seen, real_set = {}, cm.KernelSet

    def kernel_set(*args, **kwargs):
        seen["specs"] = real_set(*args, **kwargs).specs
        return SimpleNamespace(start_loading=lambda bind: None, close=lambda: None)
    monkeypatch.setattr(cm, "KernelSet", kernel_set)
    return seen
