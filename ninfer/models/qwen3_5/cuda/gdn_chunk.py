"""Host side of the chunked gated delta rule for prefill (kernels/gdn_chunk.py): the chunk size a
geometry gets, the kernels' shared-memory budgets, the workspace it needs and its two launches.

A call that is not a decode step runs every row through two kernels:
  gdn_chunk_prep  grid (row, value head, chunk of the row), fully parallel: gates, the chunk's
                  cumulative log decay (float64), the WY matrices U (into `core`, in place of the
                  output), W and the causal intra-chunk matrix P, per-token decay factors
  gdn_chunk_scan  grid (row, value head, block of SCAN_VB value columns), sequential over the
                  row's chunks with the state slice in registers
Chunks never cross a row boundary; a row's last chunk may be partial (a 1-token row is one).

A bf16 model takes the tensor-core variants instead (kernels/gdn_chunk_tc.py, `tc=True`): chunks
of TC_CHUNK tokens, every product a tf32 warp mma. A float32 model keeps the fp32 kernels (its
exactness is the point of dtype="float32"). The tensor-core scan is two launches:
gdn_chunk_state_tc (sequential over the chunks: the state's recurrence alone, each chunk's
starting state S_c written to a workspace buffer `s`) and gdn_chunk_out_tc (every chunk at once:
the outputs from S_c), so the sequential pass does about half the work per chunk (one layer at
4096 tokens on an H100, bench_gdn_chunk.py, scan ms against the one sequential kernel it
replaced: 48 value heads (27B) 0.97 / 1.12, 32 (9B, 35B-A3B) 0.70 / 1.21, 16 0.57 / 1.07).

The constants below were chosen from the PTX (shared memory, no local memory, vector shared loads,
shuffle counts), not from timings: `bench/bench_gdn_chunk.py --sweep` times the alternatives on a
GPU against gdn_recurrent.
"""
from __future__ import annotations

import math

# static shared memory one kernel may declare (numba's static arrays cannot opt in to more)
STATIC_SMEM_BYTES = 48 * 1024
# the first that fits the shared-memory budget is used. 16 first: timed on the H200 at the 27B
# head geometry (bench_gdn_chunk.py --sweep, 4096 tokens, one layer), chunk 16 took 3.56 ms
# (prep 1.40 + scan 2.15) against 5.28 ms at 32 and 5.41 ms for the sequential gdn_recurrent:
# on CUDA cores the in-chunk terms grow with the chunk, the scan's sequential steps with 1/chunk
CHUNK_SIZES = (16, 8)
PREP_THREADS = 256
PREP_KT = 32                        # key/query columns staged per pass when forming K K^T, Q K^T
SCAN_VB = 32                        # value columns per scan block
SCAN_NC = 2                         # value columns per scan thread (each shared load feeds NC FMAs)
SCAN_IB = 4                         # chunk rows a scan thread reduces together


# the tensor-core variants: 64-token chunks (4 warps of 16 chunk rows), TC_VB value columns per
# scan block (the scan passes' VB: 32 measured fastest at the 27B heads, 16 and 8 slower), U / W
# in groups of 32 columns
TC_CHUNK = 64
TC_VB = 32


def tc_row_stride(vb: int) -> int:
    """kernels/gdn_chunk_tc.row_stride: the scan's padded S / V' rows (8 or 24 mod 32 words)."""
    return vb + 8 if (vb + 8) % 16 == 8 else vb + 16


def tc_pass_smem(dk: int, vb: int = None) -> int:
    # either pass of the split scan: the state slice [dk, VB] and V' [Cn, VB] (padded rows), one
    # decay factor
    return 4 * ((dk + TC_CHUNK) * tc_row_stride(vb or TC_VB) + TC_CHUNK)


def tc_prep_smem() -> int:
    # A and T [Cn, Cn + 4], one block row of T's products [Cn - 16, 16], float64 log decay,
    # fp32 gates and betas
    cn = TC_CHUNK
    return 4 * (2 * cn * (cn + 4) + max(256, (cn - 16) * 16)) + 8 * cn + 2 * 4 * cn


def tc_ok(dk: int, dv: int) -> bool:
    """Whether the tensor-core variants take this head geometry: every warp an equal share of
    the state's 16-row tiles, whole 32-column groups, shared memory within the static limit
    (dk 128, every Qwen3.5 release: yes; dk 256 exceeds it)."""
    # (TC_CHUNK / 16 warps x 16 rows = TC_CHUNK state rows a pass)
    return (dk % TC_CHUNK == 0 and dv % TC_VB == 0
            and tc_pass_smem(dk) <= STATIC_SMEM_BYTES and tc_prep_smem() <= STATIC_SMEM_BYTES)


def scan_ks(dk: int) -> int:
    """Threads sharing one value column's dk state rows (dk is a multiple of 4: check_geometry)."""
    return 8 if dk % 8 == 0 else 4


def scan_threads(dk: int) -> int:
    return SCAN_VB // SCAN_NC * scan_ks(dk)


def scan_smem(cn: int, dk: int) -> int:
    # one [Cn, dk] tile (W, then q, then decayed k), U / V' [Cn, VB], P [Cn, Cn], two per-token
    # decay factors (dk = 128 at Cn = 64 would need 58 KiB)
    return 4 * cn * (dk + SCAN_VB + cn + 2)


def prep_smem(cn: int) -> int:
    # A [Cn, Cn], q/k slices [Cn, KT + 1], float64 log decay, fp32 gates and betas
    return 4 * cn * cn + 2 * 4 * cn * (PREP_KT + 1) + 8 * cn + 2 * 4 * cn


def chunk_size(dk: int) -> int | None:
    """Tokens per chunk for key head dim `dk`; None if not even the smallest chunk fits."""
    for cn in CHUNK_SIZES:
        if scan_smem(cn, dk) <= STATIC_SMEM_BYTES and prep_smem(cn) <= STATIC_SMEM_BYTES:
            return cn
    return None


def state_chunk_slots(n: int, rows: int, cn: int) -> int:
    """S_c slots the split scan needs for calls of up to n tokens in up to `rows` rows: chunk z
    of row r takes slot query_start[r] // cn + r + z (kernels/gdn_chunk_tc.chunk_slot), and a
    row's chunks end below the next row's first slot, so n // cn + rows bound them all."""
    return n // cn + rows


def buffer_shapes(n: int, nv: int, dk: int, cn: int, dv: int = 0, rows: int = 0) -> dict:
    """Workspace buffers (float32) for up to n tokens: W [n, nv, dk], P [n, nv, Cn] (row i of a
    chunk's causal q.k decay matrix), decay factors [n, nv, 2] (exp(G_i), exp(G_last - G_i)).
    U lives in the output buffer `core` itself. With dv and rows (the tensor-core scan's two
    passes): S_c [state_chunk_slots, nv, dk, dv] too."""
    shapes = {"w": (n, nv, dk), "p": (n, nv, cn), "g": (n, nv, 2)}
    if dv and rows:
        shapes["s"] = (state_chunk_slots(n, rows, cn), nv, dk, dv)
    return shapes


def workspace_bytes(n: int, nv: int, dk: int, dv: int = 0, rows: int = 0) -> int:
    """An upper bound of buffer_shapes' bytes for either path (the S_c buffer where dv and rows
    are given)."""
    cn = max(chunk_size(dk) or CHUNK_SIZES[-1], TC_CHUNK)     # either path's (an upper bound)
    shapes = buffer_shapes(n, nv, dk, cn)
    if dv and rows:
        shapes["s"] = (state_chunk_slots(n, rows, TC_CHUNK), nv, dk, dv)
    return sum(4 * math.prod(s) for s in shapes.values())


def max_chunks(rows, n: int, b: int, cn: int) -> int:
    """Chunks of the longest row (the prep grid's z); without row info a bound from n and b
    (every row has at least one token). `rows`: host (query_start, tokens, context) per row."""
    longest = max((ln for _, ln, _ in rows), default=0) if rows else n - b + 1
    return max(1, -(-longest // cn))


def launch(launch_fn, dk: int, dv: int, nv: int, cn: int, b: int, chunks: int, *, core, w, p, g,
           qkv, proj, proj_stride: int, a_off: int, b_off: int, a_log, dt_bias, state,
           query_start, context_lens, state_slots, prep_threads: int = PREP_THREADS,
           scan_vb: int | None = None, scan_nt: int | None = None, tc: bool = False,
           s=None) -> None:
    """The launches of one GDN layer; launch_fn(name, grid, block, args). `prep_threads`,
    `scan_vb` and `scan_nt` must match the kernels' NT, VB and VB / NC * KS (the simulator tests
    and the benchmark's sweep compile other variants). `tc`: the tensor-core variants (chunk
    `cn` = 16 x their warps, usually TC_CHUNK; threads follow from it, `scan_vb` defaults to
    TC_VB) need `s` (buffer_shapes' "s" for this call's tokens and rows): the scan's state
    and output passes."""
    if tc:
        prep_threads = scan_nt = 2 * cn            # a warp per 16 chunk rows
    scan_vb = scan_vb or (TC_VB if tc else SCAN_VB)
    sfx = "_tc" if tc else ""
    launch_fn("gdn_chunk_prep" + sfx, (b, nv, chunks), (prep_threads,),
              (core, w, p, g, qkv, proj, proj_stride, a_off, b_off, a_log, dt_bias, query_start))
    nb = -(-dv // scan_vb)
    if tc:
        assert s is not None, "the tensor-core scan writes each chunk's state to `s`"
        launch_fn("gdn_chunk_state_tc", (b, nv, nb), (scan_nt,),
                  (core, w, s, g, qkv, state, query_start, context_lens, state_slots))
        launch_fn("gdn_chunk_out_tc", (b, nv, chunks * nb), (scan_nt,),
                  (core, p, s, g, qkv, query_start))
        return
    launch_fn("gdn_chunk_scan", (b, nv, nb), (scan_nt or scan_threads(dk),),
              (core, w, p, g, qkv, state, query_start, context_lens, state_slots))
