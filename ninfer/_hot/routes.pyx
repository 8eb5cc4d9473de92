# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""The MoE prefill's routed-row layout, compiled: one pass over the pairs (a counting sort by
expert) instead of numpy's sort and gathers. Same contract as `routes_py.py` (read it there)."""
from cpython.mem cimport PyMem_Free, PyMem_Malloc


def expert_rows_fill(int[::1] ids, Py_ssize_t top_k, Py_ssize_t num_experts, Py_ssize_t cap,
                     int[::1] counts, int[::1] src, int[::1] row_of_pair):
    cdef Py_ssize_t pairs = ids.shape[0], e, p, k, row, rows, over
    if counts.shape[0] < num_experts or row_of_pair.shape[0] < pairs or top_k < 1:
        raise ValueError("expert_rows_fill: counts, row_of_pair or top_k do not fit the ids")
    cdef Py_ssize_t *first = <Py_ssize_t *> PyMem_Malloc(2 * num_experts * sizeof(Py_ssize_t))
    if first == NULL:
        raise MemoryError()
    cdef Py_ssize_t *rank = first + num_experts
    try:
        rows = num_experts * cap
        for e in range(num_experts):
            first[e] = rows                  # where expert e's rows past cap start
            over = counts[e] - cap
            if over > 0:
                rows += over
            rank[e] = 0
        if src.shape[0] < rows:
            raise ValueError(f"expert_rows_fill: {rows} rows exceed src's {src.shape[0]}")
        for row in range(rows):
            src[row] = 0
        for p in range(pairs):
            e = ids[p]
            if e < 0 or e >= num_experts:
                raise ValueError(f"expert_rows_fill: id {e} outside [0, {num_experts})")
            k = rank[e]
            rank[e] = k + 1
            if k < cap:
                row = e * cap + k
            else:
                row = first[e] + k - cap
            row_of_pair[p] = <int>row
            src[row] = <int>(p // top_k)
        return rows
    finally:
        PyMem_Free(first)
