"""batch_invariant (issue 19) on the CPU: Replay re-runs history the way it first ran, the pinned
cuBLASLt plans (a fake library), the decode attention split that does not depend on B.
The GPU side (bitwise logits, the paused 8-prompt experiment) is tests/gpu/test_load_invariance_gpu.py."""
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer.models.qwen3_5.program import Program, RowDecision, SamplingSpec
from ninfer.options import EngineOptions
from ninfer.models.qwen3_5.fakes import FakeModel
from fake_cublaslt import fake_cublaslt

GREEDY = SamplingSpec(seed=1)
SEEDED = SamplingSpec(seed=77, temperature=0.9, top_k=20, top_p=0.95)


def _opts(**kw):
    base = dict(max_concurrency=4, max_context=64, page_size=4, prefill_chunk=5)
    return EngineOptions(**{**base, **kw})


def _step(prog, sid):
    assert prog.reserve_units([sid]) == [True]
    pending = prog.execute([sid])
    row = pending.rows[0]
    prog.commit(pending, [RowDecision(len(row.produced))])
    return row


def _run(prog, sid, num_tokens, pause_at=None):
    """Generate num_tokens; after `pause_at` of them, pause to Replay and resume. Returns the
    tokens and the new-token counts of the Replay units."""
    out, replay_units = [], []
    while len(out) < num_tokens:
        if pause_at is not None and len(out) == pause_at:
            pause_at = None
            sid = prog.resume(prog.pause(sid, allow_snapshot=False))
        row = _step(prog, sid)
        if row.is_replay:
            replay_units.append(row.num_new_tokens)
        out += list(row.produced)
    prog.release(sid)
    prog.assert_all_free()
    return out, replay_units


@pytest.mark.parametrize("spec", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_replay_reruns_prompt_chunks_then_one_token_per_generated_token(spec):
    p = np.random.default_rng(3).integers(1, 64, 13).astype(np.int32)
    prog = Program(FakeModel(), _opts())
    want, none = _run(prog, prog.bind(p, spec), 20)
    assert none == []
    prog = Program(FakeModel(), _opts(batch_invariant=True))
    got, units = _run(prog, prog.bind(p, spec), 20, pause_at=7)
    assert got == want
    # history at the pause: 13 prompt + 7 generated, frontier 19 (the last token is decode's):
    # the prompt's own chunks (5, 5, 3) as its prefill ran them, then 6 one-token units
    assert units == [5, 5, 3] + [1] * 6
    prog = Program(FakeModel(), _opts())
    got, units = _run(prog, prog.bind(p, spec), 20, pause_at=7)
    assert got == want and units == [5, 5, 5, 4]          # default: chunks across the boundary


def test_replay_of_a_paused_prefill_keeps_its_chunks():
    p = np.random.default_rng(4).integers(1, 64, 12).astype(np.int32)
    prog = Program(FakeModel(), _opts(batch_invariant=True))
    sid = prog.bind(p, GREEDY)
    _step(prog, sid)                                       # [0, 5) of the prompt
    sid = prog.resume(prog.pause(sid, allow_snapshot=False))
    sizes = [_step(prog, sid).num_new_tokens for _ in range(3)]
    assert sizes == [5, 5, 2]                              # 0-5 replayed, 5-10, 10-12 (+ token)
    prog.release(sid)


# ---- GEMMs: no atomics, one problem shape for every decode batch --------------------------------

def _fake_lt(invariant):
    return fake_cublaslt(invariant=invariant)


@pytest.mark.parametrize("invariant", [False, True])
def test_invariant_preference_forbids_atomic_split_k(invariant):
    from ninfer.core.cuda import cublaslt as C
    lt, calls = _fake_lt(invariant)
    lt.plan(8, 4096, 2048)
    masks = [a for n, a in calls if n == "cublasLtMatmulPreferenceSetAttribute"
             and a[1] == C.PREF_REDUCTION_SCHEME_MASK]
    if invariant:
        assert len(masks) == 1 and masks[0][2]._obj.value == C.INVARIANT_REDUCTIONS
        assert not C.INVARIANT_REDUCTIONS & C.REDUCTION_INPLACE
    else:
        assert masks == []


def _runner(invariant):
    from ninfer.models.qwen3_5.cuda import runner as R
    from ninfer.models.qwen3_5.config import TextConfig
    cfg = TextConfig(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=256)
    gemms = []
    lt = SimpleNamespace(gemm=lambda st, x, w, y, m, n, k, *a: gemms.append((m, n, k)))
    ws = SimpleNamespace(x=SimpleNamespace(ptr=0), proj=SimpleNamespace(ptr=0),
                         act=SimpleNamespace(ptr=0), h=SimpleNamespace(ptr=0), mid=0, part=0,
                         ml=0, tc=SimpleNamespace(l_cap=0))
    # kernels: each its own name, so a recorder in place of launch sees which one is launched
    names = SimpleNamespace(**{k: k for k in ("qk_norm_rope_kv", "paged_attention",
                                              "paged_attention_mma", "attn_combine", "rmsnorm")},
                            specs={"paged_attention_mma": None})
    r = R.StepRunner(R.StepResources(cfg=cfg, ws=ws, weights={}, lt=lt, kernels=names,
                                     num_sms=132, b_cap=1, moe_gemv_tokens=1, n_cap=16, route_host=None, media=None),
                     invariant=invariant, attn_tc_min_tokens=64)
    r.gemms = gemms
    r.gemv_max_bytes = 0          # every product through the recorded cuBLASLt (not the GEMV)
    return r


def test_invariant_gemms_run_every_small_m_as_pin_m():
    from ninfer.core.cuda.cublaslt import PIN_M
    for invariant in (False, True):
        r = _runner(invariant)
        for m in (1, 3, PIN_M, PIN_M + 1, 100):
            r.gemm(None, 0, 0, 0, m, 64, 32)
        want = [max(m, PIN_M) if invariant else m for m in (1, 3, PIN_M, PIN_M + 1, 100)]
        assert [g[0] for g in r.gemms] == want


def _gemv_runner(invariant, gemv_max_bytes):
    """_runner with bf16 operands, the decode GEMV taking products of up to gemv_max_bytes and
    its kernels (gemv{m}, gemv_norm{m}) named in the set; launches recorded as (kernel, grid,
    block, args)."""
    r = _runner(invariant)
    r.gemv_max_bytes = gemv_max_bytes
    r.res.ws.gin_bytes = 2
    launches = []
    r.launch = lambda st, kernel, grid, block, args, smem=0: launches.append(
        (kernel, grid, block, args))
    for m in range(1, 9):
        setattr(r.kernels, f"gemv{m}", f"gemv{m}")
        setattr(r.kernels, f"gemv_norm{m}", f"gemv_norm{m}")
    return r, launches


def test_small_decode_products_take_the_gemv():
    """StepRunner.gemv_fits: products of 1..GEMV_MAX_M tokens, weights of at most
    gemv_max_bytes with rows of whole 512-byte spans, 16-byte aligned operands, W[n, k] (not
    w_kn), one product, contiguous y rows run on the decode GEMV kernel of their token count,
    one warp an output row; everything else on cuBLASLt. The GEMV's rows never depend on M, so
    the invariant mode takes it too."""
    from ninfer.models.qwen3_5.cuda import runner as R
    for invariant in (False, True):
        r, launches = _gemv_runner(invariant, 2 * 64 * 512)
        r.gemm(None, 0x100, 0x200, 0x300, 3, 64, 512, beta=1.0)
        assert launches == [("gemv3", (-(-64 // R.GEMV_WARPS),), (32 * R.GEMV_WARPS,),
                             (0x300, 0x100, 0x200, 64, 256, 1.0))]
        for args, kw in (((0x100, 0x200, 0x300, 9, 64, 512), {}),       # 9 tokens
                         ((0x100, 0x200, 0x300, 1, 65, 512), {}),       # over the bytes
                         ((0x100, 0x200, 0x300, 1, 64, 384), {}),       # not whole spans
                         ((0x108, 0x200, 0x300, 1, 64, 512), {}),       # x 8-byte aligned
                         ((0x100, 0x200, 0x300, 1, 64, 512), {"w_kn": True}),
                         ((0x100, 0x200, 0x300, 1, 32, 512), {"ldc": 64})):
            r.gemm(None, *args, **kw)
        assert len(launches) == 1 and len(r.gemms) == 6


def test_a_norm_runs_in_the_gemv_prologue_where_the_product_takes_the_gemv():
    """StepRunner.normed: the norm and the product after it as one gemv_norm launch (its
    block 0 stores ws.x) where the decode GEMV takes the product and the set has the kernel for
    that many tokens; else the norm kernel, then the product (here cuBLASLt's, recorded)."""
    from ninfer.core.cuda.cublaslt import PIN_M
    from ninfer.models.qwen3_5.cuda import runner as R
    for invariant in (False, True):
        r, launches = _gemv_runner(invariant, 2 * 64 * 256)
        r.kernels.specs = {f"gemv_norm{m}" for m in range(1, 5)}
        r.fuse_norm = True
        ws, norm = r.res.ws, SimpleNamespace(ptr=0x40)
        w = SimpleNamespace(ptr=0x200, shape=(64, 256))
        r.normed(None, norm, w, 3, 64)
        assert launches == [("gemv_norm3", (-(-64 // R.GEMV_WARPS),), (32 * R.GEMV_WARPS,),
                             (ws.proj, ws.h, w, 64, 128, 0.0, norm, ws.x, r.cfg.rms_norm_eps))]
        assert r.gemms == []
        launches.clear()
        big = SimpleNamespace(ptr=0x200, shape=(65, 256))        # over the GEMV's bytes
        for args in ((norm, w, 5, 64),                           # no kernel for 5 tokens
                     (norm, big, 3, 65)):
            r.normed(None, *args)
        assert [k for k, *_ in launches] == ["rmsnorm", "gemv5", "rmsnorm"]
        assert r.gemms == [(PIN_M if invariant else 3, 65, 256)]
        r.fuse_norm = False
        launches.clear()
        r.normed(None, norm, w, 3, 64)
        assert [k for k, *_ in launches] == ["rmsnorm", "gemv3"]


# ---- decode attention splits -------------------------------------------------------------------

def _attention_splits_of(invariant, n, mma=False, page_size=16):
    r = _runner(invariant)
    r.attn_mma = mma
    launches = []
    r.launch = lambda st, kernel, grid, block, args, smem=0: launches.append((kernel, grid))
    meta = SimpleNamespace(layout=SimpleNamespace(n_cap=16, p_cap=4), positions=0, token_row=0,
                           query_start=0, context_lens=0, block_tables=0)
    lw = {k: SimpleNamespace(ptr=0, shape=(64, 256))
          for k in ("w_in", "w_out", "q_norm", "k_norm", "input_norm")}
    kv = SimpleNamespace(k=[0], v=[0], page_size=page_size)
    r.attention(None, meta, n, n, lw, kv, 0)
    return [(kernel, grid[2]) for kernel, grid in launches
            if kernel.startswith("paged_attention")]


def test_decode_attention_splits_do_not_depend_on_b_when_invariant():
    from ninfer.models.qwen3_5.cuda import runner as R
    for mma, name in ((False, "paged_attention"), (True, "paged_attention_mma")):
        fixed = {tuple(_attention_splits_of(True, b, mma)) for b in range(1, 9)}
        assert fixed == {((name, R.decode_splits(2, 132, mma)),)}
        varying = {tuple(_attention_splits_of(False, b, mma)) for b in range(1, 9)}
        assert len(varying) > 1                                # what the mode removes
    # the partial-result buffer holds b_cap rows at the fixed split
    assert R.part_rows_needed(16, 2, 132, 8) >= 8 * R.decode_splits(2, 132)


def test_attention_on_tensor_cores_at_its_own_splits():
    from ninfer.models.qwen3_5.cuda import runner as R
    for ps in (16, 8, 5):                # (pages smaller than a tile: each key's page read)
        assert _attention_splits_of(False, 3, mma=True, page_size=ps) == [
            ("paged_attention_mma", R.mma_splits(3, 2, 132))]
    # the partial-result buffer, sized by attention_splits, holds every mma launch's splits
    for n in range(1, 300):
        for nkv in (1, 2, 4):
            assert R.mma_splits(n, nkv, 132) <= R.attention_splits(n, nkv, 132)


# ---- the whole Engine on the numpy model --------------------------------------------------------

def test_engine_batch_invariant_under_kv_pressure_equals_alone(tmp_path):
    """Seeded rows, some asking for logprobs (host sampling), through Replay pauses: the same
    tokens as each prompt alone; Replay really ran its one-token units."""
    from fixture_utils import convert_fixture
    from ninfer import Engine, SamplingParams
    path = convert_fixture("dense", tmp_path)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 256, n).astype(np.int32) for n in (6, 13, 29, 9, 21, 3)]

    def params(i):
        return SamplingParams(max_tokens=10, ignore_eos=True, seed=50 + i, temperature=0.9,
                              top_p=0.9, logprobs=2 if i % 2 else None)
    with Engine(path, max_concurrency=1, batch_invariant=True) as engine:
        want = [engine.generate(p, params(i)).token_ids for i, p in enumerate(prompts)]
    with Engine(path, max_concurrency=4, max_context=56, page_size=8, num_kv_pages=8,
                prefill_chunk=8, host_snapshot_bytes=0, batch_invariant=True) as engine:
        handles = [engine.submit(p, params(i)) for i, p in enumerate(prompts)]
        got = [h.result(timeout=120).token_ids for h in handles]
        stats = engine.stats()
    assert got == want
    assert stats["pauses"] > 0


def test_cli_flag_and_help():
    from ninfer.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(["run", "--prompt", "x", "--batch-invariant"]).batch_invariant is True
    sub = next(a for a in parser._actions if a.choices and "run" in a.choices).choices["run"]
    assert "--batch-invariant" in sub.format_help()          # help strings are %-formatted
