"""Whole model on CUDA vs the numpy backend (tiny random models), graph replay vs eager, chunked vs
full prefill, and the decode hot path (graph only: no allocation, no launch, no numba)."""
import sys

import numpy as np
import pytest

from gpu_harness import TOL_MODEL_BF16, rel_err
from tiny_model import TinyArtifact, tiny_config

from ninfer.core.cuda import driver as d
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.options import EngineOptions

pytestmark = pytest.mark.gpu
PAGE = 4


def options(**kw):
    base = dict(backend="cuda", max_concurrency=4, max_context=256, prefill_chunk=64, page_size=PAGE)
    base.update(kw)
    return EngineOptions(**base)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request):
    from ninfer.models.qwen3_5 import load_model
    from ninfer.models.qwen3_5.cuda_model import load_cuda_model
    art = TinyArtifact(tiny_config(moe=request.param == "moe"), seed=3)
    cpu = load_model(art, EngineOptions(backend="numpy"))
    gpu = load_cuda_model(art, options())
    yield cpu, gpu
    gpu.close()
    cpu.close()


class Seqs:
    """Per-backend pools and per-row page tables for a few sequences."""

    def __init__(self, model, rows=4, pages_per_row=64):
        self.kv = model.new_kv_pool(rows * pages_per_row + 1, PAGE)
        self.state = model.new_state_pool(rows + 1)
        self.tables = np.arange(rows * pages_per_row, dtype=np.int32).reshape(rows, pages_per_row)[:, ::-1].copy()

    def close(self):
        for p in (self.kv, self.state):
            if hasattr(p, "close"):
                p.close()


@pytest.fixture
def seqs_of():
    made = []

    def make(model):
        made.append(Seqs(model))
        return made[-1]
    yield make
    for s in made:
        s.close()


def batch_for(seqs, rows, chunks, ctxs):
    lengths = [len(c) for c in chunks]
    return ForwardBatch(token_ids=np.concatenate(chunks).astype(np.int32),
                        positions=ForwardBatch.text_positions(ctxs, lengths),
                        query_start=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                        context_lens=np.asarray(ctxs, np.int32),
                        block_tables=seqs.tables[rows],
                        state_slots=np.asarray(rows, np.int32))


def test_prefill_logits_match_numpy(pair, seqs_of):
    cpu, gpu = pair
    r = np.random.default_rng(1)
    V = cpu.config.text.vocab_size
    prompts = [r.integers(0, V, 13), r.integers(0, V, 1), r.integers(0, V, 29)]
    sc, sg = seqs_of(cpu), seqs_of(gpu)
    rows = [0, 2, 1]
    out = gpu.forward(batch_for(sg, rows, prompts, [0, 0, 0]), sg.kv, sg.state)
    ref = cpu.forward(batch_for(sc, rows, prompts, [0, 0, 0]), sc.kv, sc.state)
    assert out.shape == ref.shape == (3, V)
    assert rel_err(out, ref) < TOL_MODEL_BF16
    # all_logits: every position of the batch
    ref_all = cpu.forward(batch_for(sc, [3], [prompts[0]], [0]), sc.kv, sc.state, all_logits=True)
    out_all = gpu.forward(batch_for(sg, [3], [prompts[0]], [0]), sg.kv, sg.state, all_logits=True)
    assert out_all.shape == (13, V)
    assert rel_err(out_all, ref_all) < TOL_MODEL_BF16


def test_prefill_tensor_core_attention_matches_numpy(pair, seqs_of):
    """Rows at the tensor-core threshold T in one batch (T+1 and T on tensor cores, T-1 between
    them on the CUDA-core kernel, launched from its token offset), then continuing chunks (ctx > 0,
    starting mid-page: page size 4) with a short row between two long ones; all logits against
    numpy, and against the same calls with every row on the CUDA-core kernel."""
    cpu, gpu = pair
    T = 10
    r = np.random.default_rng(5)
    V = cpu.config.text.vocab_size
    rows = [0, 1, 2]
    prompts = [r.integers(0, V, n) for n in (T + 1, T - 1, T)]
    more = [r.integers(0, V, n) for n in (T + 3, 2, T)]
    ctxs = [len(p) for p in prompts]
    saved = gpu.attn_tc_min_tokens
    outs = {}
    try:
        for name, tc_min in (("tc", T), ("cores", 10 ** 9)):
            gpu.attn_tc_min_tokens = tc_min
            sg = seqs_of(gpu)
            outs[name] = (gpu.forward(batch_for(sg, rows, prompts, [0, 0, 0]), sg.kv, sg.state,
                                      all_logits=True),
                          gpu.forward(batch_for(sg, rows, more, ctxs), sg.kv, sg.state,
                                      all_logits=True))
            sg.close()          # the arena holds one test's pools at a time
    finally:
        gpu.attn_tc_min_tokens = saved
    sc = seqs_of(cpu)
    ref = (cpu.forward(batch_for(sc, rows, prompts, [0, 0, 0]), sc.kv, sc.state, all_logits=True),
           cpu.forward(batch_for(sc, rows, more, ctxs), sc.kv, sc.state, all_logits=True))
    for i in range(2):
        assert outs["tc"][i].shape == ref[i].shape
        assert rel_err(outs["tc"][i], ref[i]) < TOL_MODEL_BF16
        assert rel_err(outs["tc"][i], outs["cores"][i]) < TOL_MODEL_BF16


def test_greedy_continuation_identical(pair, seqs_of):
    """Free-running greedy on both backends: identical tokens until numpy's top-2 margin drops
    under NEAR_TIE of the logits' spread (below bf16 activation resolution: the CPU run of this
    model has a 0.4% near-tie at step 10); there CUDA must pick one of numpy's top two, and the
    comparison stops. At least 8 steps must be compared."""
    NEAR_TIE = 0.01
    cpu, gpu = pair
    r = np.random.default_rng(2)
    V = cpu.config.text.vocab_size
    prompt = r.integers(0, V, 11)
    runs = {}
    for name, m in (("cpu", cpu), ("gpu", gpu)):
        s = seqs_of(m)
        logits = m.forward(batch_for(s, [0], [prompt], [0]), s.kv, s.state)
        toks, tops, ctx = [], [], len(prompt)
        for _ in range(12):
            order = np.argsort(-logits[0])
            toks.append(int(order[0]))
            tops.append((order[:2].tolist(), float(logits[0, order[0]] - logits[0, order[1]]),
                         float(logits[0].std())))
            logits = m.forward(batch_for(s, [0], [np.array([toks[-1]])], [ctx]), s.kv, s.state)
            ctx += 1
        runs[name] = (toks, tops)
    compared = 0
    for i, (tc, tg) in enumerate(zip(runs["cpu"][0], runs["gpu"][0])):
        top2, margin, spread = runs["cpu"][1][i]
        if margin < NEAR_TIE * spread:
            assert tg in top2, f"step {i}: cuda token {tg} not in numpy's near-tied top-2 {top2}"
            break
        assert tg == tc, f"step {i}: cuda {tg} != numpy {tc} (numpy margin {margin:.3f})"
        compared += 1
    assert compared >= 8, f"only {compared} steps before a near-tie: pick another prompt"


def _snapshot(s, rows, pages):
    return [s.state.read(r) for r in rows], s.kv.read_pages(pages)


def _restore(s, rows, pages, snap):
    for r, img in zip(rows, snap[0]):
        s.state.write(r, img)
    s.kv.write_pages(pages, snap[1])


def test_graph_replay_equals_eager_and_batched_rows(pair, seqs_of):
    _, gpu = pair
    r = np.random.default_rng(3)
    V = gpu.config.text.vocab_size
    s = seqs_of(gpu)
    rows, ctxs = [0, 1, 2], [9, 4, 17]
    prompts = [r.integers(0, V, c) for c in ctxs]
    gpu.forward(batch_for(s, rows, prompts, [0, 0, 0]), s.kv, s.state)
    pages = sorted(set(s.tables[rows, :8].reshape(-1).tolist()))
    snap = _snapshot(s, rows, pages)
    step = batch_for(s, rows, [r.integers(0, V, 1) for _ in rows], ctxs)
    graphed = gpu.forward(step, s.kv, s.state)
    state_after = s.state.read(1)
    _restore(s, rows, pages, snap)
    gpu.options = options(graphs=False)
    try:
        eager = gpu.forward(step, s.kv, s.state)
    finally:
        gpu.options = options()
    assert np.array_equal(graphed, eager)
    for a, b in zip(state_after[1], s.state.read(1)[1]):
        assert np.array_equal(a, b)
    # a batched decode equals each row decoded alone (same graph sizes differ: B=3 vs B=1)
    _restore(s, rows, pages, snap)
    singles = []
    for i, row in enumerate(rows):
        one = batch_for(s, [row], [step.token_ids[i:i + 1]], [ctxs[i]])
        singles.append(gpu.forward(one, s.kv, s.state)[0])
    assert rel_err(np.stack(singles), graphed) < 1e-4


def _decode_under(cpu, gpu, seqs_of, setting, ran, seed):
    """A decode step of three rows on `gpu` with the runner's `setting` True and False, graphs
    off and on: each against numpy within the model's bf16 tolerance, graph replay the same
    bits as eager, the two settings within float32 rounding amplified by the later bf16
    roundings. ran(names, on): checks the eager profile's kernel names under each setting."""
    runner = gpu.runner
    before = getattr(runner, setting)
    r = np.random.default_rng(seed)
    V = cpu.config.text.vocab_size
    rows, ctxs = [0, 1, 2], [6, 3, 11]
    prompts = [r.integers(0, V, c) for c in ctxs]
    step_tokens = [r.integers(0, V, 1) for _ in rows]
    sc = seqs_of(cpu)
    cpu.forward(batch_for(sc, rows, prompts, [0, 0, 0]), sc.kv, sc.state)
    ref = cpu.forward(batch_for(sc, rows, step_tokens, ctxs), sc.kv, sc.state)
    outs = {}
    try:
        for on in (True, False):
            for graphs in (False, True):
                setattr(runner, setting, on)
                for g in gpu.graphs.take_all():
                    g.destroy()
                gpu.options = options(graphs=graphs)
                sg = seqs_of(gpu)
                gpu.forward(batch_for(sg, rows, prompts, [0, 0, 0]), sg.kv, sg.state)
                if not graphs:
                    runner.profile = []
                out = gpu.forward(batch_for(sg, rows, step_tokens, ctxs), sg.kv, sg.state)
                if not graphs:
                    ran(set(runner.profile_summary()), on)
                assert rel_err(out, ref) < TOL_MODEL_BF16, (setting, on, graphs)
                outs[on, graphs] = out
    finally:
        setattr(runner, setting, before)
        gpu.options = options()
        for g in gpu.graphs.take_all():
            g.destroy()
    assert np.array_equal(outs[True, False], outs[True, True])
    assert rel_err(outs[True, False], outs[False, False]) < 1e-2


def test_decode_attention_on_tensor_cores_matches_numpy(pair, seqs_of):
    """The decode step's attention on tensor cores (kernels/attention_mma.py) and on the CUDA
    cores: _decode_under (the prompts' prefill rows take the same kernel; pages of 4 keys: each
    key's page read)."""
    cpu, gpu = pair
    assert "paged_attention_mma" in gpu.kernels.specs

    def ran(names, on):
        assert ("paged_attention_mma" in names) == on, names
    _decode_under(cpu, gpu, seqs_of, "attn_mma", ran, seed=8)


def test_moe_router_in_the_gate_up_prologue_matches_numpy(pair, seqs_of):
    """A MoE decode's top-k in the experts' gate|up GEMV (expert_gate_up_routed) and as its own
    kernel: _decode_under."""
    cpu, gpu = pair
    if not cpu.config.text.is_moe:
        pytest.skip("dense model: no router")
    assert gpu.runner.router_fused(3, gpu.weights["layers"][0]) is False      # (off: default)

    def ran(names, on):
        assert ("expert_gate_up_routed" in names) == on and ("router_topk" in names) != on, names
    _decode_under(cpu, gpu, seqs_of, "fuse_router", ran, seed=9)


def test_moe_decode_tail_in_one_launch_matches_numpy(pair, seqs_of):
    """The MoE layer's tail fused (moe_down_combine, the default) and in four launches
    (silu_mul, the shared down GEMV, expert_down, moe_combine): _decode_under."""
    cpu, gpu = pair
    if not cpu.config.text.is_moe:
        pytest.skip("dense model")
    assert gpu.runner.fuse_moe_tail, "the tiny MoE geometry should take the fused tail"

    def ran(names, fused):
        assert ("moe_down_combine" in names) == fused, names
        assert ("moe_combine" in names) != fused, names
    _decode_under(cpu, gpu, seqs_of, "fuse_moe_tail", ran, seed=5)


def test_moe_norm_in_the_router_gemv_matches_numpy(seqs_of):
    """A MoE model of hidden 256 (the decode GEMV takes its router + shared gate|up product):
    the post-attention norm in that product's prologue (gemv_norm) and as its own kernel (the
    default: the fused form measured slower): _decode_under."""
    from ninfer.models.qwen3_5 import load_model
    from ninfer.models.qwen3_5.cuda_model import load_cuda_model
    art = TinyArtifact(tiny_config(moe=True, hidden=256), seed=7)
    cpu = load_model(art, EngineOptions(backend="numpy"))
    gpu = load_cuda_model(art, options())
    try:
        gpu.runner.fuse_norm = True
        assert gpu.runner.norm_fused(3, gpu.weights["layers"][0]["w_rs"])

        def ran(names, fused):
            assert ("gemv_norm" in names) == fused, names
        _decode_under(cpu, gpu, seqs_of, "fuse_norm", ran, seed=6)
    finally:
        gpu.close()
        cpu.close()


def test_chunked_prefill_equals_full_then_decode(pair, seqs_of):
    _, gpu = pair
    r = np.random.default_rng(4)
    V = gpu.config.text.vocab_size
    prompt = r.integers(0, V, 23)
    s = seqs_of(gpu)
    full = gpu.forward(batch_for(s, [0], [prompt], [0]), s.kv, s.state)
    nxt = np.array([int(np.argmax(full[0]))])
    full_dec = gpu.forward(batch_for(s, [0], [nxt], [23]), s.kv, s.state)
    ctx, out = 0, None
    for size in (7, 1, 9, 6):
        out = gpu.forward(batch_for(s, [1], [prompt[ctx: ctx + size]], [ctx]), s.kv, s.state)
        ctx += size
    assert rel_err(out, full) < 2e-3
    chunk_dec = gpu.forward(batch_for(s, [1], [nxt], [23]), s.kv, s.state)
    assert rel_err(chunk_dec, full_dec) < 2e-3


def test_decode_hot_path_is_one_graph_launch(pair, seqs_of, monkeypatch):
    _, gpu = pair
    r = np.random.default_rng(5)
    V = gpu.config.text.vocab_size
    s = seqs_of(gpu)
    gpu.forward(batch_for(s, [0, 1], [r.integers(0, V, 5), r.integers(0, V, 3)], [0, 0]), s.kv, s.state)
    step = batch_for(s, [0, 1], [r.integers(0, V, 1), r.integers(0, V, 1)], [5, 3])
    gpu.capture_graphs(s.kv, s.state)
    if "numba.cuda" in sys.modules:            # no numba dispatcher may run on the hot path
        from numba.cuda import dispatcher

        def boom(*a, **k):
            raise AssertionError("numba dispatcher called on the decode hot path")
        monkeypatch.setattr(dispatcher.CUDADispatcher, "__call__", boom, raising=False)
    calls = gpu.lt.calls
    before = d.STATS.snapshot()
    tok = gpu.decode_greedy(step, s.kv, s.state)
    after = d.STATS.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"allocs": 0, "launches": 0, "graph_launches": 1, "syncs": 1, "copies": 2}, delta
    assert gpu.lt.calls == calls                 # cuBLASLt only inside the graph
    assert tok.shape == (2,) and 0 <= tok.min() and tok.max() < V
    assert gpu.last_host_us > 0


def test_forward_from_another_thread(pair, seqs_of):
    """The Engine worker calls the model from its own thread: the driver context must follow."""
    import threading
    _, gpu = pair
    r = np.random.default_rng(6)
    V = gpu.config.text.vocab_size
    s = seqs_of(gpu)
    prompt = r.integers(0, V, 9)
    main = gpu.forward(batch_for(s, [0], [prompt], [0]), s.kv, s.state)
    out, errors = [], []

    def work():
        try:
            out.append(gpu.forward(batch_for(s, [1], [prompt], [0]), s.kv, s.state))
            out.append(gpu.decode_greedy(batch_for(s, [1], [prompt[:1]], [9]), s.kv, s.state))
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert np.array_equal(out[0], main)
    assert out[1].shape == (1,)


@pytest.mark.parametrize("cap,launch_rows", [("device", None), ("device", 16), ("device", 0),
                                             (None, 512), (0, 512), (16, 512), (None, 0)])
def test_moe_prefill_row_layouts_match_numpy(pair, seqs_of, cap, launch_rows):
    """The MoE prefill's routed rows routed on the device (cuda/moe_route.py, a bf16 model:
    cuBLASLt's grouped GEMMs where it has them, else its strided batch over a padded block and
    our grouped GEMM over the rest: the block device_cap picks (every row in it here), a 16-row
    block with every expert overflowing, no block) and on the host (cuda/moe_rows.py) in each
    layout: the chooser's, one GEMM per expert (cap 0), a 16-row strided batch with every expert
    overflowing (43 rows each), and the chooser with free launches; logits against numpy every
    time."""
    cpu, gpu = pair
    if not cpu.config.text.is_moe:
        pytest.skip("dense model")
    route = gpu.ws.route_dev
    if cap == "device" and (route is None or not route.enabled):
        pytest.skip("no device route here (float32, or no grouped GEMM in this cuBLASLt)")
    if cap == "device" and launch_rows is not None and not route.own:
        pytest.skip("cuBLASLt's grouped GEMM takes no block")
    r = np.random.default_rng(11)
    V = cpu.config.text.vocab_size
    prompts = [r.integers(0, V, 43), r.integers(0, V, 7)]
    runner = gpu.runner
    saved = runner.moe_cap, runner.moe_launch_rows, runner.moe_device_route
    runner.last_moe_layout = None
    try:
        runner.moe_device_route = cap == "device"
        if cap != "device":
            runner.moe_cap, runner.moe_launch_rows = cap, launch_rows
        else:
            runner.moe_cap = launch_rows        # (the device route's block: None = device_cap)
        sc, sg = seqs_of(cpu), seqs_of(gpu)
        out = gpu.forward(batch_for(sg, [0, 1], prompts, [0, 0]), sg.kv, sg.state)
        ref = cpu.forward(batch_for(sc, [0, 1], prompts, [0, 0]), sc.kv, sc.state)
        layout = runner.last_moe_layout
    finally:
        runner.moe_cap, runner.moe_launch_rows, runner.moe_device_route = saved
    assert rel_err(out, ref) < TOL_MODEL_BF16
    if cap == "device":
        assert layout is None           # the host layout never ran
        return
    got_cap, rows, overflow = layout
    E = cpu.config.text.num_experts
    if cap is not None:
        assert got_cap == cap and overflow == (E if cap < 50 else 0)
    assert rows >= 50 * cpu.config.text.num_experts_per_tok
