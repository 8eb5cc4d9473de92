"""Gated delta rule for prefill, chunked, on tensor cores: gdn_chunk.py's WY / UT form with every
product a warp mma (mma.sync m16n8k8, tf32 operands, fp32 accumulators and state).

The same chunk algebra as gdn_chunk.py (i, j positions in a chunk of Cn tokens, G the cumulative
log decay from the chunk start, in float64):

    A[i, j] = beta_i k_i.k_j exp(G_i - G_j)  (j < i)     T = (I + A)^-1
    U = T (beta V)     W = T (beta K exp(G))
    V' = U - W S ;  O = exp(G) (Q S) + P V'  with P[i, j] = q_i.k_j exp(G_i - G_j)  (j <= i)
    S <- exp(G_last) S + (K exp(G_last - G))^T V'

A block has Cn / 16 warps; warp w owns chunk rows [16w, 16w + 16) of every product whose rows are
chunk positions, and state rows 16 (w + NW u) .. + 16 of the state update.

gdn_chunk_prep_tc: grid (row, value head, chunk), fully parallel. K K^T and Q K^T on the tensor
cores (only the tiles left of the diagonal), A and P formed with the decays, T in fp32 by
16 x 16 blocks (the diagonal ones by forward substitution, the rest from the rows above), then
U (into `core`, in place of the output) and W as T times the scaled V and K tiles. Writes P and
the per-token decay factors. The mma operands from global memory (K and Q, then each group's V
or K columns) are staged in shared memory by 16-byte loads, a stage's loads all in flight at
once (bit-identical to loading each fragment where used, on the simulator).
The scan over the chunks in two passes, since a sequential pass is latency-bound (~17 us a
chunk at 4 warps an SM) and only S's recurrence needs one:
gdn_chunk_state_tc: grid (row, value head, VB value columns: 32, 16 or 8), sequential over the
row's chunks. The state slice S [dk, VB] lives in the warps' accumulator registers; each chunk
stages it in shared memory as the B operand of W S, writes V' = U - W S to shared memory (and
over U in `core`) for the update, accumulates (K exp(G_last - G))^T V' into the registers, and
writes the chunk's starting state S_c to `sbuf` (chunk slot qs[r] // Cn + r + z: at most
n / Cn + rows slots).
gdn_chunk_out_tc: grid (row, value head, chunk x VB value columns), fully parallel: O =
exp(G) (Q S_c) + P V' over V' in place (staged in shared memory before O is written).

Rows past a chunk's length load as zeros (their products vanish) and are never stored: the
next row's tokens follow them in every buffer. tf32 keeps 10 mantissa bits of each operand
(relative error 2^-11, an eighth of bf16's 2^-8): the bf16 model's path; dtype="float32" keeps
the fp32 kernels of gdn_chunk.py.
"""
import math

from numba import cuda, float32, float64, uint32

from .common import inlined
from .gdn_chunk import chunk_gates
from .ptx import ld_v4_f32, mma_tf32, tf32



def row_stride(vb):
    """S / V' row stride for VB value columns: B-fragment loads (rows t, columns g) hit 32
    distinct banks when it is 8 or 24 mod 32."""
    return vb + 8 if (vb + 8) % 16 == 8 else vb + 16
GROUP = 32               # columns of U / W per pass of the prep (4 n-tiles of 8)

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "gdn_chunk_prep_tc": (
        "f32*", "f32*", "f32*", "f32*", "f32*", "f32*", "i32", "i32", "i32", "f32*", "f32*",
        "i32*"),
    "gdn_chunk_state_tc": ("f32*", "f32*", "f32*", "f32*", "f32*", "f32*", "i32*", "i32*",
                           "i32*"),
    "gdn_chunk_out_tc": ("f32*", "f32*", "f32*", "f32*", "f32*", "i32*"),
}


@inlined
def chunk_slot(q0, r, z, Cn):
    """The S_c slot of chunk z of row r (its tokens from q0 = query_start[r]): distinct for
    every chunk of a call, below n // Cn + rows (cuda/gdn_chunk.py state_slots)."""
    return q0 // Cn + r + z


@inlined
def mma_acc(acc, o, a0, a1, a2, a3, b0, b1):
    """acc[o .. o + 4) += A B: one m16n8k8 tf32 mma into accumulators held in a local array."""
    d0, d1, d2, d3 = mma_tf32(a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
    acc[o] = d0
    acc[o + 1] = d1
    acc[o + 2] = d2
    acc[o + 3] = d3


@inlined
def ld_tf32(p, i, ok):
    """p[i] as a tf32 operand, or 0 where the row lies past the chunk (then p[i] is not read)."""
    x = uint32(0)
    if ok:
        x = tf32(p[i])
    return x


def staged_loads(ST, SR):
    """An inlined loader of a stage of rows into registers: ST 16-byte loads a thread, every one
    issued before any is used, rows sr + u SR (u < ST; zeros from row L on) at columns sc ..
    sc + 3 of src[base + row * stride ..] into regs[4u .. 4u + 4). (ST and SR are constants of
    the kernel: its loops unroll and regs stays in registers.)"""
    @inlined
    def load(regs, src, base, stride, L, sr, sc):
        for u in range(ST):
            i = sr + u * SR
            x0 = float32(0.0)
            x1 = float32(0.0)
            x2 = float32(0.0)
            x3 = float32(0.0)
            if i < L:
                x0, x1, x2, x3 = ld_v4_f32(src, base + i * stride + sc)
            regs[4 * u] = x0
            regs[4 * u + 1] = x1
            regs[4 * u + 2] = x2
            regs[4 * u + 3] = x3
    return load


def gdn_chunk_prep_tc(dk, dv, nk, nv, Cn):
    C = 2 * nk * dk + nv * dv
    ratio = nv // nk
    assert Cn % 16 == 0 and dk % GROUP == 0 and dv % GROUP == 0
    TS = Cn + 4              # A / T row stride: a fragment's (g, t) loads hit 32 distinct banks
    CT = Cn // 8             # n-tiles of K K^T (chunk columns); k-steps of T X (chunk positions)
    GU = dv // GROUP
    GW = dk // GROUP
    TT = Cn * TS             # shared/local array sizes must be compile-time constants
    ACC = CT * 4
    NT = 2 * Cn              # a warp per 16 chunk rows
    XSZ = max(256, (Cn // 16 - 1) * 256)       # X of one block row of T (below its diagonal)
    XU = -(-XSZ // NT)
    GACC = GROUP // 8 * 4
    # the chunk's operands are staged in shared memory with 16-byte loads, every load of a
    # stage in flight at once, before the mma loops read their fragments there: K and Q in
    # passes of KP columns (over A's and T's space, free until A is formed), each group's scaled
    # V or K columns (over A's space, free once T is formed). Loaded where used, fragment by
    # fragment from global memory (8 rows of 16 bytes a warp load, each tile's B operand again
    # by every warp), the loads' latency was most of this kernel's time.
    KP = GROUP               # K / Q columns a pass (a multiple of 8; dk a multiple of it)
    KS = KP + 4              # staged K / Q row stride: fragment loads (rows g, columns t) hit
                             # 32 distinct banks (4 mod 32)
    BS = GROUP + 8           # staged B row stride (rows t, columns g: 8 mod 32)
    TA = max(TT, Cn * BS)    # T's offset: past A and a group's staged B (which go over A)
    SH = TA + TT             # A, T (and the staging over them)
    ST = Cn * KP // 4 // NT  # 16-byte loads a thread a stage (a pass's K or Q, a group's B)
    LST = 4 * ST             # (array sizes: names of the factory, not expressions)
    assert Cn * KS <= TA and ST * NT * 4 == Cn * KP and dk % KP == 0
    SR = NT // (KP // 4)     # rows between a thread's loads
    load = staged_loads(ST, SR)

    def gdn_chunk_prep_tc_kernel(core, wbuf, pbuf, gbuf, qkv, proj, proj_stride, a_off, b_off,
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
        eg = cuda.shared.array(Cn, float32)
        bt = cuda.shared.array(Cn, float32)
        sh = cuda.shared.array(SH, float32)    # A at 0, T at TA
        sX = cuda.shared.array(XSZ, float32)
        # (the first staging barrier below also orders chunk_gates' writes before their reads)
        chunk_gates(G, eg, bt, gbuf, proj, proj_stride, a_off, b_off, a_log, dt_bias, t0, L, h,
                    nv, tid, Cn)

        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        i0 = (tid >> 5) * 16         # this warp's chunk rows
        ia = i0 + g
        ib = ia + 8
        ko = nk * dk                 # k follows q in a qkv row
        sr = tid // (KP // 4)        # the staged row and 4 columns of this thread's first load
        sc = (tid % (KP // 4)) * 4   # (a K / Q pass's and a U / W group's: GROUP = KP)
        lk = cuda.local.array(LST, float32)
        lq = cuda.local.array(LST, float32)

        # K K^T and Q K^T for the warp's rows, the tiles left of (and on) the diagonal block;
        # K at sh[0 ..), Q at sh[TA ..), rows past the chunk's length staged as zeros
        accK = cuda.local.array(ACC, float32)
        accQ = cuda.local.array(ACC, float32)
        for x in range(ACC):
            accK[x] = float32(0.0)
            accQ[x] = float32(0.0)
        for kp in range(dk // KP):
            row = t0 * C + kh * dk + kp * KP
            load(lk, qkv, row + ko, C, L, sr, sc)
            load(lq, qkv, row, C, L, sr, sc)
            cuda.syncthreads()       # (the last pass's fragments are read)
            for u in range(ST):
                at = (sr + u * SR) * KS + sc
                for e in range(4):
                    sh[at + e] = lk[4 * u + e]
                    sh[TA + at + e] = lq[4 * u + e]
            cuda.syncthreads()
            for ks in range(KP // 8):
                c = ks * 8 + t
                k0 = tf32(sh[ia * KS + c])
                k1 = tf32(sh[ib * KS + c])
                k2 = tf32(sh[ia * KS + c + 4])
                k3 = tf32(sh[ib * KS + c + 4])
                q0 = tf32(sh[TA + ia * KS + c])
                q1 = tf32(sh[TA + ib * KS + c])
                q2 = tf32(sh[TA + ia * KS + c + 4])
                q3 = tf32(sh[TA + ib * KS + c + 4])
                for nt in range(CT):
                    if nt * 8 <= i0 + 15:                    # warp-uniform
                        j = nt * 8 + g
                        b0 = tf32(sh[j * KS + c])
                        b1 = tf32(sh[j * KS + c + 4])
                        mma_acc(accK, 4 * nt, k0, k1, k2, k3, b0, b1)
                        mma_acc(accQ, 4 * nt, q0, q1, q2, q3, b0, b1)
        cuda.syncthreads()           # (the staged K and Q are read: A and T go over them)
        # A (strictly lower, into shared) and P (lower with the diagonal, to pbuf) with decays
        for nt in range(CT):
            for e in range(4):
                i = ia + 8 * (e // 2)
                j = nt * 8 + 2 * t + (e % 2)
                av = float32(0.0)
                pv = float32(0.0)
                if i < L and j <= i:
                    dec = math.exp(float32(G[i] - G[j]))          # exponent <= 0: no overflow
                    pv = accQ[4 * nt + e] * dec
                    if j < i:
                        av = bt[i] * accK[4 * nt + e] * dec
                sh[i * TS + j] = av
                if i < L:
                    pbuf[((t0 + i) * nv + h) * Cn + j] = pv
        cuda.syncthreads()

        # T = (I + A)^-1 in 16 x 16 blocks (fp32): the diagonal blocks by forward substitution,
        # a thread a column of one (a chain of at most 15 FMAs); then block row bi from the rows
        # above it: T[bi, bj] = -T[bi, bi] X with X = sum_{bj <= k < bi} A[bi, k] T[k, bj], every
        # element its own short sum (a substitution over all Cn rows, a column a thread, was 45%
        # of this kernel's time)
        if tid < Cn:
            r0 = (tid >> 4) * 16
            c = tid & 15
            for rr in range(16):
                v = float32(0.0)
                for q in range(rr):              # the column's rows above, written just now
                    v += sh[(r0 + rr) * TS + r0 + q] * sh[TA + (r0 + q) * TS + r0 + c]
                x = float32(0.0)
                if rr > c:
                    x = -v
                elif rr == c:
                    x = float32(1.0)
                sh[TA + (r0 + rr) * TS + r0 + c] = x
            for rr in range(Cn):
                if rr < r0:
                    sh[TA + rr * TS + r0 + c] = float32(0.0)     # above the diagonal block
        cuda.syncthreads()
        for bi in range(1, Cn // 16):
            for u in range(XU):
                e = tid + u * NT
                if e < bi * 256:
                    bj = e >> 8
                    rr = (e >> 4) & 15
                    c = e & 15
                    x = float32(0.0)
                    # (k from bj * 16 to bi * 16 in constant blocks of 16: each block's loads
                    # issue together, not one FMA's pair per shared-memory round trip)
                    for kb in range(Cn // 16 - 1):
                        if kb >= bj and kb < bi:                 # warp-uniform
                            for q in range(16):
                                k = kb * 16 + q
                                x += sh[(bi * 16 + rr) * TS + k] * sh[TA + k * TS + bj * 16 + c]
                    sX[e] = x
            cuda.syncthreads()
            for u in range(XU):
                e = tid + u * NT
                if e < bi * 256:
                    bj = e >> 8
                    rr = (e >> 4) & 15
                    c = e & 15
                    x = float32(0.0)
                    for q in range(16):
                        x += sh[TA + (bi * 16 + rr) * TS + bi * 16 + q] * sX[bj * 256 + q * 16 + c]
                    sh[TA + (bi * 16 + rr) * TS + bj * 16 + c] = -x
            cuda.syncthreads()

        # U = T (beta V) into core, W = T (beta exp(G) K) into wbuf, GROUP columns a pass: the
        # group's scaled columns staged at sh[0 ..) (A is no longer read), rows past L as zeros
        acc = cuda.local.array(GACC, float32)
        for grp in range(GU + GW):
            if grp < GU:
                col = 2 * nk * dk + h * dv + grp * GROUP
            else:
                col = ko + kh * dk + (grp - GU) * GROUP
            load(lk, qkv, t0 * C + col, C, L, sr, sc)
            cuda.syncthreads()       # (T is formed; the last group's B is read)
            for u in range(ST):
                i = sr + u * SR
                f = bt[i]
                if grp >= GU:
                    f = bt[i] * eg[i]
                for e in range(4):
                    sh[i * BS + sc + e] = f * lk[4 * u + e]
            cuda.syncthreads()
            for x in range(GACC):
                acc[x] = float32(0.0)
            for ks in range(CT):
                if ks * 8 <= i0 + 15:                    # T is lower triangular
                    c = ks * 8 + t
                    a0 = tf32(sh[TA + ia * TS + c])
                    a1 = tf32(sh[TA + ib * TS + c])
                    a2 = tf32(sh[TA + ia * TS + c + 4])
                    a3 = tf32(sh[TA + ib * TS + c + 4])
                    for nt in range(GROUP // 8):
                        b0 = tf32(sh[c * BS + nt * 8 + g])
                        b1 = tf32(sh[(c + 4) * BS + nt * 8 + g])
                        mma_acc(acc, 4 * nt, a0, a1, a2, a3, b0, b1)
            for nt in range(GROUP // 8):
                for e in range(4):
                    i = ia + 8 * (e // 2)
                    cc = nt * 8 + 2 * t + (e % 2)
                    if i < L:
                        if grp < GU:
                            core[(t0 + i) * nv * dv + h * dv + grp * GROUP + cc] = acc[4 * nt + e]
                        else:
                            wbuf[((t0 + i) * nv + h) * dk + (grp - GU) * GROUP + cc] = \
                                acc[4 * nt + e]
    return gdn_chunk_prep_tc_kernel


def gdn_chunk_state_tc(dk, dv, nk, nv, Cn, VB=32):
    """The sequential pass of the scan. Per chunk: S_c to sbuf and shared memory, V' = U - W S
    into shared memory and over U in `core`, then S <- exp(G_last) S + (K exp(G_last - G))^T V'.
    The final state to `state`. The loads that do not depend on the state are issued early,
    into registers: the next chunk's W fragments while this chunk's update runs, this chunk's U,
    key factors, decay and K before its first barrier (U, the factors and the decay had been
    loaded where used, three global round trips on each chunk's chain). Measured on an H100 at
    4096 tokens (bench_gdn_chunk.py), with the early W and K: without them this pass took 3x
    the time of the one sequential kernel it replaced (Q S, P V' and O in the same loop); with
    them the two passes take 0.87x (48 heads) to 0.54x (16 heads) of it, and 1.05x at 512
    tokens."""
    C = 2 * nk * dk + nv * dv
    ratio = nv // nk
    NW = Cn // 16
    assert Cn % 16 == 0 and dk % (16 * NW) == 0 and dv % VB == 0 and VB % 8 == 0
    SS = row_stride(VB)
    MT = dk // (16 * NW)     # state m-tiles per warp
    NT4 = VB // 8            # n-tiles of the value columns
    KST = dk // 8
    CT = Cn // 8
    SSZ = dk * SS
    VSZ = Cn * SS
    SREG = MT * NT4 * 4
    ACC = NT4 * 4
    WF = 4 * KST             # W fragments of a chunk (tf32 bits)
    KF = 4 * CT * MT         # K fragments of a chunk (fp32, scaled at use)

    @inlined
    def load_w(wf, wbuf, c0, L, h, ia, ib, t):
        wa = ((c0 + ia) * nv + h) * dk
        wb = ((c0 + ib) * nv + h) * dk
        for ks in range(KST):
            c = ks * 8 + t
            wf[4 * ks] = ld_tf32(wbuf, wa + c, ia < L)
            wf[4 * ks + 1] = ld_tf32(wbuf, wb + c, ib < L)
            wf[4 * ks + 2] = ld_tf32(wbuf, wa + c + 4, ia < L)
            wf[4 * ks + 3] = ld_tf32(wbuf, wb + c + 4, ib < L)

    def gdn_chunk_state_tc_kernel(core, wbuf, sbuf, gbuf, qkv, state, query_start,
                                  context_lens, state_slots):
        r = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        vb = cuda.blockIdx.z * VB
        kh = h // ratio
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        i0 = warp * 16
        ia = i0 + g
        ib = ia + 8
        sS = cuda.shared.array(SSZ, float32)
        sV = cuda.shared.array(VSZ, float32)
        gk = cuda.shared.array(Cn, float32)
        Sr = cuda.local.array(SREG, float32)       # the state slice, as mma accumulators
        accV = cuda.local.array(ACC, float32)
        uf = cuda.local.array(ACC, float32)         # this chunk's U at the accumulators' places
        wf = cuda.local.array(WF, uint32)
        kf = cuda.local.array(KF, float32)
        slot = state_slots[r]
        sbase = (slot * nv + h) * dk * dv + vb
        fresh = context_lens[r] == 0
        for u in range(MT):
            for nt in range(NT4):
                for e in range(4):
                    row = (warp + NW * u) * 16 + g + 8 * (e // 2)
                    x = float32(0.0)
                    if not fresh:
                        x = state[sbase + row * dv + nt * 8 + 2 * t + (e % 2)]
                    Sr[(u * NT4 + nt) * 4 + e] = x
        q0 = query_start[r]
        q1 = query_start[r + 1]
        hv = h * dv + vb
        load_w(wf, wbuf, q0, min(Cn, q1 - q0), h, ia, ib, t)
        for c0 in range(q0, q1, Cn):
            L = min(Cn, q1 - c0)
            # the chunk's state-independent loads first, in flight while S_c is written and
            # W S runs: U (for V' = U - W S), the key factors, the chunk's decay
            for nt in range(NT4):
                for e in range(4):
                    i = ia + 8 * (e // 2)
                    uu = float32(0.0)
                    if i < L:
                        uu = core[(c0 + i) * nv * dv + hv + nt * 8 + 2 * t + (e % 2)]
                    uf[4 * nt + e] = uu
            y = float32(0.0)
            if tid < L:
                y = gbuf[((c0 + tid) * nv + h) * 2 + 1]
            decay = gbuf[((c0 + L - 1) * nv + h) * 2]
            # this chunk's K fragments (the update's A operand), scaled once gk is staged
            for ks in range(CT):
                j = ks * 8 + t
                k0 = (c0 + j) * C + nk * dk + kh * dk
                k1 = k0 + 4 * C
                for u in range(MT):
                    m = (warp + NW * u) * 16 + g
                    o = (ks * MT + u) * 4
                    x0 = float32(0.0)
                    x1 = float32(0.0)
                    x2 = float32(0.0)
                    x3 = float32(0.0)
                    if j < L:
                        x0 = qkv[k0 + m]
                        x1 = qkv[k0 + m + 8]
                    if j + 4 < L:
                        x2 = qkv[k1 + m]
                        x3 = qkv[k1 + m + 8]
                    kf[o] = x0
                    kf[o + 1] = x1
                    kf[o + 2] = x2
                    kf[o + 3] = x3
            # S_c: the output pass's (sbuf) and this chunk's W S operand (shared)
            cb = (chunk_slot(q0, r, (c0 - q0) // Cn, Cn) * nv + h) * dk * dv + vb
            for u in range(MT):
                for nt in range(NT4):
                    for e in range(4):
                        row = (warp + NW * u) * 16 + g + 8 * (e // 2)
                        col = nt * 8 + 2 * t + (e % 2)
                        x = Sr[(u * NT4 + nt) * 4 + e]
                        sS[row * SS + col] = x
                        sbuf[cb + row * dv + col] = x
            if tid < Cn:
                gk[tid] = y
            cuda.syncthreads()
            for x in range(ACC):
                accV[x] = float32(0.0)
            for ks in range(KST):
                c = ks * 8 + t
                w0 = wf[4 * ks]
                w1 = wf[4 * ks + 1]
                w2 = wf[4 * ks + 2]
                w3 = wf[4 * ks + 3]
                for nt in range(NT4):
                    b0 = tf32(sS[c * SS + nt * 8 + g])
                    b1 = tf32(sS[(c + 4) * SS + nt * 8 + g])
                    mma_acc(accV, 4 * nt, w0, w1, w2, w3, b0, b1)
            if c0 + Cn < q1:                   # the next chunk's W, in flight from here
                load_w(wf, wbuf, c0 + Cn, min(Cn, q1 - c0 - Cn), h, ia, ib, t)
            # V' = U - W S into shared memory and over U (rows past L: zero, never stored)
            for nt in range(NT4):
                for e in range(4):
                    i = ia + 8 * (e // 2)
                    cc = nt * 8 + 2 * t + (e % 2)
                    v = uf[4 * nt + e] - accV[4 * nt + e]
                    sV[i * SS + cc] = v
                    if i < L:
                        core[(c0 + i) * nv * dv + hv + cc] = v
            cuda.syncthreads()
            # S <- exp(G_last) S + (K exp(G_last - G))^T V' (exp(G_last), `decay`: gbuf's first
            # factor at the chunk's last token)
            for x in range(SREG):
                Sr[x] *= decay
            for ks in range(CT):
                if ks * 8 < L:                            # block-uniform
                    j = ks * 8 + t
                    f0 = gk[j]
                    f1 = gk[j + 4]
                    for u in range(MT):
                        # (a fragment past L loaded as 0: f * 0 = +0, as the scan's 0 bits)
                        o = (ks * MT + u) * 4
                        a0 = tf32(f0 * kf[o])
                        a1 = tf32(f0 * kf[o + 1])
                        a2 = tf32(f1 * kf[o + 2])
                        a3 = tf32(f1 * kf[o + 3])
                        for nt in range(NT4):
                            b0 = tf32(sV[j * SS + nt * 8 + g])
                            b1 = tf32(sV[(j + 4) * SS + nt * 8 + g])
                            s = (u * NT4 + nt) * 4
                            mma_acc(Sr, s, a0, a1, a2, a3, b0, b1)
            cuda.syncthreads()       # the next chunk rewrites sS, sV, gk
        for u in range(MT):
            for nt in range(NT4):
                for e in range(4):
                    row = (warp + NW * u) * 16 + g + 8 * (e // 2)
                    state[sbase + row * dv + nt * 8 + 2 * t + (e % 2)] = \
                        Sr[(u * NT4 + nt) * 4 + e]
    return gdn_chunk_state_tc_kernel


def gdn_chunk_out_tc(dk, dv, nk, nv, Cn, VB=32):
    """The parallel pass of the scan: a block per (row, value head, chunk x VB columns) stages
    S_c [dk, VB] (sbuf) and V' [Cn, VB] (core) in shared memory, then writes O = exp(G) (Q S_c)
    + P V' over V'. Q and P are loaded fragment by fragment where used. Two ways of loading them
    ahead measured slower on an H100: into registers before the staging, as the state pass does
    its W (1.05 against 0.97 ms at 48 heads, 4096 tokens), and staged in shared memory 16 columns
    at a time by 16-byte loads, as the prep stages K and Q (0.258-0.277 against 0.234-0.238 ms at
    32 heads: 64 registers against 51 and 36 KB of shared memory, 6 blocks an SM instead of 7)."""
    C = 2 * nk * dk + nv * dv
    ratio = nv // nk
    NW = Cn // 16
    NT = 32 * NW
    assert Cn % 16 == 0 and dv % VB == 0 and VB % 8 == 0 and dk % 8 == 0
    NB = dv // VB            # value blocks a chunk
    SS = row_stride(VB)
    NT4 = VB // 8
    KST = dk // 8
    CT = Cn // 8
    SSZ = dk * SS
    VSZ = Cn * SS
    ACC = NT4 * 4

    def gdn_chunk_out_tc_kernel(core, pbuf, sbuf, gbuf, qkv, query_start):
        r = cuda.blockIdx.x
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z // NB
        vb = (cuda.blockIdx.z % NB) * VB
        tid = cuda.threadIdx.x
        q0 = query_start[r]
        q1 = query_start[r + 1]
        c0 = q0 + z * Cn
        if c0 >= q1:
            return                   # whole block: the row has fewer chunks
        L = min(Cn, q1 - c0)
        kh = h // ratio
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        i0 = (tid >> 5) * 16
        ia = i0 + g
        ib = ia + 8
        sS = cuda.shared.array(SSZ, float32)
        sV = cuda.shared.array(VSZ, float32)
        gq = cuda.shared.array(Cn, float32)
        accO = cuda.local.array(ACC, float32)
        hv = h * dv + vb
        oka = ia < L
        okb = ib < L
        qa = (c0 + ia) * C + kh * dk
        qb = (c0 + ib) * C + kh * dk
        pa = ((c0 + ia) * nv + h) * Cn
        pb = ((c0 + ib) * nv + h) * Cn
        cb = (chunk_slot(q0, r, z, Cn) * nv + h) * dk * dv + vb
        for e in range(tid, dk * VB, NT):
            row = e // VB
            col = e - row * VB
            sS[row * SS + col] = sbuf[cb + row * dv + col]
        for e in range(tid, Cn * VB, NT):
            i = e // VB
            col = e - i * VB
            x = float32(0.0)
            if i < L:
                x = core[(c0 + i) * nv * dv + hv + col]
            sV[i * SS + col] = x
        if tid < Cn:
            y = float32(0.0)
            if tid < L:
                y = gbuf[((c0 + tid) * nv + h) * 2]
            gq[tid] = y
        cuda.syncthreads()
        for x in range(ACC):
            accO[x] = float32(0.0)
        for ks in range(KST):
            c = ks * 8 + t
            x0 = ld_tf32(qkv, qa + c, oka)
            x1 = ld_tf32(qkv, qb + c, okb)
            x2 = ld_tf32(qkv, qa + c + 4, oka)
            x3 = ld_tf32(qkv, qb + c + 4, okb)
            for nt in range(NT4):
                b0 = tf32(sS[c * SS + nt * 8 + g])
                b1 = tf32(sS[(c + 4) * SS + nt * 8 + g])
                mma_acc(accO, 4 * nt, x0, x1, x2, x3, b0, b1)
        for nt in range(NT4):
            for e in range(4):
                accO[4 * nt + e] *= gq[ia + 8 * (e // 2)]
        # O += P V' (P is zero right of the diagonal: k-steps up to the warp's last row)
        for ks in range(CT):
            if ks * 8 <= i0 + 15 and ks * 8 < L:      # warp-uniform
                c = ks * 8 + t
                p0 = ld_tf32(pbuf, pa + c, oka)
                p1 = ld_tf32(pbuf, pb + c, okb)
                p2 = ld_tf32(pbuf, pa + c + 4, oka)
                p3 = ld_tf32(pbuf, pb + c + 4, okb)
                for nt in range(NT4):
                    b0 = tf32(sV[c * SS + nt * 8 + g])
                    b1 = tf32(sV[(c + 4) * SS + nt * 8 + g])
                    mma_acc(accO, 4 * nt, p0, p1, p2, p3, b0, b1)
        for nt in range(NT4):
            for e in range(4):
                i = ia + 8 * (e // 2)
                if i < L:
                    core[(c0 + i) * nv * dv + hv + nt * 8 + 2 * t + (e % 2)] = accO[4 * nt + e]
    return gdn_chunk_out_tc_kernel
