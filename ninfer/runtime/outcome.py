"""Per-row verdicts and final results: pure functions of a request record and a unit row.

The EngineCore calls `decide` between Program execution and Program commit (the Frontend preview
happens here and mutates nothing), and `final_result` once, at the terminal transition.
"""
from __future__ import annotations

import logging
import time

from ..api import GenerationResult
from ..contracts import RowDecision
from .request import Request

log = logging.getLogger("ninfer.engine")


def decide(req: Request, row, now: float, max_context: int) -> tuple:
    """(RowDecision, preview, error) for one row of a PendingBatch.

    Cancelled or past its deadline -> accept 0. A Frontend fault ends only this request (the row
    is treated as cancelled, with the error). Otherwise the preview says how many tokens are
    accepted and whether a stop ended the output; the budget (max_tokens, max_context) says
    whether the row is terminal by length."""
    if req.is_cancel_requested or req.deadline_passed(now):
        return RowDecision(0, is_cancelled=True), None, None
    if not row.produced:
        return RowDecision(0), None, None
    # a speculative row may produce past the budget: only what max_tokens / max_context leave
    room = min(req.params.max_tokens - req.num_generated_tokens,
               max_context - req.num_prompt_tokens - req.num_generated_tokens)
    produced = min(len(row.produced), max(room, 1))
    try:
        preview = req.session.preview(list(row.produced[:produced]))
        accepted = int(preview.accepted)
        is_stop = preview.finish_reason is not None
        if not 0 <= accepted <= produced or (not is_stop and accepted != produced):
            raise RuntimeError(f"preview accepted {accepted} of {produced} tokens "
                               f"(finish_reason {preview.finish_reason!r})")
    except Exception as exc:  # noqa: BLE001 - a Frontend fault ends only this request
        log.exception("request %s: output preview failed", req.request_id)
        return RowDecision(0, is_cancelled=True), None, f"output processing failed: {exc}"
    accepted = max(accepted, 1)          # the stop token itself joins the model history
    num_generated = req.num_generated_tokens + accepted
    is_length = num_generated >= req.params.max_tokens \
        or req.num_prompt_tokens + num_generated >= max_context
    return RowDecision(accepted, is_terminal=is_stop or is_length), preview, None


def final_result(req: Request, reason: str, error) -> GenerationResult:
    now = time.monotonic()
    session = req.session
    first = req.first_token_time
    return GenerationResult(
        text=_safe_attr(session, "text", ""),
        reasoning_text=_safe_attr(session, "reasoning_text", ""),
        tool_calls=list(_safe_attr(session, "tool_calls", []) or []),
        token_ids=list(req.token_ids), finish_reason=reason,
        num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
        logprobs=req.logprobs, error=error,
        stop_sequence=_safe_attr(session, "stop_sequence", None),
        time_to_first_token=None if first is None else first - req.submit_time,
        prefill_seconds=0.0 if req.admit_time is None else (first or now) - req.admit_time,
        decode_seconds=0.0 if first is None else now - first)


def _safe_attr(obj, name, default):
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001 - a broken session must not block the terminal event
        return default
