"""The launch sequence of one forward step on the device (eager, or recorded into a graph).

    embed -> [rmsnorm -> GEMM w_in -> mixer kernels -> GEMM w_out (+= residual, beta 1)
              rmsnorm -> GEMM gate|up -> silu_mul  -> GEMM down  (+= residual)] x layers
          -> rmsnorm(selected rows) -> GEMM lm_head -> argmax

(`normed`: a norm and the product after it, one gemv_norm launch where fuse_norm takes it.)
The residual stream `h` is fp32; GEMM inputs are bf16 (written by the kernel before the GEMM;
fp32 in a dtype="float32" model); GEMM outputs are fp32. Every buffer is a fixed workspace
region, so a step allocates nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ....core.cuda import driver as _d
from ....core.cuda.cublaslt import FP8_BLOCK, PIN_M, alignment, fp8_scale_rows
from ..config import FULL_ATTENTION, TextConfig
from ..model import INT8_HEAD_ROWS
from . import attention_tc as tc
from . import moe_route, moe_rows
from . import gdn_chunk as gc
from . import qweights as qw
from .kernel_set import (GEMV_MAX_M, attention_mma_group, dequant_name, paged_attention_group,
                         qgemv_name, qmma_name)
from .media_rows import MediaRows


MAX_GRID_Y = 65535          # a launch's grid.y limit


class Workspace:
    """Fixed activation buffers for up to `n_cap` tokens and `lg_cap` logits rows."""

    route_dev = None        # a bf16 MoE model's moe_route.DeviceRoute

    def __init__(self, arena, cfg: TextConfig, n_cap: int, lg_cap: int, part_rows: int,
                 max_keys: int, f32: bool = False, wq_elements: int = 0, w8a8_k: int = 0,
                 mtp: bool = False, verify: bool = None, rows_cap: int = 8):
        """mtp: the MTP head's buffers; verify (default: mtp): a speculative verify's (every
        token's final-normed hidden, the rows' snapshot bases), for either drafter; rows_cap:
        the most rows of one call (the split GDN scan's S_c slots depend on it)."""
        verify = mtp if verify is None else verify
        take = arena.take
        gin = np.float32 if f32 else np.uint16      # GEMM inputs: bf16, or fp32 (dtype="float32")
        self.gin_bytes = np.dtype(gin).itemsize
        H, V = cfg.hidden_size, cfg.vocab_size
        C, Vd, nv = cfg.linear_conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        widths_in, widths_act = [], [H]
        if cfg.linear_layer_ids:
            widths_in.append(C + Vd + 2 * nv)
            widths_act.append(Vd)
        if cfg.attention_layer_ids:
            widths_in.append(2 * nh * hd + 2 * nkv * hd)
            widths_act.append(nh * hd)
        if cfg.is_moe:
            E, Is = cfg.num_experts, cfg.shared_expert_intermediate_size
            widths_in.append(E + 2 * Is + 1)
            widths_act.append(Is)
        else:
            widths_in.append(2 * cfg.intermediate_size)
            widths_act.append(cfg.intermediate_size)
        if mtp:
            widths_act.append(2 * H)     # the MTP head's fc input (StepRunner.mtp)
        n = n_cap
        ws = "workspace"
        self.h = take((n, H), np.float32, ws)
        self.x = take((n, H), gin, ws)
        self.act = take((n, max(widths_act)), gin, ws)
        self.proj = take((n, max(widths_in)), np.float32, ws)
        self.mid = take((n, max(C if cfg.linear_layer_ids else 1,
                                nh * hd if cfg.attention_layer_ids else 1)), np.float32, ws)
        self.core = take((n, max(Vd, 1)), np.float32, ws)
        if cfg.linear_layer_ids:
            # chunked delta rule (prefill, cuda/gdn_chunk.py): W, P, per-token decay factors
            dk = cfg.linear_key_head_dim
            # bf16: the tensor-core variants where the geometry allows (kernel_set's choice too)
            self.gdn_tc = not f32 and gc.tc_ok(dk, cfg.linear_value_head_dim)
            self.gdn_cn = gc.TC_CHUNK if self.gdn_tc else gc.chunk_size(dk) or gc.CHUNK_SIZES[-1]
            shp = gc.buffer_shapes(n, nv, dk, self.gdn_cn, cfg.linear_value_head_dim
                                   if self.gdn_tc else 0, rows_cap)
            self.gdn_w, self.gdn_p, self.gdn_g = (take(shp[k], np.float32, ws) for k in "wpg")
            # the tensor-core scan's chunk-start states, for calls of up to rows_cap rows
            self.gdn_s = take(shp["s"], np.float32, ws) if self.gdn_tc else None
            self.gdn_rows = rows_cap
        if cfg.attention_layer_ids:
            self.part = take((part_rows, nh, hd), np.float32, ws)
            self.ml = take((part_rows, nh, 2), np.float32, ws)
            # fp32: no tensor-core prefill attention (bf16 only); l_cap 0 -> split_rows takes no row
            self.tc = tc.TcBuffers(0, 0, 0, 0, 0, 0, t_cap=0, l_cap=0, s_cap=0)
        if cfg.attention_layer_ids and not f32:
            # tensor-core prefill attention (attention_tc.py): fixed buffers for n_cap tokens
            # and rows of up to max_keys keys
            sz = tc.buffer_sizes(nh, nkv, hd, n, max_keys)
            tb = {k: take((sz[k],), dt, ws) for k, dt in
                  (("qb", np.uint16), ("o", np.float32), ("kc", np.uint16), ("vc", np.uint16),
                   ("s", np.float32), ("p", np.uint16))}
            self.tc = tc.TcBuffers(**{k: a.ptr for k, a in tb.items()}, t_cap=n,
                                   l_cap=sz["l_cap"], s_cap=sz["s"])
        if cfg.is_moe:
            K, I = cfg.num_experts_per_tok, cfg.moe_intermediate_size
            self.ids = take((n * K,), np.int32, ws)
            self.wts = take((n * K,), np.float32, ws)
            self.mact = take((n * K, I), np.float32, ws)
            # grouped path (prefill): the routed rows in moe_rows.py's layout (padded block +
            # overflow), at most grouped_rows of them
            self.grouped_rows = R = grouped_rows(n, K, cfg.num_experts)
            self.my = take((R, H), np.float32, ws)
            self.shared = take((n, H), np.float32, ws)
            self.xg = take((R, H), gin, ws)
            self.gu = take((R, 2 * I), np.float32, ws)
            self.gact = take((R, I), gin, ws)
            self.route = take((R + n * K,), np.int32, ws)    # [row -> token (R) | pair -> row]
            # the same layout routed on the device (moe_route.py): its counts, the grouped
            # GEMMs' row counts and addresses; a table of expert addresses per MoE layer
            self.route_dev = None if f32 else moe_route.DeviceRoute(
                take, cfg, n, cfg.num_hidden_layers + int(mtp), ws)
        # packed weights' prefill tile (cuda/qweights.py): a slab of rows dequantized for cuBLASLt
        self.wq = take((wq_elements,), gin, ws) if wq_elements else None
        # fp8 weights' prefill on fp8 tensor cores (qweights.w8a8_ok): the GEMM input as e4m3
        # codes and its per-token, per-128-column scales (kernels/act_quant.py's layout)
        self.xq = self.xqs = None
        if w8a8_k and not f32:
            self.xq = take((fp8_scale_rows(n) * w8a8_k,), np.uint8, ws)
            self.xqs = take((w8a8_k // FP8_BLOCK * fp8_scale_rows(n),), np.float32, ws)
        self.xf = take((lg_cap, H), gin, ws)
        # the MTP head's input hidden states (the target's final-normed ones, or its own), and a
        # verify's first snapshot slot per row (StepRunner.run's snap)
        self.mtp_h = take((n, H), gin, ws) if verify else None
        self.snap = take((n,), np.int32, ws) if verify else None
        self.logits = take((lg_cap, V), np.float32, ws)
        self.tokens = take((lg_cap,), np.int32, ws)


def w8a8_bytes(n_cap: int, k: int) -> int:
    """Workspace bytes of the quantized GEMM input (Workspace.xq, xqs) for rows of width k."""
    rows = fp8_scale_rows(n_cap)
    return rows * k + 4 * (k // FP8_BLOCK) * rows if k else 0


def grouped_rows(n: int, top_k: int, num_experts: int) -> int:
    """Rows of the MoE prefill's routed-row buffers: twice the routed pairs plus one aligned
    block per expert, room for moe_rows' padding (its cap never takes more)."""
    return 2 * n * top_k + moe_rows.CAP_ALIGN * num_experts


COMBINE_GROUPS = 8          # kernels/attention.COMBINE_GROUPS (the kernels' module imports numba)
EXPERT_DOWN_ROWS = 4        # kernels/moe.DOWN_ROWS: expert_down's output rows per warp
ROUTER_THREADS = 32         # kernels/moe.ROUTER_THREADS: router_topk's block, a warp a token
GATHER_THREADS = 128        # kernels/moe.GATHER_THREADS: gather_rows' block, 16 bytes a thread
GATED_WARPS = 4             # kernels/norm.GATED_WARPS: gated_rmsnorm4's (token, head) pairs a block
CONV_TOKENS = 16            # kernels/conv.CONV_TOKENS: conv_silu_chunk's tokens a block
GEMV_WARPS = 4              # kernels/gemv.WARPS: the decode GEMV's output rows a block
GEMV_SPAN_BYTES = 512       # kernels/gemv.SPAN words of 4 bytes: its rows' granule
GEMV_MAX_BYTES = 16 << 20   # StepRunner.gemv_max_bytes' default
# MoE calls of at most this many tokens run the layer's tail as one launch (fused_tail): a
# 35B-A3B decode step on the H100 3.79 -> 3.59 ms at B = 1, but 9.40 -> 9.55 ms at B = 8, where
# a block a token re-reads the shared expert's rows and recomputes its SwiGLU for every token
FUSED_TAIL_TOKENS = 4


def combine_launch(tokens: int, nh: int, hd: int) -> tuple:
    """attn_combine's (grid, block): a block per (token, head, 32 dims), a warp per group of
    splits."""
    return (tokens, nh, (hd + 31) // 32), (32 * COMBINE_GROUPS,)


def attention_splits(n: int, nkv: int, num_sms: int) -> int:
    """Key splits per (token, kv head): about 4 blocks per SM, at most 128 (a warp walks its keys
    serially, so long contexts need many splits to keep loads in flight)."""
    return max(1, min(128, math.ceil(4 * num_sms / max(n * nkv, 1))))


def mma_splits(n: int, nkv: int, num_sms: int) -> int:
    """Key splits per (token, kv head) of paged_attention_mma: the grid in one wave of 2 blocks
    an SM (its 206 registers a thread leave room for 2 blocks of 128), at most 128. A warp keeps
    16 KB of K/V loads in flight, so fewer splits than the CUDA-core kernel's suffice; a grid
    just past a wave would run a second, nearly empty one. Never more than attention_splits
    (the partial-result buffer is sized by it)."""
    return max(1, min(128, 2 * num_sms // max(n * nkv, 1)))


def decode_splits(nkv: int, num_sms: int, mma: bool = False) -> int:
    """Key splits of every decode token in batch-invariant mode: B = 1's choice for every B (a
    token's attention sum must run in the same order whatever B is; attention_splits varies
    with B); `mma`: paged_attention_mma's."""
    return (mma_splits if mma else attention_splits)(1, nkv, num_sms)


def part_rows_needed(n_cap: int, nkv: int, num_sms: int, invariant_rows: int = 0) -> int:
    """Partial-result rows for the largest launch; `invariant_rows`: decode rows (b_cap) that
    batch-invariant mode runs at decode_splits each."""
    return max([n * attention_splits(n, nkv, num_sms) for n in
                list(range(1, min(n_cap, 4 * num_sms) + 1)) + [n_cap]]
               + [invariant_rows * decode_splits(nkv, num_sms)])


def split_rows(rows, n: int, tc_min: int, l_cap: int):
    """Which rows take the tensor-core prefill attention: those with >= tc_min new tokens whose
    keys fit its buffers (a KV pool of larger pages than the options planned for can exceed them).
    Returns (their indices, the token ranges [t0, t1) left to the CUDA-core kernel: runs of
    consecutive other rows). `rows`: (query_start, new tokens, context) per row, in order."""
    big = [i for i, (_, ln, ctx) in enumerate(rows)
           if ln >= tc_min and tc.pad8(ctx + ln) <= l_cap]
    runs, t0 = [], 0
    for i in big:
        if rows[i][0] > t0:
            runs.append((t0, rows[i][0]))
        t0 = rows[i][0] + rows[i][1]
    if t0 < n:
        runs.append((t0, n))
    return big, runs


@dataclass(frozen=True)
class StepResources:
    """What a step's launches use, handed over by the model at load (the runner keeps no
    reference to the model)."""
    cfg: TextConfig
    ws: Workspace
    weights: dict                 # weight_load.load_weights: embed, layers[i], norm, lm_head
    lt: object                    # CublasLt: every GEMM
    kernels: object               # KernelSet: the geometry's loaded kernels, by attribute
    num_sms: int                  # attention key splits per launch
    b_cap: int                    # decode rows of a graph (batch-invariant GEMV rows)
    moe_gemv_tokens: int          # an MoE step of more tokens takes the grouped (prefill) path
    n_cap: int                    # tokens per call
    route_host: object            # pinned: the grouped MoE path's routing round trip
    media: MediaRows              # media embeddings over the gathered rows (eager calls)


class StepRunner:
    """Issues one step's launches. `dry=True` resolves GEMM plans and kernels without launching
    (done before graph capture, so capture never asks cuBLASLt's heuristic or loads a module).
    `invariant` (the model's batch_invariant): GEMMs of fewer than PIN_M rows run as PIN_M rows,
    decode attention at decode_splits, so a row's arithmetic does not depend on B."""

    invariant = False
    w8a8 = False

    def __init__(self, res: StepResources, *, invariant: bool, attn_tc_min_tokens,
                 w8a8: bool = False, fuse_moe_tail: bool = False):
        self.res = res
        # paged attention's blocks per kv head: G / GS (the GS its kernel was compiled with)
        cfg = res.cfg
        G = cfg.num_attention_heads // max(cfg.num_key_value_heads, 1)
        self.attn_subgroups = G // paged_attention_group(G, cfg.head_dim) \
            if cfg.attention_layer_ids else 1
        gm = attention_mma_group(G, cfg.head_dim) if cfg.attention_layer_ids else 0
        self.attn_mma_subgroups = G // gm if gm else 1
        self.cfg: TextConfig = res.cfg
        self.kernels = res.kernels   # launched by attribute: self.kernels.rmsnorm
        self.invariant = bool(invariant)
        # fp8 weights' prefill rows on the fp8 tensor cores (the model's fp8_activations: the
        # workspace has the quantized input's buffers and cuBLASLt the block-scaled GEMM)
        self.w8a8 = bool(w8a8)
        # rows of at least this many new tokens take the tensor-core prefill attention
        # (attention_tc.py); settable (tests and the benchmark move it to cover both paths)
        self.attn_tc_min_tokens = attn_tc_min_tokens
        self.dry = False
        self.profile = None          # list of (name, start event, end event) when profiling
        self.rows = None             # host (query_start, tokens, context) per row of the step
        # MoE prefill row layout (moe_rows.py): the launch-cost weight, a forced block size
        # (None: chosen per call; tests force 0 = one GEMM per expert, or a small cap = overflow;
        # on the device route 0 = our grouped GEMM alone)
        self.moe_launch_rows = moe_rows.LAUNCH_ROWS
        self.moe_cap = None
        # packed experts' prefill on the grouped tensor-core GEMV (experts_grouped), reading the
        # codes in place; False dequantizes every expert into the workspace for cuBLASLt (the
        # slower path: 35B-A3B fp8 TTFT 512 78.8 ms against 182 ms; bench_engine --moe-dequant)
        self.packed_grouped = True
        # bf16 experts' prefill routed on the device (experts_routed) where the workspace's
        # DeviceRoute is enabled (cuBLASLt's grouped GEMM, or its strided batch over a padded
        # block + ours over the overflow): no sync a MoE layer, and faster (H100, 35B-A3B
        # model step, bench_decode: T = 64 .. 4096 tokens in 0.83-0.96 of the host route's
        # time); False takes the host layout (experts_grouped), one sync per MoE layer
        self.moe_device_route = True
        # products of at most this many weight bytes and GEMV_MAX_M tokens run on the decode
        # GEMV (gemv_fits), one launch instead of cuBLASLt's split-K nodes (H100, 35B-A3B
        # decode step: B=1 4.24 -> 4.05 ms at 16 MB, 4.09 at 64 MB; B=8 9.75 -> 9.77 at 16 MB,
        # 10.03 at 64 MB; bench_decode --gemv-max-mb sweeps it); 0: none
        self.gemv_max_bytes = GEMV_MAX_BYTES
        self.last_moe_layout = None  # (cap, rows, overflow experts) of the last grouped call
        # a decode MoE layer's tail (shared expert, experts' down, combine, residual) in one
        # launch instead of four (fused_tail): on where the kernel set has moe_down_combine
        # (kernel_set.fused_moe_tail); False: the four (bench_decode --fuse-moe-tail 0). Calls
        # of up to fused_tail_tokens tokens take it (every decode call in batch-invariant mode,
        # so a row's sums never depend on B)
        self.fuse_moe_tail = bool(fuse_moe_tail)
        self.fused_tail_tokens = FUSED_TAIL_TOKENS
        # a norm in the prologue of the product after it (kernels/gemv.py gemv_norm;
        # norm_fused): one launch instead of two where the kernel set has it and the product
        # takes the decode GEMV (a MoE layer's router + shared gate|up; at a raised
        # gemv_max_bytes the blocks' input projections too). Off: correct on the GPU but slower
        # (H100, 35B-A3B decode, 2K: B=1 3.57-3.71 ms against 3.38-3.42, B=8 10.4-10.7 against
        # 8.95-9.37: every block norms the step's rows of h again; bench_decode --fuse-norm 1,0)
        self.fuse_norm = False
        # the decode step's attention (and short prefill rows') on tensor cores
        # (kernels/attention_mma.py; attention_mma). H100 decode step, on against off: 27B
        # B=8 at 32K 28.4 against 41.9 ms, B=1 21.3 / 23.1; 9B B=8 at 32K 10.6 / 15.7;
        # 35B-A3B B=8 at 2K 8.95-9.03 / 9.30; B=1 at 2K within 1% either way
        # (bench_decode --attn-mma 1,0; docs/performance.md)
        self.attn_mma = True
        # SwiGLU four columns a thread (silu_mul4; swiglu), the GDN output's gated norm a
        # warp a head (gated_rmsnorm4; gated_norm) where the rows allow, and a prefill's conv
        # CONV_TOKENS tokens a block (conv_silu_chunk). H100 9B prefill of 4096: 8.86 -> 6.59
        # ms of SwiGLU (bench_decode --wide-kernels 1,0: decode rows with them and without)
        self.wide_kernels = True
        # a decode MoE layer's top-k in the prologue of its experts' gate|up GEMV
        # (expert_gate_up_routed; router_fused): one launch instead of two. Off: correct on the
        # GPU but no faster (H100, 35B-A3B at 2K: B=1 within 1% either way, B=2 and 4 2.5-4%
        # slower, B=8 0.6-0.8% slower: every block ranks the token's 256 logits again;
        # bench_decode --fuse-router 1,0)
        self.fuse_router = False

    # -- primitives --------------------------------------------------------------------------------
    def _timed(self, st, name, fn):
        if self.profile is None:
            fn()
            return
        e0, e1 = _d.Event(), _d.Event()
        e0.record(st)
        fn()
        e1.record(st)
        self.profile.append((name, e0, e1))

    def profile_summary(self) -> dict:
        """name -> total ms of the recorded launches (call after the stream is synchronised)."""
        out = {}
        for name, e0, e1 in self.profile or []:
            out[name] = out.get(name, 0.0) + e0.elapsed_ms(e1)
            e0.destroy()
            e1.destroy()
        self.profile = None
        return out

    def gemv_fits(self, x, w, m, n, k, w_kn, batch, ldc) -> bool:
        """Whether a product runs on the decode GEMV (kernels/gemv.py) instead of cuBLASLt:
        bf16, at most GEMV_MAX_M tokens, W[n, k] of at most gemv_max_bytes with rows of whole
        512-byte spans, 16-byte aligned operands, y's rows contiguous."""
        return (0 < m <= GEMV_MAX_M and 2 * n * k <= self.gemv_max_bytes and not w_kn
                and batch == 1 and ldc in (0, n) and (2 * k) % GEMV_SPAN_BYTES == 0
                and x % 16 == 0 and w % 16 == 0 and self.res.ws.gin_bytes == 2)

    def gemm(self, st, x, w, y, m, n, k, beta=0.0, w_kn=False, name="gemm", batch=1,
             strides=(0, 0, 0), ldc=0):
        if self.gemv_fits(x, w, m, n, k, w_kn, batch, ldc):
            self.launch(st, getattr(self.kernels, f"gemv{m}"), (-(-n // GEMV_WARPS),),
                        (32 * GEMV_WARPS,), (y, x, w, n, k // 2, float(beta)))
            return
        lt = self.res.lt
        if self.invariant and m < PIN_M and batch == 1:
            # one problem shape for every small M: the same kernel, grid and split-K, so each
            # row's sums run in the same order whatever B is (cuBLASLt picks kernels per M, and
            # some decide their split at run time); rows m..PIN_M-1 are scratch: the model's
            # workspaces hold at least PIN_M rows in this mode
            m = PIN_M
        if self.dry:
            lt.plan(m, n, k, beta, lt.batch_alignment(x, w, y, batch, strides), w_kn, batch, strides,
                    ldc)
            return
        self._timed(st, name, lambda: lt.gemm(st, x, w, y, m, n, k, beta, w_kn, batch, strides,
                                              ldc))

    def linear(self, st, x, w, y, m, n, k, beta=0.0, name="gemm"):
        """y[m, n] (fp32) = x[m, k] @ w^T (+ beta * y): a bf16 matrix through cuBLASLt, a
        packed one (qweights.QMatrix) segment by segment (qlinear)."""
        if isinstance(w, qw.QMatrix):
            self.qlinear(st, x, w, y, m, n, k, beta)
        else:
            self.gemm(st, x, w.ptr, y, m, n, k, beta, name=name)

    def qlinear(self, st, x, w, y, m, n, k, beta):
        """Each segment writes its columns [row0, row0 + rows) of y (row stride n): bf16 rows
        through cuBLASLt; codes as GEMVs over the packed bytes for up to GEMV_MAX_ROWS rows (all
        decode rows in batch-invariant mode: a row's sums never depend on B), on tensor cores
        (qmma) for a bf16 model where the shape allows (qweights.mma_ok), else on CUDA cores
        (qgemv: the float32 model's exact decode, odd shapes); more rows: fp8 segments with
        `w8a8` on the fp8 tensor cores (the input quantized once, then cuBLASLt's block-scaled
        GEMM), the rest as slabs dequantized into the workspace tile and multiplied through
        cuBLASLt."""
        g = self.res.ws.gin_bytes
        gemv_rows = max(qw.GEMV_MAX_ROWS, self.res.b_cap) if self.invariant else qw.GEMV_MAX_ROWS
        quantized, m4 = False, m // 4 * 4
        for seg in w.segments:
            yp = y + 4 * seg.row0
            if seg.layout == qw.BF16:
                self.gemm(st, x, seg.w.ptr, yp, m, seg.rows, k, beta, name="gemm", ldc=n)
            elif m <= gemv_rows and g == 2 and qw.mma_ok(seg.layout, k, seg.block[1]):
                self.qmma(st, seg, x, yp, 0, m, n, k, beta)
            elif m <= gemv_rows:
                vec = int(qw.vector_ok(seg.layout, k, seg.block[1]))
                for b0 in range(0, m, qw.GEMV_BATCH):
                    mb = min(qw.GEMV_BATCH, m - b0)
                    bm = next(b for b in qw.BMS if b >= mb)
                    self.launch(st, getattr(self.kernels, qgemv_name(seg.layout, bm, seg.asym)),
                                (-(-seg.rows // (qw.WARPS * qw.ROWS)), 1), (qw.THREADS,),
                                (yp + 4 * n * b0, x + g * k * b0, x + g * k * b0, seg.w, seg.w,
                                 seg.scale, seg.zero.ptr if seg.zero is not None else 0, mb,
                                 seg.rows, k, n, seg.block[0], seg.block[1],
                                 seg.scale.shape[-1], beta, vec, 0, 0, 0, 0, 0))
            elif self.w8a8 and qw.w8a8_ok(seg) and self.fp8_ok(seg, yp, m4, n, k, beta):
                # cuBLASLt takes M a multiple of 4: the last m % 4 rows run as decode rows do
                if not quantized:            # the input once for every fp8 segment
                    self.act_quant(st, x, m4, k)
                    quantized = True
                self.gemm_fp8(st, seg, yp, m4, n, k, beta)
                if m > m4:
                    self.qmma(st, seg, x, yp, m4, m, n, k, beta)
            else:
                tile = self.res.ws.wq
                step = qw.slab_rows(seg, tile.shape[0])
                for r0 in range(0, seg.rows, step):
                    rows = min(step, seg.rows - r0)
                    self.dequant(st, seg, k, r0, rows)
                    self.gemm(st, x, tile.ptr, yp + 4 * r0, m, rows, k, beta, name="gemm",
                              ldc=n)

    def qmma(self, st, seg, x, y, r0, m, ldy, k, beta):
        """Rows [r0, m) of y = x @ the segment's codes^T (+ beta * y) on the tensor-core GEMV,
        8 rows of x per launch."""
        g = self.res.ws.gin_bytes
        kernel = getattr(self.kernels, qmma_name(seg.layout, seg.asym,
                                                 qw.mma_split(seg.layout, seg.block[1])))
        for b0 in range(r0, m, qw.GEMV_BATCH):
            self.launch(st, kernel, (-(-seg.rows // qw.MMA_ROWS), 1), (32 * qw.MMA_WARPS,),
                        (y + 4 * ldy * b0, x + g * k * b0, seg.w, seg.scale,
                         seg.zero.ptr if seg.zero is not None else 0,
                         min(qw.GEMV_BATCH, m - b0), seg.rows, k, ldy, seg.block[0],
                         seg.block[1], seg.scale.shape[-1], beta, 0, 0, 0, 0, 0))

    def fp8_ok(self, seg, y, m4, ldy, k, beta) -> bool:
        """Whether cuBLASLt has a block-scaled fp8 GEMM for this shape (it refuses some, e.g.
        M = 512, N = 256, K = 128 with CUBLAS_STATUS_NOT_SUPPORTED: those dequantize)."""
        if m4 < 4:
            return False
        ws = self.res.ws
        return self.res.lt.fp8_plan_ok(m4, seg.rows, k, beta,
                                       alignment(ws.xq.ptr, seg.w.ptr, y), ldy)

    def act_quant(self, st, x, m, k):
        """x[m, k] (bf16) -> the workspace's e4m3 codes and scales (kernels/act_quant.py)."""
        ws = self.res.ws
        ld = fp8_scale_rows(m)
        self.launch(st, self.kernels.act_quant_fp8,
                    (-(-k // (FP8_BLOCK * qw.ACT_QUANT_WARPS)), ld), (32 * qw.ACT_QUANT_WARPS,),
                    (x, ws.xq, ws.xqs, m, k, ld))

    def gemm_fp8(self, st, seg, y, m, ldy, k, beta):
        """y[m, seg.rows] (row stride ldy) = the quantized input @ the segment's codes^T on the
        fp8 tensor cores (cuBLASLt's block-scaled GEMM), + beta * y. (Its plan is made by
        fp8_ok, which chose this path.)"""
        lt, ws = self.res.lt, self.res.ws
        if self.dry:
            return
        self._timed(st, "gemm_fp8", lambda: lt.gemm_fp8(st, ws.xq.ptr, ws.xqs.ptr, seg.w.ptr,
                                                        seg.scale.ptr, y, m, seg.rows, k, beta,
                                                        ldy))

    def dequant(self, st, seg, k, r0, rows, e0=0, experts=1):
        """Rows [r0, r0 + rows) of experts [e0, e0 + experts) of a packed segment, decoded into
        the workspace tile (bf16; fp32 in a float32 model), expert after expert."""
        vec = qw.vector_ok(seg.layout, k, seg.block[1])
        units = seg.row_bytes // 8 if vec else k          # a thread per word, or per code
        tile = self.res.ws.wq
        self.launch(st, getattr(self.kernels, dequant_name(seg.layout, seg.asym)),
                    (-(-units // qw.DEQUANT_THREADS), rows, experts), (qw.DEQUANT_THREADS,),
                    (tile, tile, seg.w, seg.w, seg.scale,
                     seg.zero.ptr if seg.zero is not None else 0, r0, rows, k, seg.block[0],
                     seg.block[1], seg.scale.shape[-1], e0, seg.rows * seg.row_bytes,
                     seg.scale.shape[-2] * seg.scale.shape[-1], int(vec)))

    def launch(self, st, kernel, grid, block, args, smem=0):
        """`kernel`: one of self.kernels, named by attribute at the call site (taking it
        resolves the module even on a dry run)."""
        if self.dry:
            return
        # the profile's key is the kernel's name (its spec's factory, as the kernel set names it)
        name = kernel.spec.factory if self.profile is not None else None
        self._timed(st, name, lambda: kernel.launch(st, grid, block, args, smem))

    def swiglu(self, st, out, gu, rows, stride, off, inter):
        """out [rows, inter] = silu(gate) * up of gu's rows (gate at columns off .., up at
        off + inter .., rows `stride` apart): four columns a thread (silu_mul4) where the rows'
        words are 16-byte aligned, else one (a MoE layer's shared gate|up sits at an odd offset
        of the router's row)."""
        if self.wide_kernels and (stride | off | inter) % 4 == 0 \
                and "silu_mul4" in self.kernels.specs:
            self.launch(st, self.kernels.silu_mul4, (rows, -(-inter // 1024)), (256,),
                        (out, gu, stride, off, inter))
        else:
            self.launch(st, self.kernels.silu_mul, (rows, -(-inter // 256)), (256,),
                        (out, gu, stride, off, inter))

    def gated_norm(self, st, out, x, z, z_stride, z_off, w, n, nv, dv):
        """out [n, nv * dv] = rmsnorm(x) * w * silu(z) per (token, value head), z of token t at
        z[t * z_stride + z_off ..]: a warp a head (gated_rmsnorm4) where its rows' words are
        16-byte aligned and the kernel set has it, else a block a head."""
        eps = self.cfg.rms_norm_eps
        if self.wide_kernels and (z_stride | z_off) % 4 == 0 \
                and "gated_rmsnorm4" in self.kernels.specs:
            pairs = n * nv
            self.launch(st, self.kernels.gated_rmsnorm4, (-(-pairs // GATED_WARPS),),
                        (32 * GATED_WARPS,), (out, x, z, z_stride, z_off, w, nv, pairs, eps))
        else:
            self.launch(st, self.kernels.gated_rmsnorm, (n, nv),
                        (min(128, (dv + 31) // 32 * 32),), (out, x, z, z_stride, z_off, w, dv, eps))

    def launch_named(self, st, name, grid, block, args):
        # the helper modules (gdn_chunk.launch, attention_tc.attend_row) hand their kernels' names
        # as data: they also drive other kernel sets (the simulator tests, the benchmark's sweep)
        self.launch(st, getattr(self.kernels, name), grid, block, args)

    # -- the step ----------------------------------------------------------------------------------
    def run(self, st, meta, n: int, b: int, n_out: int, kv, state, out_start: int = 0,
            rows=None, media=None, snap=None, capture=None):
        """`rows`: host (query_start, new tokens, context) per row, for the choice of the prefill
        attention path; None (decode graphs) -> the CUDA-core kernel for every row. `snap`: a
        speculative verify's (device int32 [b]): row r's State after each of its tokens i also
        goes to State slot snap[r] + i (the recurrent delta rule, sequential over the row's few
        tokens; snap[r] < 0: none), so a rejected draft is undone by a slot copy. `media`:
        (token rows, embeddings) written over the gathered embeddings (eager calls only).
        `capture(st, layer, n)`: called after each decoder layer (a DFlash drafter's features:
        cuda/dflash.DFlashRunner.capture)."""
        cfg, ws, W = self.cfg, self.res.ws, self.res.weights
        self.rows = rows
        H = cfg.hidden_size
        self.launch(st, self.kernels.embed_gather, ((H + 255) // 256, n), (256,),
                    (ws.h, W["embed"], meta.token_ids, H))
        if media is not None and not self.dry:
            self.res.media.write(st, media)
        n_attn = n_lin = 0
        for i, lw in enumerate(W["layers"]):
            # each block norms ws.h into ws.x itself (normed: in its first product where it can)
            if cfg.layer_types[i] == FULL_ATTENTION:
                self.attention(st, meta, n, b, lw, kv, n_attn)
                n_attn += 1
            else:
                self.gdn(st, meta, n, b, lw, state, n_lin, snap)
                n_lin += 1
            if cfg.is_moe:
                self.moe(st, n, lw)
            else:
                self.mlp(st, n, lw)
            if capture is not None:
                capture(st, i, n)
        self.head(st, meta, n_out, out_start)

    def mtp(self, st, meta, n: int, b: int, n_out: int, kv, vocab: int = None):
        """One MTP head step over the n tokens of `meta` (models/qwen3_5/mtp.py): its input
        hidden states in ws.mtp_h, its KV the pool's last attention layer; leaves the final-normed
        MTP hidden of every token in ws.x and the logits and argmax of the meta's n_out output
        rows (head; over the first `vocab` ids where given: a draft's)."""
        cfg, ws, W = self.cfg, self.res.ws, self.res.weights
        M, H = W["mtp"], cfg.hidden_size
        self.rows = None                  # (CUDA-core attention for every row)
        self.launch(st, self.kernels.embed_gather, ((H + 255) // 256, n), (256,),
                    (ws.h, W["embed"], meta.token_ids, H))
        self.launch(st, self.kernels.mtp_prologue, (n, 2), (256,),
                    (ws.act, ws.h, ws.mtp_h, M["norm_embedding"], M["norm_hidden"], H,
                     cfg.rms_norm_eps))
        self.linear(st, ws.act.ptr, M["fc"], ws.h.ptr, n, H, 2 * H)
        self.attention(st, meta, n, b, M, kv, len(kv.k) - 1)
        if cfg.is_moe:
            self.moe(st, n, M)
        else:
            self.mlp(st, n, M)
        self.rmsnorm(st, ws.x, ws.h, M["norm"], n)
        self.head(st, meta, n_out, norm=M["norm"], vocab=vocab)

    def head(self, st, meta, n_out: int, out_start: int = 0, norm=None, vocab: int = None):
        """Logits [n_out, V] and their argmax of the meta's output rows. vocab: the first
        `vocab` ids only (MTP drafts, EngineOptions.draft_vocab): a bf16 lm_head's first rows
        are a matrix of their own, so the product reads those alone and the argmax runs over
        them, up to INT8_HEAD_ROWS rows from the int8 copy of them where the model made one
        (EngineOptions.draft_head; model.DraftHead's rule); a packed lm_head's segments cover
        every id, so it keeps them all."""
        cfg, ws, W = self.cfg, self.res.ws, self.res.weights
        H, V = cfg.hidden_size, cfg.vocab_size
        head = W["lm_head"]
        if vocab is not None and not isinstance(head, qw.QMatrix):
            V = min(V, int(vocab))
            if "draft_head" in W and n_out <= INT8_HEAD_ROWS:
                head = W["draft_head"]          # (its rows: the first draft_vocab ids)
        self.rmsnorm(st, ws.xf, ws.h, W["norm"] if norm is None else norm, n_out,
                     row_idx=meta.out_rows + 4 * out_start)
        self.linear(st, ws.xf.ptr, head, ws.logits.ptr, n_out, V, H)
        self.launch(st, self.kernels.argmax, (n_out,), (1024,), (ws.tokens, ws.logits, V))

    def final_hidden(self, st, n: int):
        """The final-normed hidden of all n tokens of the step just run into ws.mtp_h (the
        speculative units' drafter feed; the head normed only its output rows)."""
        self.rmsnorm(st, self.res.ws.mtp_h, self.res.ws.h, self.res.weights["norm"], n)

    def head_of(self, st, n: int):
        """Logits and argmax of n final-normed hidden states put in ws.xf (a draft's MTP
        hidden: the speculative units' first draft and masked drafts)."""
        cfg, ws, W = self.cfg, self.res.ws, self.res.weights
        V = cfg.vocab_size
        self.linear(st, ws.xf.ptr, W["lm_head"], ws.logits.ptr, n, V, cfg.hidden_size)
        self.launch(st, self.kernels.argmax, (n,), (1024,), (ws.tokens, ws.logits, V))

    def rmsnorm(self, st, out, x, w, rows, row_idx=None):
        H = self.cfg.hidden_size
        block = 1024 if rows <= 64 else 256
        self.launch(st, self.kernels.rmsnorm, (rows,), (block,),
                    (out, x, w, row_idx if row_idx is not None else 0, int(row_idx is not None),
                     H, self.cfg.rms_norm_eps))

    def gdn(self, st, meta, n, b, lw, state, l, snap=None):
        cfg, ws = self.cfg, self.res.ws
        H, C, Vd = cfg.hidden_size, cfg.linear_conv_dim, cfg.linear_value_dim
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        P = C + Vd + 2 * nv
        self.normed(st, lw["input_norm"], lw["w_in"], n, P)
        blk = (max(dk, dv) + 31) // 32 * 32
        decode = int(n == b and snap is None)
        if n > b and self.wide_kernels and "conv_silu_chunk" in self.kernels.specs:
            # (a prefill: CONV_TOKENS consecutive tokens a block, each input loaded once)
            self.launch(st, self.kernels.conv_silu_chunk, (-(-n // CONV_TOKENS), 2 * nk + nv),
                        (blk,), (ws.mid, ws.proj, P, lw["conv_w"], state.conv[l],
                                 meta.token_row, meta.query_start, meta.context_lens,
                                 meta.state_slots, n))
        else:
            self.launch(st, self.kernels.conv_silu, (n, 2 * nk + nv), (blk,),
                        (ws.mid, ws.proj, P, lw["conv_w"], state.conv[l], meta.token_row,
                         meta.query_start, meta.context_lens, meta.state_slots, decode))
        if snap is not None:
            # a verify: the windows and S after each token into the row's snapshot slots too
            self.launch(st, self.kernels.conv_state_update_snap, ((C + 127) // 128, b), (128,),
                        (state.conv[l], ws.proj, P, meta.query_start, meta.context_lens,
                         meta.state_slots, snap))
            self.launch(st, self.kernels.gdn_recurrent_snap, (b, nv, (dv + 31) // 32), (128,),
                        (ws.core, ws.mid, ws.proj, P, C + Vd + nv, C + Vd, lw["a_log"],
                         lw["dt_bias"], state.recurrent[l], meta.query_start, meta.context_lens,
                         meta.state_slots, snap))
        elif decode:
            self.launch(st, self.kernels.gdn_recurrent, (b, nv, (dv + 31) // 32), (128,),
                        (ws.core, ws.mid, ws.proj, P, C + Vd + nv, C + Vd, lw["a_log"],
                         lw["dt_bias"], state.recurrent[l], meta.query_start, meta.context_lens,
                         meta.state_slots))
        else:
            self.launch(st, self.kernels.conv_state_update, ((C + 127) // 128, b), (128,),
                        (state.conv[l], ws.proj, P, meta.query_start, meta.context_lens,
                         meta.state_slots))
            # prefill (any row length, 1 included): the chunked form, parallel within chunks
            if ws.gdn_s is not None and b > ws.gdn_rows:
                raise ValueError(f"GDN prefill: {b} rows in one call; the workspace's chunk "
                                 f"states take {ws.gdn_rows}")
            gc.launch(lambda name, grid, block, args:
                      self.launch_named(st, name, grid, block, args),
                      dk, dv, nv, ws.gdn_cn, b, gc.max_chunks(self.rows, n, b, ws.gdn_cn),
                      core=ws.core, w=ws.gdn_w, p=ws.gdn_p, g=ws.gdn_g, qkv=ws.mid, proj=ws.proj,
                      proj_stride=P, a_off=C + Vd + nv, b_off=C + Vd, a_log=lw["a_log"],
                      dt_bias=lw["dt_bias"], state=state.recurrent[l],
                      query_start=meta.query_start, context_lens=meta.context_lens,
                      state_slots=meta.state_slots, tc=ws.gdn_tc, s=ws.gdn_s)
        self.gated_norm(st, ws.act, ws.core, ws.proj, P, C, lw["norm_w"], n, nv, dv)
        self.linear(st, ws.act.ptr, lw["w_out"], ws.h.ptr, n, H, Vd, beta=1.0)

    def attention(self, st, meta, n, b, lw, kv, a):
        cfg, ws = self.cfg, self.res.ws
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        P = 2 * nh * hd + 2 * nkv * hd
        lay = meta.layout
        self.normed(st, lw["input_norm"], lw["w_in"], n, P)
        self.launch(st, self.kernels.qk_norm_rope_kv, (n, nh + nkv), ((hd + 31) // 32 * 32,),
                    (ws.mid, ws.proj, P, lw["q_norm"], lw["k_norm"], kv.k[a], kv.v[a],
                     meta.positions, lay.n_cap, meta.token_row, meta.query_start,
                     meta.context_lens, meta.block_tables, lay.p_cap, kv.page_size,
                     cfg.rope_theta, cfg.rms_norm_eps))
        scale = 1.0 / math.sqrt(hd)
        big, runs = split_rows(self.rows or [], n, self.attn_tc_min_tokens, ws.tc.l_cap)
        rows = self.rows
        mma = self.attention_mma()
        for r0, r1 in runs:
            m = r1 - r0
            if n == b and self.invariant:     # a decode step: splits fixed for every B
                splits = decode_splits(nkv, self.res.num_sms, mma)
            else:
                splits = (mma_splits if mma else attention_splits)(m, nkv, self.res.num_sms)
            args = (ws.part, ws.ml, ws.mid, kv.k[a], kv.v[a], meta.token_row, meta.query_start,
                    meta.context_lens, meta.block_tables, lay.p_cap, kv.page_size, splits, scale,
                    r0)
            if mma:
                self.launch(st, self.kernels.paged_attention_mma,
                            (m, nkv * self.attn_mma_subgroups, splits), (128,), args)
            else:
                # all G heads of a kv group per block where they fit (splitting them, GS < G,
                # measured 1.45x slower for the 27B 4096-token prefill: K/V re-reads outweigh
                # the extra resident warps); G/GS blocks per kv head where they do not (G = 16)
                self.launch(st, self.kernels.paged_attention,
                            (m, nkv * self.attn_subgroups, splits), (128,), args)
            self.launch(st, self.kernels.attn_combine, *combine_launch(m, nh, hd),
                        (ws.act, ws.part, ws.ml, ws.proj, P, splits, r0))
        for i in big:
            q0, ln, ctx = rows[i]
            tc.attend_row(lambda name, grid, block, args: self.launch_named(st, name, grid, block,
                                                                          args),
                          lambda x, w, y, m, nn, k, w_kn: self.gemm(st, x, w, y, m, nn, k, w_kn=w_kn,
                                                                    name="attn_gemm"),
                          ws.tc, hd, nh // nkv, nkv, scale, row=i, q_start=q0, n=ln, ctx=ctx,
                          q=ws.mid.ptr, k_cache=kv.k[a].ptr, v_cache=kv.v[a].ptr,
                          block_tables=meta.block_tables, bt_stride=lay.p_cap,
                          page_size=kv.page_size, out=ws.act.ptr, proj=ws.proj.ptr, proj_stride=P)
        self.linear(st, ws.act.ptr, lw["w_out"], ws.h.ptr, n, H, nh * hd, beta=1.0)

    def mlp(self, st, n, lw):
        cfg, ws = self.cfg, self.res.ws
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.normed(st, lw["post_norm"], lw["w_gu"], n, 2 * I)
        self.swiglu(st, ws.act, ws.proj, n, 2 * I, 0, I)
        self.linear(st, ws.act.ptr, lw["w_down"], ws.h.ptr, n, H, I, beta=1.0)

    def moe(self, st, n, lw):
        cfg, ws = self.cfg, self.res.ws
        H, E, K = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
        I, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        P = E + 2 * Is + 1
        self.normed(st, lw["post_norm"], lw["w_rs"], n, P)
        routed = self.router_fused(n, lw)
        if not routed:
            self.launch(st, self.kernels.router_topk, (n,), (ROUTER_THREADS,),
                        (ws.ids, ws.wts, ws.proj, P))
        fused = self.fused_tail(n, lw)
        if not fused:
            self.swiglu(st, ws.act, ws.proj, n, P, E, Is)
            self.linear(st, ws.act.ptr, lw["shared_down"], ws.shared.ptr, n, H, Is)
        if n > self.res.moe_gemv_tokens and not self.dry:
            # (an enabled route holds every MoE layer's expert addresses: DeviceRoute.bind)
            if self.moe_device_route and ws.route_dev is not None and ws.route_dev.enabled:
                self.experts_routed(st, n, lw)
            else:
                self.experts_grouped(st, n, lw)
            use_rows = 1
        elif isinstance(lw["experts_gu"], qw.QMatrix):
            self.experts_packed(st, n, lw)
            use_rows = 0
        else:
            # decode / small batches (and every graph): warp-per-row GEMVs over the K experts
            if routed:
                self.launch(st, self.kernels.expert_gate_up_routed, (n * K, (I + 3) // 4),
                            (128,), (ws.mact, ws.x, lw["experts_gu"], ws.ids, ws.wts, ws.proj,
                                     P))
            else:
                self.launch(st, self.kernels.expert_gate_up, (n * K, (I + 3) // 4), (128,),
                            (ws.mact, ws.x, lw["experts_gu"], ws.ids, K))
            if fused:
                # the shared expert, the experts' down rows, the combine and the residual add
                self.launch(st, self.kernels.moe_down_combine, (H // EXPERT_DOWN_ROWS, n),
                            (32 * (K + 1),),
                            (ws.h, ws.mact, lw["experts_down"], ws.ids, ws.wts, ws.proj, P, E,
                             lw["shared_down"]))
                return
            self.launch(st, self.kernels.expert_down, (n * K, -(-H // (4 * EXPERT_DOWN_ROWS))),
                        (128,),
                        (ws.my, ws.mact, lw["experts_down"], ws.ids))
            use_rows = 0
        self.launch(st, self.kernels.moe_combine, ((H + 255) // 256, n), (256,),
                    (ws.h, ws.my, ws.route.ptr + 4 * ws.grouped_rows, use_rows, ws.wts, ws.shared,
                     ws.proj.ptr + 4 * (E + 2 * Is), P))

    def normed(self, st, norm, w, n, N):
        """ws.x = the RMS norm of ws.h (weights `norm`), then ws.proj[n, N] = ws.x @ w^T: a
        block's norm and its first product. One launch (gemv_norm, whose block 0 also stores
        ws.x for the kernels after) where norm_fused, else the norm kernel and the product."""
        cfg, ws = self.cfg, self.res.ws
        H = cfg.hidden_size
        if self.norm_fused(n, w):
            self.launch(st, getattr(self.kernels, f"gemv_norm{n}"), (-(-N // GEMV_WARPS),),
                        (32 * GEMV_WARPS,), (ws.proj, ws.h, w, N, H // 2, 0.0, norm, ws.x,
                                             cfg.rms_norm_eps))
            return
        self.rmsnorm(st, ws.x, ws.h, norm, n)
        self.linear(st, ws.x.ptr, w, ws.proj.ptr, n, N, H)

    def attention_mma(self) -> bool:
        """Whether the CUDA-core path's query tokens take paged_attention_mma (tensor cores, 16
        keys a warp at once): `attn_mma` on and the kernel in the set (bf16 pools, head_dim a
        multiple of 64: kernel_set.attention_mma_group)."""
        return self.attn_mma and "paged_attention_mma" in self.kernels.specs

    def norm_fused(self, n, w) -> bool:
        """Whether a norm and the product after it run as one gemv_norm launch: `fuse_norm`
        on, a kernel for n tokens in the set, a bf16 product the decode GEMV takes."""
        return (self.fuse_norm and f"gemv_norm{n}" in self.kernels.specs
                and not isinstance(w, qw.QMatrix)
                and self.gemv_fits(self.res.ws.x.ptr, w.ptr, n, w.shape[0], self.cfg.hidden_size,
                                   False, 1, 0))

    def router_fused(self, n, lw) -> bool:
        """Whether this MoE call's top-k runs in the prologue of the experts' gate|up GEMV
        (expert_gate_up_routed) instead of router_topk: `fuse_router` on, a decode-sized call
        of bf16 experts (the warp-per-row GEMVs), the kernel in the set."""
        return (self.fuse_router and n <= self.res.moe_gemv_tokens
                and not isinstance(lw["experts_gu"], qw.QMatrix)
                and "expert_gate_up_routed" in self.kernels.specs)

    def fused_tail(self, n, lw) -> bool:
        """Whether this MoE call's tail runs as moe_down_combine: a decode-sized call (the
        warp-per-row expert GEMVs) of bf16 experts and shared expert, `fuse_moe_tail` on."""
        return (self.fuse_moe_tail and n <= self.res.moe_gemv_tokens
                and (n <= self.fused_tail_tokens or self.invariant)
                and not isinstance(lw["experts_gu"], qw.QMatrix)
                and not isinstance(lw["experts_down"], qw.QMatrix)
                and not isinstance(lw["shared_down"], qw.QMatrix))

    def experts_packed(self, st, n, lw):
        """Decode with packed experts: one GEMV launch per projection over every (token, slot)
        pair (grid.y), each reading its expert's codes: gate|up -> SwiGLU -> down into ws.my."""
        cfg, ws = self.cfg, self.res.ws
        H, K, I = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        pairs = n * K
        self._expert_gemv(st, lw["experts_gu"], ws.x, ws.gu, pairs, 2 * I, H, K, 0)
        self.swiglu(st, ws.gact, ws.gu, pairs, 2 * I, 0, I)
        self._expert_gemv(st, lw["experts_down"], ws.gact, ws.my, pairs, H, I, K, 1)

    def _expert_gemv(self, st, w, x, y, pairs, n, k, top_k, x_per_pair, ids=None):
        """y[pair] = expert ids[pair]'s product with x (row pair // top_k, or pair when
        x_per_pair). top_k -1: grouped mode, `pairs` groups of the table at `ids`
        (moe_rows.expert_groups), y and x rows as the groups say (qmma only)."""
        (seg,) = w.segments
        w_stride = seg.rows * seg.row_bytes
        s_stride = seg.scale.shape[-2] * seg.scale.shape[-1]
        zero = seg.zero.ptr if seg.zero is not None else 0
        ids = self.res.ws.ids if ids is None else ids
        if self.mma_experts(w, k):
            self.launch(st, getattr(self.kernels, qmma_name(
                            seg.layout, seg.asym, qw.mma_split(seg.layout, seg.block[1]))),
                        (-(-n // qw.MMA_ROWS), pairs), (32 * qw.MMA_WARPS,),
                        (y, x, seg.w, seg.scale, zero, 1, n, k, n, seg.block[0], seg.block[1],
                         seg.scale.shape[-1], 0.0, ids, top_k, x_per_pair, w_stride, s_stride))
            return
        assert top_k > 0, "grouped mode runs on qmma only"
        self.launch(st, getattr(self.kernels, qgemv_name(seg.layout, 1, seg.asym)),
                    (-(-n // (qw.WARPS * qw.ROWS)), pairs), (qw.THREADS,),
                    (y, x, x, seg.w, seg.w, seg.scale,
                     zero, 1, n, k, n, seg.block[0], seg.block[1], seg.scale.shape[-1], 0.0,
                     int(qw.vector_ok(seg.layout, k, seg.block[1])), self.res.ws.ids, top_k,
                     x_per_pair, w_stride, s_stride))

    def mma_experts(self, w, k) -> bool:
        """Packed experts of width k that the tensor-core GEMV takes (bf16 activations)."""
        (seg,) = w.segments
        return self.res.ws.gin_bytes == 2 and qw.mma_ok(seg.layout, k, seg.block[1])

    def _expert_gemm(self, st, w, x, y, c, n, k, overflow, g):
        """The grouped path's products of one projection: bf16 experts through one strided-
        batched GEMM over the padded block + one per overflowing expert; packed experts
        dequantized into the workspace tile a slab of experts at a time (qweights.py)."""
        E = self.cfg.num_experts
        if not isinstance(w, qw.QMatrix):
            if c:
                self.gemm(st, x.ptr, w.ptr, y.ptr, c, n, k, batch=E,
                          strides=(n * k, c * k, c * n), name="expert_gemm")
            for e, r0, cnt in overflow:
                self.gemm(st, x.ptr + g * k * r0, w.at(e), y.ptr + 4 * n * r0, cnt, n, k,
                          name="expert_gemm")
            return
        (seg,) = w.segments
        tile = self.res.ws.wq
        per = max(1, tile.shape[0] // (n * k))          # experts per slab

        def dequant(e0, count):
            self.dequant(st, seg, k, 0, n, e0, count)
        for e0 in range(0, E if c else 0, per):
            cnt = min(per, E - e0)
            dequant(e0, cnt)
            self.gemm(st, x.ptr + g * k * c * e0, tile.ptr, y.ptr + 4 * n * c * e0, c, n, k,
                      batch=cnt, strides=(n * k, c * k, c * n), name="expert_gemm")
        for e, r0, cnt in overflow:
            dequant(e, 1)
            self.gemm(st, x.ptr + g * k * r0, tile.ptr, y.ptr + 4 * n * r0, cnt, n, k,
                      name="expert_gemm")

    def experts_routed(self, st, n, lw):
        """Prefill with the routing on the device (moe_route.py): the routed rows laid out by
        three small kernels (expert-sorted, pair order within an expert: experts_grouped's
        layout for a block size cap), gathered, and the experts' gate|up and down. Where
        cuBLASLt has a grouped GEMM, cap 0 and one grouped GEMM a projection, whose row counts
        and addresses the layout kernels wrote. Else (DeviceRoute.own) cap from the pairs alone
        (moe_route.device_cap, or moe_cap where set): a strided-batched GEMM over the padded
        block, then our grouped GEMM over a work list of 64-row tiles of the overflow, written
        from the counts. No host round trip."""
        cfg, ws = self.cfg, self.res.ws
        route = ws.route_dev
        H, E, K, I = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, \
            cfg.moe_intermediate_size
        pairs = n * K
        cap = 0
        if route.own:
            cap = moe_route.device_cap(pairs, E, ws.grouped_rows) if self.moe_cap is None \
                else self.moe_cap
        rows = E * cap + pairs          # the rows the layout may use (src -1 where unused)
        assert rows <= ws.grouped_rows, (rows, ws.grouped_rows)
        nb = moe_route.chunks(pairs)
        self.launch(st, self.kernels.moe_route_count, (nb,), (moe_route.COUNT_THREADS,),
                    (route.counts, ws.ids, pairs))
        self.launch(st, self.kernels.moe_route_scan, (1,), (-(-E // 32) * 32,),
                    (route.counts, route.rows, route.first, route.ptrs, route.spec, ws.route, nb,
                     moe_route.NPTR, cap, pairs))
        self.launch(st, self.kernels.moe_route_place, (nb,), (32,),
                    (ws.route, ws.route.ptr + 4 * ws.grouped_rows, ws.ids, route.counts,
                     route.first, cap, pairs))
        g = ws.gin_bytes
        words = H * g // 4
        self.launch(st, self.kernels.gather_rows, (rows, -(-words // (4 * GATHER_THREADS))),
                    (GATHER_THREADS,), (ws.xg, ws.x, ws.route, words))
        if route.own:
            # the padded block on cuBLASLt, the overflow's tiles on ours (kernels/grouped_gemm.py)
            t_cap = moe_route.tile_cap(pairs, E)
            self.launch(st, self.kernels.moe_route_tiles, (1,), (-(-E // 32) * 32,),
                        (route.tiles, route.rows, route.first, cap, t_cap))

            def gemm(out, x, w, n, k):
                self._expert_gemm(st, w, x, out, cap, n, k, (), g)
                self.launch(st, getattr(self.kernels, moe_route.gemm_kernel(k)),
                            (t_cap, n // moe_route.GEMM_BN), (moe_route.GEMM_THREADS,),
                            (out, x, w, route.tiles, t_cap, n, k))
            gemm(ws.gu, ws.xg, lw["experts_gu"], 2 * I, H)
            self.launch(st, self.kernels.routed_silu_mul, (rows, -(-I // moe_route.SILU_THREADS)),
                        (moe_route.SILU_THREADS,), (ws.gact, ws.gu, ws.route, I))
            gemm(ws.my, ws.gact, lw["experts_down"], H, I)
            return
        plan_gu, plan_dn = route.plans(self.res.lt, pairs)
        w_gu, w_dn = route.tables[lw["experts_gu"].ptr]
        one, zero = route.scalars.ptr, route.scalars.ptr + 4
        lt = self.res.lt
        self._timed(st, "expert_gemm", lambda: lt.grouped_gemm(
            st, plan_gu, w_gu, route.ptrs.at(0), route.ptrs.at(1), one, zero))
        self.swiglu(st, ws.gact, ws.gu, pairs, 2 * I, 0, I)
        self._timed(st, "expert_gemm", lambda: lt.grouped_gemm(
            st, plan_dn, w_dn, route.ptrs.at(2), route.ptrs.at(3), one, zero))

    def experts_grouped(self, st, n, lw):
        """Prefill: route on the host (one sync), lay the routed rows out by expert (moe_rows.py:
        a padded block for one strided-batched GEMM over all experts + per-expert overflow), gather,
        GEMM gate|up, SwiGLU, GEMM down; moe_combine reads each pair's row through a map.
        Packed experts the tensor-core GEMV takes read their codes as stored instead: every
        expert's rows consecutive (cap 0), one grouped qmma launch per projection over groups of
        up to 8 rows (moe_rows.expert_groups), no dequantized copy of the weights."""
        cfg, ws, res = self.cfg, self.res.ws, self.res
        H, E, K, I = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        pairs = n * K
        gu_w, dn_w = lw["experts_gu"], lw["experts_down"]
        grouped_mma = self.packed_grouped and isinstance(gu_w, qw.QMatrix) \
            and self.mma_experts(gu_w, H) and self.mma_experts(dn_w, I) \
            and pairs // moe_rows.GROUP_ROWS + E <= MAX_GRID_Y     # the groups are grid.y
        _d.copy_dtoh_async(res.route_host.ptr, ws.ids.ptr, 4 * pairs, st)
        st.synchronize()
        R = ws.grouped_rows
        host = res.route_host.view(np.int32, 0, R + 2 * res.n_cap * K)
        lay = moe_rows.expert_rows(host[:pairs], K, E, R, launch_rows=self.moe_launch_rows,
                                   cap=0 if grouped_mma else self.moe_cap)
        self.last_moe_layout = (lay.cap, lay.rows, len(lay.overflow))
        groups = moe_rows.expert_groups(lay.overflow).reshape(-1) if grouped_mma else ()
        # staged: row -> token, then the groups, then pair -> row; on the device the first two
        # at ws.route (rows + 3 * groups <= R: cap 0 has rows = pairs), the map at R
        staged = host[pairs: pairs + lay.rows + len(groups) + pairs]
        staged[:lay.rows] = lay.src
        staged[lay.rows: lay.rows + len(groups)] = groups
        staged[lay.rows + len(groups):] = lay.row_of_pair
        base = res.route_host.ptr + 4 * pairs
        _d.copy_htod_async(ws.route.ptr, base, 4 * (lay.rows + len(groups)), st)
        _d.copy_htod_async(ws.route.ptr + 4 * R, base + 4 * (lay.rows + len(groups)), 4 * pairs,
                           st)
        rows, g = lay.rows, ws.gin_bytes
        words = H * g // 4                  # a row as 32-bit words (bf16 pairs or fp32)
        self.launch(st, self.kernels.gather_rows, (rows, -(-words // (4 * GATHER_THREADS))),
                    (GATHER_THREADS,), (ws.xg, ws.x, ws.route, words))
        if grouped_mma:
            table, ng = ws.route.ptr + 4 * rows, len(groups) // 3
            self._expert_gemv(st, gu_w, ws.xg, ws.gu, ng, 2 * I, H, -1, 0, ids=table)
        else:
            self._expert_gemm(st, gu_w, ws.xg, ws.gu, lay.cap, 2 * I, H, lay.overflow, g)
        self.swiglu(st, ws.gact, ws.gu, rows, 2 * I, 0, I)
        if grouped_mma:
            self._expert_gemv(st, dn_w, ws.gact, ws.my, ng, H, I, -1, 0, ids=table)
        else:
            self._expert_gemm(st, dn_w, ws.gact, ws.my, lay.cap, H, I, lay.overflow, g)
