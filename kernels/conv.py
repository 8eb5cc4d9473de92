"""Gated DeltaNet causal depthwise conv1d + SiLU, with the L2 norm of q and k fused in.

Channels (C = 2*Kd + Vd) are [q heads | k heads | v heads]; one block per (token, head). Taps that
fall before the row's first new token read the StateImage (last K-1 *inputs*, oldest first), or
zero when the row starts fresh (context_len == 0). `conv_state_update` then stores the new window;
`conv_state_update_snap` (a speculative verify's) also stores the window after each of a row's
tokens into State slots snap_base[r] + i (the delta rule's gdn_recurrent_snap keeps S there).
"""
import math

from numba import cuda, float32

from .common import block_sum, inlined, silu, warp_sum

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "conv_silu": ("f32*", "f32*", "i32", "f32*", "f32*", "i32*", "i32*", "i32*", "i32*", "i32"),
    "conv_silu_chunk": ("f32*", "f32*", "i32", "f32*", "f32*", "i32*", "i32*", "i32*", "i32*",
                        "i32"),
    "conv_state_update": ("f32*", "f32*", "i32", "i32*", "i32*", "i32*"),
    "conv_state_update_snap": ("f32*", "f32*", "i32", "i32*", "i32*", "i32*", "i32*"),
}


def conv_silu(K, dk, dv, nk, nv):
    C = 2 * nk * dk + nv * dv
    KM1 = K - 1

    def conv_silu_kernel(out, proj, proj_stride, w, conv_state, token_row, query_start,
                         context_lens, state_slots, decode):
        # decode != 0: every row brings one token, so this thread alone reads and then rewrites
        # its channel's window (no conv_state_update launch, one graph node less per layer)
        scratch = cuda.shared.array(32, float32)
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y
        j = cuda.threadIdx.x
        if h < 2 * nk:
            width = dk
            c = h * dk + j
        else:
            width = dv
            c = 2 * nk * dk + (h - 2 * nk) * dv + j
        r = token_row[t]
        q0 = query_start[r]
        i = t - q0
        ctx = context_lens[r]
        slot = state_slots[r]
        y = float32(0.0)
        if j < width:
            acc = float32(0.0)
            for tap in range(K):
                s = i - KM1 + tap
                if s >= 0:
                    xv = proj[(q0 + s) * proj_stride + c]
                elif ctx > 0:
                    xv = conv_state[(slot * C + c) * KM1 + KM1 + s]
                else:
                    xv = float32(0.0)
                acc += w[c * K + tap] * xv
            y = silu(acc)
            if decode != 0:
                base = (slot * C + c) * KM1
                for m in range(KM1 - 1):
                    conv_state[base + m] = conv_state[base + m + 1] if ctx > 0 else float32(0.0)
                conv_state[base + KM1 - 1] = proj[t * proj_stride + c]
        if h < 2 * nk:
            tot = block_sum(y * y, scratch)
            y = y / math.sqrt(tot + float32(1e-6))
            if h < nk:
                y = y * float32(1.0 / math.sqrt(dk))
        if j < width:
            out[t * C + c] = y
    return conv_silu_kernel


CONV_TOKENS = 16    # conv_silu_chunk: consecutive tokens a block


def conv_silu_chunk(K, dk, dv, nk, nv):
    """conv_silu over CONV_TOKENS consecutive tokens of the call a block (a prefill's): each
    thread slides its channel's window along them, one load an input where conv_silu's block a
    token loaded K, the K weights loaded once, and the q/k heads' L2 norms of the block's tokens
    through warp sums and one barrier (conv_silu: two a token). The same products and sums in
    the same order as conv_silu: the same bits, whichever kernel a call takes (a decode row
    beside a prefill row takes this one). State reads as conv_silu's; it writes no state
    (conv_state_update does, after it)."""
    C = 2 * nk * dk + nv * dv
    KM1 = K - 1
    TT = CONV_TOKENS
    NW = (max(dk, dv) + 31) // 32           # warps a block
    PARTS = TT * NW
    NWP = 1 << (NW - 1).bit_length()        # NW rounded up to a power of two

    def conv_silu_chunk_kernel(out, proj, proj_stride, w, conv_state, token_row, query_start,
                               context_lens, state_slots, n):
        # grid (ceil(n / TT), 2 * nk + nv), block 32 * NW: thread j is channel j of head h for
        # tokens t0 .. t0 + TT - 1 (rows change inside a block: the window is refilled there)
        part = cuda.shared.array(PARTS, float32)
        h = cuda.blockIdx.y
        j = cuda.threadIdx.x
        lane = j & 31
        wid = j >> 5
        if h < 2 * nk:
            width = dk
            c0 = h * dk
        else:
            width = dv
            c0 = 2 * nk * dk + (h - 2 * nk) * dv
        live = j < width
        c = c0 + min(j, width - 1)          # (idle lanes load a live channel, store nothing)
        wv = cuda.local.array(K, float32)
        for tap in range(K):
            wv[tap] = w[c * K + tap]
        win = cuda.local.array(KM1, float32)    # the KM1 inputs before the token, oldest first
        ys = cuda.local.array(TT, float32)
        t0 = cuda.blockIdx.x * TT
        prev = -1
        for i in range(TT):
            t = t0 + i
            y = float32(0.0)
            if t < n:
                r = token_row[t]
                if r != prev:
                    prev = r
                    q0 = query_start[r]
                    ctx = context_lens[r]
                    slot = state_slots[r]
                    for m in range(KM1):
                        s = t - q0 - KM1 + m
                        if s >= 0:
                            win[m] = proj[(q0 + s) * proj_stride + c]
                        elif ctx > 0:
                            win[m] = conv_state[(slot * C + c) * KM1 + KM1 + s]
                        else:
                            win[m] = float32(0.0)
                xv = proj[t * proj_stride + c]
                acc = float32(0.0)
                for m in range(KM1):
                    acc += wv[m] * win[m]
                acc += wv[KM1] * xv
                for m in range(KM1 - 1):
                    win[m] = win[m + 1]
                win[KM1 - 1] = xv
                y = silu(acc)
            ys[i] = y
        if h < 2 * nk:
            for i in range(TT):
                v = ys[i] if live else float32(0.0)
                v = warp_sum(v * v)
                if lane == 0:
                    part[i * NW + wid] = v
            cuda.syncthreads()
            tmp = cuda.local.array(NWP, float32)
            for i in range(TT):
                # the warps' sums added as block_sum's closing warp_sum adds them (an xor
                # butterfly over the first NWP lanes, the rest zeros): the same bits as
                # conv_silu, so a decode row's q/k do not depend on a prefill row beside it
                for k in range(NWP):
                    tmp[k] = part[i * NW + k] if k < NW else float32(0.0)
                off = NWP // 2
                while off > 0:
                    for k in range(off):
                        tmp[k] += tmp[k + off]
                    off //= 2
                y = ys[i] / math.sqrt(tmp[0] + float32(1e-6))
                if h < nk:
                    y = y * float32(1.0 / math.sqrt(dk))
                ys[i] = y
        if live:
            for i in range(TT):
                t = t0 + i
                if t < n:
                    out[t * C + c] = ys[i]
    return conv_silu_chunk_kernel


def conv_state_update(K, C):
    window = _window(K)

    def conv_state_update_kernel(conv_state, proj, proj_stride, query_start, context_lens,
                                 state_slots):
        # grid (ceil(C/128), rows): window = last K-1 of [old state (or zeros) | row inputs]
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        r = cuda.blockIdx.y
        if c >= C:
            return
        q0 = query_start[r]
        base = (state_slots[r] * C + c) * (K - 1)
        window(conv_state, proj, proj_stride, q0, query_start[r + 1] - q0, context_lens[r], base,
               c, base)
    return conv_state_update_kernel


def conv_state_update_snap(K, C):
    window = _window(K)

    def conv_state_update_snap_kernel(conv_state, proj, proj_stride, query_start, context_lens,
                                      state_slots, snap_base):
        # conv_state_update, and first the window after each of the row's first i + 1 inputs
        # into slot snap_base[r] + i (the old window is read before the row's slot is written)
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        r = cuda.blockIdx.y
        if c >= C:
            return
        q0 = query_start[r]
        n = query_start[r + 1] - q0
        ctx = context_lens[r]
        base = (state_slots[r] * C + c) * (K - 1)
        first = snap_base[r]
        if first >= 0:
            for i in range(n):
                window(conv_state, proj, proj_stride, q0, i + 1, ctx, base, c,
                       ((first + i) * C + c) * (K - 1))
        window(conv_state, proj, proj_stride, q0, n, ctx, base, c, base)
    return conv_state_update_snap_kernel


def _window(K):
    KM1 = K - 1

    @inlined
    def window(conv_state, proj, proj_stride, q0, n, ctx, base, c, dst):
        # conv_state[dst ..] = the last K-1 of [the window at base (or zeros: ctx == 0) | the
        # row's first n inputs]
        win = cuda.local.array(KM1, float32)
        for m in range(KM1):
            s = n - KM1 + m          # index into the row's inputs; < 0 -> old state
            if s >= 0:
                win[m] = proj[(q0 + s) * proj_stride + c]
            elif ctx > 0:
                win[m] = conv_state[base + KM1 + s]
            else:
                win[m] = float32(0.0)
        for m in range(KM1):
            conv_state[dst + m] = win[m]
    return window
