"""Gated delta rule, fp32 state, sequential over each row's tokens (prefill and decode alike).

One block per (row, value head, block of VB value columns); thread (v, ks) keeps the column slice
S[ks*SL:(ks+1)*SL, v] in registers, the KS slices of a column sit in adjacent lanes and reduce by
shuffles. Gating is fused: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).

    S <- S * exp(g);  kv = S^T k;  delta = (v - kv) * beta;  S <- S + k delta^T;  o = S^T q
q and k arrive L2-normalised (q also scaled by 1/sqrt(dk)) from the conv kernel.

gdn_recurrent_snap is the same step for a speculative verify: it also writes S after each of a
row's tokens into State slots snap_base[r] + i (i = 0 .. tokens - 1; snap_base[r] < 0: none), so
a rejected draft is undone by taking the accepted position's S instead of recomputing.
"""
import math

from numba import cuda, float32

from .common import FULL_MASK, inlined, sigmoid, softplus

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "gdn_recurrent": (
        "f32*", "f32*", "f32*", "i32", "i32", "i32", "f32*", "f32*", "f32*", "i32*", "i32*",
        "i32*"),
    "gdn_recurrent_snap": (
        "f32*", "f32*", "f32*", "i32", "i32", "i32", "f32*", "f32*", "f32*", "i32*", "i32*",
        "i32*", "i32*"),
}

VB = 32
KS = 4


def gdn_recurrent(dk, dv, nk, nv):
    step = _recurrent(dk, dv, nk, nv, snap=False)

    def gdn_recurrent_kernel(out, qkv, proj, proj_stride, a_off, b_off, a_log, dt_bias, state,
                             query_start, context_lens, state_slots):
        step(out, qkv, proj, proj_stride, a_off, b_off, a_log, dt_bias, state, query_start,
             context_lens, state_slots, state_slots)
    return gdn_recurrent_kernel


def gdn_recurrent_snap(dk, dv, nk, nv):
    step = _recurrent(dk, dv, nk, nv, snap=True)

    def gdn_recurrent_snap_kernel(out, qkv, proj, proj_stride, a_off, b_off, a_log, dt_bias,
                                  state, query_start, context_lens, state_slots, snap_base):
        step(out, qkv, proj, proj_stride, a_off, b_off, a_log, dt_bias, state, query_start,
             context_lens, state_slots, snap_base)
    return gdn_recurrent_snap_kernel


def _recurrent(dk, dv, nk, nv, snap):
    """The kernels' body (one inlined device function; `snap` a constant of the variant)."""
    SL = dk // KS          # state rows per thread
    SL2 = SL - SL % 2      # the paired part of the loops below (odd SL: one tail row)
    C = 2 * nk * dk + nv * dv
    ratio = nv // nk
    QL = (dk + VB * KS - 1) // (VB * KS)     # q/k elements each thread stages per token

    @inlined
    def step(out, qkv, proj, proj_stride, a_off, b_off, a_log, dt_bias, state, query_start,
             context_lens, state_slots, snap_base):
        r = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        v = cuda.blockIdx.z * VB + tid // KS
        ks = tid % KS
        live = v < dv                 # dv < VB: idle columns still join barriers and shuffles
        vc = min(v, dv - 1)           # clamped column for loads, never stored
        kh = h // ratio
        qs = cuda.shared.array(dk, float32)
        kk = cuda.shared.array(dk, float32)
        slot = state_slots[r]
        sbase = (slot * nv + h) * dk * dv
        S = cuda.local.array(SL, float32)
        fresh = context_lens[r] == 0
        for i in range(SL):
            if fresh:
                S[i] = float32(0.0)
            else:
                S[i] = state[sbase + (ks * SL + i) * dv + vc]
        neg_a = -math.exp(a_log[h])
        dtb = dt_bias[h]
        t0 = query_start[r]
        t1 = query_start[r + 1]
        # software pipeline: token t+1's inputs are loaded into registers while t computes
        qn = cuda.local.array(QL, float32)
        kn = cuda.local.array(QL, float32)
        for c in range(QL):
            m = tid + c * VB * KS
            if m < dk:
                qn[c] = qkv[t0 * C + kh * dk + m]
                kn[c] = qkv[t0 * C + nk * dk + kh * dk + m]
        an = proj[t0 * proj_stride + a_off + h]
        bn = proj[t0 * proj_stride + b_off + h]
        vn = qkv[t0 * C + 2 * nk * dk + h * dv + vc]
        decay_n = math.exp(neg_a * softplus(an + dtb))
        beta_n = sigmoid(bn)
        for t in range(t0, t1):
            for c in range(QL):
                m = tid + c * VB * KS
                if m < dk:
                    qs[m] = qn[c]
                    kk[m] = kn[c]
            decay = decay_n
            beta = beta_n
            vv = vn
            cuda.syncthreads()
            more = t + 1 < t1
            if more:
                tn = t + 1
                for c in range(QL):
                    m = tid + c * VB * KS
                    if m < dk:
                        qn[c] = qkv[tn * C + kh * dk + m]
                        kn[c] = qkv[tn * C + nk * dk + kh * dk + m]
                an = proj[tn * proj_stride + a_off + h]
                bn = proj[tn * proj_stride + b_off + h]
                vn = qkv[tn * C + 2 * nk * dk + h * dv + vc]
            # two accumulators per reduction: halves the dependent FMA chain
            p0 = float32(0.0)
            p1 = float32(0.0)
            for i in range(0, SL2, 2):
                S[i] = S[i] * decay
                S[i + 1] = S[i + 1] * decay
                p0 += S[i] * kk[ks * SL + i]
                p1 += S[i + 1] * kk[ks * SL + i + 1]
            if SL2 < SL:
                S[SL - 1] = S[SL - 1] * decay
                p0 += S[SL - 1] * kk[ks * SL + SL - 1]
            part = p0 + p1
            part += cuda.shfl_xor_sync(FULL_MASK, part, 1)
            part += cuda.shfl_xor_sync(FULL_MASK, part, 2)
            delta = (vv - part) * beta
            o0 = float32(0.0)
            o1 = float32(0.0)
            for i in range(0, SL2, 2):
                S[i] = S[i] + kk[ks * SL + i] * delta
                S[i + 1] = S[i + 1] + kk[ks * SL + i + 1] * delta
                o0 += S[i] * qs[ks * SL + i]
                o1 += S[i + 1] * qs[ks * SL + i + 1]
            if SL2 < SL:
                S[SL - 1] = S[SL - 1] + kk[ks * SL + SL - 1] * delta
                o0 += S[SL - 1] * qs[ks * SL + SL - 1]
            o = o0 + o1
            o += cuda.shfl_xor_sync(FULL_MASK, o, 1)
            o += cuda.shfl_xor_sync(FULL_MASK, o, 2)
            if ks == 0 and live:
                out[t * nv * dv + h * dv + v] = o
            if snap:
                first = snap_base[r]
                if first >= 0 and live:
                    snap0 = ((first + t - t0) * nv + h) * dk * dv
                    for i in range(SL):
                        state[snap0 + (ks * SL + i) * dv + v] = S[i]
            if more:
                # next token's gates, after this token's work has hidden their loads' latency
                decay_n = math.exp(neg_a * softplus(an + dtb))
                beta_n = sigmoid(bn)
            cuda.syncthreads()
        if live:
            for i in range(SL):
                state[sbase + (ks * SL + i) * dv + v] = S[i]
    return step
