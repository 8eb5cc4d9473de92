"""Per-call metadata in one fixed int32 block: the host packs it into pinned staging, one async
copy moves it, every kernel reads it at fixed addresses (so a captured graph stays valid).

    [token_ids n | token_row n | positions 3n | out_rows n | query_start b+1 | context_lens b |
     state_slots b | block_tables b*p]            (n, b, p = the region's capacities)
"""
from __future__ import annotations

import numpy as np

from .... import _hot

FIELDS = ("token_ids", "token_row", "positions", "out_rows", "query_start", "context_lens",
          "state_slots", "block_tables")


class MetaLayout:
    def __init__(self, n_cap: int, b_cap: int, p_cap: int):
        self.n_cap, self.b_cap, self.p_cap = int(n_cap), int(b_cap), int(p_cap)
        sizes = dict(token_ids=n_cap, token_row=n_cap, positions=3 * n_cap, out_rows=n_cap,
                     query_start=b_cap + 1, context_lens=b_cap, state_slots=b_cap,
                     block_tables=b_cap * p_cap)
        self.offsets, off = {}, 0
        for f in FIELDS:
            self.offsets[f] = off
            off += sizes[f]
        self.count = off
        self.field_offsets = np.array([self.offsets[f] for f in FIELDS], np.int32)

    @property
    def nbytes(self) -> int:
        return self.count * 4

    def used_bytes(self, num_rows: int) -> int:
        """Bytes to copy for a call of `num_rows` rows (block tables are the last field)."""
        return (self.offsets["block_tables"] + num_rows * self.p_cap) * 4

    def pack(self, host: np.ndarray, batch, out_rows: np.ndarray) -> None:
        """Write `batch` into the int32 host image `host` (len >= count)."""
        n, b = batch.num_tokens, batch.num_rows
        if n > self.n_cap or b > self.b_cap or len(out_rows) > self.n_cap:
            # a field written past its capacity would run into the next one unnoticed
            raise ValueError(f"call metadata: {n} tokens / {b} rows exceed the layout's "
                             f"{self.n_cap} / {self.b_cap}")
        o = self.offsets
        qs = np.asarray(batch.query_start, np.int32)
        host[o["token_ids"]: o["token_ids"] + n] = batch.token_ids
        host[o["token_row"]: o["token_row"] + n] = np.repeat(np.arange(b, dtype=np.int32),
                                                             np.diff(qs))
        pos = np.asarray(batch.positions, np.int32)
        for axis in range(3):
            s = o["positions"] + axis * self.n_cap
            host[s: s + n] = pos[axis]
        host[o["out_rows"]: o["out_rows"] + len(out_rows)] = out_rows
        host[o["query_start"]: o["query_start"] + b + 1] = qs
        host[o["context_lens"]: o["context_lens"] + b] = batch.context_lens
        host[o["state_slots"]: o["state_slots"] + b] = batch.state_slots
        bt = np.asarray(batch.block_tables, np.int32)
        w = min(bt.shape[1], self.p_cap)
        s = o["block_tables"]
        tables = host[s: s + b * self.p_cap].reshape(b, self.p_cap)
        tables[:] = -1
        tables[:, :w] = bt[:, :w]


    def pack_decode(self, host: np.ndarray, batch) -> int:
        """Fast path for rows of one token each (the decode step): ninfer._hot.pack_decode writes
        every field in one compiled pass (its pure-Python twin when not built). Returns the bytes
        to copy."""
        i32 = np.int32
        words = _hot.pack_decode(host, self.field_offsets, self.n_cap, self.p_cap,
                                 np.ascontiguousarray(batch.token_ids, i32),
                                 np.asarray(batch.positions, i32),
                                 np.ascontiguousarray(batch.context_lens, i32),
                                 np.ascontiguousarray(batch.state_slots, i32),
                                 np.asarray(batch.block_tables, i32))
        return 4 * words


class DeviceMeta:
    """Device addresses of one MetaLayout region."""

    def __init__(self, layout: MetaLayout, base_ptr: int):
        self.layout = layout
        self.base = int(base_ptr)
        for f, off in layout.offsets.items():
            setattr(self, f, self.base + 4 * off)
