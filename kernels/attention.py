"""Paged causal GQA attention over bf16 KV pools (decode and prefill alike), split over keys.
`f32` (both factories): fp32 KV pools and output, the same arithmetic. `kvq` "fp8" / "int8"
(paged_attention): pools of one-byte codes with a float32 scale per token and kv head
(ninfer/ops/kv_quant.py; common.kvq_row the page layout), read as "u16*": a lane's pair is two
codes, decoded exactly; the key's scale multiplies its dot product (K) and its softmax weight (V).

grid (query tokens, kv heads * G/GS, splits), 4 warps. A block serves the G query heads of one kv head for
one token: each K/V row is read once for G heads. Query token t of row r (index i in the row) sees
keys [0, context_len + i]; split s takes a contiguous slice of them, warps interleave over its keys.
Each lane holds dims {2e, 2e+1} for e = lane + 32c (bf16 pairs read as u32: coalesced).
Output per split: unnormalised acc and (max, sum) for `attn_combine`, which merges the splits and
applies the sigmoid output gate, writing bf16 (fp32) for o_proj. `t_base`: the launch covers tokens
[t_base, t_base + grid.x) of the call (rows left to it by the tensor-core prefill path); part/ml are
indexed from the launch's first token.
"""
import math

from numba import cuda, float32, uint32

from .common import (bf16x2_hi, bf16x2_lo, f32_pair, inlined, kv_codec, kvq_row, sigmoid, storage,
                     u16_pair_f32, warp_max, warp_sum)

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "paged_attention": (
        "f32*", "f32*", "f32*", "u32*", "u32*", "i32*", "i32*", "i32*", "i32*", "i32", "i32", "i32",
        "f32", "i32"),
    "attn_combine": ("u16*", "f32*", "f32*", "f32*", "i32", "i32", "i32"),
}

WARPS = 4
NEG_INF = float32(-3.0e38)


def _kv_pairs(f32, kvq=""):
    """(k0, k1, v0, v1) = K/V pair i when `live`, else zeros (kvq: the codes' values, unscaled;
    i counts u16 code pairs)."""
    if kvq:
        value = kv_codec(kvq)[1]

        @inlined
        def kv_codes(k_cache, v_cache, i, live):
            p = uint32(0)
            pv = uint32(0)
            if live:
                p = uint32(k_cache[i])
                pv = uint32(v_cache[i])
            return (value(p & uint32(0xFF)), value(p >> uint32(8)), value(pv & uint32(0xFF)),
                    value(pv >> uint32(8)))
        return kv_codes

    if f32:
        @inlined
        def kv_f32(k_cache, v_cache, i, live):
            k0 = k1 = v0 = v1 = float32(0.0)
            if live:
                k0, k1 = f32_pair(k_cache, i)
                v0, v1 = f32_pair(v_cache, i)
            return k0, k1, v0, v1
        return kv_f32

    @inlined
    def kv_bf16(k_cache, v_cache, i, live):
        p = uint32(0)
        pv = uint32(0)
        if live:
            p = k_cache[i]
            pv = v_cache[i]
        return bf16x2_lo(p), bf16x2_hi(p), bf16x2_lo(pv), bf16x2_hi(pv)
    return kv_bf16


def paged_attention(hd, G, nkv, GS=0, f32=False, kvq="", causal=True):
    # causal False (a DFlash drafter's block pass): every query token of a row sees all the
    # row's keys, [0, context_len + its new tokens)
    # GS: query heads per block (a divisor of G; 0 -> G). Fewer heads per block = fewer registers
    # and more resident warps, at the cost of reading each K/V row G/GS times (measured slower for
    # the 27B prefill, so the model uses GS = G; kept and tested for other geometries).
    if GS == 0:
        GS = G
    NSUB = G // GS
    HP = hd // 2             # u32 (bf16 pairs) per head row
    NC = (HP + 31) // 32     # pairs per lane; lanes past HP hold zeros
    nh = G * nkv
    QN = GS * 2 * NC
    NC2 = 2 * NC
    kv_pairs = _kv_pairs(f32, kvq)
    merge = merge_warps(GS, hd)
    quant = bool(kvq)      # (k_cache / v_cache "u16*": kernel_set.KVQ_VARIANTS; f32 unused)

    def paged_attention_kernel(part, ml, q, k_cache, v_cache, token_row, query_start,
                               context_lens, block_tables, bt_stride, page_size, n_splits, scale,
                               t_base):
        tl = cuda.blockIdx.x
        t = t_base + tl
        g = cuda.blockIdx.y // NSUB
        h0 = g * G + (cuda.blockIdx.y % NSUB) * GS
        s = cuda.blockIdx.z
        lane = cuda.threadIdx.x & 31
        w = cuda.threadIdx.x >> 5
        r = token_row[t]
        if causal:
            L = context_lens[r] + t - query_start[r] + 1
        else:
            L = context_lens[r] + query_start[r + 1] - query_start[r]
        chunk = (L + n_splits - 1) // n_splits
        k0 = s * chunk
        k1 = min(L, k0 + chunk)
        qv = cuda.local.array(QN, float32)
        acc = cuda.local.array(QN, float32)
        mx = cuda.local.array(GS, float32)
        sm = cuda.local.array(GS, float32)
        for gi in range(GS):
            qb = (t * nh + h0 + gi) * hd
            for c in range(NC):
                e = lane + 32 * c
                q0 = float32(0.0)
                q1 = float32(0.0)
                if e < HP:
                    q0 = q[qb + 2 * e] * scale
                    q1 = q[qb + 2 * e + 1] * scale
                qv[(gi * NC + c) * 2] = q0
                qv[(gi * NC + c) * 2 + 1] = q1
                acc[(gi * NC + c) * 2] = float32(0.0)
                acc[(gi * NC + c) * 2 + 1] = float32(0.0)
            mx[gi] = NEG_INF
            sm[gi] = float32(0.0)
        kp = cuda.local.array(NC2, float32)
        vp = cuda.local.array(NC2, float32)
        key = k0 + w
        page_next = 0
        if key < k1:
            page_next = block_tables[r * bt_stride + key // page_size]
        while key < k1:
            # the next key's page id is fetched one step ahead (a dependent load otherwise)
            page = page_next
            key_next = key + WARPS
            if key_next < k1:
                page_next = block_tables[r * bt_stride + key_next // page_size]
            if quant:
                row, sb = kvq_row(page, key % page_size, g, page_size, nkv, hd)
                rb = row // 2
                ks = u16_pair_f32(k_cache, sb // 2)
                vs = u16_pair_f32(v_cache, sb // 2)
            else:
                rb = ((page * page_size + key % page_size) * nkv + g) * HP
            for c in range(NC):
                kp[2 * c], kp[2 * c + 1], vp[2 * c], vp[2 * c + 1] = kv_pairs(
                    k_cache, v_cache, rb + lane + 32 * c, lane + 32 * c < HP)
            for gi in range(GS):
                d = float32(0.0)
                for c in range(NC2):
                    d += qv[gi * NC2 + c] * kp[c]
                d = warp_sum(d)
                if quant:
                    d = d * ks
                m_new = max(mx[gi], d)
                corr = math.exp(mx[gi] - m_new)
                pw = math.exp(d - m_new)
                sm[gi] = sm[gi] * corr + pw
                mx[gi] = m_new
                if quant:
                    pw = pw * vs
                for c in range(NC2):
                    acc[gi * NC2 + c] = acc[gi * NC2 + c] * corr + pw * vp[c]
            key = key_next
        # merge the 4 warps through shared memory
        sh_m = cuda.shared.array((WARPS, GS), float32)
        sh_l = cuda.shared.array((WARPS, GS), float32)
        sh_acc = cuda.shared.array((WARPS, GS, hd), float32)
        for gi in range(GS):
            if lane == 0:
                sh_m[w, gi] = mx[gi]
                sh_l[w, gi] = sm[gi]
            for c in range(NC):
                e = lane + 32 * c
                if e < HP:
                    sh_acc[w, gi, 2 * e] = acc[gi * 2 * NC + 2 * c]
                    sh_acc[w, gi, 2 * e + 1] = acc[gi * 2 * NC + 2 * c + 1]
        cuda.syncthreads()
        merge(part, ml, sh_m, sh_l, sh_acc, tl * nh + h0, n_splits, s)
    return paged_attention_kernel


def merge_warps(GS, hd):
    """merge(part, ml, sh_m, sh_l, sh_o, th0, n_splits, s): the block's WARPS partial softmax
    sums of its GS heads (sh_m [WARPS, *] maxima, sh_l sums, sh_o [WARPS, GS, hd] unnormalised
    outputs; a warp without keys: max NEG_INF) rescaled to their common max and written as split
    s's partials of rows th0 .. th0 + GS (token * nh + head) for attn_combine. After a barrier."""
    @inlined
    def merge(part, ml, sh_m, sh_l, sh_o, th0, n_splits, s):
        for idx in range(cuda.threadIdx.x, GS * hd, WARPS * 32):
            gi = idx // hd
            dd = idx % hd
            m = NEG_INF
            for ww in range(WARPS):
                m = max(m, sh_m[ww, gi])
            tot_l = float32(0.0)
            tot_a = float32(0.0)
            for ww in range(WARPS):
                if sh_m[ww, gi] > NEG_INF:
                    f = math.exp(sh_m[ww, gi] - m)
                    tot_l += f * sh_l[ww, gi]
                    tot_a += f * sh_o[ww, gi, dd]
            pbase = (th0 + gi) * n_splits + s
            part[pbase * hd + dd] = tot_a
            if dd == 0:
                ml[pbase * 2] = m
                ml[pbase * 2 + 1] = tot_l
    return merge


@inlined
def merge_split(ms, ls, a, m, tot_l, tot_a):
    """One split's (max ms, sum ls, unnormalised a) into the running sums, rescaled to the max m;
    an empty split (ms = NEG_INF: no keys, its partials never written) adds nothing. (The tail
    loop below does the same, reading a split's sums only when it has keys.)"""
    if ms > NEG_INF:
        f = math.exp(ms - m)
        return tot_l + f * ls, tot_a + f * a
    return tot_l, tot_a


# attn_combine: split groups per block (a warp each, 32 dims wide); the launch geometry is
# ninfer/models/qwen3_5/cuda/runner.combine_launch, which must agree (a test checks)
COMBINE_GROUPS = 8


def attn_combine(hd, nh, f32=False, gated=True):
    # gated False (a DFlash drafter): no output gate, proj unread
    store = storage(f32)[0]
    SG = COMBINE_GROUPS
    T = 32 * SG

    def attn_combine_kernel(out, part, ml, proj, proj_stride, n_splits, t_base):
        # grid (tokens, nh, ceil(hd/32)), block 32*SG: merge splits, divide, gate by sigmoid ->
        # bf16 [n, nh*hd]. Warp g sums splits g, g + SG, ... for its 32 dims, four splits' loads
        # in flight at once; the warps' sums meet in shared memory. (One thread walking all
        # splits serially took 35 us a launch at 128 splits on the H200: a load's latency each.)
        sh_m = cuda.shared.array(SG, float32)
        sh_a = cuda.shared.array((SG, 32), float32)
        sh_l = cuda.shared.array(SG, float32)
        tl = cuda.blockIdx.x
        t = t_base + tl
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid & 31
        g = tid >> 5
        dd = cuda.blockIdx.z * 32 + lane
        ok = dd < hd
        base = (tl * nh + h) * n_splits
        m = NEG_INF
        for s in range(tid, n_splits, T):
            m = max(m, ml[(base + s) * 2])
        m = warp_max(m)
        if lane == 0:
            sh_m[g] = m
        cuda.syncthreads()
        m = sh_m[0]
        for j in range(1, SG):
            m = max(m, sh_m[j])
        tot_l = float32(0.0)
        tot_a = float32(0.0)
        s = g
        while s + 3 * SG < n_splits:
            r0 = base + s
            r1 = r0 + SG
            r2 = r1 + SG
            r3 = r2 + SG
            m0 = ml[r0 * 2]
            m1 = ml[r1 * 2]
            m2 = ml[r2 * 2]
            m3 = ml[r3 * 2]
            l0 = ml[r0 * 2 + 1]
            l1 = ml[r1 * 2 + 1]
            l2 = ml[r2 * 2 + 1]
            l3 = ml[r3 * 2 + 1]
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            if ok:
                a0 = part[r0 * hd + dd]
                a1 = part[r1 * hd + dd]
                a2 = part[r2 * hd + dd]
                a3 = part[r3 * hd + dd]
            tot_l, tot_a = merge_split(m0, l0, a0, m, tot_l, tot_a)
            tot_l, tot_a = merge_split(m1, l1, a1, m, tot_l, tot_a)
            tot_l, tot_a = merge_split(m2, l2, a2, m, tot_l, tot_a)
            tot_l, tot_a = merge_split(m3, l3, a3, m, tot_l, tot_a)
            s += 4 * SG
        while s < n_splits:
            ms = ml[(base + s) * 2]
            if ms > NEG_INF:
                f = math.exp(ms - m)
                tot_l += f * ml[(base + s) * 2 + 1]
                if ok:
                    tot_a += f * part[(base + s) * hd + dd]
            s += SG
        sh_a[g, lane] = tot_a
        if lane == 0:
            sh_l[g] = tot_l
        cuda.syncthreads()
        if g == 0 and ok:
            a = sh_a[0, lane]
            l = sh_l[0]
            for j in range(1, SG):
                a += sh_a[j, lane]
                l += sh_l[j]
            if gated:
                gate = proj[t * proj_stride + h * 2 * hd + hd + dd]
                out[(t * nh + h) * hd + dd] = store(a / l * sigmoid(gate))
            else:
                out[(t * nh + h) * hd + dd] = store(a / l)
    return attn_combine_kernel
