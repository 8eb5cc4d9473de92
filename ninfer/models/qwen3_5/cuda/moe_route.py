"""The MoE prefill routed on the device: no host round trip per MoE layer.

The host path (StepRunner.experts_grouped) copies the router's ids to the host, lays the routed
rows out there (moe_rows.py) and launches the layer's expert GEMMs after it: one sync per MoE
layer while the GPU idles, and the launches wait for Python. Here three small kernels lay the
rows out on the device (kernels/moe.py moe_route_count, _scan, _place: the host's layout for a
given block size `cap`) and, for cap 0 (every expert's rows consecutive in pair order), write
what cuBLASLt's grouped GEMM reads from device memory: each expert's row count and the addresses
of its rows in the buffers it reads and writes. The expert GEMMs are then two grouped GEMMs
(gate|up, down), one launch each, whatever the routing: cuBLASLt's where it has one (cuBLAS
13.10 and later).

Where it has none, the layout is the host's padded one (moe_rows.py) with a block size the host
picks from the number of pairs alone (`device_cap`: the mean rows an expert and a margin, no
sync): one strided-batched cuBLASLt GEMM over the padded block of every expert, and the rows past
it (the overflow of the experts routed more than cap) on our tensor-core kernel
(kernels/grouped_gemm.py) over a work list of 64-row tiles that a fourth small kernel writes
from the experts' row counts (moe_route_tiles). Our kernel alone (cap 0) reads each expert's
weights once but at 0.4-0.7 of cuBLASLt's rate over the padded block (H100, 35B-A3B,
bench/probe_grouped_gemm.py: T=512 gate|up 0.78 against 0.54 ms, T=4096 2.02 against 0.88 ms),
which computes the padding too, at its own rate.

Device arrays (carved from the workspace, DeviceRoute.nbytes):
    counts   int32 [chunks_cap, E]   per chunk of ROUTE_CHUNK pairs: its pairs per expert, then
                                     (after the scan) its first rank among each expert's pairs
    rows     int32 [E]               each expert's rows (the grouped GEMMs' m_g)
    first    int32 [E]               each expert's first overflow row (cap 0: its first row)
    ptrs     uint64 [4, E]           each expert's first row in xg, gu, gact, my
    spec     uint64 [8]              (base, row bytes) of xg, gu, gact, my: the scan's input
    dims     int32 [3, E]            H, 2I, I for every expert (the layouts' other dimensions)
    scalars  float32 [2]             1.0, 0.0: alpha and beta (read by device pointer)
    w_ptrs   uint64 [tables, 2, E]   each MoE layer's expert weights: gate|up and down, by expert
    tiles    int32 [3, tile_cap]     our grouped GEMM's work list: (expert or -1, first row, rows)
"""
from __future__ import annotations

import numpy as np

from ....core.cuda import driver as _d
from .moe_rows import CAP_ALIGN

ROUTE_CHUNK = 512           # kernels/moe.ROUTE_CHUNK: pairs a block of moe_route_count / _place
COUNT_THREADS = 256         # kernels/moe.ROUTE_COUNT_THREADS: moe_route_count's block
NPTR = 4                    # row-address arrays the scan writes: xg, gu, gact, my
# kernels/grouped_gemm.py's tile: BM routed rows x BN outputs a block of GEMM_THREADS, k in steps
# of BK (tests/test_grouped_gemm_nogpu.py checks these against the kernel's)
GEMM_BM, GEMM_BN, GEMM_BK, GEMM_THREADS = 64, 64, 32, 128
# ... and its wider k step, taken where k is whole steps of it (twice the loads in flight, half
# the barriers: H100, 35B-A3B experts, probe_grouped_gemm.py, every row on it: gate|up 0.81x of
# BK 32's time at T=512, 0.75x at 4096; down 0.83x, 0.82x)
GEMM_BK_WIDE = 64
SILU_THREADS = 256          # kernels/grouped_gemm.SILU_THREADS: routed_silu_mul's block
# The padded block's rows an expert over the mean: the mean again, at most this many (then
# rounded up to CAP_ALIGN). The best blocks of a 35B-A3B prefill on the H100 (bench_decode
# --route-caps; a random model's routing, more skewed than uniform): T = 64 / 512 / 1024 /
# 2048 / 4096 / 8192 tokens (mean 2 / 16 / 32 / 64 / 128 / 256 rows) took 16 / 32 / 64 / 96 /
# 160 / 272 (the largest tried). Padded rows cost cuBLASLt's rate, overflow rows our slower GEMM's
CAP_MARGIN_ROWS = 32


def chunks(pairs: int) -> int:
    return -(-int(pairs) // ROUTE_CHUNK)


def tile_cap(pairs: int, num_experts: int) -> int:
    """Entries of the grouped GEMM's work list for `pairs` routed pairs: each expert's rows in
    tiles of GEMM_BM, at most one partial tile an expert."""
    return -(-int(pairs) // GEMM_BM) + int(num_experts)


def device_cap(pairs: int, num_experts: int, max_rows: int) -> int:
    """The padded block's rows an expert for `pairs` routed pairs, chosen without their counts:
    the mean + min(the mean, CAP_MARGIN_ROWS), rounded up to a multiple of CAP_ALIGN, at most
    what keeps the block + every pair (the most the overflow can take) within max_rows (the
    workspace's grouped_rows: always >= the mean + CAP_ALIGN). 0 for no pairs."""
    pairs, E = int(pairs), int(num_experts)
    if pairs <= 0:
        return 0
    mean = -(-pairs // E)
    cap = CAP_ALIGN * -(-(mean + min(mean, CAP_MARGIN_ROWS)) // CAP_ALIGN)
    return max(0, min(cap, (max_rows - pairs) // E // CAP_ALIGN * CAP_ALIGN))


def gemm_kernel(k: int) -> str:
    """The kernel set's name of our grouped GEMM for products over k (own_gemm_fits): the wide
    k step where k is whole steps of it."""
    return "grouped_gemm64" if k % GEMM_BK_WIDE == 0 else "grouped_gemm"


def own_gemm_fits(n: int, k: int) -> bool:
    """kernels/grouped_gemm.fits: whole column blocks and k steps (16-byte aligned rows)."""
    return n > 0 and k > 0 and n % GEMM_BN == 0 and k % GEMM_BK == 0


def nbytes(n_cap: int, top_k: int, num_experts: int, tables: int) -> int:
    """Device bytes of DeviceRoute's arrays (before the arena's alignment of each)."""
    E = num_experts
    return 4 * chunks(n_cap * top_k) * E + 2 * 4 * E + 8 * NPTR * E + 8 * 2 * NPTR + 4 * 3 * E + 8 \
        + 8 * 2 * E * tables + 4 * 3 * tile_cap(n_cap * top_k, E)


class DeviceRoute:
    """Buffers and grouped-GEMM plans of the device-routed MoE prefill (one per workspace)."""

    enabled = False             # set by bind(): a grouped GEMM takes these experts
    own = False                 # ... and it is ours (kernels/grouped_gemm.py), not cuBLASLt's

    def __init__(self, take, cfg, n_cap: int, tables: int, region: str):
        E = self.E = cfg.num_experts
        self.H, self.I = cfg.hidden_size, cfg.moe_intermediate_size
        self.counts = take((chunks(n_cap * cfg.num_experts_per_tok) * E,), np.int32, region)
        self.rows = take((E,), np.int32, region)
        self.first = take((E,), np.int32, region)
        self.ptrs = take((NPTR, E), np.uint64, region)
        self.spec = take((2 * NPTR,), np.uint64, region)
        self.dims = take((3, E), np.int32, region)
        self.scalars = take((2,), np.float32, region)
        self.w_ptrs = take((max(tables, 1), 2, E), np.uint64, region)
        self.tables = {}        # a layer's gate|up weights' address -> (its two pointer arrays)
        self.tiles = take((3 * tile_cap(n_cap * cfg.num_experts_per_tok, E),), np.int32, region)

    def bind(self, stream, lt, ws, layers) -> bool:
        """Upload what stays fixed (the buffers' row addresses; for cuBLASLt's grouped GEMM the
        dimensions, alpha and beta and every MoE layer's expert addresses: `layers`, the MoE
        layers' weight dicts, whose plans it makes once). Returns whether the device route is
        enabled: off for packed experts, with no layers, or where neither cuBLASLt's grouped
        GEMM nor ours (`own`: kernels/grouped_gemm.py, whole 64-column blocks and 32-wide k
        steps) takes the experts."""
        from ....core.cuda.cublaslt import DeviceError
        E, H, I = self.E, self.H, self.I
        dense = [lw for lw in layers if hasattr(lw["experts_gu"], "ptr")
                 and hasattr(lw["experts_down"], "ptr")]
        self.enabled = self.own = False
        if not dense or len(dense) != len(layers) or len(dense) > self.w_ptrs.shape[0]:
            return False
        lt_grouped = lt.has_grouped_gemm()
        if not lt_grouped and not (own_gemm_fits(2 * I, H) and own_gemm_fits(H, I)
                                   and ws.gin_bytes == 2):
            return False
        g = ws.gin_bytes
        spec = np.array([ws.xg.ptr, g * H, ws.gu.ptr, 4 * 2 * I, ws.gact.ptr, g * I,
                         ws.my.ptr, 4 * H], np.uint64)
        _d.upload(self.spec.ptr, spec, stream)
        if not lt_grouped:
            self.enabled = self.own = True
            return True
        _d.upload(self.dims.ptr, np.repeat(np.array([H, 2 * I, I], np.int32), E), stream)
        _d.upload(self.scalars.ptr, np.array([1.0, 0.0], np.float32), stream)
        table = np.zeros(self.w_ptrs.shape, np.uint64)
        for i, lw in enumerate(dense):
            gu, dn = lw["experts_gu"], lw["experts_down"]
            table[i, 0] = gu.ptr + np.arange(E, dtype=np.uint64) * (2 * I * H * g)
            table[i, 1] = dn.ptr + np.arange(E, dtype=np.uint64) * (H * I * g)
            self.tables[gu.ptr] = (self.w_ptrs.at(i, 0), self.w_ptrs.at(i, 1))
        _d.upload(self.w_ptrs.ptr, table, stream)
        try:
            self.plans(lt, 4096)
        except DeviceError:
            return False
        self.enabled = True
        return True

    def plans(self, lt, pairs: int):
        """The two grouped plans (gate|up: N = 2I, K = H; down: N = H, K = I) for a call of
        `pairs` routed pairs: the heuristic's hint is the mean rows an expert, bucketed to a
        power of two (one plan per bucket)."""
        E, H, I = self.E, self.H, self.I
        avg = 1 << max(0, (max(1, pairs // E) - 1).bit_length())
        d_h, d_2i, d_i = (self.dims.at(j) for j in range(3))
        return (lt.grouped_plan(2 * I, H, E, self.rows.ptr, d_2i, d_h, avg),
                lt.grouped_plan(H, I, E, self.rows.ptr, d_h, d_i, avg))
