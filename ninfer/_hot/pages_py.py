"""Page-table updates and batch packing: the pure-Python twin of `pages.pyx`.

Both modules expose the same three functions with the same arguments and results; `ninfer._hot`
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
