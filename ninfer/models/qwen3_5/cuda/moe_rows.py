"""Row layout of the MoE prefill's routed rows (host side, after one sync on the router's ids).

cuBLASLt has no grouped GEMM, only strided batches of equal shape. So every expert gets `cap` rows
of a padded block (expert e's first min(count_e, cap) routed rows at e*cap + rank; the other rows of
the block are padding), which ONE strided-batched GEMM over all E experts covers; an expert routed
more than `cap` rows puts the rest in an overflow region after the block, one GEMM each.

    rows [0, E*cap)                 padded block, expert-major
    rows [E*cap, E*cap + overflow)  the rows past cap of the heavy experts, expert by expert

`cap` (a multiple of CAP_ALIGN, or 0: every expert its own GEMM, the layout of the old path) is
chosen to minimise  padded rows + overflow rows + LAUNCH_ROWS * heavy experts  within the
workspace's `max_rows`: one more GEMM launch costs about as much as LAUNCH_ROWS rows of work.

Packed (quantized) experts take cap 0 instead, every expert's rows consecutive, and
`expert_groups` cuts them into groups of up to GROUP_ROWS rows: the grid of the grouped
tensor-core GEMV (kernels/quant_gemv.py qmma, grouped mode), which reads the codes as stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .... import _hot as hot

CAP_ALIGN = 16
GROUP_ROWS = 8              # rows of x one qmma block multiplies (its mma's n)
# ~10 us per extra cuBLASLt call vs ~17 ns of tensor-core time per row of a 35B-A3B expert pair
LAUNCH_ROWS = 512


@dataclass(frozen=True)
class ExpertRows:
    cap: int                  # rows per expert in the padded block (0: no block)
    rows: int                 # rows used in all (block + overflow)
    src: np.ndarray           # int32 [rows]: the token each row reads (padding rows: token 0)
    row_of_pair: np.ndarray   # int32 [pairs]: the row holding (token t, k-th choice) = pair t*K+k
    overflow: tuple           # ((expert, first row, count), ...) past the block


def choose_cap(counts: np.ndarray, max_rows: int, launch_rows: int = LAUNCH_ROWS) -> int:
    E = len(counts)
    top = int(counts.max(initial=0))
    best, best_cost = 0, int(counts.sum()) + launch_rows * int(np.count_nonzero(counts))
    for cap in range(CAP_ALIGN, -(-top // CAP_ALIGN) * CAP_ALIGN + 1, CAP_ALIGN):
        over = np.maximum(counts - cap, 0)
        rows = E * cap + int(over.sum())
        if rows > max_rows:
            break          # rows grow with cap (each step adds E padded rows, frees <= E)
        cost = rows + launch_rows * int(np.count_nonzero(over))
        if cost < best_cost:
            best, best_cost = cap, cost
    return best


def expert_rows(ids: np.ndarray, top_k: int, num_experts: int, max_rows: int,
                launch_rows: int = LAUNCH_ROWS, cap: int = None) -> ExpertRows:
    """Layout for the router's ids [pairs] (pair = token * top_k + k; ids < num_experts).
    `cap` forces a block size (tests); otherwise choose_cap picks it."""
    ids = np.asarray(ids)
    pairs = len(ids)
    if pairs % top_k or (pairs and (ids.min() < 0 or ids.max() >= num_experts)):
        raise ValueError(f"router ids: {pairs} ids for top-{top_k}, or an id outside "
                         f"[0, {num_experts})")
    counts = np.bincount(ids, minlength=num_experts)
    if cap is None:
        cap = choose_cap(counts, max_rows, launch_rows)
    over = np.maximum(counts - cap, 0)
    block = num_experts * cap
    rows = block + int(over.sum())
    if rows > max_rows:
        raise ValueError(f"expert rows: {rows} rows exceed the workspace's {max_rows}")
    # the rows themselves: ninfer._hot (one compiled pass over the pairs where built: this runs
    # on the host between a sync and the layer's next launches, once per MoE layer of a prefill)
    row_of_pair = np.empty(pairs, np.int32)
    src = np.empty(rows, np.int32)
    hot.expert_rows_fill(np.ascontiguousarray(ids, np.int32), top_k, num_experts, cap,
                         counts.astype(np.int32), src, row_of_pair)
    heavy = np.nonzero(over)[0]
    over_first = block + np.concatenate([[0], np.cumsum(over)[:-1]])
    return ExpertRows(cap, rows, src, row_of_pair,
                      tuple((int(e), int(over_first[e]), int(over[e])) for e in heavy))


def expert_groups(overflow, size: int = GROUP_ROWS) -> np.ndarray:
    """int32 [groups, 3]: (expert, first row, rows) for every run of at most `size` consecutive
    rows of one expert, from (expert, first row, count) ranges (a cap-0 layout's `overflow`),
    in their order."""
    if not overflow:
        return np.zeros((0, 3), np.int32)
    e, r0, cnt = (np.array(c, np.int64) for c in zip(*overflow))
    ng = -(-cnt // size)
    which = np.repeat(np.arange(len(e)), ng)
    j = np.arange(int(ng.sum())) - np.repeat(np.cumsum(ng) - ng, ng)
    return np.stack([e[which], r0[which] + j * size,
                     np.minimum(size, cnt[which] - j * size)], axis=1).astype(np.int32)
