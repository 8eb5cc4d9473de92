"""Quantized objects: the encoders (bf16/f32 -> fp8 / int8 / int4 blocks), the `Quantize` recipe
that picks which tensors to encode, and the writer of one quantized parent with its scale (and
zero) objects. The encodings are docs/artifact.md 3.2.1; `models/qwen3_5/quant.py` decodes them.

A parent [..., R, C] is encoded in blocks of [br, bc] elements, one scale per block:

    fp8_block   [128, 128]  q = e4m3(w / s), s = amax / 448              (the release FP8 layout)
    int8_block  [1, g]      q = rint(w / s) in [-127, 127], s = amax / 127
    int4_block  [1, 128]    asymmetric: s = (hi - lo) / 15, z = rint(-lo / s), q = rint(w / s) + z
                            symmetric:  s = amax / 7, q = rint(w / s) + 8 (zero fixed at 8)
                            (lo = min(w, 0), hi = max(w, 0) over the block; q in [0, 15])

Rows of one parent may fall in independently blocked segments (the gate and up halves of a fused
expert): a block never straddles two segments. When a segment's rows are not a multiple of br the
stored block is [1, bc], each row carrying its block's scale (exact, only more scale entries).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from ..artifact import format as fmt
from ..errors import ConvertError
from ..models.qwen3_5.quant import dequantize
from .gptq import FP8, FP8_MAX, gptq_codes, gptq_fp8
from .recipe import ValuePreserving

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_BLOCK = (128, 128)
FORMATS = ("fp8", "int8", "int4")
SCALE_SUFFIX = ".weight_scale_inv"       # an FP8 release: `<module>.weight_scale_inv` per weight
LAYOUT_OF = {"fp8": "fp8_block", "int8": "int8_block", "int4": "int4_block"}
GROUP = 128                         # int8 / int4 columns per scale group, by default
CALIBRATED_INT4_GROUP = 64          # ... for int4 with --calibration: measured, docs/
                                    # performance.md "int4, issue 24 step 5"
INT4_GROUP_UNIT = 32                # an int4 group is whole 16-byte chunks of codes
CALIBRATION_TOKENS = 8192           # tokens of the calibration text the statistics sum over

# The text weights `--quantize` encodes: every projection of attention, GDN and the MLP / experts.
# Kept 16-bit: embeddings, norms, conv1d, A_log, dt_bias, the router and shared-expert gate, and
# GDN in_proj_a / in_proj_b ([num_v_heads, H]: the decay and beta gates, <0.1% of the bytes; the
# release FP8 checkpoints keep them bf16 too). lm_head only with quantize_lm_head.
QUANTIZED_LEAVES = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
    "linear_attn.out_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
    "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass
class QuantPlan:
    """How one object is stored quantized."""
    layout: str                 # fp8_block | int8_block | int4_block
    block: tuple                # (br, bc) the encoder uses
    segment_rows: int           # rows per independently blocked segment of a matrix
    rows: int                   # R of the logical [..., R, C]
    asymmetric: bool = False    # int4 with zero points
    scales: list | None = None  # source scale tensors, one per source (import of an FP8 release)
    hessian: object = None      # calibration: H [C, C], or one H (or None) per expert

    @property
    def stored_block(self) -> tuple:
        br, bc = self.block
        whole = self.segment_rows == self.rows or self.segment_rows % br == 0
        return (br if whole else 1, bc)

    def manifest(self, name: str, shape) -> dict:
        q = {"shape": list(shape), "block": list(self.stored_block), "scale": name + ".scale"}
        if self.asymmetric:
            q["zero"] = name + ".zero"
        return q


# ------------------------------------------------------------------------------------ encoders

ENCODE_PIECE = 1 << 24      # elements per piece encode() hands a worker thread


def encode(layout: str, x: np.ndarray, block: tuple, asymmetric: bool = False):
    """Segments x [S, n, C] (float) -> (stored [S, n, C'], scale f32 [S, ceil(n/br), ceil(C/bc)],
    zero uint8 of the scale's shape or None). A large x is encoded by threads (numpy's ufuncs
    and casts release the GIL) in pieces of about ENCODE_PIECE elements: whole segments, or
    whole block rows of one; a block never spans two pieces, so the bytes are those of one."""
    S, n, C = x.shape
    workers = min(os.cpu_count() or 1, 8)
    if S * n * C <= ENCODE_PIECE or workers < 2:
        return _encode(layout, x, block, asymmetric)
    br = block[0]
    rows = n if n * C <= ENCODE_PIECE else max(br, ENCODE_PIECE // C // br * br)
    segs = max(1, ENCODE_PIECE // (rows * C))
    starts = [(s0, r0) for s0 in range(0, S, segs) for r0 in range(0, n, rows)]
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda sr: _encode(layout, x[sr[0]:sr[0] + segs, sr[1]:sr[1] + rows],
                                                 block, asymmetric), starts))
    per = -(-n // rows)                  # pieces per group of segments, in row order
    out = []
    for i in range(3):
        if parts[0][i] is None:
            out.append(None)
            continue
        groups = [np.concatenate([p[i] for p in parts[g:g + per]], axis=1)
                  for g in range(0, len(parts), per)]
        out.append(np.concatenate(groups, axis=0))
    return tuple(out)


def _encode(layout: str, x: np.ndarray, block: tuple, asymmetric: bool):
    """encode() in one piece: in place on one float32 copy of x."""
    S, n, C = x.shape
    br, bc = block
    nbr, nbc = -(-n // br), -(-C // bc)
    if (n, C) == (nbr * br, nbc * bc):
        padded = np.array(x, np.float32)                        # a copy: divided in place below
    else:
        padded = np.zeros((S, nbr * br, nbc * bc), np.float32)  # zeros change no amax / range
        padded[:, :n, :C] = x
    blocks = padded.reshape(S, nbr, br, nbc, bc)
    lo, hi = blocks.min(axis=(2, 4)), blocks.max(axis=(2, 4))
    zero = None
    if layout == "int4_block" and asymmetric:
        lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
        scale = _nonzero((hi - lo) / 15.0)
        zero = np.clip(np.rint(-lo / scale), 0, 15)
        q = _rint_clip(np.divide(blocks, _b(scale), out=blocks), -np.inf, np.inf)
        q = _rint_clip(np.add(q, _b(zero), out=q), 0, 15)
        zero = zero.astype(np.uint8)
    else:
        amax = np.maximum(hi, -lo)
        top = {"fp8_block": FP8_MAX, "int8_block": 127.0, "int4_block": 7.0}[layout]
        scale = _nonzero(amax / top)
        q = np.divide(blocks, _b(scale), out=blocks)
        if layout == "fp8_block":
            np.clip(q, -FP8_MAX, FP8_MAX, out=q)
        elif layout == "int8_block":
            q = _rint_clip(q, -127, 127)
        else:
            q = np.add(_rint_clip(q, -8, 7), 8, out=q)
    q = q.reshape(S, nbr * br, nbc * bc)[:, :n, :C]
    if layout == "fp8_block":
        stored = q.astype(FP8)
    elif layout == "int8_block":
        stored = q.astype(np.int8)
    else:
        stored = pack_int4(q.astype(np.uint8))
    return stored, scale.astype(np.float32), zero


def encode_calibrated(layout: str, w: np.ndarray, h: np.ndarray, group,
                      asymmetric: bool = False):
    """One matrix w [n, C] with GPTQ error compensation for inputs of second moment h [C, C]
    (calibrate.py, gptq.py); returns encode's triple for S = 1. group: the int layouts' group
    size, or fp8's (br, bc) block."""
    if layout == "fp8_block":
        _, scale, _ = encode("fp8_block", np.asarray(w, np.float32)[None], group)
        return gptq_fp8(w, h, group, scale[0])[None], scale, None
    bits = 8 if layout == "int8_block" else 4
    codes, scale, zero = gptq_codes(w, h, group, bits=bits, asymmetric=asymmetric)
    if layout == "int8_block":
        stored = codes.astype(np.int8)
    else:
        stored = pack_int4((codes if asymmetric else codes + 8).astype(np.uint8))
    return stored[None], scale[None], None if zero is None else zero[None]


def _encode_segments(qp: QuantPlan, segs: np.ndarray, row0: int):
    """encode() of segments [S, n, C] whose first row is row `row0` of the flattened parent;
    with calibration statistics (int8 / int4), GPTQ per segment."""
    h = qp.hessian
    if h is None:
        return encode(qp.layout, segs, qp.block, qp.asymmetric)
    parts = []
    for k, seg in enumerate(segs):
        hk = h[(row0 + k * segs.shape[1]) // qp.rows] if isinstance(h, list) else h
        group = qp.block if qp.layout == "fp8_block" else qp.block[1]
        parts.append(encode(qp.layout, seg[None], qp.block, qp.asymmetric) if hk is None else
                     encode_calibrated(qp.layout, seg, hk, group, qp.asymmetric))
    stored, scale, zero = (np.concatenate(p) if p[0] is not None else None for p in zip(*parts))
    return stored, scale, zero


def _float32(a: np.ndarray) -> np.ndarray:
    """Exact widening; bf16 by its bits (ml_dtypes' cast is ~5x slower)."""
    if a.dtype == BF16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _rint_clip(q: np.ndarray, low: float, high: float) -> np.ndarray:
    np.rint(q, out=q)
    return np.clip(q, low, high, out=q)


def _nonzero(scale: np.ndarray) -> np.ndarray:
    """An all-zero block gets scale 1 (its codes are 0 either way)."""
    return np.where(scale > 0, scale, 1.0).astype(np.float32)


def _b(per_block: np.ndarray) -> np.ndarray:
    """[S, nbr, nbc] -> broadcastable over [S, nbr, br, nbc, bc]."""
    return per_block[:, :, None, :, None]


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [..., C] -> bytes [..., ceil(C/2)]: element 2k in bits 0-3 of byte k,
    2k+1 in bits 4-7 (an odd C pads the last high nibble with 0)."""
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def per_row(scale_rows: np.ndarray, br: int, rows: int) -> np.ndarray:
    """Scales of one segment [ceil(rows/br), nbc] -> one row each [rows, nbc] (stored block 1)."""
    return np.repeat(scale_rows, br, axis=0)[:rows]


# ------------------------------------------------------------------------------------ the recipe

class Quantize(ValuePreserving):
    """Quantize the projections of the text model (QUANTIZED_LEAVES; lm_head on request) from a
    16/32-bit checkpoint; every other tensor is stored value-preserving. `quantize_lm_head`:
    False, True (the recipe's format) or a format of its own ("int8" beside an int4 body: the
    head is read whole every decode step, and 8 bits there cost little quality). `group`:
    int8 / int4 columns per scale group, None for whole rows (int8), "auto" for GROUP, or
    CALIBRATED_INT4_GROUP for int4 with a calibration text."""

    def __init__(self, format: str, *, group: int | None | str = "auto", asymmetric: bool = True,
                 quantize_lm_head: bool = False, calibration: str | None = None,
                 calibration_tokens: int = CALIBRATION_TOKENS, sequential: bool = True):
        if format not in FORMATS:
            raise ConvertError(f"--quantize {format!r}: expected one of {', '.join(FORMATS)}")
        if isinstance(group, str) and group == "auto":
            group = CALIBRATED_INT4_GROUP if format == "int4" and calibration is not None \
                else GROUP
        if group is not None and (not isinstance(group, int) or group < 1):
            raise ConvertError(f"quantization group {group!r}: expected a positive int or None")
        if format == "int4" and group is None:
            raise ConvertError("int4 needs a group size (per-channel int4 loses too much)")
        head = format if quantize_lm_head is True else quantize_lm_head
        if head not in (False, None) and head not in FORMATS:
            raise ConvertError(f"--quantize-lm-head {head!r}: expected one of {', '.join(FORMATS)}")
        if "int4" in (format, head) and group is not None and group % INT4_GROUP_UNIT:
            raise ConvertError(f"int4 group {group}: expected a multiple of {INT4_GROUP_UNIT} "
                               "(the GPU kernels read whole chunks of 32 codes)")
        self.format, self.group, self.asymmetric = format, group, asymmetric
        self.lm_head_format = head or None         # None: lm_head stays 16-bit
        self.quantize_lm_head = self.lm_head_format is not None
        self.name = f"quantize-{format}"
        self.calibration, self.calibration_tokens = calibration, calibration_tokens
        self.sequential = sequential    # calibrate layer i on the quantized layers < i
        self.hessians: dict = {}        # logical -> H (or per expert), filled by prepare()

    def prepare(self, measure) -> None:
        """With a calibration text: the input statistics of every projection, from `measure`
        (the converter's `hessians_for_checkpoint` bound to the checkpoint)."""
        if self.calibration is None:
            return
        self.hessians = measure(self.calibration, self.calibration_tokens,
                                self._dequantized if self.sequential else None)

    def _dequantized(self, logical: str, w: np.ndarray, h) -> np.ndarray:
        """w [..., R, C] float32 as this recipe stores it with statistics h, decoded (what the
        later layers see during sequential calibration)."""
        rows = w.shape[-2] // 2 if logical.endswith(".mlp.experts.gate_up_proj") else w.shape[-2]
        qp = self.quant_plan(logical, w.shape, rows)
        qp.hessian = h
        segs = w.reshape(-1, rows, w.shape[-1])
        stored, scale, zero = _encode_segments(qp, segs, 0)
        qt = SimpleNamespace(shape=segs.shape, block=qp.block, data=stored, scale=scale,
                             zero=zero, layout=qp.layout, view=None)
        return dequantize(qt, logical).reshape(w.shape)

    def selects(self, logical: str) -> bool:
        """Whether the text weight `logical` is quantized (the converter asks for a tied
        embedding under its lm_head name)."""
        if logical == "text.lm_head.weight":
            return self.quantize_lm_head
        return logical.startswith("text.layers.") and logical.split(".", 3)[3] in QUANTIZED_LEAVES

    def quant_plan(self, logical: str, shape: tuple, segment_rows: int) -> QuantPlan:
        fmt = self.lm_head_format if logical == "text.lm_head.weight" else self.format
        block = FP8_BLOCK if fmt == "fp8" else (1, self.group or shape[-1])
        return QuantPlan(LAYOUT_OF[fmt], block, segment_rows, shape[-2],
                         asymmetric=fmt == "int4" and self.asymmetric,
                         hessian=self.hessians.get(logical))

    def describe(self) -> dict:
        return {"format": self.format, "from": "converter",     # block [1, null]: whole rows
                "block": list(FP8_BLOCK) if self.format == "fp8" else [1, self.group],
                "asymmetric": self.format == "int4" and self.asymmetric,
                "lm_head": self.quantize_lm_head,
                **({"lm_head_format": self.lm_head_format}
                   if self.lm_head_format not in (None, self.format) else {}),
                "method": "gptq" if self.calibration is not None else "round"}


# ------------------------------------------------------------------------------------ FP8 releases

def plan_release_fp8(src, plan) -> None:
    """Mark every object whose sources carry `weight_scale_inv` as fp8_block, value-preserving
    (bytes and scales as stored; scale_inv multiplies: w = q * scale_inv[r // br, c // bc]).
    Checks dtypes and scale shapes against config's weight_block_size; reads no payload."""
    br, bc = src.quantization["block"]
    used = set()
    for o in plan.objects:
        scaled = [s for s in o.sources if s in plan.scales]
        fp8 = [s for s in o.sources if src.tensors[s].dtype == FP8]
        if not scaled and not fp8:
            continue
        bad = next((s for s in o.sources if s not in scaled), None)
        if bad is not None:
            raise ConvertError(f"tensor {bad!r}: {'float8 without' if bad in fp8 else 'no'} "
                               f"{SCALE_SUFFIX[1:]}" + (f" (its group {o.name} mixes quantized and "
                                                         "unquantized tensors)" if scaled else ""))
        dtypes = set()
        for s in o.sources:
            info, scale = src.tensors[s], src.tensors[plan.scales[s]]
            if info.dtype != FP8 or len(info.shape) != 2:
                raise ConvertError(f"tensor {s!r}: has {SCALE_SUFFIX[1:]} but is {info.dtype} "
                                   f"{list(info.shape)}, expected a 2-D float8_e4m3fn weight")
            want = [-(-info.shape[0] // br), -(-info.shape[1] // bc)]
            if list(scale.shape) != want or scale.dtype.name not in fmt.SCALE_DTYPES:
                raise ConvertError(f"tensor {plan.scales[s]!r}: {scale.dtype} {list(scale.shape)}, "
                                   f"expected float32 or bfloat16 {want} (blocks {[br, bc]} of "
                                   f"{list(info.shape)})")
            dtypes.add(scale.dtype)
            used.add(s)
        if len(dtypes) > 1:
            raise ConvertError(f"{o.name}: scales mix dtypes {sorted(map(str, dtypes))}")
        o.quant = QuantPlan("fp8_block", (br, bc), src.tensors[o.sources[0]].shape[0],
                            o.shape[-2], scales=[plan.scales[s] for s in o.sources])
    orphan = sorted(set(plan.scales) - used)
    if orphan:
        raise ConvertError(f"tensor {plan.scales[orphan[0]]!r}: no weight {orphan[0]!r} for it")


# ------------------------------------------------------------------------------------ writing

def write_quantized(src, o, writer, progress) -> None:
    """Stream object `o` (ObjectPlan with a QuantPlan) into `writer`: the parent, then its
    scale and zero objects. `progress(nbytes)` after each source piece."""
    qp = o.quant
    br, bc = qp.block
    sbr = qp.stored_block[0]
    scales, zeros = [], []
    row0 = 0                                # rows of the flattened [-1, C] parent written so far
    dtype = fmt.DTYPES[fmt.QUANT_LAYOUTS[qp.layout]]
    with writer.begin_object(o.name, dtype, fmt.quant_data_shape(qp.layout, o.shape), qp.layout,
                             quant=qp.manifest(o.name, o.shape)) as sink:
        for k, s in enumerate(o.sources):
            if qp.scales is not None:           # an FP8 release: bytes and scales as they are
                for piece in src.read_chunks(s):
                    sink.write(piece)
                    progress(piece.nbytes)
                scale = src.read_whole(qp.scales[k]).astype(np.float32)
                if not np.all(np.isfinite(scale)):
                    raise ConvertError(f"tensor {qp.scales[k]!r}: non-finite scales")
                rows = src.tensors[s].shape[0]
                scales.append(per_row(scale, br, rows) if sbr != br else scale)
                continue
            for piece in src.read_chunks(s, row_multiple=br):
                segs = piece.reshape(-1, qp.segment_rows, piece.shape[-1]) if piece.ndim == 3 \
                    else piece[None]
                stored, scale, zero = _encode_segments(qp, _float32(segs), row0)
                row0 += segs.shape[0] * segs.shape[1]
                sink.write(stored)
                for part, out in ((scale, scales), (zero, zeros)):
                    if part is None:
                        continue
                    if sbr != br:
                        part = np.stack([per_row(p, br, segs.shape[1]) for p in part])
                    out.append(part.reshape(-1, part.shape[-1]))
                progress(piece.nbytes)
    want = fmt.quant_scale_shape(o.shape, qp.stored_block)
    # an FP8 release's scales keep their dtype (bf16 or f32: value-preserving), ours are f32
    scale_dtype = src.tensors[qp.scales[0]].dtype if qp.scales else np.dtype(np.float32)
    writer.add_object(o.name + ".scale", np.concatenate(scales).astype(scale_dtype).reshape(want))
    if qp.asymmetric:
        writer.add_object(o.name + ".zero", np.concatenate(zeros).reshape(want))
