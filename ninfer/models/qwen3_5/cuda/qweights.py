"""Quantized weights on the device: the packed codes, scales and zero points of an artifact's
fp8_block / int8_block / int4_block bindings (docs/artifact.md 3.2.1) kept as they are stored.

A device matrix of the weight plan (weights.py: w_in, w_out, w_gu, ...) whose sources include a
quantized binding becomes a `QMatrix`: its rows in `QSegment`s, each one layout. Fused matrices
mix layouts (the GDN projection keeps in_proj_b / in_proj_a in bf16, the MoE one its router and
shared-expert gate), so a segment is either packed codes or plain bf16 rows; adjacent sources of
one layout and block merge into one segment (one launch). The runner (runner.StepRunner.linear)
runs a segment of codes as a GEMV over the packed bytes for up to GEMV_MAX_ROWS rows (decode:
each weight byte read once per 8 rows, kernels/quant_gemv.py), and for more rows (prefill)
dequantizes slabs of rows into the workspace's `wq` tile and multiplies in bf16 through
cuBLASLt; fp8 codes in [128, 128] blocks instead go straight to cuBLASLt's block-scaled e4m3
GEMM with the input quantized per token and 128 columns (W8A8, `w8a8_ok`; the fp8_activations
option). A bf16 segment is a cuBLASLt GEMM writing its column range of the output.

The codes go up unchanged: the same bytes the numpy backend decodes (models/qwen3_5/quant.py), so
a float32 model on the GPU computes the numpy backend's values up to summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....core.cuda.cublaslt import FP8_K_MULTIPLE
from ....errors import ArtifactError, DeviceError

BF16 = "bf16"
LAYOUTS = ("fp8_block", "int8_block", "int4_block")
GEMV_MAX_ROWS = 32          # more rows: dequantize + cuBLASLt (weight bytes read once per 8 rows)
GEMV_BATCH = 8              # rows one GEMV launch reads each weight byte for (kernels' BM <= 8)
SLAB_ELEMENTS = 1 << 26     # the prefill tile: at most this many dequantized elements (128 MiB bf16)
# kernels/quant_gemv.py's launch geometry (the kernels' module imports numba; a warm start does
# not: tests/test_quant_weights_nogpu.py checks the two agree)
THREADS, WARPS, ROWS, DEQUANT_THREADS = 128, 4, 4, 256
ACT_QUANT_WARPS = 4         # kernels/act_quant.WARPS: 128-column groups per block
FP8_SCALE_COLS = 4          # fp8 [128, 128] scale rows: a multiple of this many blocks (cuBLASLt)
BMS = (1, 2, 4, 8)
MMA_WARPS = 4               # kernels/quant_gemv.qmma: block of 4 warps over 16 output rows
MMA_ROWS = 16
MMA_GEOMETRY = f"{MMA_WARPS}:4"  # warps:unroll of the model's qmma (bench_quant --mma)


def vector_ok(layout: str, k: int, bc: int) -> bool:
    """kernels/quant_gemv.vector_ok: rows of whole 8-byte words, no word across a scale block."""
    e = 16 if layout == "int4_block" else 8
    return k % e == 0 and bc % e == 0


def mma_split(layout: str, bc: int) -> int:
    """kernels/quant_gemv.mma_split: scale blocks per qmma step (4 chunks of 32 int4 / 16 byte
    codes), 1 when a block holds whole steps."""
    step = 128 if layout == "int4_block" else 64
    return step // bc if 0 < bc < step and step % bc == 0 else 1


def mma_ok(layout: str, k: int, bc: int) -> bool:
    """kernels/quant_gemv.mma_ok: the tensor-core GEMV (bf16 models) takes rows of whole 16-byte
    chunks (32 int4 / 16 byte codes) whose steps of 4 chunks lie in one scale block, a power of
    two of steps per block; or steps of 2 or 4 whole blocks (K a multiple of the block)."""
    c = 32 if layout == "int4_block" else 16
    if 0 < bc < 4 * c:
        return mma_split(layout, bc) in (2, 4) and k % bc == 0
    spb = bc // (4 * c)
    return k % c == 0 and bc % (4 * c) == 0 and spb & (spb - 1) == 0


@dataclass(frozen=True)
class SourcePart:
    """One artifact binding's rows within a segment."""
    name: str
    row0: int               # first row within the segment
    rows: int


@dataclass(frozen=True)
class SegmentPlan:
    row0: int               # first row within the device matrix
    rows: int
    k: int
    layout: str             # BF16 or a quantized layout
    block: tuple = (1, 1)   # (br, bc) of the stored scales
    asym: bool = False      # int4 with zero points
    experts: int = 1        # leading dimension (MoE expert stacks)
    parts: tuple = ()

    @property
    def row_bytes(self) -> int:
        return (self.k + 1) // 2 if self.layout == "int4_block" else self.k

    @property
    def scale_shape(self) -> tuple:
        """(experts, row blocks, columns): fp8 [128, 128] scale rows padded to a multiple of 4
        blocks (FP8_SCALE_COLS), the row stride cuBLASLt's block-scaled GEMM reads; every
        kernel takes the stride as an argument."""
        br, bc = self.block
        cols = -(-self.k // bc)
        if self.layout == "fp8_block" and tuple(self.block) == (128, 128):
            cols = -(-cols // FP8_SCALE_COLS) * FP8_SCALE_COLS
        return (self.experts, -(-self.rows // br), cols)

    def nbytes(self) -> int:
        """Device bytes (regions rounded as the arena rounds them)."""
        if self.layout == BF16:
            return _round(self.experts * self.rows * self.k * 2)
        s = int(np.prod(self.scale_shape))
        return (_round(self.experts * self.rows * self.row_bytes) + _round(4 * s)
                + (_round(s) if self.asym else 0))


@dataclass(frozen=True)
class QSegment:
    """A segment on the device: `w` bf16 [experts, rows, k] or uint8 codes [experts, rows,
    row_bytes]; `scale` f32 and `zero` uint8 [experts, ceil(rows/br), sc_cols] for codes."""
    plan: SegmentPlan
    w: object
    scale: object = None
    zero: object = None

    def __getattr__(self, name):
        return getattr(self.plan, name)


@dataclass(frozen=True)
class QMatrix:
    shape: tuple            # (N, K) or (E, N, K) as the bf16 matrix would be
    segments: tuple


def _round(n: int) -> int:
    from ....core.cuda.arena import _round_up
    return _round_up(max(int(n), 1))


def matrix_plan(artifact, shape, sources) -> tuple | None:
    """The segments of one weight-plan matrix, or None when no source is quantized."""
    if artifact is None or not any(artifact.has(n) and artifact.is_quantized(n)
                                   for n, _ in sources):
        return None
    k = shape[-1]
    experts = shape[0] if len(shape) == 3 else 1
    segs, row = [], 0
    for name, rows in sources:
        rows = shape[-2] if rows is None else rows
        if artifact.is_quantized(name):
            qt = artifact.quantized(name)
            if qt.view is not None:
                raise DeviceError(f"backend 'cuda': quantized binding {name!r} is a view of "
                                  "another object; the CUDA kernels read whole stored objects")
            if qt.layout not in LAYOUTS:
                raise ArtifactError(f"binding {name!r}: unknown quantized layout {qt.layout!r}")
            want = (experts, rows, k) if experts > 1 else (rows, k)
            if tuple(qt.shape) != want:
                raise ArtifactError(f"binding {name!r}: shape {list(qt.shape)} != expected "
                                    f"{list(want)}")
            seg = SegmentPlan(row, rows, k, qt.layout, tuple(int(b) for b in qt.block),
                              qt.zero is not None, experts, (SourcePart(name, 0, rows),))
        else:
            seg = SegmentPlan(row, rows, k, BF16, experts=experts,
                              parts=(SourcePart(name, 0, rows),))
        prev = segs[-1] if segs else None
        if prev is not None and _mergeable(prev, seg):
            segs[-1] = SegmentPlan(prev.row0, prev.rows + seg.rows, k, prev.layout, prev.block,
                                   prev.asym, experts,
                                   prev.parts + (SourcePart(name, prev.rows, seg.rows),))
        else:
            segs.append(seg)
        row += rows
    return tuple(segs)


def _mergeable(a: SegmentPlan, b: SegmentPlan) -> bool:
    if a.experts > 1 or a.layout != b.layout:
        return False
    if a.layout == BF16:
        return True
    # the scales concatenate along rows only when no block straddles the boundary
    return a.block == b.block and a.asym == b.asym and a.rows % a.block[0] == 0


def formats(plans) -> frozenset:
    """{(layout, asym, split)} of every segment of codes among `plans` (the kernels to load;
    split: `mma_split` of its scale block width, which selects the tensor-core GEMV's variant)."""
    return frozenset((s.layout, s.asym, mma_split(s.layout, s.block[1]))
                     for segs in plans for s in segs if s.layout != BF16)


def int8_head_plan(rows: int, k: int) -> SegmentPlan:
    """The MTP drafts' int8 head (EngineOptions.draft_head "int8"; models/qwen3_5/model.py): the
    lm_head's first `rows` rows as int8 codes, a scale per row and 128 columns, made on the
    device at load (kernels/act_quant.py head_quant_int8)."""
    from ..model import HEAD_GROUP
    return SegmentPlan(0, int(rows), int(k), "int8_block", (1, HEAD_GROUP))


def w8a8_ok(seg) -> bool:
    """A segment the block-scaled fp8 GEMM takes as stored (cublaslt.gemm_fp8): e4m3 codes in
    [128, 128] scale blocks, K whole blocks, one matrix (not an expert stack)."""
    return (seg.layout == "fp8_block" and tuple(seg.block) == (128, 128) and seg.experts == 1
            and seg.k % FP8_K_MULTIPLE == 0)


def w8a8_k(plans) -> int:
    """The largest K of a w8a8_ok segment (0: none): the quantized input's row width."""
    return max((s.k for segs in plans for s in segs if w8a8_ok(s)), default=0)


def slab_elements(plans, n_cap: int, f32: bool = False) -> int:
    """Elements of the workspace tile the prefill path dequantizes into (0: never needed)."""
    if n_cap <= GEMV_MAX_ROWS:
        return 0
    need = 0
    for segs in plans:
        for s in segs:
            if s.layout != BF16:
                # (an expert stack: whole experts per slab, at least one)
                need = max(need, min(s.experts * s.rows * s.k,
                                     max(SLAB_ELEMENTS, (s.rows if s.experts > 1 else 128) * s.k)))
    return need


def slab_rows(seg, elements: int) -> int:
    """Rows per prefill slab of `seg` in a tile of `elements`: whole scale-row blocks."""
    rows = min(max(1, elements // seg.k), 65535)        # (grid.y of the dequant kernel)
    if rows >= seg.rows:
        return seg.rows
    # whole 128-row blocks (fp8's scale rows; also keeps each slab's output columns 512-byte
    # aligned: a slab of 13107 rows left cuBLASLt a 4-byte alignment and a kernel 8x slower)
    return max(128, rows // 128 * 128)


# -- host images --------------------------------------------------------------------------------

def codes_host(artifact, part: SourcePart, layout: str) -> np.ndarray:
    """The stored codes of one binding as uint8, checked as the numpy reader checks its decode
    (an e4m3 NaN code would decode to NaN there: refused here too)."""
    qt = artifact.quantized(part.name)
    codes = np.asarray(qt.data).view(np.uint8)
    if layout == "fp8_block" and _has_fp8_nan(codes):
        raise ArtifactError(f"binding {part.name!r}: dequantized values are not all finite "
                            "(an e4m3 NaN code)")
    return codes


def scale_host(artifact, part: SourcePart, cols: int = 0) -> np.ndarray:
    """The stored scales, rows padded with 1.0 to `cols` columns (SegmentPlan.scale_shape)."""
    qt = artifact.quantized(part.name)
    s = np.asarray(qt.scale, np.float32)
    if not np.all(np.isfinite(s)):
        raise ArtifactError(f"binding {part.name!r}: dequantized values are not all finite "
                            "(a non-finite scale)")
    if cols > s.shape[-1]:
        pad = [(0, 0)] * (s.ndim - 1) + [(0, cols - s.shape[-1])]
        s = np.pad(s, pad, constant_values=1.0)
    return s


def zero_host(artifact, part: SourcePart) -> np.ndarray:
    z = np.asarray(artifact.quantized(part.name).zero).view(np.uint8)
    if int(z.max(initial=0)) > 15:
        raise ArtifactError(f"binding {part.name!r}: int4 zero point {int(z.max())} > 15")
    return z


def _has_fp8_nan(codes: np.ndarray, chunk: int = 1 << 22) -> bool:
    flat = codes.reshape(-1)
    scratch = np.empty(min(chunk, flat.size), np.uint8)
    for i in range(0, flat.size, chunk):
        part = flat[i: i + chunk]
        t = scratch[: part.size]
        np.bitwise_and(part, 0x7F, out=t)
        if (t == 0x7F).any():
            return True
    return False
