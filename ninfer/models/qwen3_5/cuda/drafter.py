"""The MTP drafter on the CUDA model (issue 25): mtp.MtpDrafter's contract, which
program/speculative.py drafts and feeds through, over CudaModel.mtp_forward / mtp_argmax /
head_logits (a
model loaded with mtp=True: the MTP layer's weights, kernels, and its KV as the pool's last
layer). Host arrays in and out, as the numpy drafter's."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ....options import MAX_DRAFT_TOKENS

from ..batch import ForwardBatch
from ..mtp import draft_greedy


BF16 = np.dtype(ml_dtypes.bfloat16)


def host_rows(rows) -> np.ndarray:
    """Hidden states (or DFlash features) on the host as a drafter call takes them: a bf16
    model's rows as its steps hand them (ml_dtypes.bfloat16, the device's bits: TokenStep.hidden)
    stay as they are, anything else is float32. A catch-up feed concatenates and uploads
    thousands of rows; widening each to float32 and narrowing it back on the host cost more
    than the feed's device work."""
    a = np.asarray(rows)
    return a if a.dtype == BF16 else np.asarray(a, np.float32)

def token_pieces(batch: ForwardBatch, cap: int) -> list:
    """The batch cut into calls of at most `cap` tokens, in order: [(sub-batch, token indices
    of the batch it holds)]. A row longer than what is left of a call continues in the next one
    from where it stopped (its context past the tokens the earlier call wrote)."""
    if cap < 1:
        raise ValueError(f"token_pieces: cap {cap} must be >= 1")
    qs = np.asarray(batch.query_start, np.int64)
    ctx = np.asarray(batch.context_lens, np.int64)
    pieces, segs, used = [], [], 0

    def close():
        idx = np.concatenate([np.arange(qs[r] + a, qs[r] + z) for r, a, z in segs])
        counts = np.array([z - a for _, a, z in segs], np.int32)
        rows = [r for r, _, _ in segs]
        sub = ForwardBatch(np.asarray(batch.token_ids)[idx],
                           np.asarray(batch.positions)[:, idx],
                           np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                           np.array([ctx[r] + a for r, a, _ in segs], np.int32),
                           np.asarray(batch.block_tables)[rows],
                           np.asarray(batch.state_slots)[rows])
        pieces.append((sub, idx))
    for r in range(batch.num_rows):
        a, n = 0, int(qs[r + 1] - qs[r])
        while a < n:
            z = min(n, a + cap - used)
            segs.append((r, a, z))
            used += z - a
            a = z
            if used == cap:
                close()
                segs, used = [], 0
    if segs:
        close()
    return pieces


class CudaDrafter:
    """The checkpoint's MTP head on the device, for the speculative units (speculative.py)."""
    hidden_layers = None        # its feed reads the target's final-normed hidden
    max_draft_tokens = MAX_DRAFT_TOKENS["mtp"]
    pages_ahead = 0             # its draft steps write KV only where the verify will

    def __init__(self, model):
        if not getattr(model, "mtp", False):
            raise ValueError("CudaDrafter: the CUDA model was loaded without its MTP head "
                             "(mtp=True)")
        self.model, self.text = model, model.text

    def join_kv_pool(self, kv) -> None:
        """The CUDA model's pools already hold the drafter's layer, last (new_kv_pool with
        mtp=True): check it is this pool."""
        want = len(self.text.attention_layer_ids) + 1
        if len(kv.k) != want:
            raise ValueError(f"MTP: the KV pool has {len(kv.k)} layers, the target's "
                             f"{want - 1} and the drafter's make {want}")

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [N, V]: the shared lm_head over final-normed hidden states [N, H]."""
        return self.model.head_logits(hidden)

    def forward_argmax(self, batch: ForwardBatch, hidden: np.ndarray, kv) -> tuple:
        """MtpDrafter.forward_argmax's contract on the device: (int32 [B] argmax of each row's
        last token's logits, taken by the head's argmax kernel: B ids come down, not B x V
        logits; that token's MTP hidden [B, H], the rows' last alone: a feed's other MTP hidden
        states stay on the device). A batch of more tokens than one call takes runs as several
        calls (token_pieces); a row's id and hidden are those of the call where its last token
        ran."""
        return self._argmax(batch, hidden, kv, last_only=True)

    def forward(self, batch: ForwardBatch, hidden: np.ndarray, kv, *,
                with_logits: bool = True) -> tuple:
        """MtpDrafter.forward's contract on the device. Without logits (the feed) a batch of
        more tokens than one call takes runs as several calls (token_pieces), in order."""
        if with_logits:
            return self.model.mtp_forward(batch, hidden, kv)
        return None, self._argmax(batch, hidden, kv, last_only=False)[1]

    def _argmax(self, batch: ForwardBatch, hidden: np.ndarray, kv, last_only: bool) -> tuple:
        """(ids [B], MTP hidden [B, H] of the rows' last tokens with last_only, else [N, H])
        through calls of at most n_cap tokens."""
        if batch.num_tokens <= self.model.n_cap:
            return self.model.mtp_argmax(batch, hidden, kv, last_only=last_only)
        hidden = host_rows(hidden)
        g = np.empty((batch.num_rows if last_only else len(hidden), hidden.shape[1]),
                     np.float32)
        ends = np.asarray(batch.query_start[1:], np.int64) - 1
        ids = np.full(batch.num_rows, -1, np.int32)
        for sub, idx in token_pieces(batch, self.model.n_cap):
            sub_ids, sub_g = self.model.mtp_argmax(sub, hidden[idx], kv, last_only=last_only)
            sub_ends = idx[np.asarray(sub.query_start[1:], np.int64) - 1]
            rows = np.searchsorted(ends, sub_ends)
            done = ends[np.minimum(rows, len(ends) - 1)] == sub_ends
            ids[rows[done]] = sub_ids[done]
            if last_only:
                g[rows[done]] = sub_g[done]
            else:
                g[idx] = sub_g
        return ids, g

    # the speculator runs a verify whose every row drafted through verify_and_draft: the feed
    # and the next unit's drafts behind the verify, one wait instead of three
    drafts_in_verify = True

    def verify_draft_fits(self, n: int, rows: int, steps: int) -> bool:
        return self.model.verify_draft_fits(n, rows, steps)

    def verify_and_draft(self, model, batch: ForwardBatch, kv, state, rows, *, snap_base,
                         steps: int) -> tuple:
        """mtp.verify_and_draft's contract: CudaModel.verify_and_draft (model is this
        drafter's)."""
        return self.model.verify_and_draft(batch, kv, state, rows, snap_base=snap_base,
                                           steps=steps)

    def draft_greedy(self, kv, hidden: np.ndarray, next_tokens, context_lens, block_tables, k, *,
                     with_logits: bool = True, pick=None) -> tuple:
        """mtp.draft_greedy over this drafter: where no logits and no picks are wanted and every
        row drafts the same k, the model's chain (CudaModel.mtp_chain: the k steps in one call,
        each step's argmaxes fed to the next on the device, one wait), else step by step."""
        ks = np.broadcast_to(np.asarray(k, np.int64), (len(next_tokens),))
        steps = int(ks[0]) if len(ks) else 0
        if not with_logits and pick is None and len(ks) and bool((ks == steps).all()) \
                and self.model.mtp_chain_fits(len(ks), steps):
            return self.model.mtp_chain(hidden, next_tokens, context_lens, block_tables, steps,
                                        kv), None
        return draft_greedy(self, kv, hidden, next_tokens, context_lens, block_tables, k,
                            with_logits=with_logits, pick=pick)
