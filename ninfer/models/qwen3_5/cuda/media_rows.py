"""Media embeddings (the vision tower's output at the placeholders) written over their tokens'
rows of the step's hidden buffer, after the embedding gather and before the first layer.

    checked_media(batch, media, hidden_size) -> (rows int64 [k], vectors float32 [k, H])
    MediaRows(hidden, hidden_size, n_cap).write(stream, media)    # eager calls only
"""
from __future__ import annotations

import numpy as np

from ....core.cuda import driver as _d


def checked_media(batch, media, hidden_size: int) -> tuple:
    """(rows, vectors) as int64 / float32: ascending token indices < batch.num_tokens with one
    [hidden_size] vector each; ValueError otherwise."""
    rows, vectors = media
    rows = np.asarray(rows, np.int64)
    vectors = np.ascontiguousarray(vectors, np.float32)
    H = hidden_size
    if vectors.shape != (len(rows), H) or (len(rows) and (
            rows.min() < 0 or rows.max() >= batch.num_tokens or np.any(np.diff(rows) <= 0))):
        raise ValueError(f"forward: media rows must be ascending token indices < "
                         f"{batch.num_tokens} with one [H={H}] vector each, got rows "
                         f"{rows.shape} and vectors {vectors.shape}")
    return rows, vectors


class MediaRows:
    """Copies media vectors over rows of `hidden` (fp32 [n_cap, hidden_size] on the device): one
    async copy per run of adjacent rows from a pinned staging buffer, made on first use. The
    caller synchronizes before the next write (forward does), so the staging is free again."""

    def __init__(self, hidden, hidden_size: int, n_cap: int):
        self._hidden_ptr, self._H, self._n_cap = hidden.ptr, hidden_size, n_cap
        self._host = None

    def write(self, st, media) -> None:
        rows, vectors = media
        H = self._H
        if self._host is None:
            self._host = _d.PinnedBuffer(self._n_cap * H * 4)
        self._host.view(np.float32, 0, vectors.size)[:] = vectors.ravel()
        cut = np.flatnonzero(np.diff(rows) != 1) + 1
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(rows)]):
            _d.copy_htod_async(self._hidden_ptr + int(rows[a]) * H * 4,
                               self._host.ptr + a * H * 4, (b - a) * H * 4, st)

    def free(self) -> None:
        """Release the staging (if made). Idempotent."""
        if self._host is not None:
            host, self._host = self._host, None
            host.free()
