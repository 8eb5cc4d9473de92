"""Backend-neutral contracts: the plain data and the protocols that the runtime, the Program and
the backends share. Nothing here imports a model family or a backend, so every layer may import it
(imports run downward: runtime -> contracts <- models).

    EngineCore ──(RowDecision)──> Program ──(ForwardBatch, SampleRow)──> Model (numpy | cuda)
         <──(PendingBatch of RowResult, ResumeState)──┘        <──(logits | token ids)──┘

`Model` is what a Program needs from a backend (and KVPoolProtocol / StatePoolProtocol its pools);
`ProgramProtocol` what the EngineCore and the ContextCache need of a Program (with
`CheckpointStoreProtocol`, its checkpoint store); `FrontendProtocol` / `OutputSessionProtocol` what
the EngineCore needs of the Frontend. Capabilities are declared attributes (`Model.samples_on_device`,
`Model.encode_media`, `ProgramProtocol.accepts_media` / `is_speculative`), never hasattr probes.
A unit crosses EngineCore -> Program as plain data: RowView (plan_view), RowPlan / UnitPlan
(launch), PendingBatch (collect), RowDecision (commit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol, runtime_checkable

import numpy as np

from .api import SamplingParams


class ProgramError(RuntimeError):
    """The Program's physical bookkeeping or a unit contract was broken: the Engine must fail."""


# ---- sampling ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """The compiled, immutable sampling parameters of one sequence (seed always resolved)."""

    seed: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    is_constrained: bool = False      # structured output: a grammar masks every sampled token
    # OpenAI logit_bias: ((token id, bias), ...) sorted by id, added after the penalties
    logit_bias: tuple = ()

    @classmethod
    def from_params(cls, params: SamplingParams, seed: int) -> "SamplingSpec":
        return cls(seed=int(seed), temperature=float(params.temperature), top_k=int(params.top_k),
                   top_p=float(params.top_p), min_p=float(params.min_p),
                   presence_penalty=float(params.presence_penalty),
                   frequency_penalty=float(params.frequency_penalty),
                   repetition_penalty=float(params.repetition_penalty),
                   logprobs=None if params.logprobs is None else int(params.logprobs),
                   is_constrained=params.structured is not None,
                   logit_bias=tuple(sorted((int(t), float(b)) for t, b in
                                           (params.logit_bias or {}).items())))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits: greedy, no penalty, bias or grammar mask changes them, no
        logprobs asked for."""
        return self.is_greedy and self.samples_from_logits_alone

    @property
    def samples_from_logits_alone(self) -> bool:
        """The next token is a function of the raw logits, the seed and the position only: no
        penalty (they read the tokens generated so far), bias or grammar mask, no logprobs. Such
        a row's next step may be launched before its current token is known on the host (the
        pipelined decode: Program.launch_ahead)."""
        return (self.logprobs is None and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and self.repetition_penalty == 1.0
                and not self.is_constrained and not self.logit_bias)


@dataclass(frozen=True)
class SampleRow:
    """One row's request to a backend that samples on the device (`Model.sample`): the host
    sampler's sample_row arguments (no logprobs). `cache_key` names the prompt, so the backend may
    keep its distinct ids between steps."""
    spec: SamplingSpec
    position: int
    prompt_ids: np.ndarray
    generated_ids: np.ndarray
    mask: Optional[np.ndarray] = None
    cache_key: object = None


# ---- unit results and decisions ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RowResult:
    """One row of a PendingBatch: what the unit consumed and produced for one sequence."""

    seq_id: int
    num_new_tokens: int         # tokens this unit ran through the model (KV/State advance)
    produced: tuple             # sampled token ids (0 or 1; a speculative row 1..k+1), or a
                                # control unit's forced tokens
    logprobs: tuple             # TokenLogprob per produced token when asked for, else ()
    is_replay: bool             # rebuilding accepted history; nothing new is produced
    is_control: bool = False    # produced = the forced tokens (not sampled)
    # a speculative verify (program/speculative.py): ran the last token + k drafts, produced the
    # verified prefix; history advances by the accepted count, the rest rolls back
    is_speculative: bool = False


@dataclass(frozen=True, slots=True)
class RowDecision:
    """The Engine's verdict on one row. A cancelled row accepts 0; otherwise
    1 <= accepted <= produced when the row produced, and a nonterminal row accepts all.
    is_discarded: the row's request ended on the unit before, which this one was launched
    ahead of (Program.launch_ahead): it accepts 0 and is terminal; what it ran stays run."""

    accepted: int
    is_terminal: bool = False
    is_cancelled: bool = False
    is_discarded: bool = False


class PendingBatch:
    """The provisional outcome of one unit (move-only: consumed by exactly one commit or abort).

    Membership is frozen at execution; until consumed, the rows' KV beyond their frontier and
    their State slots are provisional (the Program keeps a backup of each State image)."""

    __slots__ = ("rows", "_backups", "_is_consumed", "_epoch")

    def __init__(self, rows: tuple, backups: list, epoch: int):
        self.rows = rows
        self._backups = backups
        self._is_consumed = False
        self._epoch = epoch

    @property
    def is_consumed(self) -> bool:
        return self._is_consumed

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"PendingBatch({len(self.rows)} rows, consumed={self._is_consumed})"


@dataclass(frozen=True, slots=True, eq=False)
class ResumeState:
    """What a paused request needs to continue (owned by the Engine while paused).

    `kind` is "replay" (re-execute the accepted history through prefill chunks) or "snapshot"
    (State and KV of the frontier copied to host memory; revocable back to replay).
    `token_ids` holds prompt + accepted generated tokens; `num_computed_tokens` is the frontier
    the sequence had reached when paused."""

    kind: str
    token_ids: np.ndarray
    num_prompt_tokens: int
    num_computed_tokens: int
    spec: SamplingSpec
    snapshot_id: Optional[int] = None
    state_image: Optional[tuple] = None
    kv_pages: Optional[tuple] = None
    host_bytes: int = 0
    media: Optional[object] = None      # a vision prompt's positions and embeddings (Program)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


# ---- a unit's plan (EngineCore -> Program), as plain data ------------------------------------------
class RowView(NamedTuple):
    """What the EngineCore plans with, for one resident sequence (`Program.plan_view`, one call
    per cycle for all residents). A NamedTuple (immutable, ~10x cheaper to build than a frozen
    dataclass): one per resident per cycle is on the decode path."""
    seq_id: int
    kind: str                   # the next unit: "prefill", "replay" or "decode"
    is_protected: bool          # holds a resume permit (protected resume)
    is_sampling: bool           # the next unit samples a token (unless the row is given forced tokens)


class RowPlan(NamedTuple):
    """One row of a unit: the OutputSession's answers, asked once per cycle by the EngineCore
    (a NamedTuple for the same reason as RowView)."""
    seq_id: int
    forced: Optional[tuple] = None       # a control unit's tokens (decode-ready rows only)
    mask: Optional[np.ndarray] = None    # bool [V] allowed next tokens of a sampling row, or None


@dataclass(frozen=True, slots=True, eq=False)
class UnitPlan:
    """One unit for `Program.launch`: its rows in batch order.

    keep_rollback=False skips the State backup of each row (the Engine releases a cancelled row
    at once). draft_masks (speculative decoding only) maps (seq_id, drafts) to the masks of the
    positions after each draft prefix (OutputSession.token_masks_along): the one callable left,
    because the drafts exist only inside the Program, after the unit is launched; it is pure
    (mutates no session) and borrowed for this unit only."""
    rows: tuple                          # RowPlan, in batch order
    keep_rollback: bool = True
    draft_masks: Optional[Callable[[int, tuple], list]] = None

    @property
    def seq_ids(self) -> list:
        return [r.seq_id for r in self.rows]


# ---- capacity and the checkpoint store (typed answers of the Program) ---------------------------
@dataclass(frozen=True, slots=True)
class Capacity:
    """What the Program has free now (`Program.capacity()`): the EngineCore's check before an act
    that the act itself checks again (bind, resume, reserve)."""
    free_kv_pages: int
    free_state_slots: int


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One context-cache checkpoint as its store holds it (`Program.checkpoints.info`)."""
    num_tokens: int             # the exact prefix [0, num_tokens) its State and KV cover
    on_device: bool             # device tier (pages by reference + a cache State slot), else host
    device_pages_freed: int     # KV pages dropping or demoting it would free now (unshared ones)
    host_bytes: int             # host tier: bytes of its host copies, else 0
    is_moving: bool = False     # on the device, its demotion's host copies under way


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """The checkpoint store's usage against its budgets (`Program.checkpoints.usage()`)."""
    host_bytes_used: int
    host_budget_bytes: int
    device_pages_used: int      # distinct KV pages the device checkpoints hold
    device_page_budget: int
    device_bytes_used: int      # those pages + the cache State slots in use
    num_cache_slots: int        # 0: no device tier
    num_entries: int
    num_free_cache_slots: int = 0
    num_moving: int = 0         # device checkpoints whose demotion's copies are under way
    moving_pages_freed: int = 0     # KV pages those give back when their copies are done


@dataclass(frozen=True, slots=True)
class CaptureRoom:
    """What a device capture of [0, num_tokens) of a sequence needs (`Program.capture_room`)."""
    is_slot_free: bool          # a cache State slot is free
    num_pages_taken: int        # free pages it takes (the copy of a partly filled page)
    num_pages_added: int        # pages it adds to the device checkpoints' distinct set


# ---- what a model family loads from ---------------------------------------------------------------
class WeightSource(Protocol):
    """What a model family's loaders read from an artifact: ninfer.artifact.Artifact, and
    fakes.TensorArtifact for tests. Every method exists on every source (no probing): a source
    without quantized bindings answers is_quantized False and lists no uses."""
    path: str
    model_config_json: dict

    def has(self, name: str) -> bool: ...
    def tensor(self, name: str) -> np.ndarray: ...        # read-only, logical shape
    def is_quantized(self, name: str) -> bool: ...
    def quantized(self, name: str): ...                   # artifact.format.QuantizedTensor
    @property
    def manifest(self) -> dict: ...                       # "uses": [{binding, activation}]


# ---- the pools a backend provides ----------------------------------------------------------------
@runtime_checkable
class KVPoolProtocol(Protocol):
    """Paged KV of every full-attention layer (`Model.new_kv_pool`). Page images are host float32
    copies: (k list, v list), one array per layer (kv_dtype fp8 / int8: each page's codes and
    scales as bytes, ops/kv_quant.QuantizedPages.raw, on both backends)."""
    num_pages: int
    # start_read_pages copies while the model's steps go on (CUDA: a copy stream), so the
    # context cache demotes ahead of need; False: the read is done when it starts (numpy)
    reads_async: bool

    def read_pages(self, pages) -> tuple: ...

    def start_read_pages(self, pages) -> "HostRead":
        """read_pages, begun now and finished later: the pages must not change until the
        HostRead is done (the checkpoint store holds them meanwhile). The image may keep the
        pool's own bytes (CUDA's bf16 pool: uint16 bits), which write_pages takes back: the
        context cache's host tier keeps it only to write it back."""

    def write_pages(self, pages, image: tuple) -> None: ...

    def copy_pages(self, src_pages, dst_pages) -> None:
        """Page dst[i] becomes a copy of page src[i] in every layer (lists of one length, the two
        disjoint; CUDA: device to device on the model's stream, in order with the steps)."""


@runtime_checkable
class StatePoolProtocol(Protocol):
    """One StateImage (GDN conv + recurrent state) per slot (`Model.new_state_pool`)."""
    num_slots: int
    reads_async: bool               # as KVPoolProtocol's

    def zero(self, slot: int) -> None: ...

    def read(self, slot: int) -> tuple: ...

    def start_read(self, slot: int) -> "HostRead": ...

    def write(self, slot: int, image: tuple) -> None: ...

    def copy(self, src_slot: int, dst_slot: int) -> None:
        """The context cache's checkpoints: slot dst becomes a copy of slot src."""


# ---- what the EngineCore needs of the Frontend and of an OutputSession ----------------------------
@runtime_checkable
class OutputSessionProtocol(Protocol):
    """One request's output (stop, channels, detokenization, tools, grammar): preview, then commit.
    Per cycle the EngineCore asks `forced_tokens` of a decode-ready row once, `needs_mask` /
    `token_mask` of a sampling row once, `preview` once per produced row, then `commit`.
    `may_force_tokens`: a control unit may come later (a thinking budget), so no decode step
    may be launched before the one in flight is previewed."""
    needs_mask: bool
    may_force_tokens: bool

    def forced_tokens(self) -> tuple: ...

    def token_mask(self): ...

    def token_masks_along(self, token_ids) -> list: ...

    def preview(self, token_ids): ...

    def preview_finish(self, reason: str): ...

    def commit(self, preview) -> None: ...


@runtime_checkable
class FrontendProtocol(Protocol):
    """Tokenizer, chat template, media preprocessing; one OutputSession per request."""

    def prepare(self, prompt, *, tools=None, enable_thinking=True): ...

    def new_output_session(self, params, prepared, tools=None, *, request_id=None): ...


# ---- what the runtime needs of the Program ---------------------------------------------------------
@runtime_checkable
class CheckpointStoreProtocol(Protocol):
    """The Program's context-cache store as the runtime's ContextCache sees it (the only physical
    ledger of checkpoints: their pages, State slots and host bytes)."""

    def info(self, cid: int) -> CheckpointInfo: ...

    def ids(self) -> list: ...

    def usage(self) -> StoreUsage: ...

    def host_cost(self, num_tokens: int) -> int: ...

    # start_demote's copies run beside the steps (the pools' reads_async): settle finishes them
    reads_async: bool

    def demote(self, cid: int) -> None: ...

    def start_demote(self, cid: int) -> None: ...

    def settle(self, wait: bool = False) -> int: ...

    def drop(self, cid: int) -> None: ...


@runtime_checkable
class ProgramProtocol(Protocol):
    """What the EngineCore and the ContextCache call on a Program (models/qwen3_5/program). Only the
    Engine worker calls it. Capabilities are declared attributes, never probed."""
    vocab_size: int
    accepts_media: bool             # bind takes image / video prompts (a vision tower runs)
    is_speculative: bool            # decode rows verify drafts (RowResult.is_speculative)
    merges_units: bool              # a cycle's decode rows and prefill chunk may be one unit
    host_budget_bytes: int          # Snapshot pauses' host budget
    host_bytes_free: int
    checkpoints: CheckpointStoreProtocol

    # capacity (check / act pairs: the act checks again and raises ProgramError)
    def capacity(self) -> Capacity: ...

    def can_bind(self, num_prompt_tokens: int, num_reused: int = 0, checkpoint=None) -> bool: ...

    def pages_short_to_bind(self, num_prompt_tokens: int, num_reused: int = 0,
                            checkpoint=None) -> int: ...

    def can_resume(self, rs: ResumeState) -> bool: ...

    def pages_short_to_resume(self, rs: ResumeState) -> int: ...

    def snapshot_cost(self, seq_id: int) -> int: ...

    # sequence lifetime
    def bind(self, prompt_ids, spec: SamplingSpec, *, capture_at: int = 0, checkpoint=None,
             media=None, encoded_media=None) -> int: ...

    def encode_media(self, prompt_ids, media, positions):
        """The vision tower's output for bind's encoded_media; thread-safe (no Program state)."""

    def pause(self, seq_id: int, *, allow_snapshot: bool = True) -> ResumeState: ...

    def resume(self, rs: ResumeState) -> int: ...

    def revoke_snapshot(self, rs: ResumeState) -> ResumeState: ...

    def discard(self, rs: ResumeState) -> None: ...

    def release(self, seq_id: int, *, keep_frontier: bool = False, on_device: bool = True): ...

    # units: plan_view once per cycle, reserve, launch -> collect -> commit (or abort_pending)
    def plan_view(self, seq_ids) -> list: ...

    def has_protected(self) -> bool: ...

    def reserve_units(self, seq_ids, *, forced=None, stop_at_short: bool = False) -> list: ...

    def launch(self, plan: UnitPlan): ...

    def collect(self, inflight) -> PendingBatch: ...

    # the pipelined decode: the next decode step of the unit in flight, launched before it is
    # collected (its token ids fed on the device; Model.chains_token_steps), or None
    def launch_ahead(self, inflight): ...

    def commit(self, pending: PendingBatch, decisions) -> None: ...

    def abort_pending(self, pending: PendingBatch) -> None: ...

    # the context cache's sequence-bound hooks
    def continuation(self, seq_id: int) -> np.ndarray: ...

    def due_captures(self, seq_ids) -> dict: ...

    def capture_room(self, seq_id: int, num_tokens: int, *,
                     at_release: bool = False) -> CaptureRoom: ...

    def capture_checkpoint(self, seq_id: int, *, keep: bool = True,
                           on_device: bool = True) -> Optional[int]: ...

    def promote_checkpoint(self, checkpoint: int, seq_id: int) -> None: ...

    def prefill_progress(self, seq_id: int): ...

    def add_capture(self, seq_id: int, position: int) -> bool: ...

    # observation and audits
    def stats(self) -> dict: ...

    def assert_all_free(self, *, full: bool = True) -> None: ...


# ---- the backend protocol ------------------------------------------------------------------------
@runtime_checkable
class Model(Protocol):
    """What the Program needs from a backend (numpy: NumpyModel, cuda: CudaModel).

    `forward` returns float32 logits [B, V] (the host samples). A backend with
    `greedy_on_device` also has `decode_greedy(batch, kv, state) -> int32 [B]` (argmax on the
    device); one with `samples_on_device` has
    `sample(batch, kv, state, rows: list[SampleRow | None]) -> int32 [B]`. Both are
    `launch_tokens(batch, kv, state, rows=None).collect()`: launch_tokens returns at once with a
    step whose `collect() -> int32 [B]` waits for that step's ids alone (host work may run in
    between); one step is in flight at a time (collect before the next launch).
    `batch_limits(kv, state) -> BatchLimits` are the limits its `ForwardBatch.check` uses.
    Speculative decoding (program/speculative.py) also asks for
    `verify_forward(batch, kv, state, out_rows, *, snap_base=None, media=None) -> (logits of
    out_rows, final-normed hidden [N, H])`, `verify_snapshots` (snap_base: the State after each
    token of row r into slots snap_base[r] + i) and, with `samples_on_device`,
    `verify_tokens(batch, kv, state, out_rows, rows, ...) -> (int32 token per out row, hidden)`;
    one with `step_hidden` also takes `launch_tokens(..., keep_hidden=True)`, whose step's
    `hidden() -> [B, H]` (after collect) is every row's final-normed hidden state (float32, or
    a bf16 backend's own bits as ml_dtypes.bfloat16, which its drafter takes back as they are):
    the drafter's feed of a plain decode step a speculative Program runs at k = 0.
    `checks_batches=False` (set by the Program unless its debug option asks otherwise) lets the
    backend trust the batches it is given: the Program validated them once, when it built them."""

    backend: str
    greedy_on_device: bool
    samples_on_device: bool
    # one call may hold decode rows and a prefill chunk together (rows of 1 and of many
    # tokens): the Program then runs a cycle's decode rows and its chunk as one unit
    mixed_batches: bool
    # launch_tokens(batch, ..., after=step) takes a greedy decode batch's token ids from a step
    # still in flight, on the device: the Program may launch decode step k+1 before step k is
    # collected (Program.launch_ahead), so the host's work on step k overlaps step k+1
    chains_token_steps: bool
    # launch_tokens(..., keep_hidden=True): the step's final-normed hidden states too (above)
    step_hidden: bool
    # seconds of one-off work done so far (CUDA: graphs captured, GEMM plans made), read before
    # and after a call: the draft policy takes a speculative unit's time less what grew during
    # it as that k's cost (0.0 for ever on a backend without any)
    one_off_seconds: float
    checks_batches: bool
    max_kv_pages: Optional[int]     # KV pages the backend's memory plan holds (None: no limit)
    max_state_slots: Optional[int]  # State slots its memory plan holds (None: no limit)
    # a vision model's (prompt_ids, media, positions) -> vision.PromptMedia; None: text only
    encode_media: Optional[Callable]
    # seconds of the load's phases the backend measured ("setup": device, memory, libraries;
    # "weights"; "kernels": their wait beyond the weights') and of warm_up's ("graphs": capture);
    # the Engine reports them in Engine.startup_seconds
    load_phases: dict
    warm_up_phases: dict

    def warm_up(self, kv, state) -> None: ...

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPoolProtocol: ...

    def new_state_pool(self, num_slots: int) -> StatePoolProtocol: ...

    def forward(self, batch, kv, state, *, all_logits: bool = False) -> np.ndarray: ...

    def close(self) -> None: ...


class HostRead(Protocol):
    """A pool's host copy in progress (KVPoolProtocol.start_read_pages / StatePool.start_read)."""

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""

    def result(self):
        """The image read_pages / read would return (waits for the copy); once."""


class ReadyRead:
    """A host read that was done when it started (the numpy pools)."""
    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def done(self) -> bool:
        return True

    def result(self):
        return self._value


class ReadyStep:
    """A token step that finished when it was launched: collect() returns its output."""
    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def collect(self):
        return self._value


class ImmediateTokenSteps:
    """`launch_tokens` for a backend whose `decode_greedy` / `sample` compute synchronously (the
    test fakes): the step is done at launch. The CUDA model launches for real (cuda/token_step.py)."""

    def launch_tokens(self, batch, kv, state, rows=None, *, after=None) -> ReadyStep:
        """after: a step whose ids are this batch's token ids (row r's token = its id r; the
        pipelined decode, `chains_token_steps`): done at launch here, so they are known."""
        if after is not None:
            batch.token_ids[:] = after.collect()
        return ReadyStep(self.decode_greedy(batch, kv, state) if rows is None
                         else self.sample(batch, kv, state, rows))


# ---- the model call ------------------------------------------------------------------------------
_SAME_KV_SLOT = "ForwardBatch: two new tokens would write the same KV page slot"


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What a backend can run without corrupting another row (ForwardBatch.check). None: the rule
    does not apply (page_size None: no attention layers, so no KV rules; num_state_slots None: no
    GDN layers, so no State rules; the capacities None: no limit)."""
    vocab_size: Optional[int] = None
    page_size: Optional[int] = None
    num_kv_pages: Optional[int] = None
    num_state_slots: Optional[int] = None
    max_rows: Optional[int] = None
    max_tokens: Optional[int] = None
    max_pages_per_row: Optional[int] = None
    rows_need_tokens: bool = True     # every row brings >= 1 new token (and there is a row)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The plain-data plan of one model call (the Program builds it, a backend runs it).

    Rows are sequences; their new tokens are packed back to back:

        token_ids   [N]        all rows' new tokens, row r at query_start[r]:query_start[r+1]
        positions   [3, N]     MRoPE (t, h, w) positions; text-only prompts have t == h == w
        query_start [B+1]      prefix sums of the rows' new-token counts (query_start[0] == 0)
        context_lens[B]        tokens of each row already in KV / State before this call
        block_tables[B, P]     KV page ids of each row, in order; -1 pads; must cover
                               context_lens[r] + new tokens of row r
        state_slots [B]        StateImage slot of each row (GDN conv + recurrent state)

    A row with context_lens[r] == 0 starts from a zero State (whatever its slot held is ignored
    and overwritten). After the call the row's KV holds positions [0, context_lens[r] + n_r) and
    its State has consumed every token in it."""
    token_ids: np.ndarray
    positions: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    state_slots: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def row_lengths(self) -> np.ndarray:
        return np.diff(self.query_start)

    @staticmethod
    def text_positions(context_lens, lengths) -> np.ndarray:
        """[3, N] positions for text-only rows: context_len, context_len+1, ... per row."""
        pos = np.concatenate([np.arange(c, c + n, dtype=np.int32)
                              for c, n in zip(context_lens, lengths)]) if len(lengths) else \
            np.zeros(0, np.int32)
        return np.broadcast_to(pos, (3, len(pos))).copy()

    @classmethod
    def single(cls, token_ids, context_len: int, block_table, state_slot: int = 0) -> "ForwardBatch":
        """One text-only row (scoring, tests)."""
        ids = np.asarray(token_ids, dtype=np.int32)
        return cls(token_ids=ids,
                   positions=cls.text_positions([context_len], [len(ids)]),
                   query_start=np.array([0, len(ids)], dtype=np.int32),
                   context_lens=np.array([context_len], dtype=np.int32),
                   block_tables=np.asarray(block_table, dtype=np.int32).reshape(1, -1),
                   state_slots=np.array([state_slot], dtype=np.int32))

    def validate(self, page_size: int) -> None:
        """The layout rules alone (shapes, KV coverage): check() with no model's limits."""
        self.check(BatchLimits(page_size=page_size, rows_need_tokens=False))

    def check(self, limits: BatchLimits) -> None:
        """Raise ValueError for a plan a backend with these limits cannot run without corrupting
        another row. The one home of the batch rules; the Program builds valid batches, so a
        backend calls this only while its checks_batches is set."""
        B, N = self.num_rows, self.num_tokens
        qs = np.asarray(self.query_start)
        if qs.shape != (B + 1,) or qs[0] != 0 or qs[-1] != N or np.any(qs[1:] < qs[:-1]):
            raise ValueError(f"ForwardBatch: bad query_start {qs} for {N} tokens")
        if np.shape(self.positions) != (3, N):
            raise ValueError(f"ForwardBatch: positions shape {np.shape(self.positions)} != (3, {N})")
        lengths = qs[1:] - qs[:-1]
        if limits.rows_need_tokens and (B < 1 or np.any(lengths < 1)):
            raise ValueError(f"ForwardBatch: every row needs >= 1 new token, got {lengths.tolist()}")
        if (limits.max_tokens is not None and N > limits.max_tokens) or \
                (limits.max_rows is not None and B > limits.max_rows):
            raise ValueError(f"ForwardBatch: {N} tokens / {B} rows exceed the model's capacity "
                             f"({limits.max_tokens} tokens, {limits.max_rows} rows); split the "
                             "prefill into chunks")
        ctxs = np.asarray(self.context_lens)
        if B and int(ctxs.min()) < 0:
            # (it would index before the block table and write K/V outside the pool)
            raise ValueError("ForwardBatch: context_lens must be >= 0")
        ids = np.asarray(self.token_ids)
        if limits.vocab_size is not None and ids.size and \
                (ids.min() < 0 or ids.max() >= limits.vocab_size):
            raise ValueError(f"ForwardBatch: token id out of range [0, {limits.vocab_size})")
        bt, slots = np.asarray(self.block_tables), np.asarray(self.state_slots)
        if (limits.page_size is not None or limits.num_state_slots is not None) and (
                slots.shape != (B,) or
                (limits.page_size is not None and (bt.ndim != 2 or bt.shape[0] != B))):
            raise ValueError("ForwardBatch: block_tables / state_slots do not match the rows")
        if limits.num_state_slots is not None and B and (
                len(set(slots.tolist())) != B or slots.min() < 0 or
                slots.max() >= limits.num_state_slots):
            raise ValueError(f"ForwardBatch: state slots {slots.tolist()} must be distinct and "
                             f"< {limits.num_state_slots}")
        if limits.page_size is not None:
            self._check_kv(limits, bt, ctxs, lengths)

    def _check_kv(self, limits: BatchLimits, bt, ctxs, lengths) -> None:
        ps = limits.page_size
        need = (ctxs + lengths + ps - 1) // ps                    # pages each row must name
        width = int(need.max(initial=0))
        if limits.max_pages_per_row is not None and width > limits.max_pages_per_row:
            raise ValueError(f"ForwardBatch: a row needs {width} pages, more than max_context "
                             f"allows ({limits.max_pages_per_row})")
        short = need > bt.shape[1]
        if width <= bt.shape[1]:
            short = np.any((bt[:, :width] < 0) & (np.arange(width) < need[:, None]), axis=1)
        if np.any(short):
            r = int(np.argmax(short))
            raise ValueError(f"ForwardBatch: row {r} block table does not cover "
                             f"{int(ctxs[r] + lengths[r])} tokens")
        if limits.num_kv_pages is not None and int(bt.max(initial=-1)) >= limits.num_kv_pages:
            raise ValueError(f"ForwardBatch: block table names a page >= {limits.num_kv_pages}")
        # the page slot each new token writes: two tokens of one call must not share one
        tok_row = np.repeat(np.arange(len(lengths)), lengths)
        tok_pos = np.asarray(ctxs)[tok_row] + (np.arange(self.num_tokens) - self.query_start[tok_row])
        flat = bt[tok_row, tok_pos // ps].astype(np.int64) * ps + tok_pos % ps
        if len(np.unique(flat)) != len(flat):
            raise ValueError(_SAME_KV_SLOT)


__all__ = ["BatchLimits", "Capacity", "CaptureRoom", "CheckpointInfo", "CheckpointStoreProtocol",
           "ForwardBatch", "FrontendProtocol", "ImmediateTokenSteps", "KVPoolProtocol", "Model", "OutputSessionProtocol",
           "PendingBatch", "ProgramError", "ProgramProtocol", "ReadyStep", "ResumeState", "RowDecision",
           "RowPlan", "RowResult", "RowView", "SampleRow", "SamplingSpec", "StatePoolProtocol",
           "StoreUsage", "UnitPlan"]
