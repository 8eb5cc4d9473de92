"""`Engine(path, backend="cuda")` end to end (Program, EngineCore, decode graphs) on a transformers
fixture: greedy generations equal the numpy Engine's and transformers' tokens, two concurrent
requests (a B=2 decode graph) equal the same requests run alone, and scoring logits match."""
import numpy as np
import pytest

from fixture_utils import convert_fixture, load_reference
from gpu_harness import TOL_FIXTURE_BF16, rel_err

from ninfer import Engine
from ninfer.api import SamplingParams

pytestmark = pytest.mark.gpu
NAME = "dense"     # its reference continuations matched free-running greedy on the GPU


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory):
    return convert_fixture(NAME, tmp_path_factory.mktemp("ninfer_engine_cuda"))


def test_engine_cuda_greedy_matches_numpy_and_transformers(artifact_path):
    ref = load_reference(NAME)
    conts = ref.continuations[:2]
    params = [SamplingParams(max_tokens=len(c.tokens), temperature=0.0) for c in conts]
    results = {}
    for backend in ("cuda", "numpy"):
        with_engine = Engine(artifact_path, backend=backend, max_concurrency=2, max_context=256)
        try:
            alone = [with_engine.generate(np.asarray(c.prompt), p).token_ids
                     for c, p in zip(conts, params)]
            handles = [with_engine.submit(np.asarray(c.prompt), p) for c, p in zip(conts, params)]
            together = [h.result().token_ids for h in handles]
        finally:
            with_engine.close()
        results[backend] = (alone, together)
    cuda_alone, cuda_together = results["cuda"]
    assert cuda_together == cuda_alone                     # B=2 graph rows == B=1 runs
    assert cuda_alone == results["numpy"][0]
    for got, c in zip(cuda_alone, conts):
        n = len(got)                                      # may stop early at an EOS token
        assert n >= 1 and got == c.tokens.tolist()[:n]


def test_engine_cuda_scoring_logits(artifact_path):
    ref = load_reference(NAME)
    seq = ref.sequences[-1]
    eng = Engine(artifact_path, backend="cuda", purpose="scoring", max_context=256)
    try:
        res = eng.score(seq.ids, return_logits=True)
    finally:
        eng.close()
    logits = np.asarray(res.logits)
    assert logits.shape[-1] == seq.logits.shape[-1]
    assert rel_err(logits, seq.logits[: len(logits)]) < TOL_FIXTURE_BF16


@pytest.mark.parametrize("device_fraction", [0.5, 0.0], ids=["device", "host"])
def test_engine_cuda_prefix_checkpoint_hit_equals_cold(artifact_path, device_fraction):
    """A prefix checkpoint kept on the device (pages by reference, a copy of the partly filled
    page and of the State slot: device-to-device copies) or on the host tier (State + KV to
    host) and installed into a new slot gives the same tokens as a cold run."""
    rng = np.random.default_rng(4)
    base = rng.integers(3, 256, 21).astype(np.int32)
    longer = np.concatenate([base, rng.integers(3, 256, 10).astype(np.int32)])
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    with Engine(artifact_path, backend="cuda", max_concurrency=1, max_context=256,
                prefix_cache=False) as engine:
        cold = engine.generate(longer, params).token_ids
        assert engine.stats()["prefix_cache_entries"] == 0
    with Engine(artifact_path, backend="cuda", max_concurrency=1, max_context=256,
                prefill_chunk=8, page_size=8, prefix_cache_host_bytes=64 << 20,
                prefix_cache_device_fraction=device_fraction, debug_checks=True) as engine:
        engine.generate(base, params)           # debug_checks: the worker audits the ledgers
        warm = engine.generate(longer, params).token_ids
        stats = engine.stats()
        assert engine.health == "ready"
    assert warm == cold
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_tokens_reused"] == 21
    assert (stats["prefix_cache_device_bytes"] > 0) == (device_fraction > 0)


def test_mixed_batches_give_the_same_tokens(artifact_path, monkeypatch):
    """Decode rows beside a prefill chunk in one eager call (CudaModel.mixed_batches on: the
    Program merges a cycle's decode rows and chunk into one unit) give the tokens of a decode
    graph and the chunk run apart, and the numpy Engine's (float32: the same arithmetic)."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    rng = np.random.default_rng(9)
    short = rng.integers(3, 256, 5).astype(np.int32)
    long = rng.integers(3, 256, 150).astype(np.int32)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)

    def run(backend, mixed):
        monkeypatch.setattr(CudaModel, "mixed_batches", mixed)
        # (debug_checks: every call checked against the model's capacities)
        with Engine(artifact_path, backend=backend, dtype="float32", max_concurrency=2,
                    max_context=256, prefill_chunk=32, debug_checks=True) as engine:
            assert engine._core.program.merges_units == (mixed or backend == "numpy")
            handles = [engine.submit(short, params), engine.submit(long, params)]
            return [h.result().token_ids for h in handles]
    merged = run("cuda", True)
    assert merged == run("cuda", False)
    assert merged == run("numpy", True)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_pipelined_decode_gives_the_same_tokens(artifact_path, monkeypatch, sampled):
    """Decode steps launched ahead (CudaModel.chains_token_steps on: step k+1's token ids
    copied on the device from step k's output, two steps in flight) give the tokens of steps
    collected one by one, for rows ending at different steps; the steps ahead really ran.
    Sampled: seeded draws on the device ((seed, position): the same token either way), the
    chained steps' sampler parameters through their own stagings."""
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, n).astype(np.int32) for n in (5, 17, 9)]
    draw = dict(temperature=0.9, top_p=0.95) if sampled else dict(temperature=0.0)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=7 + i, **draw)
              for i, m in enumerate((24, 9, 40))]

    def run(chain):
        monkeypatch.setattr(CudaModel, "chains_token_steps", chain)
        with Engine(artifact_path, backend="cuda", dtype="float32", max_concurrency=3,
                    max_context=256) as engine:
            program, ahead = engine._core.program, []
            launch_ahead = program.launch_ahead
            def counted(inflight):              # the steps really launched ahead
                step = launch_ahead(inflight)
                ahead.extend([step] if step is not None else [])
                return step
            program.launch_ahead = counted
            handles = [engine.submit(p, q) for p, q in zip(prompts, params)]
            tokens = [h.result().token_ids for h in handles]
            assert engine.health == "ready"
        return tokens, len(ahead)
    (chained, n_ahead), (plain, n_plain) = run(True), run(False)
    assert chained == plain
    assert n_ahead >= 20 and n_plain == 0
