"""The concrete classes satisfy the typed seams of ninfer/contracts.py: the Program (and its
checkpoint store) what the EngineCore and ContextCache call, the Frontend and OutputSession what the
EngineCore asks, the backends' pools what the Program uses. runtime_checkable isinstance checks
that every member is there; the static lists below pin the members the seam names."""
import numpy as np

from ninfer import contracts
from ninfer.api import SamplingParams
from ninfer.contracts import (CheckpointStoreProtocol, FrontendProtocol, KVPoolProtocol, Model,
                              OutputSessionProtocol, ProgramProtocol, StatePoolProtocol)
from ninfer.models.qwen3_5.frontend.output_session import OutputSession
from ninfer.models.qwen3_5.program import Program
from ninfer.options import EngineOptions
from ninfer.models.qwen3_5.fakes import FakeFrontend, FakeModel


def _program():
    return Program(FakeModel(), EngineOptions(max_concurrency=2, max_context=64, page_size=4,
                                              prefill_chunk=8))


def test_program_and_its_store_satisfy_their_protocols():
    prog = _program()
    assert isinstance(prog, ProgramProtocol)
    assert isinstance(prog.checkpoints, CheckpointStoreProtocol)
    assert prog.accepts_media is False and prog.is_speculative is False


def test_pools_and_model_satisfy_their_protocols():
    model = FakeModel()
    assert isinstance(model, Model)
    assert isinstance(model.new_kv_pool(4, 4), KVPoolProtocol)
    assert isinstance(model.new_state_pool(2), StatePoolProtocol)


def test_frontend_and_output_session_satisfy_their_protocols():
    frontend = FakeFrontend()
    assert isinstance(frontend, FrontendProtocol)
    params = SamplingParams(max_tokens=4)
    prepared = frontend.prepare("hi")
    session = frontend.new_output_session(params, prepared)
    # the fake session has no grammar: only the members the EngineCore calls on every row
    for name in ("needs_mask", "forced_tokens", "preview", "preview_finish", "commit"):
        assert hasattr(session, name), name
    # the real OutputSession has every member of the protocol
    for name in _members(OutputSessionProtocol):
        assert hasattr(OutputSession, name), name


def test_the_engine_core_and_context_cache_call_only_protocol_members():
    """Every `self.program.X` in engine_core.py / context_cache.py names a ProgramProtocol
    member, and every `self.store.X` a CheckpointStoreProtocol member: the seam is the protocol."""
    import inspect
    import re
    from ninfer.runtime import context_cache, engine_core
    program_members = _members(ProgramProtocol)
    store_members = _members(CheckpointStoreProtocol)
    for module in (engine_core, context_cache):
        src = inspect.getsource(module)
        used = set(re.findall(r"self\.program\.(\w+)", src))
        assert used <= program_members, (module.__name__, used - program_members)
        used = set(re.findall(r"self\.store\.(\w+)", src))
        assert used <= store_members, (module.__name__, used - store_members)


def test_plan_view_answers_every_resident_at_once():
    prog = _program()
    spec = contracts.SamplingSpec(seed=1)
    a = prog.bind(np.arange(1, 6, dtype=np.int32), spec)
    b = prog.bind(np.arange(1, 20, dtype=np.int32), spec)
    views = prog.plan_view([a, b])
    assert [(v.seq_id, v.kind, v.is_protected, v.is_sampling) for v in views] == \
        [(a, "prefill", False, True), (b, "prefill", False, False)]   # 19 tokens: 8 + 8 + 3
    assert prog.capacity().free_state_slots == 0


def _members(proto) -> set:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return names
