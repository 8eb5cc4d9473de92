# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""Page-table updates and batch packing, compiled. Same contract as `pages_py.py` (read it there)."""


def take_pages(int[::1] free_stack, Py_ssize_t num_free, int[::1] table_row,
               Py_ssize_t start, Py_ssize_t count):
    cdef Py_ssize_t i
    if count < 0 or count > num_free or start + count > table_row.shape[0]:
        raise ValueError(f"take_pages: cannot take {count} of {num_free} free pages "
                         f"into entries [{start}, {start + count}) of {table_row.shape[0]}")
    for i in range(count):
        table_row[start + i] = free_stack[num_free - 1 - i]
    return num_free - count


def give_pages(int[::1] free_stack, Py_ssize_t num_free, int[::1] table_row,
               Py_ssize_t start, Py_ssize_t stop):
    cdef Py_ssize_t i, count = stop - start
    if count < 0 or num_free + count > free_stack.shape[0] or stop > table_row.shape[0]:
        raise ValueError(f"give_pages: cannot return entries [{start}, {stop}) "
                         f"with {num_free} of {free_stack.shape[0]} pages free")
    for i in range(start, stop):
        if table_row[i] < 0:
            raise ValueError(f"give_pages: entries [{start}, {stop}) hold unmapped pages")
    for i in range(count):
        free_stack[num_free + i] = table_row[stop - 1 - i]
        table_row[stop - 1 - i] = -1
    return num_free + count


def release_pages(int[::1] free_stack, Py_ssize_t num_free, int[::1] refcount,
                  int[::1] table_row, Py_ssize_t start, Py_ssize_t stop):
    cdef Py_ssize_t i
    cdef int page
    if start < 0 or stop < start or stop > table_row.shape[0]:
        raise ValueError(f"release_pages: entries [{start}, {stop}) outside the table row")
    for i in range(start, stop):
        page = table_row[i]
        if page < 0 or page >= refcount.shape[0] or refcount[page] < 1:
            raise ValueError(f"release_pages: entries [{start}, {stop}) hold unmapped or "
                             f"unreferenced pages")
    for i in range(stop - 1, start - 1, -1):
        page = table_row[i]
        refcount[page] -= 1
        if refcount[page] == 0:
            if num_free >= free_stack.shape[0]:
                raise ValueError("release_pages: the free stack is full")
            free_stack[num_free] = page
            num_free += 1
        table_row[i] = -1
    return num_free


def pack_batch(int[:, ::1] token_buf, int[:, ::1] block_tables, int[::1] slots,
               int[::1] starts, int[::1] counts, int[::1] out_tokens, int[:, :] out_positions,
               int[::1] out_query_start, int[:, ::1] out_tables):
    cdef Py_ssize_t r, i, s, a, c, n = 0, p
    cdef Py_ssize_t num_pages = block_tables.shape[1]
    out_query_start[0] = 0
    for r in range(slots.shape[0]):
        s = slots[r]
        a = starts[r]
        c = counts[r]
        if c < 0 or a < 0 or a + c > token_buf.shape[1]:
            raise ValueError(f"pack_batch: row {r} span [{a}, {a + c}) outside the token buffer")
        for i in range(c):
            out_tokens[n + i] = token_buf[s, a + i]
            out_positions[0, n + i] = a + i
            out_positions[1, n + i] = a + i
            out_positions[2, n + i] = a + i
        for p in range(num_pages):
            out_tables[r, p] = block_tables[s, p]
        n += c
        out_query_start[r + 1] = n
    return n


def pack_decode(int[::1] out, int[::1] offsets, Py_ssize_t n_cap, Py_ssize_t p_cap,
                int[::1] token_ids, int[:, :] positions, int[::1] context_lens,
                int[::1] state_slots, int[:, :] block_tables):
    cdef Py_ssize_t r, axis, p, w, b = token_ids.shape[0]
    cdef Py_ssize_t o_tab = offsets[7]
    if positions.shape[0] != 3 or positions.shape[1] < b or context_lens.shape[0] < b \
            or state_slots.shape[0] < b or block_tables.shape[0] < b:
        raise ValueError(f"pack_decode: inputs do not hold {b} rows")
    if b > n_cap:
        raise ValueError(f"pack_decode: {b} rows exceed the layout's {n_cap}")
    if o_tab + b * p_cap > out.shape[0]:
        raise ValueError("pack_decode: the metadata image is too small")
    w = min(block_tables.shape[1], p_cap)
    for p in range(o_tab):              # fields beyond row b read 0, as the graph was captured
        out[p] = 0
    for r in range(b):
        out[offsets[0] + r] = token_ids[r]
        out[offsets[1] + r] = <int>r
        for axis in range(3):
            out[offsets[2] + axis * n_cap + r] = positions[axis, r]
        out[offsets[3] + r] = <int>r
        out[offsets[4] + r] = <int>r
        out[offsets[5] + r] = context_lens[r]
        out[offsets[6] + r] = state_slots[r]
        for p in range(w):
            out[o_tab + r * p_cap + p] = block_tables[r, p]
        for p in range(w, p_cap):
            out[o_tab + r * p_cap + p] = -1
    out[offsets[4] + b] = <int>b
    return o_tab + b * p_cap
