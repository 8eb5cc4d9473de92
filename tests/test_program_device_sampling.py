"""Program with a backend that samples on the device (`model.sample`, as the CUDA model does):
which rows take it, and that each row's request carries the host sampler's exact arguments
(spec, position, prompt, generated, mask). The fake model samples with the host oracle itself,
so the tokens must equal the host path's."""
import numpy as np
import pytest

from ninfer.models.qwen3_5.program import Program, ProgramError, RowDecision, SamplingSpec
from ninfer.models.qwen3_5.program.sampling import SampleRow, sample_row
from ninfer.models.qwen3_5.fakes import FakeModel

from test_program import GREEDY, SEEDED, generate, opts, prompt, run_alone, step

PENALISED = SamplingSpec(seed=5, temperature=0.8, top_k=10, top_p=0.9, min_p=0.05,
                         repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)


class DeviceSamplingModel(FakeModel):
    """decode_greedy and sample from the same logits as forward; records every sample request."""
    greedy_on_device = samples_on_device = True

    def __init__(self):
        super().__init__()
        self.num_greedy_calls = self.num_sample_calls = 0
        self.requests = []

    def decode_greedy(self, batch, kv, state):
        self.num_greedy_calls += 1
        logits = self.forward(batch, kv, state)
        self.num_calls -= 1
        return np.argmax(logits, axis=-1).astype(np.int32)

    def sample(self, batch, kv, state, rows):
        self.num_sample_calls += 1
        logits = self.forward(batch, kv, state)
        self.num_calls -= 1
        assert len(rows) == batch.num_rows
        out = []
        for r, row in enumerate(rows):
            if row is None:
                out.append(int(np.argmax(logits[r])))
                continue
            assert isinstance(row, SampleRow)
            self.requests.append(SampleRow(row.spec, row.position, row.prompt_ids.copy(),
                                           row.generated_ids.copy(),
                                           None if row.mask is None else row.mask.copy(),
                                           row.cache_key))
            out.append(sample_row(logits[r], row.spec, row.prompt_ids, row.generated_ids,
                                  row.position, row.mask)[0])
        return np.array(out, np.int32)


@pytest.mark.parametrize("spec", [SEEDED, PENALISED,
                                  SamplingSpec(seed=2, repetition_penalty=1.3),
                                  SamplingSpec(seed=3, temperature=1.2, presence_penalty=0.5)],
                         ids=["seeded", "penalised", "greedy-repetition", "presence"])
def test_sampling_rows_take_the_device_sampler_with_the_host_arguments(spec):
    p = prompt(3, 11)
    want = run_alone(p, spec, 12)
    model = DeviceSamplingModel()
    prog = Program(model, opts())
    sid = prog.bind(p, spec)
    assert generate(prog, sid, 12) == want
    prog.release(sid)
    prog.assert_all_free()
    assert model.num_calls == 0 and model.num_sample_calls > 0      # never host logits
    assert len(model.requests) == 12
    keys = {req.cache_key for req in model.requests}
    assert len(keys) == 1 and next(iter(keys))[-1] == len(p)
    for i, req in enumerate(model.requests):
        assert req.spec == spec and req.mask is None
        assert np.array_equal(req.prompt_ids, p)
        assert req.generated_ids.tolist() == want[:i]
        assert req.position == len(p) + i


def test_plain_greedy_keeps_the_argmax_path_and_logprobs_the_host():
    model = DeviceSamplingModel()
    prog = Program(model, opts())
    sid = prog.bind(prompt(4, 6), GREEDY)
    generate(prog, sid, 5)
    prog.release(sid)
    assert model.num_sample_calls == 0 and model.num_calls == 0 and model.num_greedy_calls > 0
    model = DeviceSamplingModel()
    prog = Program(model, opts())
    spec = SamplingSpec(seed=9, temperature=0.7, logprobs=2)
    sid = prog.bind(prompt(4, 6), spec)
    assert generate(prog, sid, 5) == run_alone(prompt(4, 6), spec, 5)
    prog.release(sid)
    assert model.num_sample_calls == 0 and model.num_calls == 5     # every sampling step: host


def test_a_mixed_batch_samples_every_row_on_the_device():
    """Plain greedy, penalised and seeded rows, prefill chunks that sample nothing (None) and
    decode rows in one call: each row's tokens equal the row run alone on the host."""
    prompts = [prompt(s, n) for s, n in zip(range(3), (3, 14, 9))]
    specs = [GREEDY, PENALISED, SEEDED]
    want = [run_alone(p, s, 10) for p, s in zip(prompts, specs)]
    model = DeviceSamplingModel()
    prog = Program(model, opts())
    sids = [prog.bind(p, s) for p, s in zip(prompts, specs)]
    got = {s: [] for s in sids}
    seen_none = False
    orig = model.sample

    def spy(batch, kv, state, rows):
        nonlocal seen_none
        seen_none |= any(r is None for r in rows)
        return orig(batch, kv, state, rows)
    model.sample = spy
    while any(len(v) < 10 for v in got.values()):
        live = [s for s in sids if len(got[s]) < 10]
        for s, produced in zip(live, step(prog, live)):
            got[s] += produced
    assert [got[s][:10] for s in sids] == want
    assert seen_none and model.num_calls == 0


def test_grammar_masks_reach_the_device_sampler():
    V = 64
    allowed = np.zeros(V, np.bool_)
    allowed[[3, 17, 40]] = True
    spec = SamplingSpec(seed=11, temperature=1.0, is_constrained=True)
    results = []
    for model in (FakeModel(), DeviceSamplingModel()):
        prog = Program(model, opts())
        sid = prog.bind(prompt(8, 7), spec)
        out = []
        while len(out) < 6:
            assert prog.reserve_units([sid]) == [True]
            pending = prog.execute([sid], masks={sid: allowed})
            prog.commit(pending, [RowDecision(len(r.produced)) for r in pending.rows])
            out += list(pending.rows[0].produced)
        results.append(out)
        if isinstance(model, DeviceSamplingModel):
            assert model.num_calls == 0 and len(model.requests) == 6
            assert all(np.array_equal(r.mask, allowed) for r in model.requests)
    assert results[0] == results[1] and set(results[0]) <= {3, 17, 40}


def test_device_sampled_ids_are_checked():
    model = DeviceSamplingModel()
    model.sample = lambda batch, kv, state, rows: np.array([-1], np.int32)
    prog = Program(model, opts())
    sid = prog.bind(prompt(6, 3), SEEDED)
    assert prog.reserve_units([sid]) == [True]
    with pytest.raises(ProgramError, match="model.sample returned"):
        prog.execute([sid])


def test_the_program_imports_no_backend_module():
    """The Program is backend-neutral: the device-sampling request type is its own (defined in
    program/sampling.py); cuda/sampler.py re-exports the same class for the CUDA side."""
    import subprocess
    import sys
    code = ("import sys; import ninfer.models.qwen3_5.program as p; "
            "bad = sorted(m for m in sys.modules if m.startswith('ninfer.models.qwen3_5.cuda')"
            " or m.startswith('ninfer.core.cuda')); print(bad); assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    from ninfer.models.qwen3_5.cuda import sampler
    assert sampler.SampleRow is SampleRow


def test_prompt_cache_keys_never_name_another_programs_prompt():
    """The CUDA sampler keeps each prompt's distinct ids under the row's cache_key, in a cache
    that lives on the model. Two Programs over one model (sequence ids restart in each) with
    prompts of the same length must not share a key: the second would get the first's ids and
    penalise the wrong tokens."""
    from ninfer.models.qwen3_5.cuda.sampler import PromptCache

    class CachingModel(DeviceSamplingModel):
        cache = PromptCache()

        def sample(self, batch, kv, state, rows):
            for row in rows:
                if row is not None:
                    assert np.array_equal(self.cache.unique(row.cache_key, row.prompt_ids),
                                          np.unique(row.prompt_ids)), "stale prompt ids"
            return super().sample(batch, kv, state, rows)

    spec = SamplingSpec(seed=2, repetition_penalty=1.3)
    model = CachingModel()
    for seed in (3, 4):
        p = prompt(seed, 11)
        prog = Program(model, opts())
        sid = prog.bind(p, spec)
        assert generate(prog, sid, 3) == run_alone(p, spec, 3)
        prog.release(sid)
    assert len({req.cache_key for req in model.requests}) == 2
