"""A unit's rows to and from the backend: packing them into a ForwardBatch (and the media rows of
vision prompts), choosing the backend path that runs them, and reading what it returns back into
RowResults. Plain functions of the token buffer, the block tables and the rows' records."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .... import _hot
from ....contracts import ForwardBatch, ProgramError, RowResult, SampleRow
from .page_ledger import pages_for
from .sampling import sample_row as sample_logits
from .sequences import Sequence, Unit


def pack_rows(token_buf, block_tables, page_size: int, seqs, units, ahead: int = 0) -> ForwardBatch:
    """The rows' next units as one batch; ahead=1: the decode step after the one in flight
    (positions one further; its token ids are placeholders the backend replaces on its device
    with the step in flight's, Program.launch_ahead)."""
    max_pages_per_seq = block_tables.shape[1]
    slots = np.array([s.slot for s in seqs], np.int32)
    starts = np.array([s.num_computed_tokens + ahead for s in seqs], np.int32)
    counts = np.array([u.num_new_tokens for u in units], np.int32)
    n = int(counts.sum())
    tokens, positions = np.empty(n, np.int32), np.empty((3, n), np.int32)
    query_start = np.empty(len(seqs) + 1, np.int32)
    tables = np.empty((len(seqs), max_pages_per_seq), np.int32)
    _hot.pack_batch(token_buf, block_tables, slots, starts, counts,
                    tokens, positions, query_start, tables)
    width = max(1, pages_for(int((starts + counts).max()), page_size))
    for r, seq in enumerate(seqs):           # vision prompts: MRoPE positions, not text ones
        if seq.media is not None:
            a = int(query_start[r])
            positions[:, a:a + counts[r]] = seq.media.positions_for(int(starts[r]),
                                                                    int(counts[r]))
    return ForwardBatch(tokens, positions, query_start, starts, tables[:, :width].copy(), slots)


def media_rows(seqs, units):
    """(batch rows, embeddings) of the media placeholders this batch computes, or None."""
    rows, vecs, offset = [], [], 0
    for seq, unit in zip(seqs, units):
        if seq.media is not None:
            r, v = seq.media.rows_in(seq.num_computed_tokens, unit.num_new_tokens)
            rows.append(r + offset)
            vecs.append(v)
        offset += unit.num_new_tokens
    rows = np.concatenate(rows) if rows else ()
    return (rows, np.concatenate(vecs)) if len(rows) else None


def device_path(model, seqs, units, masks) -> Optional[str]:
    """Which device path returns token ids instead of [B, V] logits, or None (host sampling).
    No row may be forced (a control unit) or ask for logprobs (they need the raw logits on
    the host). "greedy": `decode_greedy` (CUDA: argmax inside the decode graph), when every
    sampling row is plain greedy (no penalties, no grammar mask); "sample": `sample` (the
    whole sampler on the device: penalties, masks, temperature, top-k/top-p/min-p)."""
    if any(unit.forced or (unit.is_sampling and seq.spec.logprobs is not None)
           for seq, unit in zip(seqs, units)):
        return None
    if model.greedy_on_device and all(
            not unit.is_sampling or (seq.spec.is_plain_greedy and mask is None)
            for seq, unit, mask in zip(seqs, units, masks)):
        return "greedy"
    return "sample" if model.samples_on_device else None


def sample_requests(token_buf, program_uid: int, seqs, units, masks, ahead: int = 0) -> list:
    """The device sampler's rows (None for a row that does not sample). The prompt cache key
    names the Program too: the sampler lives on the model, which may serve several. ahead=1:
    the step after the one in flight (Program.launch_ahead: rows whose spec
    samples_from_logits_alone, so the generated ids it cannot know yet are not read)."""
    return [sample_request(token_buf, program_uid, seq, seq.num_tokens + ahead, mask,
                           known=seq.num_tokens) if unit.is_sampling else None
            for seq, unit, mask in zip(seqs, units, masks)]


def sample_request(token_buf, program_uid: int, seq: Sequence, position: int, mask=None,
                   known: int = None) -> SampleRow:
    """One sequence's device sampler row for the token at `position`; its generated history
    is the tokens from the prompt's end to `known` (default: position; a speculative verify's
    later positions see the drafts before them there)."""
    return SampleRow(seq.spec, position, token_buf[seq.slot, :seq.num_prompt_tokens],
                     token_buf[seq.slot, seq.num_prompt_tokens:position if known is None
                               else known],
                     mask, cache_key=(program_uid, seq.seq_id, seq.num_prompt_tokens))


def token_rows(seqs, units, tokens, vocab_size: int, what: str) -> tuple:
    """RowResults from a device path's token ids (one per row; rows that do not sample drop
    theirs)."""
    tokens = np.asarray(tokens)
    if tokens.shape != (len(seqs),) or np.any((tokens < 0) | (tokens >= vocab_size)):
        raise ProgramError(f"model.{what} returned {tokens!r} for {len(seqs)} rows")
    return tuple(RowResult(seq.seq_id, unit.num_new_tokens,
                           (int(tokens[r]),) if unit.is_sampling else (), (),
                           unit.is_replay, is_control=False)
                 for r, (seq, unit) in enumerate(zip(seqs, units)))


def sample_row(token_buf, seq: Sequence, unit: Unit, logits: np.ndarray,
               mask: Optional[np.ndarray] = None) -> RowResult:
    """One row's RowResult from its logits, sampled on the host (a control unit produces its
    forced tokens; a unit that does not sample, nothing)."""
    produced, logprobs = unit.forced, ()
    if unit.is_sampling:
        token, lp = sample_logits(logits, seq.spec,
                                  token_buf[seq.slot, :seq.num_prompt_tokens],
                                  token_buf[seq.slot, seq.num_prompt_tokens:seq.num_tokens],
                                  position=seq.num_tokens, mask=mask)
        produced, logprobs = (token,), (() if lp is None else (lp,))
    return RowResult(seq.seq_id, unit.num_new_tokens, produced, logprobs, unit.is_replay,
                     is_control=bool(unit.forced))
