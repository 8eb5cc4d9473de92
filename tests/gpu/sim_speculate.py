"""kernels/speculate.py on numba-cuda's CPU simulator (no GPU), against a numpy oracle of the
acceptance rule (program/speculative.py's: stop at the first pick that differs from the next
draft). `tests/test_speculate_nogpu.py` runs this in a subprocess (the simulator must be switched
on before numba is imported):

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_speculate.py [seed]

Prints one JSON line: rows checked, mismatches of the produced counts and of the kept slots, and
whether state_select left exactly the rows' own slots changed, each to its kept snapshot.
"""
import json
import sys

import numpy as np

from ninfer.core.cuda import numba_shim

cuda, _ = numba_shim.import_numba_cuda()
from ninfer.core.cuda.kernels import _import_kernel_module   # noqa: E402

M = _import_kernel_module("speculate")


def oracle(tokens, drafts, qs, snap_base):
    produced, keep = [], []
    for r in range(len(qs) - 1):
        k, j = qs[r + 1] - qs[r] - 1, 0
        while j < k and tokens[qs[r] + j] == drafts[r, j]:
            j += 1
        produced.append(j + 1)
        keep.append(snap_base[r] + j if snap_base[r] >= 0 else -1)
    return np.array(produced, np.int32), np.array(keep, np.int32)


def main(seed: int) -> dict:
    r = np.random.default_rng(seed)
    kmax, B = 4, 37
    ks = r.integers(0, kmax + 1, B)
    ks[:kmax + 1] = np.arange(kmax + 1)             # every k, 0 (a plain row) included
    qs = np.concatenate([[0], np.cumsum(ks + 1)]).astype(np.int32)
    drafts = r.integers(0, 50, (B, kmax)).astype(np.int32)
    drafts[ks < kmax, -1] = 7                       # (past a row's k: never read)
    tokens = r.integers(0, 50, int(qs[-1])).astype(np.int32)
    for row in range(B):                            # accept a random prefix of the drafts
        keep = r.integers(0, ks[row] + 1)
        tokens[qs[row]:qs[row] + keep] = drafts[row, :keep]
        if row % 5 == 0:                            # and every draft, now and then
            tokens[qs[row]:qs[row] + ks[row]] = drafts[row, :ks[row]]
    # row slots 0 .. B-1 (shuffled), each speculative row's snapshots after them
    slots = r.permutation(B).astype(np.int32)
    snap_base = np.full(B, -1, np.int32)
    top = B
    for row in range(B):
        if ks[row] > 0:
            snap_base[row], top = top, top + ks[row] + 1
    want_n, want_keep = oracle(tokens, drafts, qs, snap_base)
    produced = np.full(B, -99, np.int32)            # poison
    keep_slot = np.full(B, -99, np.int32)
    accept = cuda.jit(M.spec_accept())
    accept[(-(-B // 16),), (16,)](produced, keep_slot, tokens, drafts.ravel(), qs, snap_base,
                                  B, kmax)
    row_words = 300                                 # not a multiple of the block
    state0 = r.integers(0, 2 ** 32, (top + 3, row_words), dtype=np.uint64).astype(np.uint32)
    state = state0.copy()
    select = cuda.jit(M.state_select())
    select[(B, 2), (64,)](state.ravel(), keep_slot, slots, B, row_words)
    want_state = state0.copy()
    for row in range(B):
        if want_keep[row] >= 0:
            want_state[slots[row]] = state0[want_keep[row]]
    feed = check_spec_feed(r, tokens, drafts, qs, ks)
    return {**feed, "rows": B, "speculative_rows": int((ks > 0).sum()),
            "full_accepts": int(((want_n == ks + 1) & (ks > 0)).sum()),
            "produced_mismatches": int((produced != want_n).sum()),
            "keep_mismatches": int((keep_slot != want_keep).sum()),
            "state_exact": bool(np.array_equal(state, want_state)),
            "rows_changed": int((state != state0).any(1).sum()),
            "rows_expected_changed": int((want_state != state0).any(1).sum())}


def check_spec_feed(r, picks, drafts, qs, ks) -> dict:
    """spec_feed over the same rows: the verify's token ids [x, d_1 .. d_k] become the picks, each
    row's output row its last produced position, and every chain step's context length and
    three positions move by the produced count; nothing else changes (poisoned margins)."""
    B, steps, stride, axis_stride = len(ks), 3, 200, 50
    x = r.integers(0, 50, B)
    token_ids = np.concatenate([np.concatenate([[x[row]], drafts[row, :ks[row]]])
                                for row in range(B)]).astype(np.int32)
    token_ids = np.concatenate([token_ids, [-5, -6]]).astype(np.int32)   # past the rows: kept
    picks_in = np.concatenate([picks, [-7, -8]]).astype(np.int32)
    out_rows = np.full(B + 3, -99, np.int32)
    ctx0 = r.integers(0, 10_000, steps * stride).astype(np.int32)
    pos0 = r.integers(0, 10_000, steps * stride).astype(np.int32)
    ctx, pos, ids = ctx0.copy(), pos0.copy(), token_ids.copy()
    kern = cuda.jit(M.spec_feed())
    kern[(-(-B // 16),), (16,)](out_rows, ids, ctx, pos, picks_in, qs, B, steps, stride,
                                axis_stride)
    want_n, _ = oracle(picks, drafts, qs, np.full(B, -1, np.int32))
    want_out = np.full(B + 3, -99, np.int32)
    want_out[:B] = qs[:-1] + want_n - 1
    want_ids = token_ids.copy()
    want_ids[:qs[-1]] = picks[:qs[-1]]
    want_ctx, want_pos = ctx0.copy(), pos0.copy()
    for s in range(steps):
        want_ctx[s * stride + np.arange(B)] += want_n
        for axis in range(3):
            want_pos[s * stride + axis * axis_stride + np.arange(B)] += want_n
    return {"feed_out_rows_exact": bool(np.array_equal(out_rows, want_out)),
            "feed_token_ids_exact": bool(np.array_equal(ids, want_ids)),
            "feed_chain_exact": bool(np.array_equal(ctx, want_ctx)
                                     and np.array_equal(pos, want_pos))}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)))
