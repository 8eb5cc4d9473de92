"""Page-table updates and batch packing: the pure-Python twin of `pages.pyx`.

Both modules expose the same functions with the same arguments and results; `ninfer._hot`
picks the compiled one when it was built. All arrays are int32 and owned by the caller (the
Program's workspace), so neither version allocates except the twin's small temporaries.

    free_stack [num_pages]    free page ids; the top of the stack is free_stack[num_free - 1]
    table_row  [P]            one sequence's block table; -1 marks an unused entry
"""
import numpy as np


def take_pages(free_stack, num_free, table_row, start, count):
    """Pop `count` pages into table_row[start:start+count]; returns the new num_free.

    The caller has checked `count <= num_free` (check/act pair); a violation is a bug."""
    if count < 0 or count > num_free or start + count > len(table_row):
        raise ValueError(f"take_pages: cannot take {count} of {num_free} free pages "
                         f"into entries [{start}, {start + count}) of {len(table_row)}")
    if count:
        table_row[start:start + count] = free_stack[num_free - count:num_free][::-1]
    return num_free - count


def give_pages(free_stack, num_free, table_row, start, stop):
    """Push table_row[start:stop] back onto the free stack, mark them -1; returns new num_free."""
    count = stop - start
    if count < 0 or num_free + count > len(free_stack) or stop > len(table_row):
        raise ValueError(f"give_pages: cannot return entries [{start}, {stop}) "
                         f"with {num_free} of {len(free_stack)} pages free")
    if count:
        pages = table_row[start:stop]
        if np.any(pages < 0):
            raise ValueError(f"give_pages: entries [{start}, {stop}) hold unmapped pages")
        free_stack[num_free:num_free + count] = pages[::-1]
        table_row[start:stop] = -1
    return num_free + count


def release_pages(free_stack, num_free, refcount, table_row, start, stop):
    """Unmap table_row[start:stop] (mark them -1) and drop one reference of each page; a page
    whose count reaches 0 goes onto the free stack. Returns the new num_free. (Pages may be held
    by several block tables and by context-cache entries: refcount[page] counts the holders.)"""
    if start < 0 or stop < start or stop > len(table_row):
        raise ValueError(f"release_pages: entries [{start}, {stop}) outside the table row")
    pages = table_row[start:stop]
    if np.any(pages < 0) or np.any(refcount[pages] < 1):
        raise ValueError(f"release_pages: entries [{start}, {stop}) hold unmapped or "
                         f"unreferenced pages")
    for i in range(stop - 1, start - 1, -1):
        page = table_row[i]
        refcount[page] -= 1
        if refcount[page] == 0:
            if num_free >= len(free_stack):
                raise ValueError("release_pages: the free stack is full")
            free_stack[num_free] = page
            num_free += 1
        table_row[i] = -1
    return num_free


def pack_batch(token_buf, block_tables, slots, starts, counts,
               out_tokens, out_positions, out_query_start, out_tables):
    """Pack rows into ForwardBatch arrays; returns the number of packed tokens N.

    Row r takes tokens token_buf[slots[r], starts[r]:starts[r]+counts[r]] at text positions
    starts[r].. (all three MRoPE rows equal) and its block table row block_tables[slots[r]].
    out_tokens [>=N], out_positions [3, >=N], out_query_start [B+1], out_tables [B, P]."""
    num_rows = len(slots)
    out_query_start[0] = 0
    n = 0
    for r in range(num_rows):
        s, a, c = int(slots[r]), int(starts[r]), int(counts[r])
        if c < 0 or a < 0 or a + c > token_buf.shape[1]:
            raise ValueError(f"pack_batch: row {r} span [{a}, {a + c}) outside the token buffer")
        out_tokens[n:n + c] = token_buf[s, a:a + c]
        out_positions[:, n:n + c] = np.arange(a, a + c, dtype=np.int32)
        out_tables[r, :] = block_tables[s, :]
        n += c
        out_query_start[r + 1] = n
    return n


def pack_decode(out, offsets, n_cap, p_cap, token_ids, positions, context_lens, state_slots,
                block_tables):
    """Write a decode batch (B rows of one token each) into the device metadata image `out`
    (int32, cuda/meta.py MetaLayout): offsets[f] = the start of field f in FIELDS order
    (token_ids, token_row, positions (3 rows of n_cap), out_rows, query_start, context_lens,
    state_slots, block_tables (B rows of p_cap, -1 padded)); every entry before the block tables
    that no row fills is 0. Returns the int32 words to copy."""
    b = len(token_ids)
    if positions.shape[0] != 3 or positions.shape[1] < b or len(context_lens) < b \
            or len(state_slots) < b or block_tables.shape[0] < b:
        raise ValueError(f"pack_decode: inputs do not hold {b} rows")
    if b > n_cap:
        raise ValueError(f"pack_decode: {b} rows exceed the layout's {n_cap}")
    rows = np.arange(b, dtype=np.int32)
    out[:offsets[7]] = 0                # fields beyond row b read 0, as the graph was captured
    out[offsets[0]: offsets[0] + b] = token_ids
    out[offsets[1]: offsets[1] + b] = rows
    for axis in range(3):
        s = offsets[2] + axis * n_cap
        out[s: s + b] = positions[axis, :b]
    out[offsets[3]: offsets[3] + b] = rows
    out[offsets[4]: offsets[4] + b + 1] = np.arange(b + 1, dtype=np.int32)
    out[offsets[5]: offsets[5] + b] = context_lens[:b]
    out[offsets[6]: offsets[6] + b] = state_slots[:b]
    w = min(block_tables.shape[1], p_cap)
    tables = out[offsets[7]: offsets[7] + b * p_cap].reshape(b, p_cap)
    tables[:, :w] = block_tables[:b, :w]
    tables[:, w:] = -1
    return offsets[7] + b * p_cap
