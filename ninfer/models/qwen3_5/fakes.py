"""Small fakes that honour the Model and Frontend contracts (docs/internals.md), for tests of
the runtime and of layers above it (gateway, CLI) without a real checkpoint. They live in the
Qwen3.5 family (its config, its KV / State pools) so that the runtime imports no model family.

FakeModel's next-token logits depend on the WHOLE history of a row, read back through the KV
pool (via the block table) and the State pool, so a paging, State-restore or Replay bug shows up
as different tokens. Values are small integers stored exactly in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ...api import TextDelta
from ...contracts import ImmediateTokenSteps
from ...errors import ArtifactError
from .config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, TextConfig
from .state import KVPool, StatePool

_P = 1_000_003                      # modulus: every stored value < 2**24, exact in float32


def fake_config(vocab_size: int = 64) -> ModelConfig:
    text = TextConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=8,
                      num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                      head_dim=2, linear_conv_kernel_dim=2, linear_key_head_dim=1,
                      linear_value_head_dim=1, linear_num_key_heads=1, linear_num_value_heads=1,
                      layer_types=(LINEAR_ATTENTION, FULL_ATTENTION), eos_token_id=(0,))
    return ModelConfig(architecture="Qwen3_5ForCausalLM", text=text)


class TensorArtifact:
    """contracts.WeightSource over a dict of plain (row-major) tensors: the artifact of model
    tests that build weights in memory. `tensor` hands out read-only views, like the mapped file."""
    path = "<tensor artifact>"

    def __init__(self, config: ModelConfig, tensors: dict):
        self.config, self._t = config, tensors
        self.model_config_json = config.to_json()
        self.manifest = {"uses": []}

    def has(self, name: str) -> bool:
        return name in self._t

    def binding_names(self) -> list:
        return sorted(self._t)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._t:
            raise ArtifactError(f"no binding {name!r}")
        v = self._t[name].view()
        v.flags.writeable = False
        return v

    def is_quantized(self, name: str) -> bool:
        return False

    def quantized(self, name: str):
        raise ArtifactError(f"binding {name!r} is not quantized")

    def resource(self, name: str):
        return None

    def close(self) -> None:
        pass


class FakeModel(ImmediateTokenSteps):
    """forward(batch, kv, state) with the real contract. Hooks for tests:
    `on_forward(batch)` runs first (block, cancel, inspect); `fail_at_call` raises there."""

    backend = "fake"
    greedy_on_device = samples_on_device = False    # subclasses add decode_greedy / sample
    mixed_batches = True
    chains_token_steps = False      # (ChainingModel: True)
    step_hidden = False             # (no hidden states: no speculative plain steps)
    one_off_seconds = 0.0
    load_phases: dict = {}
    warm_up_phases: dict = {}
    checks_batches = True
    max_kv_pages = None
    max_state_slots = None
    encode_media = None                             # text only (contracts.Model)

    def warm_up(self, kv, state) -> None:
        pass

    def __init__(self, vocab_size: int = 64, logit_scale: float = 2.0):
        self.config = fake_config(vocab_size)
        self.logit_scale = logit_scale
        self.on_forward: Optional[Callable] = None
        self.fail_at_call: Optional[int] = None
        self.num_calls = 0
        self.batch_sizes: list = []

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        return KVPool.allocate(self.config.text, num_pages, page_size)

    def new_state_pool(self, num_slots: int) -> StatePool:
        return StatePool.allocate(self.config.text, num_slots)

    def forward(self, batch, kv: KVPool, state: StatePool, *, all_logits: bool = False):
        self.num_calls += 1
        self.batch_sizes.append(batch.num_rows)
        if self.on_forward is not None:
            self.on_forward(batch)
        if self.fail_at_call is not None and self.num_calls >= self.fail_at_call:
            raise RuntimeError(f"injected model failure at call {self.num_calls}")
        batch.validate(kv.page_size)
        out = []
        for r in range(batch.num_rows):
            a, b = int(batch.query_start[r]), int(batch.query_start[r + 1])
            out.append(self._row(batch, r, batch.token_ids[a:b], batch.positions[0, a:b],
                                 kv, state, all_logits))
        return np.concatenate(out) if all_logits else np.stack(out)

    def _row(self, batch, r, tokens, positions, kv, state, all_logits):
        slot, ctx = int(batch.state_slots[r]), int(batch.context_lens[r])
        table, ps = batch.block_tables[r], kv.page_size
        k, v = kv.k[0], kv.v[0]
        conv, rec = state.conv[0], state.recurrent[0]
        if ctx == 0:
            state.zero(slot)
        rows = []
        for t, p in zip(tokens.tolist(), positions.tolist()):
            h = (int(rec[slot, 0, 0, 0]) * 31 + t + 7) % _P
            rec[slot, 0, 0, 0] = h
            conv[slot, :, 0] = t
            page, off = int(table[p // ps]), p % ps
            k[page, off, 0, :] = ((t * 131 + p * 7 + 1) % _P, h)
            v[page, off, 0, :] = (t, p)
            if all_logits or p == int(positions[-1]):
                rows.append(self._logits(table, ps, p, k, v, h, int(conv[slot, 0, 0])))
        return np.stack(rows) if all_logits else rows[-1]

    def _logits(self, table, ps, last, k, v, h, last_token):
        pos = np.arange(last + 1)
        pages = table[pos // ps]
        keys = k[pages, pos % ps, 0, 0].astype(np.int64)
        vals = v[pages, pos % ps, 0, 0].astype(np.int64)
        digest = int(((keys * (pos + 1)) % _P).sum() + (vals * 3).sum()) % _P
        rng = np.random.default_rng([digest, h, last_token])
        return (rng.standard_normal(self.config.text.vocab_size) * self.logit_scale) \
            .astype(np.float32)

    def close(self) -> None:
        pass


class LateRead:
    """A host read that copies when it finishes, not when it starts, as a copy stream may: done()
    turns True at its `polls`-th call; result() reads the rows then. A store that let its rows
    change before the read was done would keep the changed bytes (and a later hit would give
    other tokens)."""

    def __init__(self, read: Callable, polls: int):
        self._read, self._polls, self._value, self.finished = read, polls, None, False

    def done(self) -> bool:
        self._polls -= 1
        return self._polls < 0

    def result(self):
        if not self.finished:
            self._value, self.finished = self._read(), True
        return self._value


class LateKVPool(KVPool):
    """KVPool whose start_read_pages is a LateRead (contracts.KVPoolProtocol.reads_async)."""
    reads_async = True
    polls = 3

    def start_read_pages(self, pages):
        pages = np.array(pages, np.int64)
        return LateRead(lambda: self.read_pages(pages), self.polls)


class LateStatePool(StatePool):
    reads_async = True
    polls = 3

    def start_read(self, slot: int):
        return LateRead(lambda: self.read(slot), self.polls)


class LateReadModel(FakeModel):
    """FakeModel over pools whose host reads finish a few polls after they start: the context
    cache's asynchronous demotions (CheckpointStore.start_demote / settle) on a CPU."""

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        return LateKVPool.allocate(self.config.text, num_pages, page_size)

    def new_state_pool(self, num_slots: int) -> StatePool:
        return LateStatePool.allocate(self.config.text, num_slots)


class NullModel(FakeModel):
    """A model that costs nothing: every unit "samples" token `token_id` on its device path, so a
    run through EngineCore measures the host's own per-cycle work (tests/test_host_cost.py)."""
    greedy_on_device = True

    def __init__(self, vocab_size: int = 64, token_id: int = 1):
        super().__init__(vocab_size)
        self.token_id = token_id

    def decode_greedy(self, batch, kv, state):
        self.num_calls += 1
        self.batch_sizes.append(batch.num_rows)
        return np.full(batch.num_rows, self.token_id, np.int32)


class ChainingModel(FakeModel):
    """FakeModel's logits, argmaxed or sampled on its "device" (decode_greedy, sample: the host
    sampler's arithmetic), with chained token steps (contracts.Model.chains_token_steps): the
    Program launches decode step k+1 before step k is collected, the pipelined decode's path on
    a backend without a GPU."""
    greedy_on_device = samples_on_device = True
    chains_token_steps = True

    def decode_greedy(self, batch, kv, state):
        return self.forward(batch, kv, state).argmax(-1).astype(np.int32)

    def sample(self, batch, kv, state, rows):
        from .program.sampling import sample_row
        logits = self.forward(batch, kv, state)
        return np.array([int(np.argmax(z)) if row is None else
                         sample_row(z, row.spec, row.prompt_ids, row.generated_ids,
                                    row.position, row.mask)[0]
                         for z, row in zip(logits, rows)], np.int32)


@dataclass(frozen=True, slots=True)
class FakePrepared:
    token_ids: np.ndarray
    text: str = ""
    num_reusable_tokens: int = 0     # the whole prompt (a later prompt may extend it)
    media: tuple = ()                # text only (PreparedPrompt's fields the core reads)
    mrope_positions: Optional[np.ndarray] = None


@dataclass(frozen=True, slots=True)
class FakePreview:
    accepted: int
    events: tuple
    finish_reason: Optional[str]


def _char(t: int) -> str:
    return chr(ord("a") + t % 26)


@dataclass(slots=True)
class FakeOutputSession:
    """Stops on eos (unless ignore_eos), stop_token_ids and stop strings; one char per token."""

    eos_token_ids: tuple
    stop_token_ids: tuple
    stop: tuple
    text: str = ""
    reasoning_text: str = ""
    tool_calls: list = field(default_factory=list)
    num_commits: int = 0
    finish_reason: Optional[str] = None

    def preview(self, token_ids) -> FakePreview:
        text, accepted = "", 0
        for t in token_ids:
            accepted += 1
            if t in self.eos_token_ids or t in self.stop_token_ids:
                return self._preview(text, token_ids[:accepted], "stop")
            text += _char(t)
            for s in self.stop:
                cut = (self.text + text).find(s)
                if cut >= 0:
                    return self._preview((self.text + text)[len(self.text):cut] if cut >= len(self.text)
                                         else "", token_ids[:accepted], "stop")
        return self._preview(text, token_ids, None)

    def _preview(self, text, ids, reason) -> FakePreview:
        events = (TextDelta("content", text, tuple(int(i) for i in ids)),) if text else ()
        return FakePreview(len(ids), events, reason)

    def preview_finish(self, reason) -> FakePreview:
        return FakePreview(0, (), self.finish_reason or reason)

    needs_mask = False              # no grammar, min_tokens or thinking budget here
    may_force_tokens = False

    def forced_tokens(self) -> tuple:
        return ()

    def commit(self, preview: FakePreview) -> None:
        self.num_commits += 1
        self.finish_reason = self.finish_reason or preview.finish_reason
        for e in preview.events:
            self.text += e.text


class FakeFrontend:
    def __init__(self, vocab_size: int = 64, eos_token_ids=(0,)):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def tokenize(self, text: str) -> np.ndarray:
        return np.array([1 + ord(c) % (self.vocab_size - 1) for c in text], np.int32)

    def detokenize(self, ids) -> str:
        return "".join(_char(int(t)) for t in ids)

    def prepare(self, prompt, *, tools=None, enable_thinking=True) -> FakePrepared:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
            return FakePrepared(ids, prompt, len(ids))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            text = "\n".join(str(m.get("content", "")) for m in prompt)
            ids = self.tokenize(text)
            return FakePrepared(ids, text, len(ids))
        ids = np.asarray(prompt, np.int32)
        return FakePrepared(ids, "", len(ids))

    def new_output_session(self, params, prepared, tools=None, *,
                           request_id=None) -> FakeOutputSession:
        eos = () if params.ignore_eos else self.eos_token_ids
        return FakeOutputSession(eos, tuple(params.stop_token_ids), tuple(params.stop))
