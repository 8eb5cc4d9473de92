"""Weight-only quantized products on packed weights (docs/artifact.md 3.2.1): the decode GEMV
and the prefill path's dequantization into a bf16 (fp32) tile for cuBLASLt.

    value[r, c] = (q[r, c] - zero[r // br, c // bc]) * scale[r // br, c // bc]

q: fp8_block e4m3 bytes, int8_block two's-complement bytes, int4_block nibbles (even column in
the low nibble); zero: the zero object for asymmetric int4, 8 for symmetric int4, 0 otherwise.

`qgemv`: y[b, r] = sum_c value(r, c) * x[b, c] (+ beta * y[b, r]) for BM rows b of x at once
(a decode batch of up to 8 tokens reads each weight byte once). A warp owns ROWS output rows;
its lanes walk the packed rows in 8-byte words (8 codes, 16 for int4), consecutive lanes on
consecutive words (coalesced), and the ROWS words are loaded before any is used (loads in
flight). The codes become float32 without a conversion instruction: an int8 or int4 code is
or-ed into the mantissa of 2^23 and 2^23 + offset subtracted (exact); an e4m3 byte's exponent
and mantissa bits go under float32's (sign kept) and one multiply by 2^120 rebias it, which is
also exact for e4m3 subnormals. Each word's products are summed, then scaled once (a word never
straddles a scale block: the "vector" path needs bc a multiple of the word's codes). Rows of
other shapes (K not a multiple of 8 / 16, odd blocks) take the scalar path: one code at a time.
Expert mode (topk > 0): grid.y is the (token, slot) pair p, the weights those of expert ids[p]
(w_stride bytes and s_stride scales apart), x row p // topk (x_per_pair 0) or p, y row p.

Rows b >= m and r >= n are computed from clamped indices and never written, so no lane
branches inside the loop.
"""
from numba import cuda, float32, int32, int64, uint32, uint64

from .common import f32_to_bf16, inlined, warp_sum
from .ptx import (and_or, cvt_bf16x2, fma_bf16x2, ld_1, ld_stream, ld_v2, ld_v2_stream, ld_v4,
                  ld_v4_stream, mma_bf16, prmt)

THREADS = 128
WARPS = THREADS // 32
ROWS = 4                            # output rows per warp (2, 8: slower on the H200)
BMS = (1, 2, 4, 8)                  # compiled batch widths; m rows run on the smallest >= m
LAYOUTS = ("fp8_block", "int8_block", "int4_block")
DEQUANT_THREADS = 256

_QGEMV_ARGS = ("f32*", "u16*", "u64*", "u8*", "u64*", "f32*", "u8*", "i32", "i32", "i32", "i32",
               "i32", "i32", "i32", "f32", "i32", "i32*", "i32", "i32", "i64", "i64")
SIGNATURES = {
    "qgemv": _QGEMV_ARGS,
    "dequant": ("u16*", "u64*", "u8*", "u64*", "f32*", "u8*", "i32", "i32", "i32", "i32", "i32",
                "i32", "i32", "i64", "i64", "i32"),
    "qmma": ("f32*", "u32*", "u32*", "f32*", "u8*", "i32", "i32", "i32", "i32", "i32", "i32",
             "i32", "f32", "i32*", "i32", "i32", "i64", "i64"),
}
MMA_WARPS = 4                       # warps of a qmma block, splitting K
MMA_UNROLL = 4                      # steps whose loads a warp issues before using any

TWO_23 = 8388608.0
E4M3_REBIAS = 2.0 ** 120            # float32 exponent bias 127 - e4m3's 7


def codes_per_word(layout: str) -> int:
    return 16 if layout == "int4_block" else 8


def row_bytes(layout: str, k: int) -> int:
    return (k + 1) // 2 if layout == "int4_block" else k


def vector_ok(layout: str, k: int, bc: int) -> bool:
    """The kernels' word path: rows of whole 8-byte words, no word across a scale block."""
    e = codes_per_word(layout)
    return k % e == 0 and bc % e == 0


@inlined
def store_y(y, i, v, beta):
    """y[i] = v + beta * y[i]; beta 0 never reads y (the output may hold anything)."""
    if beta != float32(0.0):
        v += beta * y[i]
    y[i] = v


def _decoder(layout: str, asym: bool):
    """code (uint32 0..255 or 0..15), offset (float32) -> float32 value before scaling."""
    if layout == "fp8_block":
        @inlined
        def decode(c, off):
            bits = ((c & uint32(0x7F)) << uint32(20)) | ((c & uint32(0x80)) << uint32(24))
            return cuda.libdevice.int_as_float(int32(bits)) * float32(E4M3_REBIAS)
    elif layout == "int8_block":
        @inlined
        def decode(c, off):
            # c ^ 0x80 = signed value + 128; 2^23 + that, less 2^23 + 128
            bits = uint32(0x4B000000) | (c ^ uint32(0x80))
            return cuda.libdevice.int_as_float(int32(bits)) - off
    elif layout == "int4_block":
        @inlined
        def decode(c, off):
            bits = uint32(0x4B000000) | c
            return cuda.libdevice.int_as_float(int32(bits)) - off
    else:
        raise ValueError(f"quantized layout {layout!r} (one of {', '.join(LAYOUTS)})")
    return decode


def _offset(layout: str):
    """offset(zero array, scale index, asym) -> float32 subtracted from a decoded code."""
    if layout == "int4_block":
        @inlined
        def offset(zero, si, asym):
            z = int32(zero[si]) if asym else int32(8)
            return float32(TWO_23) + float32(z)
    else:
        base = float32(TWO_23 + 128.0) if layout == "int8_block" else float32(0.0)

        @inlined
        def offset(zero, si, asym):
            return base
    return offset


def _half_decoder(layout: str):
    """(32 bits of a word, code index j in it) -> a float32 the kernel sums against x, before
    its per-half-word correction: j a constant (an unrolled loop), 4 byte codes or 8 nibbles per
    half word. e4m3 comes out 2^-120 times its value (the sum is multiplied back); an int4 code c
    comes out 1 + c/16 and an int8 code (signed s, u = s + 128) 1 + u/256, exact, one shift and
    one logic op each: sum (c - z) x = 16 sum (1 + c/16) x - (16 + z) sum x, and
    sum s x = 256 sum (1 + u/256) x - 384 sum x, with sum x shared by every row of the warp."""
    if layout == "fp8_block":
        @inlined
        def dec(half, j):
            # the byte to the top (its sign on bit 31), an arithmetic shift by 4 puts exponent
            # and mantissa under float32's (bits 30-20; the sign copies in 30-27 are masked off)
            t = int32(half << uint32(24 - 8 * j)) >> int32(4)
            return cuda.libdevice.int_as_float(t & int32(E4M3_MASK))
    elif layout == "int8_block":
        @inlined
        def dec(half, j):
            # byte j to bits 22-15 under 1.0's exponent; flipping bit 22 adds 128 (xor: disjoint)
            bits = (((half >> uint32(8 * j)) & uint32(0xFF)) << uint32(15)) ^ uint32(0x3FC00000)
            return cuda.libdevice.int_as_float(int32(bits))
    else:
        @inlined
        def dec(half, j):
            bits = (((half >> uint32(4 * j)) & uint32(0xF)) << uint32(19)) | uint32(0x3F800000)
            return cuda.libdevice.int_as_float(int32(bits))
    return dec


E4M3_MASK = 0x87F00000 - (1 << 32)    # sign, exponent, mantissa bits of the rebiased float (int32)


def _word_offset(layout: str):
    """offset(zero array, scale index, asym) -> the half-word decoders' `off` (sum of x times it
    is subtracted): 16 + z for int4, 384 for int8, 0 for fp8."""
    if layout == "int4_block":
        @inlined
        def offset(zero, si, asym):
            z = int32(zero[si]) if asym else int32(8)
            return float32(16 + z)
    else:
        base = float32(384.0 if layout == "int8_block" else 0.0)

        @inlined
        def offset(zero, si, asym):
            return base
    return offset


def qgemv(layout, bm, asym=False, f32=False, rows=ROWS):
    """The decode GEMV for one layout and batch width BM (module docstring). Grid
    (ceil(n / (WARPS * rows)), pairs or 1), block THREADS. `rows`: output rows per warp
    (bench/bench_quant.py --rows sweeps it; the model runs ROWS)."""
    ROWS = rows
    int4 = layout == "int4_block"
    fp8 = layout == "fp8_block"
    E = codes_per_word(layout)
    CPH = E // 2                     # codes per 32-bit half word
    CB = 4 if int4 else 8            # bits per code
    MASK = 0xF if int4 else 0xFF
    NACC = ROWS * bm                 # accumulators: (output row, batch row)
    NX = CPH * bm                    # x values of one half word's codes, per batch row
    # per half word: sum = MULT * sum(dec * x) - off * sum(x) (off: 384 int8, 16 + z int4). The
    # float32 variant (dtype="float32", the numpy backend's arithmetic up to summation order)
    # decodes each code exactly instead: the correction cancels (int8: ~10 ulp of the sum)
    FAST = not f32
    MULT = float32(E4M3_REBIAS if fp8 else (16.0 if int4 else 256.0))
    decode = _decoder(layout, asym)
    dec = _half_decoder(layout)
    offset = _offset(layout)
    word_offset = _word_offset(layout)

    @inlined
    def x_group(xs, o, x, xw, xi):
        # xs[o .. o + CPH) = x[xi .. xi + CPH) as float32 (xi a multiple of 4); returns their sum
        if f32:
            for j in range(CPH):
                xs[o + j] = x[xi + j]
        else:
            for q in range(CPH // 4):
                v = xw[(xi >> 2) + q]
                lo = uint32(v & uint64(0xFFFFFFFF))
                hi = uint32(v >> uint64(32))
                xs[o + 4 * q] = cuda.libdevice.int_as_float(int32(lo << uint32(16)))
                xs[o + 4 * q + 1] = cuda.libdevice.int_as_float(int32(lo & uint32(0xFFFF0000)))
                xs[o + 4 * q + 2] = cuda.libdevice.int_as_float(int32(hi << uint32(16)))
                xs[o + 4 * q + 3] = cuda.libdevice.int_as_float(int32(hi & uint32(0xFFFF0000)))
        t = float32(0.0)
        if FAST and not fp8:
            for j in range(CPH):
                t += xs[o + j]
        return t

    @inlined
    def x_at(x, i):
        if f32:
            return x[i]
        return cuda.libdevice.int_as_float(int32((int32(x[i]) & 0xFFFF) << 16))

    def qgemv_kernel(y, x, xw, w8, w, scale, zero, m, n, k, ldy, br, bc, sc_cols, beta, vec,
                     ids, topk, x_per_pair, w_stride, s_stride):
        tid = cuda.threadIdx.x
        lane = tid & 31
        r0 = (cuda.blockIdx.x * WARPS + (tid >> 5)) * ROWS
        if r0 >= n:
            return
        p = cuda.blockIdx.y
        wbyte = int64(0)
        sbase = int64(0)
        xrow0 = int64(0)
        yrow0 = int64(0)
        if topk > 0:                                    # expert mode
            e = int64(ids[p])
            wbyte = e * w_stride
            sbase = e * s_stride
            xrow0 = int64(p) if x_per_pair else int64(p // topk)
            yrow0 = int64(p)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        rb = int64((k + 1) // 2 if int4 else k)
        if vec:
            row_words = rb >> 3
            # per row: its first word and first scale; per batch row: its first x element
            wrow = cuda.local.array(ROWS, int64)
            srow = cuda.local.array(ROWS, int64)
            xrow = cuda.local.array(bm, int64)
            for rr in range(ROWS):
                r = min(r0 + rr, n - 1)
                wrow[rr] = (wbyte >> 3) + r * row_words
                srow[rr] = sbase + (r // br) * sc_cols
            for b in range(bm):
                xrow[b] = (xrow0 + min(b, m - 1)) * k
            sh = 0                                      # bc a power of two: a shift per word
            while (1 << sh) < bc:
                sh += 1
            pow2 = (1 << sh) == bc
            words = cuda.local.array(ROWS, uint64)
            svals = cuda.local.array(ROWS, float32)
            offs = cuda.local.array(ROWS, float32)
            xs = cuda.local.array(NX, float32)
            sx = cuda.local.array(bm, float32)
            part = cuda.local.array(bm, float32)
            for wi in range(lane, row_words, 32):
                c0 = wi * E
                scol = (c0 >> sh) if pow2 else c0 // bc
                for rr in range(ROWS):
                    words[rr] = w[wrow[rr] + wi]
                    si = srow[rr] + scol
                    svals[rr] = scale[si]
                    offs[rr] = word_offset(zero, si, asym) if FAST else offset(zero, si, asym)
                for q in range(2):
                    for b in range(bm):
                        sx[b] = x_group(xs, CPH * b, x, xw, xrow[b] + c0 + CPH * q)
                    for rr in range(ROWS):
                        if q == 0:
                            half = uint32(words[rr] & uint64(0xFFFFFFFF))
                        else:
                            half = uint32(words[rr] >> uint64(32))
                        for b in range(bm):
                            part[b] = float32(0.0)
                        for j in range(CPH):
                            if FAST:
                                qv = dec(half, j)
                            else:
                                qv = decode((half >> uint32(CB * j)) & uint32(MASK), offs[rr])
                            for b in range(bm):
                                part[b] += qv * xs[CPH * b + j]
                        for b in range(bm):
                            if not FAST:
                                v = part[b]
                            elif fp8:
                                v = part[b] * MULT
                            else:
                                v = part[b] * MULT - offs[rr] * sx[b]
                            acc[rr * bm + b] += v * svals[rr]
        else:
            for c in range(lane, k, 32):
                scol = c // bc
                for rr in range(ROWS):
                    r = min(r0 + rr, n - 1)
                    byte = uint32(w8[wbyte + r * rb + (c >> 1 if int4 else c)])
                    code = (byte >> uint32(4 * (c & 1))) & uint32(MASK) if int4 else byte
                    si = sbase + (r // br) * sc_cols + scol
                    qv = decode(code, offset(zero, si, asym)) * scale[si]
                    for b in range(bm):
                        acc[rr * bm + b] += qv * x_at(x, (xrow0 + min(b, m - 1)) * k + c)
        for rr in range(ROWS):
            r = r0 + rr
            for b in range(bm):
                v = warp_sum(acc[rr * bm + b])
                if lane == 0 and r < n and b < m:
                    store_y(y, (yrow0 + b) * ldy + r, v, beta)
    qgemv_kernel.__name__ = "qgemv"
    return qgemv_kernel


def dequant(layout, asym=False, f32=False):
    """out[z, i, c] = value of expert e0 + z, row r0 + i, column c, for `rows` rows (bf16 bits,
    or fp32 with f32): the prefill path's weight tile for cuBLASLt. An expert's codes and scales
    are w_stride bytes and s_stride scales after the previous one's (0 for a plain matrix).
    `vec` (vector_ok): a thread per 8-byte word of codes, its 8 or 16 values stored as 4-value
    words (`outw`, the same buffer); else a thread per code. Grid (ceil(words or k /
    DEQUANT_THREADS), rows, experts), block DEQUANT_THREADS."""
    int4 = layout == "int4_block"
    E = codes_per_word(layout)
    MASK = 0xF if int4 else 0xFF
    CB = 4 if int4 else 8
    decode = _decoder(layout, asym)
    offset = _offset(layout)

    def dequant_kernel(out, outw, w8, w, scale, zero, r0, rows, k, br, bc, sc_cols, e0, w_stride,
                       s_stride, vec):
        t = cuda.blockIdx.x * DEQUANT_THREADS + cuda.threadIdx.x
        i = cuda.blockIdx.y
        z = int64(cuda.blockIdx.z)
        e = int64(e0) + z
        r = int64(r0 + i)
        rb = int64((k + 1) // 2 if int4 else k)
        o = (z * rows + i) * k
        if vec:
            if t >= rb >> 3:
                return
            word = w[((e * w_stride) >> 3) + r * (rb >> 3) + t]
            c0 = int64(t) * E
            si = e * s_stride + (r // br) * sc_cols + c0 // bc
            s = scale[si]
            off = offset(zero, si, asym)
            for q in range(E // 4):          # 4 values per output word
                packed = uint64(0)
                for j in range(4):
                    code = uint32((word >> uint64(CB * (4 * q + j))) & uint64(MASK))
                    v = decode(code, off) * s
                    if f32:
                        out[o + c0 + 4 * q + j] = v
                    else:
                        packed |= uint64(f32_to_bf16(v)) << uint64(16 * j)
                if not f32:
                    outw[((o + c0) >> 2) + q] = packed
            return
        c = t
        if c >= k or i >= rows:
            return
        byte = uint32(w8[e * w_stride + r * rb + (c >> 1 if int4 else c)])
        code = (byte >> uint32(4 * (c & 1))) & uint32(MASK) if int4 else byte
        si = e * s_stride + (r // br) * sc_cols + c // bc
        v = decode(code, offset(zero, si, asym)) * scale[si]
        if f32:
            out[o + c] = v
        else:
            out[o + c] = f32_to_bf16(v)
    dequant_kernel.__name__ = "dequant"
    return dequant_kernel


def mma_chunk(layout: str) -> int:
    """Codes of one lane's 16-byte load in `qmma` (a row's 4 lanes cover 4 chunks per step)."""
    return 32 if layout == "int4_block" else 16


def mma_split(layout: str, bc: int) -> int:
    """Scale blocks per `qmma` step (4 chunks of K): 1 when a block holds whole steps, else
    step / bc (blocks of 64 or 32 int4 codes; 32 or 16 byte codes)."""
    step = 4 * mma_chunk(layout)
    return step // bc if 0 < bc < step and step % bc == 0 else 1


def mma_ok(layout: str, k: int, bc: int) -> bool:
    """`qmma` runs rows of whole chunks whose every step (4 chunks of K) lies in one scale
    block (its products are scaled after the tensor core sums them), a power of two of steps
    per block (a step's block is a shift); or steps of 2 or 4 whole blocks (K a multiple of
    the block), each summed on its own."""
    c = mma_chunk(layout)
    if 0 < bc < 4 * c:
        return mma_split(layout, bc) in (2, 4) and k % bc == 0
    spb = bc // (4 * c)
    return k % c == 0 and bc % (4 * c) == 0 and spb & (spb - 1) == 0


# bf16x2 constants of qmma's decoders
_ONE2 = 0x3F803F80                  # (1, 1)
_NEG0 = 0x80008000                  # (-0, -0): fma(a, b, -0) = a * b exactly rounded
_REBIAS2 = 0x7B807B80               # (2^120, 2^120)
_INT4_BASE = 0x43004300             # (128, 128): a nibble or-ed in is 128 + c, exact
_NEG128_2 = 0xC300C300              # (-128, -128)
_NIB2 = 0x000F000F
_E4M3_EM = 0x07F007F0               # exponent and mantissa of two e4m3 bytes moved under bf16's
_SIGN2 = 0x80008000


def qmma(layout, asym=False, warps=MMA_WARPS, unroll=MMA_UNROLL, stream=True,
         probe=False, tiles=1, split=1):
    """The decode GEMV on tensor cores: y[b, r] = sum_c value(r, c) x[b, c] (+ beta y[b, r]) for
    up to 8 rows b of bf16 x, every row for the cost of one (mma.sync m16n8k16: 16 weight rows
    by the 8 batch rows of one n tile; unused batch lanes hold zeros). Grid (ceil(n / 16),
    pairs or 1), block 32 * `warps`.

    A block owns 16 output rows; its warps split K in steps of 4 chunks (`mma_chunk` codes each:
    one 16-byte load per lane and row), `unroll` steps' loads issued before the first is used.
    Lane (g, t) = (lane / 4, lane % 4) loads chunk t of rows g and g + 8 and the matching x of
    batch row g, and the codes become bf16 pairs in registers, with no conversion instruction:
      int4  a word of 8 nibbles -> (c0, c4), (c1, c5), (c2, c6), (c3, c7): each nibble or-ed
            into 128.0's mantissa, then fma(v, 1, -(128 + z)) = c - z exactly; x pairs are
            permuted (prmt) to the same (j, j + 4) order. The mma's k slots may hold any
            columns as long as A and B agree.
      fp8   a byte pair spread (prmt) to the top of two halves, shifted so e4m3's exponent and
            mantissa sit under bf16's (its sign already in place): 2^-120 times the value,
            exact for subnormals too; one fma by 2^120 rebiases it (all exact).
      int8  byte ^ 0x80 put under 2^23's exponent (one prmt), less 2^23 + 128 (float32), two rounded
            into a bf16 pair (exact: |s| <= 128 needs 8 significant bits).
    The tensor core sums each step in fp32; the step is then scaled (mma_ok: a step never
    straddles a scale block) and added to the lane's four accumulators. The warps' partial
    sums meet in shared memory and are added in warp order: a row's result never depends on
    the other rows of the batch (batch-invariant).
    Expert mode (topk > 0): as qgemv's, one batch row per (token, slot) pair.
    Grouped mode (topk < 0, the MoE prefill): grid.y is a group p of up to 8 consecutive rows
    routed to one expert, ids[3p .. 3p + 3) = (expert, first row, rows); x and y rows are
    first row + b (b < rows), the weights expert's. An expert's groups follow one another in
    grid.y, so its codes come from HBM once and from L2 for the groups after the first.
    stream: the codes are loaded with ld_v4_stream (no L1 allocation, 256-byte L2 fetches):
    2-10% faster on the H200 than plain loads, which `stream=False` keeps for comparison.
    tiles: 16-row tiles per block (grid ceil(n / (16 tiles))), every x fragment used by each.
    split (`mma_split`: 2 or 4 scale blocks per step, blocks narrower than a step): a lane's
    words of a row are then the same word of each block's 4-lane slice (8-byte or 4-byte loads,
    still 64 contiguous bytes per row and step over the 4 lanes), so each block's products are
    summed by mmas of their own and scaled apart.
    probe (bench only): the loads without the math (y gets a checksum of the codes), the
    access pattern's own speed."""
    int4 = layout == "int4_block"
    wload = ld_v4_stream if stream else ld_v4
    wload2 = ld_v2_stream if stream else ld_v2
    wload1 = ld_stream if stream else ld_1
    fp8 = layout == "fp8_block"
    if layout not in LAYOUTS:
        raise ValueError(f"quantized layout {layout!r} (one of {', '.join(LAYOUTS)})")
    CHUNK = mma_chunk(layout)
    STEP = 4 * CHUNK                    # K per warp step
    XW = CHUNK // 2                     # x words (bf16 pairs) of one lane's chunk
    S = split                           # scale blocks per step
    W = 4 // S                          # a lane's words of one row in one block
    XPW = 4 if layout == "int4_block" else 2  # x words per code word
    XG = W * XPW                        # a lane's x words in one block
    BCS = STEP // S                     # codes of a block (S > 1)
    U = unroll
    T = tiles                           # 16-row tiles per block, sharing each x fragment
    R = 2 * T                           # rows per lane
    ROWS_PER_BLOCK = 16 * T
    NACC = 4 * T                        # a lane's accumulators: 2 rows x 2 batch columns per tile
    INT8_OFF = float32(TWO_23 + 128.0)

    @inlined
    def int4_pair(wd, sh, nz):
        return fma_bf16x2(and_or(wd >> uint32(sh), uint32(_NIB2), uint32(_INT4_BASE)),
                          uint32(_ONE2), nz)

    @inlined
    def int4_word_mma(qa, qb, nza, nzb, x0, x1, x2, x3, c0, c1, c2, c3):
        # one 8-nibble word of rows g (qa) and g + 8 (qb): pairs (c0, c4), (c1, c5) in the first
        # mma, (c2, c6), (c3, c7) in the second, x permuted to the same order
        c0, c1, c2, c3 = mma_bf16(int4_pair(qa, 0, nza), int4_pair(qb, 0, nzb),
                                  int4_pair(qa, 4, nza), int4_pair(qb, 4, nzb),
                                  prmt(x0, x2, uint32(0x5410)), prmt(x0, x2, uint32(0x7632)),
                                  c0, c1, c2, c3)
        return mma_bf16(int4_pair(qa, 8, nza), int4_pair(qb, 8, nzb),
                        int4_pair(qa, 12, nza), int4_pair(qb, 12, nzb),
                        prmt(x1, x3, uint32(0x5410)), prmt(x1, x3, uint32(0x7632)),
                        c0, c1, c2, c3)

    @inlined
    def fp8_pair(wd, sel):
        v = prmt(wd, uint32(0), uint32(sel))
        e = and_or(v >> uint32(4), uint32(_E4M3_EM), v & uint32(_SIGN2))
        return fma_bf16x2(e, uint32(_REBIAS2), uint32(_NEG0))

    @inlined
    def int8_val(u, j):
        # byte j of u (an offset code, 0..255) under 2^23's exponent byte in one prmt: 2^23 + u_j
        bits = prmt(u, uint32(0x4B000000), uint32(0x7540 + j))
        return cuda.libdevice.int_as_float(int32(bits)) - INT8_OFF

    @inlined
    def load_words(p, i):
        # W consecutive code words at p[i]: 16, 8 or 4 bytes in one load
        if W == 4:
            return wload(p, i)
        if W == 2:
            a, b = wload2(p, i)
            return a, b, uint32(0), uint32(0)
        return wload1(p, i), uint32(0), uint32(0), uint32(0)

    @inlined
    def load_step(wq, xr, fs, zs, u, w, wr, off, x, px, xon, scale, zero, sr, blk, kleft, t,
                  full):
        # one step's loads into slot u: the lane's R rows' codes at words wr[i] + off (+ each
        # block's slice), x at px, scales / zero points at sr[i] + blk (+ block); kleft: codes of
        # K from the step's start (full: all of them)
        for b in range(S):
            if S == 1:
                kin = full or t * CHUNK < kleft
            else:
                kin = full or b * BCS < kleft
            for i in range(R):
                if kin:
                    q0, q1, q2, q3 = load_words(w, wr[i] + off + b * 4 * W)
                else:
                    q0 = q1 = q2 = q3 = uint32(0)
                wq[u, i, b * W] = q0
                if W > 1:
                    wq[u, i, b * W + 1] = q1
                if W > 2:
                    wq[u, i, b * W + 2] = q2
                    wq[u, i, b * W + 3] = q3
            for q in range(XG // 4 if XG >= 4 else 1):
                if xon and kin:
                    if XG >= 4:
                        x0, x1, x2, x3 = ld_v4(x, px + b * 4 * XG + 4 * q)
                    else:
                        x0, x1 = ld_v2(x, px + b * 4 * XG)
                        x2 = x3 = uint32(0)
                else:
                    x0 = x1 = x2 = x3 = uint32(0)
                xr[u, b * XG + 4 * q] = x0
                xr[u, b * XG + 4 * q + 1] = x1
                if XG >= 4:
                    xr[u, b * XG + 4 * q + 2] = x2
                    xr[u, b * XG + 4 * q + 3] = x3
            for i in range(R):
                # (a block past K has no scale: its codes are zeros, any finite factor does)
                fs[u, i, b] = scale[sr[i] + blk + b] if kin or S == 1 else float32(0.0)
                if int4:
                    zs[u, i, b] = uint32(zero[sr[i] + blk + b]) if asym and (kin or S == 1) \
                        else uint32(8)

    @inlined
    def load_full(wq, xr, fs, zs, s0, w, wr, x, xi0, xon, scale, sr, zero, gsh, t):
        # U steps that lie inside K for every lane: no bounds tests, and the code / x addresses
        # are one base per set plus constant offsets (immediates of the loads)
        px = xi0 + (STEP // 2) * s0
        for u in range(U):
            blk = (s0 + u) * S if S > 1 else (s0 + u) >> gsh
            load_step(wq, xr, fs, zs, u, w, wr, 16 * (s0 + u), x, px + (STEP // 2) * u, xon,
                      scale, zero, sr, blk, STEP, t, True)

    @inlined
    def load_tail(wq, xr, fs, zs, s0, nsteps, k, t, w, wr, x, xi0, xon, scale, sr, zero, gsh):
        # the last steps: K may end inside a step (a lane's chunk or a block past it loads
        # zeros) and a step past the end is loaded from a valid address and never used
        for u in range(U):
            s = min(s0 + u, nsteps - 1)
            blk = s * S if S > 1 else s >> gsh
            load_step(wq, xr, fs, zs, u, w, wr, 16 * s, x, xi0 + (STEP // 2) * s, xon, scale,
                      zero, sr, blk, k - s * STEP, t, False)

    @inlined
    def compute_set(wq, xr, fs, zs, nvalid, acc):
        for u in range(U):
            if probe:
                if u < nvalid:
                    v = uint32(0)
                    for i in range(R):
                        for b in range(S):
                            v ^= zs[u, i, b]
                        for j in range(4):
                            v ^= wq[u, i, j]
                    for q in range(XW):
                        v ^= xr[u, q]
                    acc[0] += float32(v & uint32(0xFF)) * fs[u, 0, 0]
                continue
            if u >= nvalid:
                continue
            for tl in range(T):
                ia = 2 * tl                         # the tile's rows g and g + 8
                ib = 2 * tl + 1
                for b in range(S):
                    # two independent tensor-core chains (even and odd words), added at the end
                    d0 = d1 = d2 = d3 = float32(0.0)
                    e0 = e1 = e2 = e3 = float32(0.0)
                    if int4:
                        # bf16 of -(128 + z) is 0xC300 | z (z < 128), in both halves
                        nza = uint32(_NEG128_2) | (zs[u, ia, b] * uint32(0x10001))
                        nzb = uint32(_NEG128_2) | (zs[u, ib, b] * uint32(0x10001))
                    for jj in range(W):
                        j = b * W + jj
                        qa = wq[u, ia, j]
                        qb = wq[u, ib, j]
                        if int4:
                            x0 = xr[u, 4 * j]
                            x1 = xr[u, 4 * j + 1]
                            x2 = xr[u, 4 * j + 2]
                            x3 = xr[u, 4 * j + 3]
                            if jj % 2 == 0:
                                d0, d1, d2, d3 = int4_word_mma(qa, qb, nza, nzb, x0, x1, x2, x3,
                                                               d0, d1, d2, d3)
                            else:
                                e0, e1, e2, e3 = int4_word_mma(qa, qb, nza, nzb, x0, x1, x2, x3,
                                                               e0, e1, e2, e3)
                            continue
                        if fp8:
                            pa0 = fp8_pair(qa, 0x1404)
                            pa1 = fp8_pair(qa, 0x3424)
                            pb0 = fp8_pair(qb, 0x1404)
                            pb1 = fp8_pair(qb, 0x3424)
                        else:
                            ua = qa ^ uint32(0x80808080)
                            ub = qb ^ uint32(0x80808080)
                            pa0 = cvt_bf16x2(int8_val(ua, 1), int8_val(ua, 0))
                            pa1 = cvt_bf16x2(int8_val(ua, 3), int8_val(ua, 2))
                            pb0 = cvt_bf16x2(int8_val(ub, 1), int8_val(ub, 0))
                            pb1 = cvt_bf16x2(int8_val(ub, 3), int8_val(ub, 2))
                        if jj % 2 == 0:
                            d0, d1, d2, d3 = mma_bf16(pa0, pb0, pa1, pb1, xr[u, 2 * j],
                                                      xr[u, 2 * j + 1], d0, d1, d2, d3)
                        else:
                            e0, e1, e2, e3 = mma_bf16(pa0, pb0, pa1, pb1, xr[u, 2 * j],
                                                      xr[u, 2 * j + 1], e0, e1, e2, e3)
                    fa = fs[u, ia, b]
                    fb = fs[u, ib, b]
                    acc[4 * tl] += (d0 + e0) * fa
                    acc[4 * tl + 1] += (d1 + e1) * fa
                    acc[4 * tl + 2] += (d2 + e2) * fb
                    acc[4 * tl + 3] += (d3 + e3) * fb

    def qmma_kernel(y, x, w, scale, zero, m, n, k, ldy, br, bc, sc_cols, beta, ids, topk,
                    x_per_pair, w_stride, s_stride):
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        g = lane >> 2
        t = lane & 3
        p = cuda.blockIdx.y
        wbase = int64(0)
        sbase = int64(0)
        xrow0 = int64(0)
        yrow0 = int64(0)
        mm = m
        if topk > 0:                                    # expert mode
            e = int64(ids[p])
            wbase = e * (w_stride >> 2)
            sbase = e * s_stride
            xrow0 = int64(p) if x_per_pair else int64(p // topk)
            yrow0 = int64(p)
            mm = 1
        elif topk < 0:                                  # grouped mode
            e = int64(ids[3 * p])
            wbase = e * (w_stride >> 2)
            sbase = e * s_stride
            xrow0 = int64(ids[3 * p + 1])
            yrow0 = xrow0
            mm = ids[3 * p + 2]
        row0 = cuda.blockIdx.x * ROWS_PER_BLOCK
        row_words = int64(k >> 3) if int4 else int64(k >> 2)
        wr = cuda.local.array(R, int64)                 # the lane's rows: first code word
        sr = cuda.local.array(R, int64)                 # and first scale
        for i in range(R):
            r = int64(min(row0 + 16 * (i // 2) + g + 8 * (i % 2), n - 1))
            wr[i] = wbase + r * row_words + W * t
            sr[i] = sbase + (r // br) * sc_cols
        xon = g < mm
        xi0 = (xrow0 + min(g, mm - 1)) * (k >> 1) + t * XG
        nsteps = (k + STEP - 1) // STEP
        nfull = k // STEP                               # steps inside K for every lane
        gsh = 31 - cuda.clz(int32(max(bc // STEP, 1)))  # a step's scale block: s >> gsh (S = 1)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        wq = cuda.local.array((U, R, 4), uint32)
        xr = cuda.local.array((U, XW), uint32)
        fs = cuda.local.array((U, R, S), float32)
        zs = cuda.local.array((U, R, S), uint32)
        # every load of U steps first, then the math: nothing waits on memory between two
        # tensor-core chains
        s0 = wid * U
        while s0 + U <= nfull:
            load_full(wq, xr, fs, zs, s0, w, wr, x, xi0, xon, scale, sr, zero, gsh, t)
            compute_set(wq, xr, fs, zs, U, acc)
            s0 += warps * U
        while s0 < nsteps:
            load_tail(wq, xr, fs, zs, s0, nsteps, k, t, w, wr, x, xi0, xon, scale, sr, zero, gsh)
            compute_set(wq, xr, fs, zs, nsteps - s0, acc)
            s0 += warps * U
        red = cuda.shared.array((warps, NACC, 32), float32)
        for i in range(NACC):
            red[wid, i, lane] = acc[i]
        cuda.syncthreads()
        for o in range(tid, 128 * T, 32 * warps):
            i = o >> 5
            ln = o & 31
            v = float32(0.0)
            for q in range(warps):
                v += red[q, i, ln]
            b = 2 * (ln & 3) + (i & 1)
            r = row0 + 16 * (i >> 2) + (ln >> 2) + 8 * ((i >> 1) & 1)
            if r < n and b < mm:
                store_y(y, (yrow0 + b) * ldy + r, v, beta)
    qmma_kernel.__name__ = "qmma"
    return qmma_kernel
