"""Sampling on the device: the host side of kernels/sample.py.

Per step the host packs each row's request (SampleRow) into pinned staging, in one block laid out

    fpar f64 [rows_cap, 8]   temperature, top_p, min_p, repetition, presence, frequency,
                             plan (out: ALL 0 / SMALL 1 / WIDE 2 / FALLBACK 3), u (out)
    ipar i32 [rows_cap, 8]   top_k (0: off), penalty word offset, penalty count, mask word offset,
                             logit_bias word offset, logit_bias count
    upar u64 [rows_cap, 2]   seed, position
    data u32 [...]           per row, packed back to back: penalty pairs (id, generated count),
                             logit_bias triples (id, low and high word of the float64 bias),
                             then the grammar mask's bits (np.packbits little-endian, V bits)

copies the used prefix of the block with ONE async H2D copy, and launches the three sampling
kernels of kernels/sample.py (`sample_prep`, `sample_stats`, `sample`; grid = (ROW_BLOCKS, rows)
each) over the fp32 logits rows the model head left in its workspace. The token ids land in a
device int32 buffer the caller copies back with the sync that ends its step. The kernels keep
per-row work (histograms, per-block partials, candidate ids) in two fixed device arrays;
`sample_prep` zeroes what the later two accumulate, so nothing is cleared from the host.

Penalty entries are the distinct ids of prompt + generated (repetition penalty) or of generated
only (presence / frequency alone), each with its generated count. np.unique over a long prompt
costs ~1 ms per 32K tokens, so a row may name a `cache_key` under which its prompt's unique ids
are kept (the Program passes (sequence id, prompt length)).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

# the request type is a backend-neutral contract; re-exported here
from ....contracts import SampleRow  # noqa: F401

NPAR = 8                     # kernels/sample.py NPAR
THREADS = 512                # kernels/sample.py SAMPLE_THREADS (register budget)
ROW_BLOCKS = 64              # kernels/sample.py ROW_BLOCKS: blocks per row
HIST_BINS = 3072             # kernels/sample.py HIST_BINS
KCAP = 1024                  # kernels/sample.py KCAP
KERNELS = ("sample_prep", "sample_stats", "sample")   # in launch order (DeviceSampler.launch)


def work_words(blocks: int = ROW_BLOCKS, nbins: int = HIST_BINS, cap: int = KCAP) -> tuple:
    """(fp64, int32) work words per row: kernels/sample.py work_f64 / work_i32."""
    return nbins + 4 * blocks, nbins + blocks + cap + 2


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


class SamplerLayout:
    """Offsets of the per-step block for `rows_cap` rows of `vocab` ids and up to `pen_cap`
    penalty entries per row."""

    def __init__(self, rows_cap: int, vocab: int, pen_cap: int):
        self.rows_cap, self.vocab = int(rows_cap), int(vocab)
        self.pen_cap = int(min(pen_cap, vocab))
        self.words = mask_words(vocab)
        self.fpar = 0
        self.ipar = self.fpar + 8 * NPAR * rows_cap
        self.upar = self.ipar + 4 * NPAR * rows_cap
        self.data = self.upar + 8 * 2 * rows_cap
        # logit_bias: at most one entry per id of the vocabulary
        self.data_words = rows_cap * (2 * self.pen_cap + 3 * self.vocab + self.words)
        self.nbytes = self.data + 4 * self.data_words

    def views(self, buf: np.ndarray):
        """Typed views (fpar, ipar, upar, data) of a uint8 buffer of nbytes."""
        r = self.rows_cap
        return (buf[self.fpar:self.ipar].view(np.float64).reshape(r, NPAR),
                buf[self.ipar:self.upar].view(np.int32).reshape(r, NPAR),
                buf[self.upar:self.data].view(np.uint64).reshape(r, 2),
                buf[self.data:self.nbytes].view(np.uint32))


class PromptCache:
    """cache_key -> sorted distinct prompt ids (a few sequences' worth; LRU)."""

    def __init__(self, capacity: int = 64):
        self.capacity, self._d = capacity, OrderedDict()

    def unique(self, key, prompt_ids) -> np.ndarray:
        if key is None:
            return np.unique(np.asarray(prompt_ids, np.int64))
        hit = self._d.get(key)
        if hit is None:
            hit = np.unique(np.asarray(prompt_ids, np.int64))
            self._d[key] = hit
            if len(self._d) > self.capacity:
                self._d.popitem(last=False)
        else:
            self._d.move_to_end(key)
        return hit


def penalty_entries(spec, prompt_unique: np.ndarray, generated_ids) -> tuple:
    """(distinct ids, generated counts) the penalties touch: sampling.apply_penalties' sets.
    Not sorted: the sorted prompt ids first, then generated ids the prompt lacks (no merge
    sort of the prompt per step)."""
    rep = spec.repetition_penalty != 1.0
    pf = (spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0) and len(generated_ids)
    if not rep and not pf:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    gen, counts = np.unique(np.asarray(generated_ids, np.int64), return_counts=True)
    if not rep:
        return gen, counts
    pu = np.asarray(prompt_unique, np.int64)
    pos = np.minimum(np.searchsorted(pu, gen), max(len(pu) - 1, 0))
    in_prompt = (pu[pos] == gen) if len(pu) else np.zeros(len(gen), np.bool_)
    ids = np.concatenate([pu, gen[~in_prompt]])
    c = np.zeros(len(ids), np.int64)
    if pf:                                  # counts only matter when the penalties are on
        c[pos[in_prompt]] = counts[in_prompt]
        c[len(pu):] = counts[~in_prompt]
    return ids, c


def pack(layout: SamplerLayout, buf: np.ndarray, rows, cache: PromptCache = None) -> int:
    """Write the requests of `rows` (SampleRow, or None: plain argmax) into `buf` (uint8, at least
    layout.nbytes); return how many leading bytes the device needs. Raises ValueError for a
    grammar mask that allows no token (the host sampler's error) or too many rows / entries."""
    V = layout.vocab
    if len(rows) > layout.rows_cap:
        raise ValueError(f"sampler: {len(rows)} rows exceed its capacity {layout.rows_cap}")
    fpar, ipar, upar, data = layout.views(buf)
    used = 0
    for r, row in enumerate(rows):
        ipar[r, :] = 0
        ipar[r, 3] = -1
        fpar[r, :] = 0.0
        fpar[r, 1] = 1.0
        fpar[r, 3] = 1.0
        upar[r, :] = 0
        if row is None:
            continue                                    # temperature 0, nothing else: argmax
        s = row.spec
        fpar[r, :6] = (s.temperature, s.top_p, s.min_p, s.repetition_penalty,
                       s.presence_penalty, s.frequency_penalty)
        ipar[r, 0] = s.top_k if 0 < s.top_k < V else 0
        upar[r, 0] = int(s.seed) & 0xFFFFFFFFFFFFFFFF
        upar[r, 1] = int(row.position) & 0xFFFFFFFFFFFFFFFF
        if s.repetition_penalty != 1.0:
            pu = (cache or PromptCache(0)).unique(row.cache_key, row.prompt_ids)
        else:
            pu = np.empty(0, np.int64)
        ids, counts = penalty_entries(s, pu, row.generated_ids)
        n = len(ids)
        if n:
            if n > layout.pen_cap:
                raise ValueError(f"sampler: {n} penalty entries exceed {layout.pen_cap} per row")
            if ids.min() < 0 or ids.max() >= V:
                raise ValueError(f"sampler: a prompt or generated id is outside [0, {V})")
            pairs = data[used: used + 2 * n].reshape(n, 2)
            pairs[:, 0] = ids
            pairs[:, 1] = counts
            ipar[r, 1], ipar[r, 2] = used, n
            used += 2 * n
        bias = s.logit_bias
        if bias:
            ids = np.array([t for t, _ in bias], np.int64)
            values = np.array([b for _, b in bias], np.float64)
            if ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) != len(ids):
                raise ValueError(f"sampler: logit_bias ids must be distinct and in [0, {V})")
            triples = data[used: used + 3 * len(ids)].reshape(-1, 3)
            triples[:, 0] = ids
            triples[:, 1:] = values.view(np.uint32).reshape(-1, 2)     # little-endian: low, high
            ipar[r, 4], ipar[r, 5] = used, len(ids)
            used += 3 * len(ids)
        if row.mask is not None:
            m = np.asarray(row.mask, np.bool_)[:V]
            if not m.any():
                raise ValueError("the grammar mask allows no token")
            bits = np.packbits(m, bitorder="little")
            w = data[used: used + layout.words]
            w[:] = 0
            w.view(np.uint8)[:len(bits)] = bits
            ipar[r, 3] = used
            used += layout.words
    return layout.data + 4 * used


class DeviceSampler:
    """Fixed device buffers (from the model's arena), pinned staging, the launch."""

    def __init__(self, arena, kernels, rows_cap: int, vocab: int, pen_cap: int):
        from ....core.cuda import driver as _d
        self._d = _d
        self.layout = SamplerLayout(rows_cap, vocab, pen_cap)
        self.block = arena.take((self.layout.nbytes,), np.uint8, "sampler parameters")
        self.z = arena.take((rows_cap, vocab), np.float64, "sampler fp64 rows")
        wf, wi = work_words()
        self.wf = arena.take((rows_cap, wf), np.float64, "sampler fp64 work")
        self.wi = arena.take((rows_cap, wi), np.int32, "sampler int32 work")
        self.staging = _d.PinnedBuffer(self.layout.nbytes)
        # a chained step's (the pipelined decode, CudaModel.launch_tokens(after=)): two small
        # stagings in turn, the fixed parameters only (its rows pack no penalty, bias or mask)
        self.ahead_staging = [_d.PinnedBuffer(self.layout.data) for _ in range(2)]
        self.kernels = kernels
        self.threads = THREADS          # the kernels' block size (their factories' default)
        self.blocks = ROW_BLOCKS        # blocks per row (idem)
        self.cache = PromptCache()

    @staticmethod
    def device_bytes(rows_cap: int, vocab: int, pen_cap: int) -> int:
        wf, wi = work_words()
        return (SamplerLayout(rows_cap, vocab, pen_cap).nbytes + 8 * rows_cap * vocab
                + rows_cap * (8 * wf + 4 * wi) + 4 * 256)

    def launch(self, stream, logits_ptr: int, tokens_ptr: int, rows, ahead_turn=None) -> None:
        """Pack, copy, launch the three kernels (asynchronous on `stream`). ahead_turn (0 or 1,
        alternating): a step launched while the previous one may not have copied its own
        parameters yet packs into that small staging; its rows must pack no data."""
        lay = self.layout
        staging = self.staging if ahead_turn is None else self.ahead_staging[ahead_turn]
        size = lay.nbytes if ahead_turn is None else lay.data
        nbytes = pack(lay, staging.view(np.uint8, 0, size), rows, self.cache)
        if nbytes > size:
            raise ValueError("sampler: a chained step's rows pack no penalty, bias or mask")
        self._d.copy_htod_async(self.block.ptr, staging.ptr, nbytes, stream)
        base = self.block.ptr
        args = (tokens_ptr, logits_ptr, self.z.ptr, lay.vocab, base + lay.fpar, base + lay.ipar,
                base + lay.upar, base + lay.data, base + lay.data, self.wf.ptr, self.wi.ptr)
        # sample_stats does nothing for greedy rows: an all-greedy step (penalties or a mask
        # make it take this path) skips its launch (~5-7 us of host time)
        sampled = any(row is not None and row.spec.temperature != 0.0 for row in rows)
        k = self.kernels
        for kernel in ((k.sample_prep, k.sample_stats, k.sample) if sampled else
                       (k.sample_prep, k.sample)):
            kernel.launch(stream, (self.blocks, len(rows)), (self.threads,), args)

    def close(self) -> None:
        for buf in [self.staging] + self.ahead_staging:
            if buf is not None:
                buf.free()
        self.staging, self.ahead_staging = None, []
