"""Per-call metadata in one fixed int32 block: the host packs it into pinned staging, one async
copy moves it, every kernel reads it at fixed addresses (so a captured graph stays valid).

    [token_ids n | token_row n | positions 3n | out_rows n | query_start b+1 | context_lens b |
     state_slots b | block_tables b*p]            (n, b, p = the region's capacities)
"""
from __future__ import annotations

import numpy as np

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

    @property
    def nbytes(self) -> int:
        return self.count * 4

    def used_bytes(self, num_rows: int) -> int:
        """Bytes to copy for a call of `num_rows` rows (block tables are the last field)."""
        return (self.offsets["block_tables"] + num_rows * self.p_cap) * 4

    def pack(self, host: np.ndarray, batch, out_rows: np.ndarray) -> None:
        """Write `batch` into the int32 host image `host` (len >= count)."""
        n, b = batch.num_tokens, batch.num_rows
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
        """Fast path for rows of one token each (the decode step): one list write for the small
        fields, one 2-D write for the block tables. Returns the bytes to copy."""
        b, n = batch.num_rows, self.n_cap
        o = self.offsets
        small = [0] * o["block_tables"]
        ids = batch.token_ids.tolist()
        small[o["token_ids"]: o["token_ids"] + b] = ids
        small[o["token_row"]: o["token_row"] + b] = range(b)
        pos = batch.positions.tolist()
        for axis in range(3):
            s = o["positions"] + axis * n
            small[s: s + b] = pos[axis]
        small[o["out_rows"]: o["out_rows"] + b] = range(b)
        small[o["query_start"]: o["query_start"] + b + 1] = range(b + 1)
        small[o["context_lens"]: o["context_lens"] + b] = batch.context_lens.tolist()
        small[o["state_slots"]: o["state_slots"] + b] = batch.state_slots.tolist()
        host[: o["block_tables"]] = small
        bt = batch.block_tables
        w = min(bt.shape[1], self.p_cap)
        tables = host[o["block_tables"]: o["block_tables"] + b * self.p_cap].reshape(b, self.p_cap)
        tables[:, :w] = bt[:, :w]
        if w < self.p_cap:
            tables[:, w:] = -1
        return self.used_bytes(b)


class DeviceMeta:
    """Device addresses of one MetaLayout region."""

    def __init__(self, layout: MetaLayout, base_ptr: int):
        self.layout = layout
        self.base = int(base_ptr)
        for f, off in layout.offsets.items():
            setattr(self, f, self.base + 4 * off)
