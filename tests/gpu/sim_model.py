"""The CUDA model's whole launch sequence on the CPU: CudaModel with its kernels on numba-cuda's
simulator, cuBLASLt's GEMMs as numpy products of the stored operands (fp32 accumulation), device
memory one numpy byte array and fake pinned buffers. It checks the plumbing of each dtype (buffer
types, offsets, the widening upload, the KV pools) against the numpy backend without a GPU;
speed and the real cuBLASLt are the GPU tests' business. Prints JSON:
{"<dtype>": {"prefill": rel err of all logits, "steps": [rel err per decode step],
             "tokens_cuda": [...], "tokens_numpy": [...]}}

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_model.py [dense|moe] [prompt tokens] [steps]
                                                         [kv_dtype: bfloat16|fp8|int8]
(kv_dtype fp8 / int8: both backends store quantized KV; kv_round_trip then compares bytes.)
"""
import inspect
import json
import pathlib
import sys
import threading

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sim_patches   # noqa: E402
import sim_storage   # noqa: E402,F401  (simulator patches: warp shuffle, libdevice bit casts)
from sim_storage import cuda, _fake   # noqa: E402

from ninfer.core.cuda import driver as d   # noqa: E402
from ninfer.core.cuda.kernels import ARG_TYPES, _import_kernel_module   # noqa: E402
from ninfer.models import model_config   # noqa: E402
from ninfer.models.qwen3_5 import cuda_model as cm   # noqa: E402
from ninfer.models.qwen3_5.batch import ForwardBatch   # noqa: E402
from ninfer.models.qwen3_5.model import NumpyModel   # noqa: E402
from ninfer.options import EngineOptions   # noqa: E402
from tiny_model import TinyArtifact, tiny_config   # noqa: E402
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray   # noqa: E402


def _syncwarp(self, mask=0xFFFFFFFF):
    sim_patches.warp_barrier()


_fake.FakeCUDAModule.syncwarp = _syncwarp
NP = {"float32": np.float32, "uint16": np.uint16, "uint32": np.uint32, "int32": np.int32,
      "uint64": np.uint64, "uint8": np.uint8, "float64": np.float64}
# Kernels whose result does not depend on the block's width (a strided loop and a block
# reduction over however many threads run) launch narrower here: the simulator runs a Python
# thread per CUDA thread, so the runner's 1,024-thread rows cost seconds each. Their 1,024-thread launches run in the GPU tests; sim_decode_kernels.py
# checks the kernels at several widths against float64. argmax is compiled for its block width
# (its `threads`: the shared reduction's size), so here it is compiled for the capped width too:
# launched 128 wide while compiled for 1,024 it reduced unwritten shared memory (garbage ids).
SIM_BLOCK_CAP = {"rmsnorm": 128, "argmax": 128}


class Machine:
    """Device memory (one mem_alloc: the model's arena) and host pinned buffers."""
    BASE, HOST = 1 << 40, 1 << 20

    def __init__(self, nbytes):
        self.mem = np.zeros(nbytes, np.uint8)
        self.host, self.next_host = {}, self.HOST
        self.lock = threading.Lock()

    def dev(self, ptr, n):
        off = ptr - self.BASE
        assert 0 <= off and off + n <= self.mem.size, "device access outside the arena"
        return self.mem[off: off + n]

    def host_bytes(self, ptr, n):
        base = max(b for b in self.host if b <= ptr)
        assert ptr - base + n <= self.host[base].size, "host access outside a pinned buffer"
        return self.host[base][ptr - base: ptr - base + n]

    def pinned(self, nbytes):
        m = self

        class Pinned:
            def __init__(self):
                # (threads pin too: the weight loader's, the context cache's PinnedReserve)
                with m.lock:
                    self.nbytes, self.ptr = int(nbytes), m.next_host
                    self.array = np.zeros(max(self.nbytes, 1), np.uint8)[: self.nbytes]
                    m.host[self.ptr] = self.array
                    m.next_host += self.nbytes + 4096

            def view(self, dtype, offset=0, count=None):
                dt = np.dtype(dtype)
                if count is None:
                    count = (self.nbytes - offset) // dt.itemsize
                return self.array[offset: offset + count * dt.itemsize].view(dt)

            def free(self):
                m.host.pop(self.ptr, None)
        return Pinned()

    def typed(self, ptr, dtype):
        """A view from `ptr` to the end of device memory (no copy: aliasing as on the GPU)."""
        dt = np.dtype(dtype)
        off = ptr - self.BASE
        assert off % dt.itemsize == 0
        n = (self.mem.size - off) // dt.itemsize
        return self.mem[off: off + n * dt.itemsize].view(dt)


class Stream:
    handle = 0

    def synchronize(self):
        pass

    def wait(self, event):
        pass


def install(machine):
    stream = Stream()

    class Device:
        cc, num_sms, name = (9, 0), 2, "simulated GPU"

        def __init__(self, device_id=0):
            self.stream = stream

        def mem_info(self):
            return 1 << 40, 1 << 40          # the arena must still fit machine.mem (checked on access)

        def make_current(self):
            pass

        def close(self):
            pass

    class Event:                 # copies here are synchronous: nothing to wait for
        def __init__(self, timing=True):
            pass

        def record(self, stream):
            pass

        def synchronize(self):
            pass

        def destroy(self):
            pass

    d.Device = Device
    d.Event = Event
    d.mem_alloc = lambda n: machine.BASE
    d.mem_free = lambda p: None
    d.PinnedBuffer = machine.pinned
    d.memset_d8_async = lambda dst, v, n, st: machine.dev(dst, n).__setitem__(slice(None), v)
    d.copy_htod_async = lambda dst, src, n, st: machine.dev(dst, n).__setitem__(
        slice(None), machine.host_bytes(src, n))
    d.copy_dtoh_async = lambda dst, src, n, st: machine.host_bytes(dst, n).__setitem__(
        slice(None), machine.dev(src, n))
    d.copy_dtod_async = lambda dst, src, n, st: machine.dev(dst, n).__setitem__(
        slice(None), machine.dev(src, n).copy())         # the context cache's pool copies
    d.copy2d_dtod_async = lambda dst, dp, src, sp, w, h, st: [          # State slot copies
        machine.dev(dst + i * dp, w).__setitem__(slice(None), machine.dev(src + i * sp, w).copy())
        for i in range(h)]

    class Kernel:
        def __init__(self, spec):
            self.spec, self.fn = spec, None          # made at first launch (load_all: nothing)

        def launch(self, st, grid, block, args, smem=0):
            if self.spec.factory == "widen_bf16":
                # the load's widening as numpy: one simulated thread per weight element is
                # minutes (the kernel itself is checked in sim_storage.py)
                out, bits, n = int(getattr(args[0], "ptr", args[0])), args[1], int(args[2])
                u = machine.typed(int(getattr(bits, "ptr", bits)), np.uint16)[:n]
                machine.typed(out, np.float32)[:n] = (u.astype(np.uint32) << 16).view(np.float32)
                return
            cap = SIM_BLOCK_CAP.get(self.spec.factory)
            if self.fn is None:
                factory = getattr(_import_kernel_module(self.spec.module), self.spec.factory)
                params = dict(self.spec.params)
                if cap is not None and "threads" in inspect.signature(factory).parameters:
                    params["threads"] = cap          # (a kernel compiled for its width)
                self.fn = cuda.jit(factory(**params))
            conv = []
            for t, a in zip(self.spec.sig, args):
                _, nt, is_ptr = ARG_TYPES[t]
                if is_ptr:
                    conv.append(FakeCUDAArray(machine.typed(int(getattr(a, "ptr", a)), NP[nt])))
                else:
                    conv.append(np.float32(a) if t == "f32" else int(a))
            g = tuple(grid) + (1,) * (3 - len(grid))
            b = tuple(block) + (1,) * (3 - len(block))
            if cap is not None and b[0] > cap:
                b = (cap,) + b[1:]
            self.fn[g, b](*conv)

    class Cache:
        def __init__(self, cc, cache_dir=None, pdl_default=False):
            self.k = {}

        def get(self, spec):
            if spec not in self.k:
                self.k[spec] = Kernel(spec)
            return self.k[spec]

        def start_precompile(self, specs, workers=None):
            class Done:                              # the simulator compiles at first launch
                def wait(self):
                    return 0
            return Done()

        def close(self):
            self.k.clear()

    class Lt:
        plan_seconds = 0.0          # (CudaModel.one_off_seconds: no plans made here)

        def __init__(self, ws_ptr, ws_bytes, f32=False, invariant=False):
            self.f32, self.calls = f32, 0

        def plan(self, *a, **k):
            pass

        def operand(self, ptr, shape):
            if self.f32:
                return machine.typed(ptr, np.float32)[: int(np.prod(shape))].reshape(shape)
            u = machine.typed(ptr, np.uint16)[: int(np.prod(shape))].reshape(shape)
            return (u.astype(np.uint32) << 16).view(np.float32)

        def gemm(self, st, x, w, y, m, n, k, beta=0.0, w_kn=False, batch=1, strides=(0, 0, 0),
                 ldc=0):
            ab = 4 if self.f32 else 2
            sw, sx, sy = strides
            ldc = ldc or n                               # y's row stride (a segment's columns)
            for i in range(batch):                       # product i at element offsets i*strides
                X = self.operand(x + ab * i * sx, (m, k))
                W = self.operand(w + ab * i * sw, (k, n) if w_kn else (n, k))
                Y = machine.typed(y + 4 * i * sy, np.float32)[: m * ldc].reshape(m, ldc)[:, :n]
                prod = X @ W if w_kn else X @ W.T        # fp32 accumulation, like COMPUTE_32F
                Y[:] = prod if beta == 0.0 else beta * Y + prod
            self.calls += 1

        def batch_alignment(self, *a, **k):
            return 256

        def has_grouped_gemm(self):
            # "moe-lt": cuBLASLt's grouped GEMM (cuBLAS 13.10+, faked below); "moe": ours
            # (kernels/grouped_gemm.py on the simulator), as on the cuBLAS 13.1 we measure on
            return not self.f32 and LT_GROUPED[0]

        def grouped_plan(self, n, k, groups, rows_dev, n_dev, k_dev, avg_rows):
            # cuBLASLt's grouped GEMM (cuda/moe_route.py): every group's rows and operand
            # addresses read from the machine's memory at the call, as the device does (bf16
            # models only: a float32 workspace has no DeviceRoute)
            return (n, k, groups, rows_dev)

        def grouped_gemm(self, st, plan, w_ptrs, x_ptrs, y_ptrs, one, zero):
            n, k, groups, rows_dev = plan
            rows = machine.typed(rows_dev, np.int32)[:groups]
            ptrs = [machine.typed(p, np.uint64)[:groups] for p in (w_ptrs, x_ptrs, y_ptrs)]
            assert machine.typed(one, np.float32)[0] == 1.0
            assert machine.typed(zero, np.float32)[0] == 0.0
            for g in range(groups):
                m = int(rows[g])
                if m:
                    X = self.operand(int(ptrs[1][g]), (m, k))
                    W = self.operand(int(ptrs[0][g]), (n, k))
                    machine.typed(int(ptrs[2][g]), np.float32)[: m * n].reshape(m, n)[:] = X @ W.T
            self.calls += 1

        def close(self):
            pass

    cm.KernelCache = Cache
    cm.CublasLt = Lt


LT_GROUPED = [False]


def run(kind="dense", prompt_len=5, steps=3, kv_dtype="bfloat16"):
    machine = Machine(96 << 20)
    install(machine)
    if kind == "dense-split":
        # paged attention's merge space made too small for the tiny model's whole group (G = 2 at
        # head_dim 64 needs 2112 bytes): one head per block, two blocks per kv head, as G = 16
        # runs at head_dim 256 (122B-A10B, 397B-A17B)
        from ninfer.models.qwen3_5.cuda import kernel_set
        kernel_set.STATIC_SMEM_BYTES = 1100
        assert kernel_set.paged_attention_group(2, 64) == 1
    LT_GROUPED[0] = kind == "moe-lt"
    art = TinyArtifact(tiny_config(moe=kind.startswith("moe")), seed=3)
    cpu = NumpyModel.from_artifact(art)
    cpu.kv_dtype = None if kv_dtype == "bfloat16" else kv_dtype
    r = np.random.default_rng(1)
    prompt = r.integers(0, model_config(art).text.vocab_size, prompt_len).astype(np.int32)
    out = {}
    for dtype in ("float32", "bfloat16"):
        opts = EngineOptions(backend="cuda", dtype=dtype, max_concurrency=1, max_context=64,
                             prefill_chunk=16, page_size=4, num_kv_pages=20, graphs=False,
                             kv_dtype=kv_dtype)
        gpu = cm.CudaModel(model_config(art), opts, artifact=art)
        gpu.runner.moe_device_route = True     # (the default where the route is enabled)
        if kind == "moe":
            # our route's padded block of 2 rows an expert, and the third row of each of the
            # prompt's 3 (every token routes to all 4 experts) past it: the strided-batched
            # GEMM and our grouped GEMM over the overflow both run
            gpu.runner.moe_cap = 2
        pages = np.arange(16, dtype=np.int32)
        kv_g, st_g = gpu.new_kv_pool(17, 4), gpu.new_state_pool(2)
        kv_c, st_c = cpu.new_kv_pool(17, 4), cpu.new_state_pool(2)
        b = ForwardBatch.single(prompt, 0, pages, 1)
        lg = gpu.forward(b, kv_g, st_g, all_logits=True)
        lc = cpu.forward(b, kv_c, st_c, all_logits=True)
        res = {"prefill": float(np.linalg.norm(lg - lc) / np.linalg.norm(lc)), "steps": [],
               "tokens_cuda": [], "tokens_numpy": [], "margins": []}
        tg, tc = int(np.argmax(lg[-1])), int(np.argmax(lc[-1]))
        for k in range(steps):
            res["tokens_cuda"].append(tg)
            res["tokens_numpy"].append(tc)
            pos = prompt_len + k
            lg = gpu.forward(ForwardBatch.single([tg], pos, pages, 1), kv_g, st_g)
            lc = cpu.forward(ForwardBatch.single([tc], pos, pages, 1), kv_c, st_c)
            res["steps"].append(float(np.linalg.norm(lg - lc) / np.linalg.norm(lc)))
            top = np.sort(lc[0])[-2:]
            res["margins"].append(float(top[1] - top[0]))
            tg, tc = int(np.argmax(lg[0])), int(np.argmax(lc[0]))
        # the pools' host images: fp32 KV survives a round trip exactly in float32
        img = kv_g.read_pages([0, 1])
        kv_g.write_pages([0, 1], img)
        res["kv_round_trip"] = all(np.array_equal(a, b) for a, b in
                                   zip(img[0] + img[1], kv_g.read_pages([0, 1])[0] +
                                       kv_g.read_pages([0, 1])[1]))
        res["kv_dtype"] = str(kv_g.k[0].dtype)
        # a bf16 MoE prefill routes on the device (cuda/moe_route.py); float32 on the host
        res["moe_device_route"] = bool(gpu.ws.route_dev is not None and gpu.ws.route_dev.enabled)
        res["moe_own_gemm"] = bool(gpu.ws.route_dev is not None and gpu.ws.route_dev.own)
        kv_g.close()
        st_g.close()
        gpu.close()
        out[dtype] = res
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(run(a[0] if a else "dense", int(a[1]) if len(a) > 1 else 5,
                         int(a[2]) if len(a) > 2 else 3, a[3] if len(a) > 3 else "bfloat16")))
