"""Paged causal GQA attention of a few query tokens on tensor cores: the decode step's attention
(and a short prefill row's), bf16 KV pools, up to 8 query heads of a kv head a block (GS; G = 16
releases: two blocks a kv head).

kernels/attention.py's paged_attention walks one key at a time a warp: two 4-byte loads a lane,
then G warp-wide sums of the dot products (5 shuffles each). That is a load's latency and ~270
instructions a key: on the H200 the 27B's KV read at B = 8, 32K context ran at ~0.8 TB/s (its
decode 36.8 ms a step against a 16.6 ms limit). Here a warp takes 16 keys at once: every lane
issues its 32 16-byte loads of the tile's K and V rows before the first is used (16 KB in
flight a warp), and the dot products and the weighted sum of V run as m16n8k16 bf16 mma
(kernels/ptx.mma_bf16), fp32 accumulation. (H100, that 27B step: 28.4 ms against the CUDA-core
kernel's 41.9; docs/performance.md.)

    S (16 rows: the GS heads, zero past GS; 8 keys) = Q K^T      two mma a k-step of 16 dims
    O^T (16 dims; 8 heads) += V^T (16 dims; 16 keys) P^T        hd / 16 mma a tile

The mma's k index may run in any order as long as both operands agree, so each lane loads whole
16-byte words of a row and the fragments take them as they come (no shuffles, no shared memory):
  - S: lane (n = lane / 4, c = lane % 4) loads key n's words 4c + 16i .. 4c + 16i + 3, whose
    words are k-pairs c and 4 + c of k-steps 2i and 2i + 1; Q's fragment takes the same words
    of its head's row (lane / 4 is the head in A).
  - S's accumulators hold P's rows as the PV product's B wants them: lane (h, c) has head h at
    keys 2c, 2c + 1 (tile n8 of keys 0-7) and 8 + 2c, 9 + 2c (keys 8-15): exactly B's b0 and b1
    of P^T. So P never leaves its registers.
  - V^T's A fragment pairs two keys at one dim: lane (d, c) loads the rows of keys 2c, 2c + 1,
    2c + 8, 2c + 9 at words 4d + 32i + j, and prmt interleaves two keys' halves: word w's low
    dims (2w) make row d of mma (i, j), its high dims (2w + 1) row d + 8.
Softmax is online per head (a row of S: its 4 lanes meet by two shuffles), in fp32 on the
scaled scores; Q and P enter the mma rounded to bf16 (as the tensor-core prefill path,
cuda/attention_tc.py, rounds them), the row sums from the unrounded P.

grid (query tokens, nkv * G / GS, splits), 4 warps; split s takes keys [s * chunk, ...) with chunk a
multiple of 16, the warps its 16-key tiles in turn. Pages of a multiple of 16 keys (the
default 16) hold whole tiles: one block-table read a tile; other page sizes read each key's
page. The block's 4 warps merge through shared memory and write
the same partials as paged_attention, for attn_combine.
"""
import math

from numba import cuda, float32, uint32

from .attention import WARPS, merge_warps
from .common import FULL_MASK, inlined
from .ptx import cvt_bf16x2, ld_v4, mma_bf16, prmt

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "paged_attention_mma": (
        "f32*", "f32*", "f32*", "u32*", "u32*", "i32*", "i32*", "i32*", "i32*", "i32", "i32", "i32",
        "f32", "i32"),
}

TILE = 16                  # keys a warp takes at once
MAX_G = 8                  # query heads a block (the n8 of the PV mma)
NEG_INF = float32(-3.0e38)
LO = uint32(0x5410)        # prmt: the low halves of two words, the first's in the low half
HI = uint32(0x7632)        # ... the high halves


@inlined
def _row4(cache, row, live):
    # four words of a K/V row, zeros for a key past the split (its page may not exist)
    x0 = x1 = x2 = x3 = uint32(0)
    if live:
        x0, x1, x2, x3 = ld_v4(cache, row)
    return x0, x1, x2, x3


@inlined
def _slot(block_tables, tb, key, page_size, k1):
    # the pool row of a key (pages smaller than a tile, or not whole tiles); past the split: 0,
    # never loaded (a row's table may end there)
    sl = 0
    if key < k1:
        sl = block_tables[tb + key // page_size] * page_size + key % page_size
    return sl


def paged_attention_mma(hd, G, nkv, GS=0):
    # GS: query heads a block (a divisor of G, at most 8; 0 -> G): G / GS blocks a kv head, each
    # reading its K/V rows (kernel_set.attention_mma_group: also the merge in 48 KB of shared
    # memory)
    if GS == 0:
        GS = G
    assert hd % 64 == 0 and 1 <= GS <= MAX_G and G % GS == 0
    NSUB = G // GS
    HP = hd // 2          # words (bf16 pairs) a K/V row
    KQ = HP // 16         # 16-byte loads a lane a K row (two k-steps each)
    VQ = HP // 32         # 16-byte loads a lane a V row (four PV mma each)
    nh = G * nkv
    NK, NV, NO = 4 * KQ, 4 * VQ, 16 * VQ      # (local arrays take literal sizes)
    merge = merge_warps(GS, hd)

    def paged_attention_mma_kernel(part, ml, q, k_cache, v_cache, token_row, query_start,
                                   context_lens, block_tables, bt_stride, page_size, n_splits,
                                   scale, t_base):
        tl = cuda.blockIdx.x
        t = t_base + tl
        g = cuda.blockIdx.y // NSUB
        h0 = g * G + (cuda.blockIdx.y % NSUB) * GS     # the block's first query head
        s = cuda.blockIdx.z
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        rn = lane >> 2          # S: the head (A row) and key (B column); PV: the dim row
        c = lane & 3
        r = token_row[t]
        L = context_lens[r] + t - query_start[r] + 1
        chunk = ((L + n_splits - 1) // n_splits + TILE - 1) // TILE * TILE
        k0 = s * chunk
        k1 = min(L, k0 + chunk)
        # Q's A fragment: head h0 + rn's words 4c + 16i + j as bf16 pairs (zero rows past GS)
        qf = cuda.local.array(NK, uint32)
        for i in range(KQ):
            for j in range(4):
                x = uint32(0)
                if rn < GS:
                    e = (t * nh + h0 + rn) * hd + 2 * (4 * c + 16 * i + j)
                    x = cvt_bf16x2(q[e + 1], q[e])
                qf[4 * i + j] = x
        o = cuda.local.array(NO, float32)
        for i in range(NO):
            o[i] = float32(0.0)
        m = NEG_INF             # head rn's running max and (this lane's part of) its sum
        lsum = float32(0.0)
        ka = cuda.local.array(NK, uint32)
        kb = cuda.local.array(NK, uint32)
        va = cuda.local.array(NV, uint32)
        vb = cuda.local.array(NV, uint32)
        vc = cuda.local.array(NV, uint32)
        vd = cuda.local.array(NV, uint32)
        tb = r * bt_stride
        whole = page_size % TILE == 0       # a tile in one page: one block-table read
        kt = k0 + TILE * w
        while kt < k1:
            # the pool rows of the lane's keys: K rows of keys rn, 8 + rn; V rows of keys 2c,
            # 2c + 1, 2c + 8, 2c + 9 (tile offsets)
            if whole:
                slot = block_tables[tb + kt // page_size] * page_size + kt % page_size
                ra, rb = slot + rn, slot + 8 + rn
                r0, r1, r2, r3 = slot + 2 * c, slot + 2 * c + 1, slot + 2 * c + 8, slot + 2 * c + 9
            else:
                ra = _slot(block_tables, tb, kt + rn, page_size, k1)
                rb = _slot(block_tables, tb, kt + 8 + rn, page_size, k1)
                r0 = _slot(block_tables, tb, kt + 2 * c, page_size, k1)
                r1 = _slot(block_tables, tb, kt + 2 * c + 1, page_size, k1)
                r2 = _slot(block_tables, tb, kt + 2 * c + 8, page_size, k1)
                r3 = _slot(block_tables, tb, kt + 2 * c + 9, page_size, k1)
            # every load of the tile before any use
            for i in range(KQ):
                ka[4 * i], ka[4 * i + 1], ka[4 * i + 2], ka[4 * i + 3] = _row4(
                    k_cache, (ra * nkv + g) * HP + 4 * c + 16 * i, kt + rn < k1)
                kb[4 * i], kb[4 * i + 1], kb[4 * i + 2], kb[4 * i + 3] = _row4(
                    k_cache, (rb * nkv + g) * HP + 4 * c + 16 * i, kt + 8 + rn < k1)
            for i in range(VQ):
                wo = 4 * rn + 32 * i
                va[4 * i], va[4 * i + 1], va[4 * i + 2], va[4 * i + 3] = _row4(
                    v_cache, (r0 * nkv + g) * HP + wo, kt + 2 * c < k1)
                vb[4 * i], vb[4 * i + 1], vb[4 * i + 2], vb[4 * i + 3] = _row4(
                    v_cache, (r1 * nkv + g) * HP + wo, kt + 2 * c + 1 < k1)
                vc[4 * i], vc[4 * i + 1], vc[4 * i + 2], vc[4 * i + 3] = _row4(
                    v_cache, (r2 * nkv + g) * HP + wo, kt + 2 * c + 8 < k1)
                vd[4 * i], vd[4 * i + 1], vd[4 * i + 2], vd[4 * i + 3] = _row4(
                    v_cache, (r3 * nkv + g) * HP + wo, kt + 2 * c + 9 < k1)
            # S = Q K^T, keys 0-7 (a) and 8-15 (b) of the tile; rows 8-15 (d2, d3) are zero
            zero = uint32(0)
            s0 = s1 = s2 = s3 = float32(0.0)
            u0 = u1 = u2 = u3 = float32(0.0)
            for i in range(KQ):
                for h in range(2):
                    x = 4 * i + 2 * h
                    s0, s1, s2, s3 = mma_bf16(qf[x], zero, qf[x + 1], zero, ka[x], ka[x + 1],
                                              s0, s1, s2, s3)
                    u0, u1, u2, u3 = mma_bf16(qf[x], zero, qf[x + 1], zero, kb[x], kb[x + 1],
                                              u0, u1, u2, u3)
            # online softmax of head rn over keys kt + 2c, + 1, + 8, + 9 (past k1: -inf)
            s0 = s0 * scale if kt + 2 * c < k1 else NEG_INF
            s1 = s1 * scale if kt + 2 * c + 1 < k1 else NEG_INF
            u0 = u0 * scale if kt + 2 * c + 8 < k1 else NEG_INF
            u1 = u1 * scale if kt + 2 * c + 9 < k1 else NEG_INF
            mt = max(max(s0, s1), max(u0, u1))
            mt = max(mt, cuda.shfl_xor_sync(FULL_MASK, mt, 1))
            mt = max(mt, cuda.shfl_xor_sync(FULL_MASK, mt, 2))
            m_new = max(m, mt)              # finite: the tile has a key below k1
            corr = math.exp(m - m_new)
            p0 = math.exp(s0 - m_new)
            p1 = math.exp(s1 - m_new)
            p2 = math.exp(u0 - m_new)
            p3 = math.exp(u1 - m_new)
            lsum = lsum * corr + (p0 + p1) + (p2 + p3)
            m = m_new
            b0 = cvt_bf16x2(p1, p0)
            b1 = cvt_bf16x2(p3, p2)
            # O^T += V^T P^T: this lane's accumulators are heads 2c (d0, d2), 2c + 1 (d1, d3)
            ca = cuda.shfl_sync(FULL_MASK, corr, 8 * c)
            cb = cuda.shfl_sync(FULL_MASK, corr, 8 * c + 4)
            # word x of keys 2c / 2c + 1 (and 2c + 8 / 2c + 9): its dims 2w are row rn of mma
            # x, its dims 2w + 1 row rn + 8 (w = 4 rn + 32 i + j)
            for i in range(VQ):
                for j in range(4):
                    x = 4 * i + j
                    y = 4 * x
                    o[y], o[y + 1], o[y + 2], o[y + 3] = mma_bf16(
                        prmt(va[x], vb[x], LO), prmt(va[x], vb[x], HI),
                        prmt(vc[x], vd[x], LO), prmt(vc[x], vd[x], HI), b0, b1,
                        o[y] * ca, o[y + 1] * cb, o[y + 2] * ca, o[y + 3] * cb)
            kt += TILE * WARPS
        lsum += cuda.shfl_xor_sync(FULL_MASK, lsum, 1)
        lsum += cuda.shfl_xor_sync(FULL_MASK, lsum, 2)
        # the 4 warps' (max, sum, O) through shared memory, merged as paged_attention's are
        sh_m = cuda.shared.array((WARPS, MAX_G), float32)
        sh_l = cuda.shared.array((WARPS, MAX_G), float32)
        sh_o = cuda.shared.array((WARPS, GS, hd), float32)
        if c == 0:
            sh_m[w, rn] = m
            sh_l[w, rn] = lsum
        for i in range(VQ):
            for j in range(4):
                y = 4 * (4 * i + j)
                d = 2 * (4 * rn + 32 * i + j)
                if 2 * c < GS:
                    sh_o[w, 2 * c, d] = o[y]
                    sh_o[w, 2 * c, d + 1] = o[y + 2]
                if 2 * c + 1 < GS:
                    sh_o[w, 2 * c + 1, d] = o[y + 1]
                    sh_o[w, 2 * c + 1, d + 1] = o[y + 3]
        cuda.syncthreads()
        merge(part, ml, sh_m, sh_l, sh_o, tl * nh + h0, n_splits, s)
    return paged_attention_mma_kernel
