"""A speculative verify's acceptance on the device (issue 25), so a verify step needs no host
round trip before the next one.

A verify row runs [x, d_1 .. d_k] (its last sampled token and k drafts) at k + 1 positions, and
the sampler picks t_0 .. t_k there exactly as decode steps at those positions would. The row
produces t_0 .. t_j, j the first position whose pick differs from the next draft (t_j != d_{j+1};
j = k when every draft holds): the rule of ninfer/models/qwen3_5/program/speculative.py, which
gives the tokens the non-speculative path would give.

    spec_accept    per row: the count produced, j + 1, and the State snapshot slot to keep,
                   snap_base + j (gdn_recurrent_snap / conv_state_update_snap wrote the State
                   after the row's token i into slot snap_base + i), or -1 for a row without
                   snapshots (a plain decode row beside the verify: its State is current)
    state_select   per row with a slot to keep: copies that slot's row of one State array (a
                   layer's S or conv window, as 32-bit words) over the row's own slot
    spec_feed      per row of a verify whose every row drafted: the metadata of the MTP
                   drafter's feed and of the next drafts, so the feed and the draft chain run
                   behind the verify with no host round trip (CudaModel.verify_and_draft). The
                   verify's token ids become its picks (the feed pairs the target's hidden at
                   position F + i with the token after it, t_i), the row's output row its last
                   produced position F + j (its MTP hidden and argmax: the next g_1, d_1), and
                   each chain step's context length and positions move by the produced count
                   j + 1 (the host staged them for a row that produced nothing)

The Engine may keep fewer tokens than produced (a stop string, max_tokens, a cancel), but only
for a request that ends there: its State is not read again.
"""
from numba import cuda, int32, int64

from .common import inlined

# kernel -> its argument types, in order; a plain literal (kernels/__init__.py says why)
SIGNATURES = {
    "spec_accept": ("i32*", "i32*", "i32*", "i32*", "i32*", "i32*", "i32", "i32"),
    "state_select": ("u32*", "i32*", "i32*", "i32", "i32"),
    "spec_feed": ("i32*", "i32*", "i32*", "i32*", "i32*", "i32*", "i32", "i32", "i32", "i32"),
}

THREADS = 256


@inlined
def verify_row(query_start, r, picks, drafts, d0):
    """(row r's first position q0, its k, j: the drafts kept before its first pick that differs
    from the next draft): picks at q0 .. q0+k, the row's drafts at d0 .. d0+k-1."""
    q0 = query_start[r]
    k = query_start[r + 1] - q0 - 1
    j = int32(0)
    while j < k and picks[q0 + j] == drafts[d0 + j]:
        j += 1
    return q0, k, j


def spec_accept():
    def spec_accept_kernel(produced, keep_slot, tokens, drafts, query_start, snap_base, B, kmax):
        # one thread per row. tokens: the sampler's pick per verify position (rows packed as
        # query_start); drafts [B, kmax]: row r's d_1 .. d_k at r * kmax (k = its positions - 1)
        r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if r >= B:
            return
        _, _, j = verify_row(query_start, r, tokens, drafts, r * kmax)
        produced[r] = j + 1
        base = snap_base[r]
        keep_slot[r] = base + j if base >= 0 else int32(-1)
    return spec_accept_kernel


def state_select():
    def state_select_kernel(rows, keep_slot, state_slots, B, row_words):
        # grid (B, blocks per row): row r's State slot := its kept snapshot slot, word by word
        r = cuda.blockIdx.x
        if r >= B:
            return
        src = keep_slot[r]
        if src < 0:
            return
        s = int64(src) * row_words
        d = int64(state_slots[r]) * row_words
        i = int64(cuda.blockIdx.y) * cuda.blockDim.x + cuda.threadIdx.x
        stride = int64(cuda.gridDim.y) * cuda.blockDim.x
        while i < row_words:
            rows[d + i] = rows[s + i]
            i += stride
    return state_select_kernel


def spec_feed():
    def spec_feed_kernel(out_rows, token_ids, chain_ctx, chain_pos, picks, query_start, B, steps,
                         stride, axis_stride):
        # one thread per row. token_ids: the verify's metadata token ids, [x, d_1 .. d_k] per row
        # (rows packed as query_start), rewritten in place with the row's picks t_0 .. t_k (its
        # drafts are read before they are overwritten: only this thread touches the row);
        # out_rows[r]: the row's last produced position. chain_ctx / chain_pos: the context
        # lengths / positions (3 axes, axis_stride apart) of chain step 0's metadata, step s
        # `stride` words after it; every row has one token a step
        r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if r >= B:
            return
        q0, k, j = verify_row(query_start, r, picks, token_ids, query_start[r] + 1)
        out_rows[r] = q0 + j
        for i in range(k + 1):
            token_ids[q0 + i] = picks[q0 + i]
        for s in range(steps):
            at = s * stride + r
            chain_ctx[at] += j + 1
            for axis in range(3):
                chain_pos[at + axis * axis_stride] += j + 1
    return spec_feed_kernel
