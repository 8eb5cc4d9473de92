"""kernels/sample.py on numba-cuda's CPU simulator (no GPU), against the host sampler.

Random requests (tests/gpu/sample_cases.py) go through cuda/sampler.py's DeviceSampler.launch
itself (its packing, its one H2D copy, its three launches and their arguments) over a fake flat
device memory, fake driver and a launcher that runs the kernels on the simulator with a small
geometry (argv[2] threads, argv[4] blocks per row, argv[5] histogram bins, argv[6] candidate cap:
small enough that V 200-2000 takes every plan); `rows` random rows follow 46 boundary rows (4 with logit_bias)
and 8 wide-nucleus rows.
Prints one JSON line: counts of rows compared, skipped at a decision margin, token mismatches,
RNG mismatches, argmax mismatches, steps that did not take exactly one H2D copy, and how many
sampled rows took each plan (kernels/sample.py ALL, SMALL, WIDE, FALLBACK).
`tests/test_cuda_sampler_nogpu.py` runs this in a subprocess (the simulator must be switched on
before numba is imported):

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_sample.py [rows] [threads] [seed] [blocks]
        [bins] [cap]
"""
import json
import pathlib
import sys
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from ninfer.core.cuda import numba_shim   # noqa: E402

cuda, _ = numba_shim.import_numba_cuda()
from sim_patches import fake_libdevice, fix_shared_array_race, yield_while_polling   # noqa: E402
fix_shared_array_race()
yield_while_polling()
fake_libdevice()

from ninfer.core.cuda.kernels import ARG_TYPES, _import_kernel_module   # noqa: E402
from ninfer.models.qwen3_5.cuda.kernel_set import SIGS   # noqa: E402
from ninfer.models.qwen3_5.cuda.sampler import (KERNELS, DeviceSampler,   # noqa: E402
                                                PromptCache, SamplerLayout, work_words)
from ninfer.models.qwen3_5.program.sampling import counter_uniform   # noqa: E402
import sample_cases as sc   # noqa: E402

NP = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "uint32": np.uint32,
      "uint64": np.uint64}


class Memory:
    """Device memory as one byte array; a pointer argument becomes a typed view that ends where
    the innermost allocation (or registered section) holding it ends."""

    def __init__(self, nbytes):
        self.mem = np.zeros(nbytes, np.uint8)
        self.top, self.allocs = 256, []

    def alloc(self, nbytes, sections=()):
        a = self.top
        self.top = (a + nbytes + 255) // 256 * 256
        assert self.top <= len(self.mem), "simulated device memory exhausted"
        self.allocs.append((a, a + nbytes))
        bounds = sorted(set(sections) | {0, nbytes})
        self.allocs += [(a + lo, a + hi) for lo, hi in zip(bounds, bounds[1:])]
        self.mem[a: a + nbytes] = 0xFF                      # poison
        return a

    def view(self, a, dt):
        end = min(hi for lo, hi in self.allocs if lo <= a < hi)
        return self.mem[a:end].view(dt)


class FakePinned:
    def __init__(self, nbytes, ptr=1 << 40):
        self.arr, self.ptr = np.zeros(nbytes, np.uint8), ptr

    def view(self, dtype, offset=0, count=None):
        return self.arr[offset:].view(dtype)[:count]

    def free(self):
        pass


class FakeKernel:
    """Kernel.launch's contract: (stream, grid, block, args) with args per SIGS[name]."""

    def __init__(self, mem, fn, name):
        self.mem, self.fn, self.name = mem, fn, name

    def launch(self, stream, grid, block, args, smem=0):
        sig = SIGS[self.name][2]
        assert len(args) == len(sig), (len(args), sig)
        conv = [self.mem.view(int(getattr(a, "ptr", a)), NP[ARG_TYPES[t][1]]) if ARG_TYPES[t][2]
                else int(a) for t, a in zip(sig, args)]
        self.fn[tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))](*conv)


def device_sampler(mem, fns, geo, rows_cap, V, pen_cap):
    """cuda/sampler.py's DeviceSampler over the fake memory, driver and kernels: its own pack,
    its one H2D copy and its launches are what run."""
    s = DeviceSampler.__new__(DeviceSampler)
    s.layout = lay = SamplerLayout(rows_cap, V, pen_cap)
    s.block = SimpleNamespace(ptr=mem.alloc(lay.nbytes, (lay.ipar, lay.upar, lay.data)))
    s.z = SimpleNamespace(ptr=mem.alloc(8 * rows_cap * V))
    wf, wi = work_words(geo["blocks"], geo["nbins"], geo["cap"])
    s.wf = SimpleNamespace(ptr=mem.alloc(8 * rows_cap * wf))
    s.wi = SimpleNamespace(ptr=mem.alloc(4 * rows_cap * wi))
    s.staging = FakePinned(lay.nbytes)
    s.ahead_staging = [FakePinned(lay.data, (2 + t) << 40) for t in range(2)]
    s.kernels = SimpleNamespace(**{n: FakeKernel(mem, fns[n], n) for n in KERNELS})
    s.cache = PromptCache()
    s.threads = geo["threads"]
    s.blocks = geo["blocks"]
    s.copies = []

    def copy_htod_async(dst, src, nbytes, stream):
        staging = next(b for b in [s.staging] + s.ahead_staging if b.ptr == src)
        assert nbytes <= len(staging.arr)
        s.copies.append(nbytes)
        mem.mem[dst: dst + nbytes] = staging.arr[:nbytes]
    s._d = SimpleNamespace(copy_htod_async=copy_htod_async)
    return s


def run(n_rows, threads, seed, blocks=4, nbins=256, cap=32):
    mod = _import_kernel_module("sample")
    geo = dict(threads=threads, blocks=blocks, nbins=nbins, cap=cap)
    fns = {n: cuda.jit(getattr(mod, n)(**geo)) for n in KERNELS}
    k_argmax = cuda.jit(mod.argmax(threads=threads))
    r = np.random.default_rng(seed)
    stats = dict(rows=0, compared=0, skipped=0, mismatches=[], rng_bad=0, argmax_bad=0,
                 copies_bad=0, reasons={}, plans=[0, 0, 0, 0], ahead_runs=0, ahead_bad=0)
    # batches of up to 4 rows of one vocabulary size (the kernel's rows share V)
    cases = []
    V0 = int(r.integers(200, 400))
    cases += [(V0, [(k, row)]) for k, row in sc.boundary_rows(r, V0)]
    V1 = int(r.integers(1500, 2001))
    rows = sc.nucleus_rows(r, V1, 8)
    cases += [(V1, rows[i:i + 2]) for i in range(0, len(rows), 2)]
    n_random = 0
    while n_random < n_rows:
        V = int(r.integers(200, 2001)) if r.random() < 0.3 else int(r.integers(200, 600))
        rows = [(str(r.choice(["normal", "peaked", "ties"])), sc.random_row(r, V))
                for _ in range(int(r.integers(1, 5)))]
        cases.append((V, rows))
        n_random += len(rows)
    for V, rows in cases:
        B = len(rows)
        mem = Memory(20 * 4 * 2000 * 8 + (1 << 20))
        logits = np.stack([sc.random_logits(r, V, kind) for kind, _ in rows])
        d_logits = mem.alloc(logits.nbytes)
        mem.mem[d_logits: d_logits + logits.nbytes] = logits.view(np.uint8).reshape(-1)
        d_tokens = mem.alloc(4 * B)
        sampler = device_sampler(mem, fns, geo, B + 1, V, 4096)
        sampler.launch(None, d_logits, d_tokens, [row for _, row in rows])
        stats["copies_bad"] += int(len(sampler.copies) != 1)
        out = mem.view(d_tokens, np.int32)[:B].copy()
        if all(row.spec.samples_from_logits_alone and row.mask is None for _, row in rows):
            # a chained step's launch (the pipelined decode): its small staging, same tokens
            sampler.launch(None, d_logits, d_tokens, [row for _, row in rows],
                           ahead_turn=stats["ahead_runs"] % 2)
            stats["ahead_runs"] += 1
            stats["ahead_bad"] += int(not np.array_equal(mem.view(d_tokens, np.int32)[:B], out))
        lay = sampler.layout
        fpar = mem.view(sampler.block.ptr + lay.fpar, np.float64).reshape(-1, 8)
        u, plan = fpar[:B, 7], fpar[:B, 6]
        am = np.full(B, -7, np.int32)
        k_argmax[(B, 1, 1), (threads, 1, 1)](am, logits.reshape(-1), V)
        stats["argmax_bad"] += int(np.sum(am != np.argmax(logits, -1)))
        for b, (_, row) in enumerate(rows):
            stats["rows"] += 1
            if not row.spec.is_greedy:
                if u[b] != counter_uniform(row.spec.seed, row.position):
                    stats["rng_bad"] += 1
                stats["plans"][int(plan[b])] += 1
            want, why = sc.oracle(logits[b], row)
            if why is not None:
                stats["skipped"] += 1
                stats["reasons"][why] = stats["reasons"].get(why, 0) + 1
                continue
            stats["compared"] += 1
            if int(out[b]) != want:
                s = row.spec
                stats["mismatches"].append(dict(
                    V=V, got=int(out[b]), want=want, T=s.temperature, top_k=s.top_k,
                    top_p=s.top_p, min_p=s.min_p, rep=s.repetition_penalty,
                    mask=row.mask is not None))
    return stats


if __name__ == "__main__":
    # the simulator runs a block's threads as Python threads meeting at barriers: a short GIL
    # switch interval makes it ~3x faster (the default 5 ms idles at every barrier)
    sys.setswitchinterval(1e-4)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    t = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    s = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    geo = [int(a) for a in sys.argv[4:7]]
    print(json.dumps(run(n, t, s, *geo)))
