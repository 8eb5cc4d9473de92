"""kernels/sample.py on numba-cuda's CPU simulator (no GPU), against the host sampler.

Random requests (tests/gpu/sample_cases.py) are packed by cuda/sampler.py's `pack` into one byte
block exactly as the device gets it; the kernels run with a small block (threads=64, or argv[2])
over the typed views of that block; `rows` random rows follow 36 boundary rows. Prints one JSON line: counts of rows compared, skipped at a
decision margin, token mismatches, RNG mismatches, argmax mismatches.
`tests/test_cuda_sampler_nogpu.py` runs this in a subprocess (the simulator must be switched on
before numba is imported):

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_sample.py [rows] [threads] [seed]
"""
import json
import pathlib
import sys
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from ninfer.core.cuda import numba_shim   # noqa: E402

cuda, _ = numba_shim.import_numba_cuda()
import numba.cuda.simulator.kernelapi as _fake   # noqa: E402

from ninfer.core.cuda.kernels import _import_kernel_module   # noqa: E402
from ninfer.models.qwen3_5.cuda.sampler import SamplerLayout, pack, PromptCache   # noqa: E402
from ninfer.models.qwen3_5.program.sampling import counter_uniform   # noqa: E402
import sample_cases as sc   # noqa: E402

# the simulator has no libdevice: the one bit cast sample.py uses
_fake.FakeCUDAModule.libdevice = SimpleNamespace(
    double_as_longlong=lambda x: np.array([x], np.float64).view(np.int64)[0])


def run(n_rows, threads, seed):
    mod = _import_kernel_module("sample")
    k_sample = cuda.jit(mod.sample(threads=threads))
    k_argmax = cuda.jit(mod.argmax(threads=threads))
    r = np.random.default_rng(seed)
    stats = dict(rows=0, compared=0, skipped=0, mismatches=[], rng_bad=0, argmax_bad=0,
                 reasons={})
    # batches of up to 4 rows of one vocabulary size (the kernel's rows share V)
    cases = []
    V0 = int(r.integers(200, 400))
    cases += [(V0, [(k, row)]) for k, row in sc.boundary_rows(r, V0)]
    n_random = 0
    while n_random < n_rows:
        V = int(r.integers(200, 2001)) if r.random() < 0.3 else int(r.integers(200, 600))
        rows = [(str(r.choice(["normal", "peaked", "ties"])), sc.random_row(r, V))
                for _ in range(int(r.integers(1, 5)))]
        cases.append((V, rows))
        n_random += len(rows)
    cache = PromptCache()
    for V, rows in cases:
        B = len(rows)
        logits = np.stack([sc.random_logits(r, V, kind) for kind, _ in rows])
        lay = SamplerLayout(B + 1, V, 4096)
        buf = np.zeros(lay.nbytes, np.uint8)
        pack(lay, buf, [row for _, row in rows], cache)
        fpar, ipar, upar, data = lay.views(buf)
        z = np.full((B, V), np.nan)
        out = np.full(B, -7, np.int32)
        k_sample[(B, 1, 1), (threads, 1, 1)](out, logits.reshape(-1), z.reshape(-1), V,
                                             fpar.reshape(-1), ipar.reshape(-1),
                                             upar.reshape(-1), data.view(np.int32), data)
        am = np.full(B, -7, np.int32)
        k_argmax[(B, 1, 1), (threads, 1, 1)](am, logits.reshape(-1), V)
        stats["argmax_bad"] += int(np.sum(am != np.argmax(logits, -1)))
        for b, (_, row) in enumerate(rows):
            stats["rows"] += 1
            if not row.spec.is_greedy and fpar[b, 7] != counter_uniform(row.spec.seed, row.position):
                stats["rng_bad"] += 1
            want, why = sc.oracle(logits[b], row)
            if why is not None:
                stats["skipped"] += 1
                stats["reasons"][why] = stats["reasons"].get(why, 0) + 1
                continue
            stats["compared"] += 1
            if int(out[b]) != want:
                s = row.spec
                stats["mismatches"].append(dict(V=V, got=int(out[b]), want=want, T=s.temperature,
                                                top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                                rep=s.repetition_penalty, mask=row.mask is not None))
    return stats


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    t = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    s = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    print(json.dumps(run(n, t, s)))
