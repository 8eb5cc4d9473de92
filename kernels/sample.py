"""Logits -> token ids on the GPU, the device twin of ninfer/models/qwen3_5/program/sampling.py.

`argmax`: the greedy id of each fp32 row (lowest id on ties); the decode graph's head uses it.

`sample`: one block per row, the host sampler's steps in its order, all filter arithmetic in fp64:
grammar mask (packed bits) and penalties (a sparse list of (id, generated count) per row) into an
fp64 copy z of the row, then greedy argmax, or z / T with top-k, top-p, min-p and the inverse-CDF
draw in ascending id order with u = counter_uniform(seed, position) (splitmix64 in uint64).

Top-k and top-p keep a best-first prefix (value descending, ties by lower id). Their thresholds come
from a radix select over an order-preserving uint64 key of z / T, 8 bits per pass from the top:
count-weighted for top-k, probability-mass-weighted (fp64) for top-p. A pass stops early when the
chosen bin holds exactly what is kept from it; otherwise the last pass leaves the exact threshold
value, and the tied ids kept at it are found by one pass over CONTIGUOUS id chunks per thread
with a block prefix scan (so id order is the oracle's tie order). A threshold is then a pair
(key, last kept id among the ties), a plain predicate every later (coalesced, strided) pass tests.
A top-k of at most KCAP ids is then gathered (ascending id) into shared memory, where top-p (each
id's mass before it in best-first order), min-p and the draw finish without more passes.
"""
import math

from numba import cuda, float32, float64, int32, int64, uint32, uint64

THREADS = 1024              # argmax
SAMPLE_THREADS = 512        # sample: ~100 registers per thread; 1024 threads would not launch
NBINS = 256                 # radix digit of 8 bits
KCAP = 1024                 # top-k up to this many ids finishes in shared memory
NPAR = 8                    # fp64 / int32 parameters per row (layout: cuda/sampler.py)
SIGN = 0x8000000000000000


def _block_argmax(threads):
    @cuda.jit(device=True, inline=True)
    def block_argmax(bv, bi, red_v, red_i):
        """The block's best (value, id): larger value, lower id on ties; every thread gets the
        id."""
        tid = cuda.threadIdx.x
        red_v[tid] = bv
        red_i[tid] = bi
        cuda.syncthreads()
        step = threads // 2
        while step > 0:
            if tid < step:
                ov = red_v[tid + step]
                oi = red_i[tid + step]
                if ov > red_v[tid] or (ov == red_v[tid] and oi < red_i[tid]):
                    red_v[tid] = ov
                    red_i[tid] = oi
            cuda.syncthreads()
            step //= 2
        best = red_i[0]
        cuda.syncthreads()          # the arrays may be reused at once
        return best
    return block_argmax


def argmax(threads=THREADS):
    block_argmax = _block_argmax(threads)

    def argmax_kernel(out, logits, vocab):
        # grid (rows,), block `threads`; np.argmax's rule: the first maximum
        red_v = cuda.shared.array(threads, float32)
        red_i = cuda.shared.array(threads, int32)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        base = int64(r) * vocab
        bv = float32(-math.inf)
        bi = int32(vocab)           # "none yet": a row of -inf still answers its first id
        for i in range(tid, vocab, threads):
            v = logits[base + i]
            if v > bv or bi == vocab:
                bv = v
                bi = i
        best = block_argmax(bv, bi, red_v, red_i)
        if tid == 0:
            out[r] = best
    return argmax_kernel


def sample(threads=SAMPLE_THREADS):
    T = threads
    block_argmax = _block_argmax(threads)

    @cuda.jit(device=True, inline=True)
    def key_of(x):
        # order-preserving: a larger float has a larger key; -0.0 and 0.0 are one value
        if x == 0.0:
            return uint64(SIGN)
        b = uint64(cuda.libdevice.double_as_longlong(x))
        if b >> uint64(63):
            return ~b
        return b | uint64(SIGN)

    @cuda.jit(device=True, inline=True)
    def splitmix64(z):
        z = z + uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
        return z ^ (z >> uint64(31))

    @cuda.jit(device=True, inline=True)
    def block_sum(v, red):
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        step = T // 2
        while step > 0:
            if tid < step:
                red[tid] += red[tid + step]
            cuda.syncthreads()
            step //= 2
        s = red[0]
        cuda.syncthreads()
        return s

    @cuda.jit(device=True, inline=True)
    def block_max(v, red):
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        step = T // 2
        while step > 0:
            if tid < step:
                if red[tid + step] > red[tid]:
                    red[tid] = red[tid + step]
            cuda.syncthreads()
            step //= 2
        s = red[0]
        cuda.syncthreads()
        return s

    @cuda.jit(device=True, inline=True)
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

    @cuda.jit(device=True, inline=True)
    def kept_by(kk, i, t_key, t_id):
        return kk > t_key or (kk == t_key and i <= t_id)

    @cuda.jit(device=True, inline=True)
    def kept_weight(x, i, m, t_key, t_id):
        if kept_by(key_of(x), i, t_key, t_id):
            return math.exp(x - m)
        return 0.0

    @cuda.jit(device=True, inline=True)
    def masked(y, i, mask, mask_off):
        x = float64(y)
        if mask_off >= 0:
            w = mask[mask_off + (i >> 5)]
            if (w >> uint32(i & 31)) & uint32(1) == uint32(0):
                x = -math.inf
        return x

    @cuda.jit(device=True, inline=True)
    def hist_one(x, i, hi, prefix, shift, by_mass, m, tk_key, tk_id, hc, hm):
        kk = key_of(x)
        if (kk & hi) == prefix and kept_by(kk, i, tk_key, tk_id):
            d = int32((kk >> uint64(shift)) & uint64(NBINS - 1))
            cuda.atomic.add(hc, d, 1)
            if by_mass:
                cuda.atomic.add(hm, d, math.exp(x - m))

    @cuda.jit(device=True, inline=True)
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
            # four loads in flight per thread before the atomics (one block streams the row)
            i = tid
            while i + 3 * T < vocab:
                x0 = z[base + i]
                x1 = z[base + i + T]
                x2 = z[base + i + 2 * T]
                x3 = z[base + i + 3 * T]
                hist_one(x0 / temp, i, hi, prefix, shift, by_mass, m, tk_key, tk_id, hc, hm)
                hist_one(x1 / temp, i + T, hi, prefix, shift, by_mass, m, tk_key, tk_id, hc, hm)
                hist_one(x2 / temp, i + 2 * T, hi, prefix, shift, by_mass, m, tk_key, tk_id,
                         hc, hm)
                hist_one(x3 / temp, i + 3 * T, hi, prefix, shift, by_mass, m, tk_key, tk_id,
                         hc, hm)
                i += 4 * T
            while i < vocab:
                hist_one(z[base + i] / temp, i, hi, prefix, shift, by_mass, m, tk_key, tk_id,
                         hc, hm)
                i += T
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
        return prefix, int32(block_max(last, red))

    def sample_kernel(out, logits, z, vocab, fpar, ipar, upar, pen, mask):
        """grid (rows,), block `threads`. fpar [rows, 8] f64: temperature, top_p, min_p,
        repetition, presence, frequency, -, u (written back); ipar [rows, 8] i32: top_k,
        penalty word offset, penalty count, mask word offset (-1: none); upar [rows, 2] u64: seed,
        position; pen: (id, generated count) pairs; mask: bits, little-endian in u32 words."""
        red = cuda.shared.array(T, float64)
        red_i = cuda.shared.array(T, int32)
        hc = cuda.shared.array(NBINS, int32)
        hm = cuda.shared.array(NBINS, float64)
        st = cuda.shared.array(4, float64)
        cid = cuda.shared.array(KCAP, int32)        # the compacted top-k (ascending id)
        cx = cuda.shared.array(KCAP, float64)
        cw = cuda.shared.array(KCAP, float64)
        ck = cuda.shared.array(KCAP, float64)
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        base = int64(r) * vocab
        temp = fpar[r * NPAR + 0]
        top_p = fpar[r * NPAR + 1]
        min_p = fpar[r * NPAR + 2]
        rep = fpar[r * NPAR + 3]
        pres = fpar[r * NPAR + 4]
        freq = fpar[r * NPAR + 5]
        top_k = ipar[r * NPAR + 0]
        pen_off = ipar[r * NPAR + 1]
        n_pen = ipar[r * NPAR + 2]
        mask_off = ipar[r * NPAR + 3]

        # 3b. the grammar mask (ids past it are off: the host packs zero bits there)
        i = tid
        while i + 3 * T < vocab:
            y0 = logits[base + i]
            y1 = logits[base + i + T]
            y2 = logits[base + i + 2 * T]
            y3 = logits[base + i + 3 * T]
            z[base + i] = masked(y0, i, mask, mask_off)
            z[base + i + T] = masked(y1, i + T, mask, mask_off)
            z[base + i + 2 * T] = masked(y2, i + 2 * T, mask, mask_off)
            z[base + i + 3 * T] = masked(y3, i + 3 * T, mask, mask_off)
            i += 4 * T
        while i < vocab:
            z[base + i] = masked(logits[base + i], i, mask, mask_off)
            i += T
        cuda.syncthreads()
        # 2-3. penalties on the listed distinct ids (a masked -inf stays -inf: they commute)
        for j in range(tid, n_pen, T):
            tok = pen[pen_off + 2 * j]
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

        if temp == 0.0:             # 4. greedy
            bv = -math.inf
            bi = int32(vocab)
            for i in range(tid, vocab, T):
                v = z[base + i]
                if v > bv or bi == vocab:
                    bv = v
                    bi = i
            best = block_argmax(bv, bi, red, red_i)
            if tid == 0:
                out[r] = best
            return

        mx = -math.inf
        i = tid
        while i + 3 * T < vocab:
            mx = max(max(mx, z[base + i]), max(z[base + i + T],
                                               max(z[base + i + 2 * T], z[base + i + 3 * T])))
            i += 4 * T
        while i < vocab:
            mx = max(mx, z[base + i])
            i += T
        m = block_max(mx, red) / temp       # max(z / T): division by T > 0 keeps the order
        # 5. top-k
        tk_key = uint64(0)
        tk_id = int32(vocab)
        if top_k > 0 and top_k < vocab:
            tk_key, tk_id = select(z, base, vocab, temp, m, float64(top_k), False,
                                   uint64(0), int32(vocab), hc, hm, st, red)
        key = splitmix64(splitmix64(upar[2 * r]) ^ upar[2 * r + 1])
        u = float64(key >> uint64(11)) * (1.0 / 9007199254740992.0)
        first = int32(vocab)
        last = int32(-1)
        if top_k > 0 and top_k < vocab and top_k <= KCAP:
            # top-k kept at most KCAP ids: gather them in ascending id order and finish the row
            # (top-p, min-p, the draw) in shared memory instead of more passes over the vocabulary
            chunk = (vocab + T - 1) // T
            lo = tid * chunk
            hi_i = min(vocab, lo + chunk)
            cnt = 0.0
            for i in range(lo, hi_i):
                if kept_by(key_of(z[base + i] / temp), i, tk_key, tk_id):
                    cnt += 1.0
            pos = int32(block_scan(cnt, red))
            n = int32(block_sum(cnt, red))
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
            target_p = top_p * block_sum(s, red)
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
            total = block_sum(mine, red)
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
                i = tid
                while i + 3 * T < vocab:
                    x0 = z[base + i] / temp
                    x1 = z[base + i + T] / temp
                    x2 = z[base + i + 2 * T] / temp
                    x3 = z[base + i + 3 * T] / temp
                    s += kept_weight(x0, i, m, tk_key, tk_id) + \
                        kept_weight(x1, i + T, m, tk_key, tk_id)
                    s += kept_weight(x2, i + 2 * T, m, tk_key, tk_id) + \
                        kept_weight(x3, i + 3 * T, m, tk_key, tk_id)
                    i += 4 * T
                while i < vocab:
                    s += kept_weight(z[base + i] / temp, i, m, tk_key, tk_id)
                    i += T
                total_k = block_sum(s, red)
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
            total = block_sum(mine, red)
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
        red_i[tid] = first
        cuda.syncthreads()
        step = T // 2
        while step > 0:
            if tid < step and red_i[tid + step] < red_i[tid]:
                red_i[tid] = red_i[tid + step]
            cuda.syncthreads()
            step //= 2
        first = red_i[0]
        cuda.syncthreads()
        last_all = block_max(float64(last), red)
        if tid == 0:
            out[r] = first if first < vocab else int32(last_all)
            fpar[r * NPAR + 7] = u
    return sample_kernel
