"""Gated delta rule for prefill, chunked (WY / UT transform), fp32 state and arithmetic.

The same recurrence as gdn.py (S <- exp(g) S; S <- S + k (beta (v - k^T S))^T; o = S^T q), a chunk
of Cn tokens at a time; ninfer/ops/delta_rule.py `gated_delta_chunked` is the numpy model. Within a
chunk (i, j its positions, G_i the cumulative log decay from the chunk start, in float64 so that
the differences G_i - G_j of large nearby values keep their precision):

    A[i, j] = beta_i k_i.k_j exp(G_i - G_j)  (j < i)     (I + A) U = beta V
                                                        (I + A) W = beta K exp(G)
    V' = U - W S ;  O = exp(G) (Q S) + P V'  with P[i, j] = q_i.k_j exp(G_i - G_j)  (j <= i)
    S <- exp(G_last) S + (K exp(G_last - G))^T V'

gdn_chunk_prep: one block per (row, value head, chunk), fully parallel. Writes U into `core` (the
output buffer: the scan reads each element before it writes the output there), W, P and the
per-token factors exp(G_i), exp(G_last - G_i).
gdn_chunk_scan: one block per (row, value head, VB value columns), sequential over the row's
chunks. Thread (cg, ks) keeps dk/KS state rows of columns cg + c*VB/NC (c < NC) in registers:
rows in groups of 4 adjacent ones interleaved over the KS lanes, so that one 16-byte shared load
reads a group's tile values and the KS lanes' loads of one tile row hit distinct banks; each tile
value read feeds NC columns; IB chunk rows go together so that their FMA chains and shuffle
reductions overlap (with IB x NC = 8 values over 8 lanes, a reduce-scatter: 7 shuffles, and each
lane stores one result). A chunk's W, U and P are staged in shared memory, then q, then the
decayed k reuse W's tile; each is loaded into registers while the phase before it computes (the
next chunk's W, U, P during the state update), so global latency hides behind the FMAs.
"""
import math

from numba import config, cuda, float32, float64, uint32

# 16-byte aligned tiles (ld.shared.v4); numba-cuda's CPU simulator refuses alignment= (and needs none)
TILE_ALIGN = None if config.ENABLE_CUDASIM else 16

from .common import FULL_MASK, inlined, sigmoid, softplus

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "gdn_chunk_prep": (
        "f32*", "f32*", "f32*", "f32*", "f32*", "f32*", "i32", "i32", "i32", "f32*", "f32*",
        "i32*"),
    "gdn_chunk_scan": ("f32*", "f32*", "f32*", "f32*", "f32*", "f32*", "i32*", "i32*", "i32*"),
}


@inlined
def reduce_scatter8(acc, ks):
    """Sum acc[0..8) over the 8 adjacent lanes ks = 0..7 (lane bits 4, 2, 1): lane ks ends with
    the total of value ks in acc[0]. Each level sends the half of the values the lane gives away
    and keeps the other: 4 + 2 + 1 shuffles instead of 8 x 3 for an all-reduce of each."""
    hi = (ks & 4) != 0
    for p in range(4):
        a = acc[p]
        b = acc[p + 4]
        acc[p] = (b if hi else a) + cuda.shfl_xor_sync(FULL_MASK, a if hi else b, 4)
    hi = (ks & 2) != 0
    for p in range(2):
        a = acc[p]
        b = acc[p + 2]
        acc[p] = (b if hi else a) + cuda.shfl_xor_sync(FULL_MASK, a if hi else b, 2)
    hi = (ks & 1) != 0
    a = acc[0]
    b = acc[1]
    acc[0] = (b if hi else a) + cuda.shfl_xor_sync(FULL_MASK, a if hi else b, 1)


@inlined
def chunk_gates(G, eg, bt, gbuf, proj, proj_stride, a_off, b_off, a_log, dt_bias, t0, L, h, nv,
                tid, cn):
    """A chunk's gates (threads < cn, one token each; the whole block calls it): beta into bt,
    the cumulative log decay G in float64 (one thread: a sequential sum), then exp(G) into eg and
    the per-token factors exp(G_i), exp(G_last - G_i) into gbuf. Rows past L get zero gates."""
    if tid < cn:
        gv = float32(0.0)
        bv = float32(0.0)
        if tid < L:
            t = t0 + tid
            # the same fp32 gate as gdn_recurrent
            gv = -math.exp(a_log[h]) * softplus(proj[t * proj_stride + a_off + h] + dt_bias[h])
            bv = sigmoid(proj[t * proj_stride + b_off + h])
        eg[tid] = gv
        bt[tid] = bv
    cuda.syncthreads()
    if tid == 0:
        acc = float64(0.0)
        for i in range(cn):
            acc += float64(eg[i])
            G[i] = acc
    cuda.syncthreads()
    if tid < cn:
        e = float32(0.0)
        if tid < L:
            gb = ((t0 + tid) * nv + h) * 2
            e = math.exp(float32(G[tid]))
            gbuf[gb] = e
            gbuf[gb + 1] = math.exp(float32(G[L - 1] - G[tid]))
        eg[tid] = e              # eg now holds exp(G) (the cumulative sum above has read it)


def gdn_chunk_prep(dk, dv, nk, nv, Cn, NT, KT):
    C = 2 * nk * dk + nv * dv
    ratio = nv // nk
    KP = KT + 1                      # padded slice rows: column j of a warp's pairs hits bank j
    NSL = (dk + KT - 1) // KT
    PPT = (Cn * Cn + NT - 1) // NT   # (i, j) pairs per thread
    assert NT >= Cn
    CC = Cn * Cn                     # shared/local array sizes must be compile-time constants
    CKP = Cn * KP
    NLD = (Cn * KT + NT - 1) // NT   # slice elements each thread loads
    NCOL = (dv + dk + NT - 1) // NT  # right-hand-side columns per thread

    def gdn_chunk_prep_kernel(core, wbuf, pbuf, gbuf, qkv, proj, proj_stride, a_off, b_off,
                              a_log, dt_bias, query_start):
        r = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        t0 = query_start[r] + cuda.blockIdx.z * Cn
        t1 = query_start[r + 1]
        if t0 >= t1:
            return                   # whole block: the row has fewer chunks
        L = min(Cn, t1 - t0)
        kh = h // ratio
        G = cuda.shared.array(Cn, float64)
        gl = cuda.shared.array(Cn, float32)
        bt = cuda.shared.array(Cn, float32)
        A = cuda.shared.array(CC, float32)
        qt = cuda.shared.array(CKP, float32)
        kt = cuda.shared.array(CKP, float32)
        chunk_gates(G, gl, bt, gbuf, proj, proj_stride, a_off, b_off, a_log, dt_bias, t0, L, h,
                    nv, tid, Cn)

        # k_i.k_j and q_i.k_j for j <= i, over dk in slices of KT columns
        accA = cuda.local.array(PPT, float32)
        accP = cuda.local.array(PPT, float32)
        for s in range(PPT):
            accA[s] = float32(0.0)
            accP[s] = float32(0.0)
        for sl in range(NSL):
            k0 = sl * KT
            for u in range(NLD):
                e = tid + u * NT
                i = e // KT
                c = e - i * KT
                qv = float32(0.0)
                kv = float32(0.0)
                if i < L and k0 + c < dk:
                    base = (t0 + i) * C + kh * dk + k0 + c
                    qv = qkv[base]
                    kv = qkv[base + nk * dk]
                if i < Cn:
                    qt[i * KP + c] = qv
                    kt[i * KP + c] = kv
            cuda.syncthreads()
            for s in range(PPT):
                e = tid + s * NT
                if e < Cn * Cn:
                    i = e // Cn
                    j = e - i * Cn
                    if j <= i and i < L:
                        a0 = float32(0.0)
                        p0 = float32(0.0)
                        for c in range(KT):
                            kj = kt[j * KP + c]
                            a0 += kt[i * KP + c] * kj
                            p0 += qt[i * KP + c] * kj
                        accA[s] += a0
                        accP[s] += p0
            cuda.syncthreads()
        for s in range(PPT):
            e = tid + s * NT
            if e < Cn * Cn:
                i = e // Cn
                j = e - i * Cn
                av = float32(0.0)
                pv = float32(0.0)
                if j <= i and i < L:
                    dec = math.exp(float32(G[i] - G[j]))      # exponent <= 0: no overflow
                    pv = accP[s] * dec
                    if j < i:
                        av = bt[i] * accA[s] * dec
                A[e] = av
                if i < L:
                    pbuf[((t0 + i) * nv + h) * Cn + j] = pv
        cuda.syncthreads()

        # (I + A) X = B by forward substitution, one right-hand-side column per thread:
        # columns [0, dv) are beta v (-> U, into core), [dv, dv + dk) beta k exp(G) (-> W).
        # The column is loaded whole first (all loads in flight); rows past L stay zero (their
        # A rows are zero)
        X = cuda.local.array(Cn, float32)
        for cc in range(NCOL):
            col = tid + cc * NT
            for i in range(Cn):
                x = float32(0.0)
                if col < dv + dk and i < L:
                    t = t0 + i
                    if col < dv:
                        x = bt[i] * qkv[t * C + 2 * nk * dk + h * dv + col]
                    else:
                        x = bt[i] * gl[i] * qkv[t * C + nk * dk + kh * dk + col - dv]
                X[i] = x
            for i in range(1, Cn):
                x0 = X[i]
                x1 = float32(0.0)
                for j in range(0, i - 1, 2):       # two accumulators: halves the FMA chain
                    x0 -= A[i * Cn + j] * X[j]
                    x1 -= A[i * Cn + j + 1] * X[j + 1]
                if i % 2 == 1:
                    x0 -= A[i * Cn + i - 1] * X[i - 1]
                X[i] = x0 + x1
            if col < dv + dk:
                for i in range(L):
                    t = t0 + i
                    if col < dv:
                        core[t * nv * dv + h * dv + col] = X[i]
                    else:
                        wbuf[(t * nv + h) * dk + col - dv] = X[i]
    return gdn_chunk_prep_kernel


def gdn_chunk_scan(dk, dv, nk, nv, Cn, VB, NC, KS, IB):
    C = 2 * nk * dk + nv * dv
    ratio = nv // nk
    SL = dk // KS                    # state rows per thread
    CG = VB // NC                    # column groups per block: thread columns cg + c * CG
    NT = CG * KS
    assert dk % KS == 0 and VB % NC == 0 and NT >= Cn and NT % 32 == 0 and Cn % IB == 0
    assert KS in (4, 8)
    # a thread's state rows come in groups of GS adjacent rows (rows m of group mg:
    # mg * GS * KS + ks * GS + q): the GS tile values of a group are one 16-byte shared load
    GS = 4 if SL % 4 == 0 else 1
    GK = GS * KS
    RS8 = KS == 8 and IB * NC == 8   # reduce-scatter: lane ks finishes value ks (u, c)
    # shared/local array sizes must be compile-time constants
    TILE = Cn * dk
    VNS = Cn * VB
    PTS = Cn * Cn
    SLN = SL * NC
    ACC = IB * NC
    NTILE = (TILE + NT - 1) // NT    # tile elements per thread (held in registers in flight)
    NVN = (VNS + NT - 1) // NT
    NPT = (PTS + NT - 1) // NT

    @inlined
    def prefetch_chunk(bt, bu, bp, wbuf, core, pbuf, gbuf, t0, q1, h, vb, tid):
        """The chunk at token t0 (of a row ending at q1): this thread's share of W, U and P into
        the registers bt, bu, bp, and its row's decay factors (exp(G_i), exp(G_last - G_i))
        returned. Rows past the chunk's length load as zeros, so every product over the padded
        rows stays finite (and zero where it is used)."""
        L = min(Cn, q1 - t0)
        for u in range(NTILE):
            e = tid + u * NT
            i = e // dk
            x = float32(0.0)
            if i < L:
                x = wbuf[((t0 + i) * nv + h) * dk + e - i * dk]
            bt[u] = x
        for u in range(NVN):
            e = tid + u * NT
            i = e // VB
            x = float32(0.0)
            if i < L:
                x = core[(t0 + i) * nv * dv + h * dv + min(vb + e - i * VB, dv - 1)]
            bu[u] = x
        for u in range(NPT):
            e = tid + u * NT
            i = e // Cn
            x = float32(0.0)
            if i < L:
                x = pbuf[((t0 + i) * nv + h) * Cn + e - i * Cn]
            bp[u] = x
        gx = float32(0.0)
        gy = float32(0.0)
        if tid < L:
            gx = gbuf[((t0 + tid) * nv + h) * 2]
            gy = gbuf[((t0 + tid) * nv + h) * 2 + 1]
        return gx, gy

    def gdn_chunk_scan_kernel(core, wbuf, pbuf, gbuf, qkv, state, query_start, context_lens,
                              state_slots):
        r = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        cg = tid // KS
        ks = tid & (KS - 1)
        kso = ks * GS                # the thread's first row within each group
        # unsigned tile offsets: numba's negative-index wrap is then provably dead, which lets
        # LLVM merge a group's GS adjacent loads into one ld.shared.v4
        ukso = uint32(kso)
        vb = cuda.blockIdx.z * VB
        v0 = vb + cg
        kh = h // ratio
        tile = cuda.shared.array(TILE, float32, alignment=TILE_ALIGN)   # W, q, k exp(G_last - G)
        vn = cuda.shared.array(VNS, float32)      # U, then V' (in place)
        pt = cuda.shared.array(PTS, float32)
        gq = cuda.shared.array(Cn, float32)
        gk = cuda.shared.array(Cn, float32)
        S = cuda.local.array(SLN, float32)
        acc = cuda.local.array(ACC, float32)
        vj = cuda.local.array(NC, float32)
        # next tile's values, loaded while the current phase computes (software pipeline)
        bt = cuda.local.array(NTILE, float32)
        bu = cuda.local.array(NVN, float32)
        bp = cuda.local.array(NPT, float32)
        slot = state_slots[r]
        sbase = (slot * nv + h) * dk * dv
        fresh = context_lens[r] == 0
        for m in range(SL):
            for c in range(NC):
                # columns past dv (dv < VB) follow a real column's values, never stored
                vc = min(v0 + c * CG, dv - 1)
                if fresh:
                    S[m * NC + c] = float32(0.0)
                else:
                    S[m * NC + c] = state[sbase + ((m // GS) * GK + kso + m % GS) * dv + vc]
        q0 = query_start[r]
        q1 = query_start[r + 1]
        # the first chunk's W, U, P and decay factors
        gx, gy = prefetch_chunk(bt, bu, bp, wbuf, core, pbuf, gbuf, q0, q1, h, vb, tid)
        for t0 in range(q0, q1, Cn):
            L = min(Cn, q1 - t0)
            for u in range(NTILE):
                e = tid + u * NT
                if e < TILE:
                    tile[e] = bt[u]
            for u in range(NVN):
                e = tid + u * NT
                if e < VNS:
                    vn[e] = bu[u]
            for u in range(NPT):
                e = tid + u * NT
                if e < PTS:
                    pt[e] = bp[u]
            if tid < Cn:
                gq[tid] = gx
                gk[tid] = gy
            cuda.syncthreads()
            for u in range(NTILE):           # q, in flight during V'
                e = tid + u * NT
                i = e // dk
                x = float32(0.0)
                if i < L:
                    x = qkv[(t0 + i) * C + kh * dk + e - i * dk]
                bt[u] = x
            # V' = U - W S, IB rows at a time (independent FMA chains and shuffles)
            for i0 in range(0, L, IB):
                for x in range(ACC):
                    acc[x] = float32(0.0)
                for m in range(SL):
                    for u in range(IB):
                        wv = tile[uint32(i0 + u) * uint32(dk) + ukso + (m // GS) * GK + m % GS]
                        for c in range(NC):
                            acc[u * NC + c] += wv * S[m * NC + c]
                if RS8:
                    reduce_scatter8(acc, ks)
                    vn[(i0 + ks // NC) * VB + cg + (ks % NC) * CG] -= acc[0]
                else:
                    off = 1
                    while off < KS:
                        for x in range(ACC):
                            acc[x] += cuda.shfl_xor_sync(FULL_MASK, acc[x], off)
                        off *= 2
                    if ks == 0:
                        for u in range(IB):
                            for c in range(NC):
                                vn[(i0 + u) * VB + cg + c * CG] -= acc[u * NC + c]
            cuda.syncthreads()
            for u in range(NTILE):
                e = tid + u * NT
                if e < TILE:
                    tile[e] = bt[u]
            cuda.syncthreads()
            for u in range(NTILE):           # k, in flight during O
                e = tid + u * NT
                i = e // dk
                x = float32(0.0)
                if i < L:
                    x = qkv[(t0 + i) * C + nk * dk + kh * dk + e - i * dk]
                bt[u] = x
            # O = exp(G) (Q S) + P V'  (P's columns split over the KS lanes; P[i, j > i] = 0)
            for i0 in range(0, L, IB):
                for x in range(ACC):
                    acc[x] = float32(0.0)
                for m in range(SL):
                    for u in range(IB):
                        qv = tile[uint32(i0 + u) * uint32(dk) + ukso + (m // GS) * GK + m % GS]
                        for c in range(NC):
                            acc[u * NC + c] += qv * S[m * NC + c]
                for u in range(IB):
                    gi = gq[i0 + u]
                    for c in range(NC):
                        acc[u * NC + c] *= gi
                for j in range(ks, i0 + IB, KS):
                    for c in range(NC):
                        vj[c] = vn[j * VB + cg + c * CG]
                    for u in range(IB):
                        pij = pt[(i0 + u) * Cn + j]
                        for c in range(NC):
                            acc[u * NC + c] += pij * vj[c]
                if RS8:
                    reduce_scatter8(acc, ks)
                    v = v0 + (ks % NC) * CG
                    if i0 + ks // NC < L and v < dv:
                        core[(t0 + i0 + ks // NC) * nv * dv + h * dv + v] = acc[0]
                else:
                    off = 1
                    while off < KS:
                        for x in range(ACC):
                            acc[x] += cuda.shfl_xor_sync(FULL_MASK, acc[x], off)
                        off *= 2
                    if ks == 0:
                        for u in range(IB):
                            if i0 + u < L:
                                for c in range(NC):
                                    if v0 + c * CG < dv:
                                        core[(t0 + i0 + u) * nv * dv + h * dv + v0 + c * CG] = \
                                            acc[u * NC + c]
            cuda.syncthreads()
            for u in range(NTILE):
                e = tid + u * NT
                if e < TILE:
                    tile[e] = bt[u] * gk[e // dk]
            cuda.syncthreads()
            # the next chunk's W, U, P and factors, in flight during the state update (after the
            # last chunk it has no rows: nothing loads)
            gx, gy = prefetch_chunk(bt, bu, bp, wbuf, core, pbuf, gbuf, t0 + Cn, q1, h, vb, tid)
            # S <- exp(G_last) S + (K exp(G_last - G))^T V'
            decay = gq[L - 1]
            for m in range(SLN):
                S[m] = S[m] * decay
            for i in range(L):
                for c in range(NC):
                    vj[c] = vn[i * VB + cg + c * CG]
                for m in range(SL):
                    kv = tile[uint32(i) * uint32(dk) + ukso + (m // GS) * GK + m % GS]
                    for c in range(NC):
                        S[m * NC + c] += kv * vj[c]
            cuda.syncthreads()       # the next chunk overwrites tile, vn, pt, gq, gk
        for m in range(SL):
            for c in range(NC):
                v = v0 + c * CG
                if v < dv:
                    state[sbase + ((m // GS) * GK + kso + m % GS) * dv + v] = S[m * NC + c]
    return gdn_chunk_scan_kernel
