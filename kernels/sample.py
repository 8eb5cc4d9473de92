"""Logits -> token ids on the GPU, the device twin of ninfer/models/qwen3_5/program/sampling.py.

`argmax`: the greedy id of each fp32 row (lowest id on ties); the decode graph's head uses it.

Sampling is three kernels over a grid of (G blocks per row, rows), each block one contiguous
chunk of ceil(V / G) ids, all filter arithmetic in fp64 (the host sampler's steps, its order):

`sample_prep`: the grammar mask (packed bits), penalties (a sparse (id, generated count) list;
a block applies those in its chunk) and logit_bias (a sparse (id, fp64 bias) list, added after the
penalties, as the host does) into an fp64 copy z of the row; the block's (max, lowest id
at it); zeroes the row's histograms and counters for the next two kernels.
`sample_stats` (non-greedy rows): m = max(z) / T from the G block maxima; per block the mass
sum of w = exp(z / T - m) and, when top-k or top-p is on, a histogram over HB bins of
d = m - z / T (bin width SPAN / HB, everything past SPAN in the last bin) with each bin's count
and mass, built in shared memory and added to the row's global histogram.
`sample`: greedy rows take the best of the G block maxima. Every block of a sampled row reads the
histogram and derives the same plan: bins are monotone in the value, so "every id of bins <= c"
is a best-first prefix. top-k: c = the bin holding the k-th id; top-p alone: c = the bin where
the mass counted from the top reaches top_p of the total. If bins <= c hold at most CAP ids
(SMALL) they are the candidates; else, for top-p alone, if bin c alone holds at most CAP ids
(WIDE) every id of bins < c is kept and bin c's ids are the candidates; else (FALLBACK) block 0
finishes the row alone with the radix-select path below. Temperature / min-p alone (ALL) keep
everything (min-p per id). Each block adds its chunk's kept mass of the surely-kept bins (with
and without min-p) to per-block partials and appends its candidates' ids to the row's list; the
last block to finish (a ticket counter) ranks the candidates exactly in best-first order (value
descending, lower id on ties), applies top-k / top-p / min-p there (top-p: the mass before an id
has not reached top_p of the total, of top-k's mass when top-k is on), which fixes the last kept
(key, id); adds the kept candidates to their chunks' partials; finds the chunk where the running
kept mass passes u * total (u = counter_uniform(seed, position), splitmix64 in uint64) and scans
that chunk in ascending id order for the first id past it.

The FALLBACK (a tie-heavy or flat row: more than CAP ids in the deciding bin) is one block:
thresholds from a radix select over an order-preserving uint64 key of z / T, 8 bits per pass from
the top, count-weighted for top-k, mass-weighted for top-p, stopping early when the chosen bin
holds exactly what is kept from it; the tied ids kept at an exact threshold are found by one pass
over contiguous id chunks per thread with a block prefix scan (the oracle's tie order). A top-k of
at most CAP ids is then gathered into shared memory where top-p, min-p and the draw finish.
"""
import math
import threading
from types import SimpleNamespace

from numba import config, cuda, float32, float64, int32, int64, uint32, uint64

from .common import inlined, tree_reductions
from .ptx import ld_v4_f32

# the three sampling kernels' common arguments: out ids, logits, z, vocab, fpar, ipar, upar,
# pen, mask, wf, wi (prep_kernel's docstring; cuda/sampler.py packs them)
SAMPLE_ARGS = ("i32*", "f32*", "f64*", "i32", "f64*", "i32*", "u64*", "i32*", "u32*", "f64*",
               "i32*")

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "argmax": ("i32*", "f32*", "i32"),
    "sample_prep": SAMPLE_ARGS,
    "sample_stats": SAMPLE_ARGS,
    "sample": SAMPLE_ARGS,
}

THREADS = 1024              # argmax
SAMPLE_THREADS = 512        # sampling kernels; the finisher needs ~100 registers per thread
ROW_BLOCKS = 64             # G: blocks per row (B = 1 fills 64 of the H200's 132 SMs)
HIST_BINS = 3072            # HB: bins of d = m - z / T over [0, SPAN): width 1/96
SPAN = 32.0                 # weights below exp(-32) (1.3e-14) all share the last bin
KCAP = 1024                 # candidates finished in shared memory (and the fallback's top-k)
NBINS = 256                 # the fallback's radix digit of 8 bits
NPAR = 8                    # fp64 / int32 parameters per row (layout: cuda/sampler.py)
SIGN = 0x8000000000000000
ALL, SMALL, WIDE, FALLBACK = 0, 1, 2, 3     # plans (written to fpar[r, 6] for the tests)


if config.ENABLE_CUDASIM:
    _LOCK = threading.Lock()

    def atomic_add_at(p, i, v):
        """The simulator's twin of the intrinsic below (its pointers are numpy arrays)."""
        with _LOCK:
            old = p[i]
            p[i] = old + v
        return old
else:
    from numba import types as _types
    from numba.cuda import nvvmutils as _nvvm
    from numba.cuda.extending import intrinsic as _intrinsic

    @_intrinsic
    def atomic_add_at(typingctx, ptr, idx, val):
        """p[i] += v atomically in global memory through a raw pointer (our kernels take
        pointers; numba's cuda.atomic wants arrays); returns the old value. fp64 is the native
        atom.global.add.f64 (sm_60+)."""
        dt = ptr.dtype
        sig = dt(ptr, _types.intp, dt)

        def codegen(context, builder, sig, args):
            p, i, v = args
            addr = builder.gep(p, [i])
            if dt == _types.float64:
                return builder.call(_nvvm.declare_atomic_add_float64(builder.module), (addr, v))
            return builder.atomic_rmw("add", addr, v, "monotonic")
        return sig, codegen


def work_f64(blocks=ROW_BLOCKS, nbins=HIST_BINS):
    """fp64 work words per row: bin masses, block maxima, block masses, kept partials x 2."""
    return nbins + 4 * blocks


def work_i32(blocks=ROW_BLOCKS, nbins=HIST_BINS, cap=KCAP):
    """int32 work words per row: bin counts, block argmax ids, candidate ids, their count,
    the last-block ticket."""
    return nbins + blocks + cap + 2


def argmax(threads=THREADS):
    tree_argmax = tree_reductions(threads).argmax

    @inlined
    def better(v, i, bv, bi, vocab):
        # a thread walks its ids in increasing order: a strictly larger value wins (the first
        # maximum stays), and the first id it sees always does ("none yet")
        if v > bv or bi == vocab:
            return v, int32(i)
        return bv, bi

    @inlined
    def better4(v0, v1, v2, v3, i, bv, bi, vocab):
        # a 16-byte group of ids i .. i + 3, in order
        bv, bi = better(v0, i, bv, bi, vocab)
        bv, bi = better(v1, i + 1, bv, bi, vocab)
        bv, bi = better(v2, i + 2, bv, bi, vocab)
        return better(v3, i + 3, bv, bi, vocab)

    def argmax_kernel(out, logits, vocab):
        # grid (rows,), block `threads`; np.argmax's rule: the first maximum. Rows of whole
        # 16-byte groups read four groups a thread at once (one scalar load at a time took 41 us
        # a 248K-id row on the H200: a load's latency each)
        red_v = cuda.shared.array(threads, float32)
        red_i = cuda.shared.array(threads, int32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        base = int64(r) * vocab
        bv = float32(-math.inf)
        bi = int32(vocab)           # "none yet": a row of -inf still answers its first id
        if vocab % 4 == 0:
            n4 = vocab // 4
            g = tid
            while g + 3 * threads < n4:
                a0, a1, a2, a3 = ld_v4_f32(logits, base + 4 * g)
                b0, b1, b2, b3 = ld_v4_f32(logits, base + 4 * (g + threads))
                c0, c1, c2, c3 = ld_v4_f32(logits, base + 4 * (g + 2 * threads))
                d0, d1, d2, d3 = ld_v4_f32(logits, base + 4 * (g + 3 * threads))
                bv, bi = better4(a0, a1, a2, a3, 4 * g, bv, bi, vocab)
                bv, bi = better4(b0, b1, b2, b3, 4 * (g + threads), bv, bi, vocab)
                bv, bi = better4(c0, c1, c2, c3, 4 * (g + 2 * threads), bv, bi, vocab)
                bv, bi = better4(d0, d1, d2, d3, 4 * (g + 3 * threads), bv, bi, vocab)
                g += 4 * threads
            while g < n4:
                a0, a1, a2, a3 = ld_v4_f32(logits, base + 4 * g)
                bv, bi = better4(a0, a1, a2, a3, 4 * g, bv, bi, vocab)
                g += threads
        else:
            for i in range(tid, vocab, threads):
                bv, bi = better(logits[base + i], i, bv, bi, vocab)
        best = tree_argmax(bv, bi, red_v, red_i)
        if tid == 0:
            out[r] = best
    return argmax_kernel


def _parts(T, G, HB, cap):
    """Device functions shared by the three sampling kernels (block size T, G blocks per row,
    HB histogram bins, cap candidates)."""
    assert T & (T - 1) == 0 and HB % T == 0 and T % G == 0 and cap >= 1
    SCALE = HB / SPAN
    WF, WI = work_f64(G, HB), work_i32(G, HB, cap)
    PV = HB
    R = tree_reductions(T)
    tree_sum, tree_max, tree_argmax = R.sum, R.max, R.argmax

    @inlined
    def key_of(x):
        # order-preserving: a larger float has a larger key; -0.0 and 0.0 are one value
        if x == 0.0:
            return uint64(SIGN)
        b = uint64(cuda.libdevice.double_as_longlong(x))
        if b >> uint64(63):
            return ~b
        return b | uint64(SIGN)

    @inlined
    def splitmix64(z):
        z = z + uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
        return z ^ (z >> uint64(31))

    @inlined
    def uniform(upar, r):
        key = splitmix64(splitmix64(upar[2 * r]) ^ upar[2 * r + 1])
        return float64(key >> uint64(11)) * (1.0 / 9007199254740992.0)

    @inlined
    def block_scan(v, red):
        """Exclusive prefix sum of v over threads in thread order (Hillis-Steele)."""
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        off = 1
        while off < T:
            t = 0.0
            if tid >= off:
                t = red[tid - off]
            cuda.syncthreads()
            red[tid] += t
            cuda.syncthreads()
            off *= 2
        ex = 0.0
        if tid > 0:
            ex = red[tid - 1]
        cuda.syncthreads()
        return ex

    @inlined
    def kept_by(kk, i, t_key, t_id):
        return kk > t_key or (kk == t_key and i <= t_id)

    @inlined
    def kept_weight(x, i, m, t_key, t_id):
        if kept_by(key_of(x), i, t_key, t_id):
            return math.exp(x - m)
        return 0.0

    @inlined
    def masked(y, i, mask, mask_off):
        x = float64(y)
        if mask_off >= 0:
            w = mask[mask_off + (i >> 5)]
            if (w >> uint32(i & 31)) & uint32(1) == uint32(0):
                x = -math.inf
        return x

    @inlined
    def bin_of(d):
        # d = m - z / T >= 0; monotone in z / T (the same fp64 operations everywhere)
        if d < SPAN:
            return min(int32(d * SCALE), int32(HB - 1))
        return int32(HB - 1)

    @inlined
    def row_max(wf, fb):
        mx = -math.inf
        for q in range(G):
            mx = max(mx, wf[fb + PV + q])
        return mx

    @inlined
    def hist_one(x, i, hi, prefix, shift, by_mass, m, tk_key, tk_id, hc, hm):
        kk = key_of(x)
        if (kk & hi) == prefix and kept_by(kk, i, tk_key, tk_id):
            d = int32((kk >> uint64(shift)) & uint64(NBINS - 1))
            cuda.atomic.add(hc, d, 1)
            if by_mass:
                cuda.atomic.add(hm, d, math.exp(x - m))

    @inlined
    def select(z, base, vocab, temp, m, need, by_mass, tk_key, tk_id, hc, hm, st, red):
        """Radix select of the best-first prefix that top-k (count `need`) or top-p (mass `need`
        of the survivors of (tk_key, tk_id)) keeps. Returns (key, last kept id at that key)."""
        tid = cuda.threadIdx.x
        prefix = uint64(0)
        hi = uint64(0)
        above = 0.0                 # count / mass of survivors with a key above the prefix
        shift = 56
        while shift >= 0:
            for b in range(tid, NBINS, T):
                hc[b] = 0
                hm[b] = 0.0
            cuda.syncthreads()
            for i in range(tid, vocab, T):
                hist_one(z[base + i] / temp, i, hi, prefix, shift, by_mass, m, tk_key, tk_id,
                         hc, hm)
            cuda.syncthreads()
            if tid == 0:
                acc = above
                chosen = -1
                low = -1
                for b in range(NBINS - 1, -1, -1):
                    if hc[b] > 0:
                        val = hm[b] if by_mass else float64(hc[b])
                        if acc + val >= need:
                            chosen = b
                            break
                        low = b
                        acc += val
                if chosen < 0:      # rounding left the mass short of the target: keep them all
                    chosen = low
                    acc -= hm[low] if by_mass else float64(hc[low])
                st[0] = acc
                st[1] = float64(chosen)
                # the bin holds exactly what is kept from it (top-k) or one token (top-p)
                st[2] = 1.0 if (hc[chosen] == 1 or (not by_mass and
                                                   acc + float64(hc[chosen]) == need)) else 0.0
            cuda.syncthreads()
            above = st[0]
            prefix |= uint64(int64(st[1])) << uint64(shift)
            done = st[2] != 0.0
            cuda.syncthreads()
            if done:
                return prefix, int32(vocab)
            hi |= uint64(NBINS - 1) << uint64(shift)
            shift -= 8
        # exact threshold value; ties at it kept in ascending id order while the prefix allows
        chunk = (vocab + T - 1) // T
        lo = tid * chunk
        hi_i = min(vocab, lo + chunk)
        mine = 0.0
        for i in range(lo, hi_i):
            x = z[base + i] / temp
            kk = key_of(x)
            if kk == prefix and kept_by(kk, i, tk_key, tk_id):
                mine += math.exp(x - m) if by_mass else 1.0
        before = above + block_scan(mine, red)
        last = -1.0
        for i in range(lo, hi_i):
            x = z[base + i] / temp
            kk = key_of(x)
            if kk == prefix and kept_by(kk, i, tk_key, tk_id):
                if by_mass:
                    if before < need:       # the mass before it has not reached top_p yet
                        last = float64(i)
                    before += math.exp(x - m)
                else:
                    before += 1.0
                    if before <= need:
                        last = float64(i)
        return prefix, int32(tree_max(last, red))

    @inlined
    def block_min_id(first, red_i):
        tid = cuda.threadIdx.x
        red_i[tid] = first
        cuda.syncthreads()
        step = T // 2
        while step > 0:
            if tid < step and red_i[tid + step] < red_i[tid]:
                red_i[tid] = red_i[tid + step]
            cuda.syncthreads()
            step //= 2
        f = red_i[0]
        cuda.syncthreads()
        return f

    @inlined
    def full_row(out, z, base, vocab, r, fpar, ipar, m, u, hc, hm, st, red, red_i, cid, cx,
                 cw, ck):
        """The whole row by one block (FALLBACK): writes out[r]."""
        tid = cuda.threadIdx.x
        temp = fpar[r * NPAR + 0]
        top_p = fpar[r * NPAR + 1]
        min_p = fpar[r * NPAR + 2]
        top_k = ipar[r * NPAR + 0]
        tk_key = uint64(0)
        tk_id = int32(vocab)
        if top_k > 0 and top_k < vocab:
            tk_key, tk_id = select(z, base, vocab, temp, m, float64(top_k), False,
                                   uint64(0), int32(vocab), hc, hm, st, red)
        first = int32(vocab)
        last = int32(-1)
        if top_k > 0 and top_k < vocab and top_k <= cap:
            # top-k kept at most cap ids: gather them in ascending id order and finish the row
            # (top-p, min-p, the draw) in shared memory instead of more passes over the vocabulary
            chunk = (vocab + T - 1) // T
            lo = tid * chunk
            hi_i = min(vocab, lo + chunk)
            cnt = 0.0
            for i in range(lo, hi_i):
                if kept_by(key_of(z[base + i] / temp), i, tk_key, tk_id):
                    cnt += 1.0
            pos = int32(block_scan(cnt, red))
            n = int32(tree_sum(cnt, red))
            for i in range(lo, hi_i):
                x = z[base + i] / temp
                if kept_by(key_of(x), i, tk_key, tk_id):
                    cid[pos] = i
                    cx[pos] = x
                    cw[pos] = math.exp(x - m)
                    pos += 1
            cuda.syncthreads()
            s = 0.0
            for j in range(tid, n, T):
                s += cw[j]
            target_p = top_p * tree_sum(s, red)
            for j in range(tid, n, T):
                w = cw[j]
                ok = min_p <= 0.0 or w >= min_p
                if ok and top_p < 1.0:
                    # 6. kept iff the mass before it in best-first order (larger value, then
                    # lower id) has not reached top_p
                    before = 0.0
                    xj = cx[j]
                    ij = cid[j]
                    for q in range(n):
                        if cx[q] > xj or (cx[q] == xj and cid[q] < ij):
                            before += cw[q]
                    ok = before < target_p
                ck[j] = w if ok else 0.0
            cuda.syncthreads()
            cchunk = (n + T - 1) // T
            clo = tid * cchunk
            chi = min(n, clo + cchunk)
            mine = 0.0
            for j in range(clo, chi):
                mine += ck[j]
            run = block_scan(mine, red)
            total = tree_sum(mine, red)
            target = u * total
            for j in range(clo, chi):
                w = ck[j]
                if w > 0.0:
                    run += w
                    last = cid[j]
                    if run > target and first == vocab:
                        first = cid[j]
        else:
            # 6. top-p over top-k's renormalised mass
            tp_key = uint64(0)
            tp_id = int32(vocab)
            if top_p < 1.0:
                s = 0.0
                for i in range(tid, vocab, T):
                    s += kept_weight(z[base + i] / temp, i, m, tk_key, tk_id)
                total_k = tree_sum(s, red)
                tp_key, tp_id = select(z, base, vocab, temp, m, top_p * total_k, True,
                                       tk_key, tk_id, hc, hm, st, red)
            # 7-8. min-p, then the inverse CDF over kept weights in ascending id order
            chunk = (vocab + T - 1) // T
            lo = tid * chunk
            hi_i = min(vocab, lo + chunk)
            mine = 0.0
            for i in range(lo, hi_i):
                x = z[base + i] / temp
                kk = key_of(x)
                w = math.exp(x - m)
                if kept_by(kk, i, tk_key, tk_id) and kept_by(kk, i, tp_key, tp_id) and \
                        (min_p <= 0.0 or w >= min_p):
                    mine += w
            run = block_scan(mine, red)
            total = tree_sum(mine, red)
            target = u * total
            for i in range(lo, hi_i):
                x = z[base + i] / temp
                kk = key_of(x)
                w = math.exp(x - m)
                if kept_by(kk, i, tk_key, tk_id) and kept_by(kk, i, tp_key, tp_id) and \
                        (min_p <= 0.0 or w >= min_p) and w > 0.0:
                    run += w
                    last = i
                    if run > target and first == vocab:
                        first = i
        # the first id whose running mass passes u * total; else (rounding) the last kept id
        first = block_min_id(first, red_i)
        last_all = tree_max(float64(last), red)
        if tid == 0:
            out[r] = first if first < vocab else int32(last_all)

    return SimpleNamespace(WF=WF, WI=WI, tree_argmax=tree_argmax, key_of=key_of, uniform=uniform,
                           tree_sum=tree_sum, tree_max=tree_max, block_scan=block_scan,
                           kept_by=kept_by, masked=masked, bin_of=bin_of, row_max=row_max,
                           full_row=full_row, block_min_id=block_min_id)


def _offsets(G, HB, cap):
    # per row: wf = [bin mass HB | block max G | block mass G | kept-bins mass G | same, min-p G]
    #          wi = [bin count HB | block argmax id G | candidate ids cap | count | ticket]
    return (0, HB, HB + G, HB + 2 * G, HB + 3 * G,
            0, HB, HB + G, HB + G + cap, HB + G + cap + 1)


def sample_prep(threads=SAMPLE_THREADS, blocks=ROW_BLOCKS, nbins=HIST_BINS, cap=KCAP):
    T, G, HB = threads, blocks, nbins
    F = _parts(T, G, HB, cap)
    WF, WI = F.WF, F.WI
    HM, PV, PA, BA, BK, HC, PI, CL, CN, CT = _offsets(G, HB, cap)
    masked, tree_argmax = F.masked, F.tree_argmax

    def prep_kernel(out, logits, z, vocab, fpar, ipar, upar, pen, mask, wf, wi):
        """grid (G, rows), block T. fpar [rows, 8] f64: temperature, top_p, min_p, repetition,
        presence, frequency, plan (out), u (out); ipar [rows, 8] i32: top_k, penalty word
        offset, penalty count, mask word offset (-1: none), logit_bias word offset, logit_bias
        count; upar [rows, 2] u64: seed, position; pen: (id, generated count) pairs and
        logit_bias (id, bias low word, bias high word) triples; mask: bits, little-endian in u32 words; wf, wi: the
        rows' work (_offsets)."""
        red_v = cuda.shared.array(T, float64)
        red_i = cuda.shared.array(T, int32)
        g = cuda.blockIdx.x
        r = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        base = int64(r) * vocab
        fb = r * WF
        ib = r * WI
        chunk = (vocab + G - 1) // G
        lo = g * chunk
        hi = min(vocab, lo + chunk)
        # this block's share of the row's histograms, zeroed for sample_stats' atomics
        per = (HB + G - 1) // G
        for b in range(g * per + tid, min(HB, g * per + per), T):
            wf[fb + HM + b] = 0.0
            wi[ib + HC + b] = 0
        if g == 0 and tid == 0:
            wi[ib + CN] = 0
            wi[ib + CT] = 0
        mask_off = ipar[r * NPAR + 3]
        # 3b. the grammar mask (ids past it are off: the host packs zero bits there)
        for i in range(lo + tid, hi, T):
            z[base + i] = masked(logits[base + i], i, mask, mask_off)
        cuda.syncthreads()
        # 2-3. penalties on the listed distinct ids of this chunk (a masked -inf stays -inf)
        rep = fpar[r * NPAR + 3]
        pres = fpar[r * NPAR + 4]
        freq = fpar[r * NPAR + 5]
        pen_off = ipar[r * NPAR + 1]
        n_pen = ipar[r * NPAR + 2]
        for j in range(tid, n_pen, T):
            tok = pen[pen_off + 2 * j]
            if tok >= lo and tok < hi:
                cnt = pen[pen_off + 2 * j + 1]
                x = z[base + tok]
                if rep != 1.0:
                    if x > 0:
                        x = x / rep
                    else:
                        x = x * rep
                if cnt > 0 and (pres != 0.0 or freq != 0.0):
                    x -= freq * float64(cnt) + pres
                z[base + tok] = x
        cuda.syncthreads()
        # 3a. logit_bias after the penalties: (id, low word, high word of the float64 bias)
        bias_off = ipar[r * NPAR + 4]
        n_bias = ipar[r * NPAR + 5]
        for j in range(tid, n_bias, T):
            tok = pen[bias_off + 3 * j]
            if tok >= lo and tok < hi:
                z[base + tok] += cuda.libdevice.hiloint2double(int32(pen[bias_off + 3 * j + 2]),
                                                               int32(pen[bias_off + 3 * j + 1]))
        cuda.syncthreads()
        bv = -math.inf
        bi = int32(vocab)           # an empty chunk loses every tie
        for i in range(lo + tid, hi, T):
            v = z[base + i]
            if v > bv or bi == vocab:
                bv = v
                bi = i
        best = tree_argmax(bv, bi, red_v, red_i)
        if tid == 0:
            wf[fb + PV + g] = red_v[0]
            wi[ib + PI + g] = best
    return prep_kernel


def sample_stats(threads=SAMPLE_THREADS, blocks=ROW_BLOCKS, nbins=HIST_BINS, cap=KCAP):
    T, G, HB = threads, blocks, nbins
    F = _parts(T, G, HB, cap)
    WF, WI = F.WF, F.WI
    HM, PV, PA, BA, BK, HC, PI, CL, CN, CT = _offsets(G, HB, cap)
    bin_of, row_max, tree_sum = F.bin_of, F.row_max, F.tree_sum

    def stats_kernel(out, logits, z, vocab, fpar, ipar, upar, pen, mask, wf, wi):
        """grid (G, rows), block T; arguments as sample_prep's."""
        hc = cuda.shared.array(HB, int32)
        hm = cuda.shared.array(HB, float64)
        red = cuda.shared.array(T, float64)
        g = cuda.blockIdx.x
        r = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        temp = fpar[r * NPAR + 0]
        if temp == 0.0:
            return
        base = int64(r) * vocab
        fb = r * WF
        ib = r * WI
        chunk = (vocab + G - 1) // G
        lo = g * chunk
        hi = min(vocab, lo + chunk)
        m = row_max(wf, fb) / temp          # max(z / T): division by T > 0 keeps the order
        need = ipar[r * NPAR + 0] > 0 or fpar[r * NPAR + 1] < 1.0
        if need:
            for b in range(tid, HB, T):
                hc[b] = 0
                hm[b] = 0.0
            cuda.syncthreads()
        s = 0.0
        for i in range(lo + tid, hi, T):
            x = z[base + i] / temp
            w = math.exp(x - m)
            s += w
            if need:
                b = bin_of(m - x)
                cuda.atomic.add(hc, b, 1)
                cuda.atomic.add(hm, b, w)
        tot = tree_sum(s, red)              # (its barriers also close the histogram)
        if tid == 0:
            wf[fb + PA + g] = tot
        if need:
            for b in range(tid, HB, T):
                c = hc[b]
                if c > 0:
                    atomic_add_at(wi, ib + HC + b, c)
                    atomic_add_at(wf, fb + HM + b, hm[b])
    return stats_kernel


def sample(threads=SAMPLE_THREADS, blocks=ROW_BLOCKS, nbins=HIST_BINS, cap=KCAP):
    T, G, HB = threads, blocks, nbins
    F = _parts(T, G, HB, cap)
    WF, WI = F.WF, F.WI
    HM, PV, PA, BA, BK, HC, PI, CL, CN, CT = _offsets(G, HB, cap)
    NBT = HB // T                            # histogram bins per thread (contiguous)
    bin_of, row_max, tree_sum, tree_max = F.bin_of, F.row_max, F.tree_sum, F.tree_max
    block_scan, key_of, kept_by, uniform = F.block_scan, F.key_of, F.kept_by, F.uniform
    full_row, block_min_id = F.full_row, F.block_min_id

    def sample_kernel(out, logits, z, vocab, fpar, ipar, upar, pen, mask, wf, wi):
        """grid (G, rows), block T; arguments as sample_prep's. Writes out[r], fpar[r, 6]
        (the plan) and fpar[r, 7] (u)."""
        red = cuda.shared.array(T, float64)
        red_i = cuda.shared.array(T, int32)
        st = cuda.shared.array(8, float64)
        pa = cuda.shared.array(G, float64)
        hc = cuda.shared.array(NBINS, int32)        # the fallback's radix histograms
        hm = cuda.shared.array(NBINS, float64)
        cid = cuda.shared.array(cap, int32)         # candidates as listed
        cx = cuda.shared.array(cap, float64)
        cw = cuda.shared.array(cap, float64)
        bid = cuda.shared.array(cap, int32)         # ... in best-first order
        bw = cuda.shared.array(cap, float64)
        g = cuda.blockIdx.x
        r = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        fb = r * WF
        ib = r * WI
        temp = fpar[r * NPAR + 0]
        if temp == 0.0:             # 4. greedy: the best block maximum, lower id on ties
            if g == 0 and tid == 0:
                bv = wf[fb + PV]
                bi = wi[ib + PI]
                for q in range(1, G):
                    v = wf[fb + PV + q]
                    i = wi[ib + PI + q]
                    if v > bv or (v == bv and i < bi):
                        bv = v
                        bi = i
                out[r] = bi
            return
        base = int64(r) * vocab
        top_p = fpar[r * NPAR + 1]
        min_p = fpar[r * NPAR + 2]
        top_k = ipar[r * NPAR + 0]
        has_k = top_k > 0
        has_p = top_p < 1.0
        m = row_max(wf, fb) / temp
        total = 0.0                 # every id's mass, in block order (deterministic)
        for q in range(G):
            total += wf[fb + PA + q]
        # the plan, the same in every block of the row
        mode = ALL
        lo_b = int32(HB)            # bins below lo_b: surely kept (min-p aside)
        hi_b = int32(-1)            # bins lo_b..hi_b: candidates
        if has_k or has_p:
            c0 = 0.0
            m0 = 0.0
            for b in range(tid * NBT, tid * NBT + NBT):
                c0 += float64(wi[ib + HC + b])
                m0 += wf[fb + HM + b]
            cb0 = block_scan(c0, red)
            mb = block_scan(m0, red)
            cb = cb0
            need_c = float64(top_k)
            need_m = top_p * total
            # the first bin where the count (top-k) or mass (top-p) from the top reaches it
            mine = float64(HB)
            last_nz = -1.0
            for b in range(tid * NBT, tid * NBT + NBT):
                c = float64(wi[ib + HC + b])
                cb += c
                mb += wf[fb + HM + b]
                if c > 0.0:
                    last_nz = float64(b)
                    if mine == HB and ((has_k and cb >= need_c) or
                                       (not has_k and mb >= need_m)):
                        mine = float64(b)
            cut = -tree_max(-mine, red)
            if cut >= HB:           # rounding left the mass short: the last nonempty bin
                cut = tree_max(last_nz, red)
            cut_b = int32(cut)
            # the count through the cut bin and in it
            cb = cb0
            for b in range(tid * NBT, tid * NBT + NBT):
                c = float64(wi[ib + HC + b])
                cb += c
                if b == cut_b:
                    st[0] = cb
                    st[1] = c
            cuda.syncthreads()
            through = st[0]
            inside = st[1]
            cuda.syncthreads()
            if through <= cap:
                mode = SMALL
                lo_b = int32(0)
                hi_b = cut_b
            elif not has_k and inside <= cap:
                mode = WIDE
                lo_b = cut_b
                hi_b = cut_b
            else:
                mode = FALLBACK
        if mode == FALLBACK:
            if g == 0:
                u = uniform(upar, r)
                full_row(out, z, base, vocab, r, fpar, ipar, m, u, hc, hm, st, red, red_i,
                         cid, cx, cw, bw)
                if tid == 0:
                    fpar[r * NPAR + 6] = float64(mode)
                    fpar[r * NPAR + 7] = u
            return
        chunk = (vocab + G - 1) // G
        lo = g * chunk
        hi = min(vocab, lo + chunk)
        sa = 0.0                    # mass of this chunk's surely kept ids, without min-p
        sk = 0.0                    # ... with min-p
        for i in range(lo + tid, hi, T):
            x = z[base + i] / temp
            w = math.exp(x - m)
            b = int32(0)
            if mode != ALL:
                b = bin_of(m - x)
            if b < lo_b:
                sa += w
                if min_p <= 0.0 or w >= min_p:
                    sk += w
            elif b <= hi_b:
                p = atomic_add_at(wi, ib + CN, 1)
                if p < cap:
                    wi[ib + CL + p] = i
        sa = tree_sum(sa, red)
        sk = tree_sum(sk, red)
        if tid == 0:
            wf[fb + BA + g] = sa
            wf[fb + BK + g] = sk
        # the last block of the row to get here finishes it
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            st[2] = 1.0 if atomic_add_at(wi, ib + CT, 1) == G - 1 else 0.0
        cuda.syncthreads()
        if st[2] == 0.0:
            return
        cuda.threadfence()
        # other blocks' results: read through atomics (L2), never a stale L1 line
        if tid == 0:
            st[7] = float64(min(atomic_add_at(wi, ib + CN, 0), cap))
        for q in range(tid, G, T):
            pa[q] = atomic_add_at(wf, fb + BA + q, 0.0)
        cuda.syncthreads()
        n = int32(st[7])
        for j in range(tid, n, T):
            i = atomic_add_at(wi, ib + CL + j, 0)
            x = z[base + i] / temp
            cid[j] = i
            cx[j] = x
            cw[j] = math.exp(x - m)
        cuda.syncthreads()
        before_all = 0.0            # mass of the surely kept bins (WIDE), in block order
        for q in range(G):
            before_all += pa[q]
        # rank the candidates best-first: larger value, lower id on ties (a total order); two
        # per thread share each (value, id) load of the O(n^2) count
        for j in range(tid, n, 2 * T):
            j2 = j + T
            two = j2 < n
            xj = cx[j]
            ij = cid[j]
            x2 = cx[j2] if two else xj
            i2 = cid[j2] if two else ij
            rk = 0
            rk2 = 0
            for q in range(n):
                xq = cx[q]
                iq = cid[q]
                if xq > xj or (xq == xj and iq < ij):
                    rk += 1
                if xq > x2 or (xq == x2 and iq < i2):
                    rk2 += 1
            bid[rk] = ij
            bw[rk] = cw[j]
            if two:
                bid[rk2] = i2
                bw[rk2] = cw[j2]
        cuda.syncthreads()
        cch = (n + T - 1) // T
        clo = tid * cch
        chi = min(n, clo + cch)
        mine = 0.0
        for j in range(clo, chi):
            mine += bw[j]
        ex = block_scan(mine, red)
        run = ex
        for j in range(clo, chi):
            run += bw[j]
            if j == top_k - 1:
                st[3] = run         # top-k's mass (SMALL: the top k are all candidates)
        cuda.syncthreads()
        target_p = top_p * (st[3] if has_k else total)
        run = ex + (before_all if mode == WIDE else 0.0)
        lastr = -1.0
        for j in range(clo, chi):
            # 5-6. top-k by rank; top-p: the mass before it has not reached top_p
            if (not has_k or j < top_k) and (not has_p or run < target_p):
                lastr = float64(j)
            run += bw[j]
        L = int32(tree_max(lastr, red)) + 1
        t_id = int32(-1)
        t_key = uint64(0)
        if L > 0:
            t_id = bid[L - 1]
            t_key = key_of(z[base + t_id] / temp)
        # each chunk's kept mass: its surely kept ids (7. min-p per id) plus its kept
        # candidates, summed in a fixed order (T / G threads per chunk, strided ranks)
        for j in range(tid, L, T):
            w = bw[j]
            cid[j] = bid[j] // chunk
            cw[j] = w if (min_p <= 0.0 or w >= min_p) else 0.0
        cuda.syncthreads()
        q = tid % G
        s = 0.0
        for j in range(tid // G, L, T // G):
            if cid[j] == q:
                s += cw[j]
        red[tid] = s
        cuda.syncthreads()
        if tid < G:
            s = atomic_add_at(wf, fb + BK + tid, 0.0)
            for k in range(T // G):
                s += red[tid + k * G]
            pa[tid] = s
        cuda.syncthreads()
        u = uniform(upar, r)
        if tid == 0:
            kept = 0.0
            for q in range(G):
                kept += pa[q]
            target = u * kept
            gs = -1
            lastq = 0
            acc = 0.0
            for q in range(G):
                if pa[q] > 0.0:
                    lastq = q
                    if gs < 0 and acc + pa[q] > target:
                        gs = q
                        break
                    acc += pa[q]
            if gs < 0:              # rounding: the last chunk with kept mass
                gs = lastq
                acc = kept - pa[lastq]
            st[4] = float64(gs)
            st[5] = acc
            st[6] = target
        cuda.syncthreads()
        gs = int32(st[4])
        acc = st[5]
        target = st[6]
        # 8. the inverse CDF inside chunk gs: contiguous ids per thread, in ascending order
        lo = gs * chunk
        hi = min(vocab, lo + chunk)
        sc = (hi - lo + T - 1) // T
        a = lo + tid * sc
        e = min(hi, a + sc)
        mine = 0.0
        for i in range(a, e):
            x = z[base + i] / temp
            w = math.exp(x - m)
            b = int32(0)
            if mode != ALL:
                b = bin_of(m - x)
            if (min_p <= 0.0 or w >= min_p) and \
                    (b < lo_b or (L > 0 and kept_by(key_of(x), i, t_key, t_id))):
                mine += w
        run = acc + block_scan(mine, red)
        first = int32(vocab)
        last = int32(-1)
        for i in range(a, e):
            x = z[base + i] / temp
            w = math.exp(x - m)
            b = int32(0)
            if mode != ALL:
                b = bin_of(m - x)
            if w > 0.0 and (min_p <= 0.0 or w >= min_p) and \
                    (b < lo_b or (L > 0 and kept_by(key_of(x), i, t_key, t_id))):
                run += w
                last = i
                if run > target and first == vocab:
                    first = i
        first = block_min_id(first, red_i)
        last_all = tree_max(float64(last), red)
        if tid == 0:
            out[r] = first if first < vocab else int32(last_all)
            fpar[r * NPAR + 6] = float64(mode)
            fpar[r * NPAR + 7] = u
    return sample_kernel
