"""The MoE prefill routed on the device: no host round trip per MoE layer.

The host path (StepRunner.experts_grouped) copies the router's ids to the host, lays the routed
rows out there (moe_rows.py) and launches the layer's expert GEMMs after it: one sync per MoE
layer while the GPU idles, and the launches wait for Python. Here three small kernels lay the
rows out on the device (kernels/moe.py moe_route_count, _scan, _place: the same layout as the
host's with cap 0, every expert's rows consecutive in pair order) and write what cuBLASLt's
grouped GEMM reads from device memory: each expert's row count and the addresses of its rows in
the buffers it reads and writes. The expert GEMMs are then two grouped GEMMs (gate|up, down), one
launch each, whatever the routing.

Device arrays (carved from the workspace, DeviceRoute.nbytes):
    counts   int32 [chunks_cap, E]   per chunk of ROUTE_CHUNK pairs: its pairs per expert, then
                                     (after the scan) its first row of each expert
    rows     int32 [E]               each expert's rows (the grouped GEMMs' m_g)
    ptrs     uint64 [4, E]           each expert's first row in xg, gu, gact, my
    spec     uint64 [8]              (base, row bytes) of xg, gu, gact, my: the scan's input
    dims     int32 [3, E]            H, 2I, I for every expert (the layouts' other dimensions)
    scalars  float32 [2]             1.0, 0.0: alpha and beta (read by device pointer)
    w_ptrs   uint64 [tables, 2, E]   each MoE layer's expert weights: gate|up and down, by expert
"""
from __future__ import annotations

import numpy as np

from ....core.cuda import driver as _d

ROUTE_CHUNK = 512           # kernels/moe.ROUTE_CHUNK: pairs a block of moe_route_count / _place
COUNT_THREADS = 256         # kernels/moe.ROUTE_COUNT_THREADS: moe_route_count's block
NPTR = 4                    # row-address arrays the scan writes: xg, gu, gact, my


def chunks(pairs: int) -> int:
    return -(-int(pairs) // ROUTE_CHUNK)


def nbytes(n_cap: int, top_k: int, num_experts: int, tables: int) -> int:
    """Device bytes of DeviceRoute's arrays (before the arena's alignment of each)."""
    E = num_experts
    return 4 * chunks(n_cap * top_k) * E + 4 * E + 8 * NPTR * E + 8 * 2 * NPTR + 4 * 3 * E + 8 \
        + 8 * 2 * E * tables


class DeviceRoute:
    """Buffers and grouped-GEMM plans of the device-routed MoE prefill (one per workspace)."""

    enabled = False             # set by bind(): the cuBLASLt here has the grouped GEMM

    def __init__(self, take, cfg, n_cap: int, tables: int, region: str):
        E = self.E = cfg.num_experts
        self.H, self.I = cfg.hidden_size, cfg.moe_intermediate_size
        self.counts = take((chunks(n_cap * cfg.num_experts_per_tok) * E,), np.int32, region)
        self.rows = take((E,), np.int32, region)
        self.ptrs = take((NPTR, E), np.uint64, region)
        self.spec = take((2 * NPTR,), np.uint64, region)
        self.dims = take((3, E), np.int32, region)
        self.scalars = take((2,), np.float32, region)
        self.w_ptrs = take((max(tables, 1), 2, E), np.uint64, region)
        self.tables = {}        # a layer's gate|up weights' address -> (its two pointer arrays)

    def bind(self, stream, lt, ws, layers) -> bool:
        """Upload what stays fixed (the buffers' row addresses, the dimensions, alpha and beta,
        every MoE layer's expert addresses: `layers`, the MoE layers' weight dicts) and ask
        cuBLASLt for the grouped GEMM once. Returns whether the device route is enabled: off
        for packed experts, where the cuBLASLt here has no grouped GEMM (then nothing is
        uploaded: no start-up work), or with no layers."""
        from ....core.cuda.cublaslt import DeviceError
        E, H, I = self.E, self.H, self.I
        dense = [lw for lw in layers if hasattr(lw["experts_gu"], "ptr")
                 and hasattr(lw["experts_down"], "ptr")]
        self.enabled = False
        if not lt.has_grouped_gemm() or not dense or len(dense) != len(layers) \
                or len(dense) > self.w_ptrs.shape[0]:
            return False
        g = ws.gin_bytes
        spec = np.array([ws.xg.ptr, g * H, ws.gu.ptr, 4 * 2 * I, ws.gact.ptr, g * I,
                         ws.my.ptr, 4 * H], np.uint64)
        _d.upload(self.spec.ptr, spec, stream)
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
