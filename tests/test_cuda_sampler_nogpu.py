"""The device sampler without a GPU: host packing, PTX compilation, and kernels/sample.py on
numba-cuda's CPU simulator against the host sampler (tests/gpu/sim_sample.py)."""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from ninfer.core.cuda import kernels as K
from ninfer.models.qwen3_5.cuda.kernel_set import spec
from ninfer.models.qwen3_5.cuda.sampler import (PromptCache, SampleRow, SamplerLayout, pack,
                                                penalty_entries)
from ninfer.models.qwen3_5.program.sampling import SamplingSpec, apply_penalties

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _unpack_pen(lay, buf, r):
    fpar, ipar, upar, data = lay.views(buf)
    off, n = ipar[r, 1], ipar[r, 2]
    pairs = data[off: off + 2 * n].view(np.int32).reshape(n, 2)
    return pairs[:, 0], pairs[:, 1]


def test_pack_penalties_reproduce_the_host_penalties():
    """The packed (id, count) entries, applied with the kernel's formulas, give apply_penalties'
    row exactly (same float64 operations)."""
    r = np.random.default_rng(3)
    V = 300
    for spec_ in (SamplingSpec(seed=1, temperature=1.0, repetition_penalty=1.3),
                  SamplingSpec(seed=1, temperature=1.0, presence_penalty=0.5,
                               frequency_penalty=0.2),
                  SamplingSpec(seed=1, temperature=1.0, repetition_penalty=0.7,
                               presence_penalty=-0.3, frequency_penalty=0.1)):
        prompt = r.integers(0, V, 80).astype(np.int32)
        gen = np.concatenate([r.integers(0, V, 20), [5, 5, 5]]).astype(np.int32)
        logits = r.standard_normal(V).astype(np.float32)
        lay = SamplerLayout(2, V, 1000)
        buf = np.zeros(lay.nbytes, np.uint8)
        used = pack(lay, buf, [None, SampleRow(spec_, 9, prompt, gen, None)], PromptCache())
        ids, counts = _unpack_pen(lay, buf, 1)
        assert used == lay.data + 4 * 2 * len(ids)
        z = logits.astype(np.float64)
        rep, pres, freq = spec_.repetition_penalty, spec_.presence_penalty, spec_.frequency_penalty
        for t, c in zip(ids, counts):
            x = z[t]
            if rep != 1.0:
                x = x / rep if x > 0 else x * rep
            if c > 0 and (pres or freq):
                x -= freq * float(c) + pres
            z[t] = x
        assert np.array_equal(z, apply_penalties(logits, spec_, prompt, gen))
    # no penalty: no entry; presence alone: only generated ids
    plain = SamplingSpec(seed=0, temperature=1.0)
    assert len(penalty_entries(plain, np.arange(5), [1, 2])[0]) == 0
    ids, c = penalty_entries(SamplingSpec(seed=0, presence_penalty=1.0), np.arange(50), [7, 7, 3])
    assert ids.tolist() == [3, 7] and c.tolist() == [1, 2]


def test_pack_logit_bias_triples_reproduce_the_host_bias():
    """The packed (id, low, high) triples, decoded as the kernel does (hiloint2double), added
    after the penalties, give apply_penalties' row bit for bit; bad ids are refused."""
    r = np.random.default_rng(4)
    V = 257
    bias = tuple((int(t), float(b)) for t, b in
                 zip(np.sort(r.choice(V, 9, replace=False)), r.uniform(-100, 100, 9)))
    sp = SamplingSpec(seed=1, temperature=1.0, repetition_penalty=1.3, logit_bias=bias)
    prompt, gen = r.integers(0, V, 30).astype(np.int32), r.integers(0, V, 5).astype(np.int32)
    logits = r.standard_normal(V).astype(np.float32)
    lay = SamplerLayout(2, V, 100)
    buf = np.zeros(lay.nbytes, np.uint8)
    pack(lay, buf, [SampleRow(sp, 9, prompt, gen, None), None], PromptCache())
    fpar, ipar, upar, data = lay.views(buf)
    z = logits.astype(np.float64)
    ids, counts = _unpack_pen(lay, buf, 0)
    for t in ids:
        z[t] = z[t] / 1.3 if z[t] > 0 else z[t] * 1.3
    off, n = ipar[0, 4], ipar[0, 5]
    triples = data[off: off + 3 * n].reshape(n, 3)
    for t, lo, hi in triples:
        z[t] += np.array([lo, hi], np.uint32).view(np.float64)[0]
    assert n == len(bias) and ipar[1, 5] == 0
    assert np.array_equal(z, apply_penalties(logits, sp, prompt, gen))
    for bad in (((V, 1.0),), ((3, 1.0), (3, 2.0))):
        with pytest.raises(ValueError, match="logit_bias"):
            pack(lay, buf, [SampleRow(SamplingSpec(seed=0, logit_bias=bad), 0, prompt, gen)])


def test_pack_mask_bits_params_and_errors():
    V = 70
    lay = SamplerLayout(3, V, 16)
    buf = np.zeros(lay.nbytes, np.uint8)
    mask = np.zeros(V - 5, np.bool_)                  # shorter than V: the tail is disallowed
    mask[[0, 31, 32, 64]] = True
    sp = SamplingSpec(seed=2**64 - 1, temperature=0.5, top_k=V + 3, top_p=0.9, min_p=0.1,
                      is_constrained=True)
    pack(lay, buf, [SampleRow(sp, 2**40 + 3, np.zeros(0, np.int32), np.zeros(0, np.int32), mask),
                    None], PromptCache())
    fpar, ipar, upar, data = lay.views(buf)
    off = ipar[0, 3]
    bits = np.unpackbits(data[off: off + lay.words].view(np.uint8), bitorder="little")[:V]
    assert np.flatnonzero(bits).tolist() == [0, 31, 32, 64]
    assert fpar[0, :3].tolist() == [0.5, 0.9, 0.1] and ipar[0, 0] == 0       # top_k >= V: off
    assert int(upar[0, 0]) == 2**64 - 1 and int(upar[0, 1]) == 2**40 + 3
    assert fpar[1, 0] == 0.0 and ipar[1, 2] == 0 and ipar[1, 3] == -1        # None: argmax
    with pytest.raises(ValueError, match="allows no token"):
        pack(lay, buf, [SampleRow(sp, 0, np.zeros(0, np.int32), np.zeros(0, np.int32),
                                  np.zeros(V, np.bool_))])
    with pytest.raises(ValueError, match="exceed"):
        pack(lay, buf, [None] * 4)
    with pytest.raises(ValueError, match="penalty entries"):
        pack(lay, buf, [SampleRow(SamplingSpec(seed=0, repetition_penalty=2.0), 0,
                                  np.arange(40, dtype=np.int32), np.zeros(0, np.int32))])


def test_prompt_cache_reuses_unique_ids():
    c = PromptCache(capacity=2)
    p = np.array([5, 1, 5, 3], np.int32)
    a = c.unique(("s", 4), p)
    assert a.tolist() == [1, 3, 5] and c.unique(("s", 4), np.zeros(0)) is a    # a hit
    c.unique(("t", 1), p)
    c.unique(("u", 1), p)
    assert ("s", 4) not in c._d                                                # evicted (LRU)


@pytest.mark.parametrize("name", ["sample_prep", "sample_stats", "sample", "argmax"])
def test_sampler_kernels_compile_to_ptx_for_sm90(name):
    try:
        ptx = K.compile_spec(spec(name), (9, 0))
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    assert ".target sm_90" in ptx and K.entry_name(ptx)
    # the block size we launch must fit the register file (64K per SM): ptxas tells, if present
    import shutil
    import tempfile
    from ninfer.models.qwen3_5.cuda import sampler
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", str(src) + ".cubin"],
                             capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    threads = 1024 if name == "argmax" else sampler.THREADS
    mod = K._import_kernel_module("sample")
    assert sampler.THREADS == mod.SAMPLE_THREADS and sampler.ROW_BLOCKS == mod.ROW_BLOCKS
    assert sampler.HIST_BINS == mod.HIST_BINS and sampler.KCAP == mod.KCAP
    assert sampler.work_words() == (mod.work_f64(), mod.work_i32())
    assert sampler.work_words(4, 64, 48) == (mod.work_f64(4, 64), mod.work_i32(4, 64, 48))
    assert regs * threads <= 65536 and "spill" not in res.stderr.replace("0 bytes spill", ""), \
        (regs, res.stderr)


def test_sample_kernel_on_the_simulator_equals_the_host_sampler():
    """46 boundary rows + 8 wide-nucleus rows + 40 random ones (V 200-2000, every filter,
    penalties, logit_bias, masks, ties) through DeviceSampler.launch (one H2D copy, the three
    launches) on
    32-thread blocks, 4 blocks per row, 256 histogram bins and a 32-id candidate cap, so every
    plan (ALL, SMALL, WIDE, FALLBACK) runs: every token equal to sample_row's except draws at a
    named decision margin (sample_cases.EPS), which must be rare; u bit-identical to
    counter_uniform; argmax exact."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/gpu/sim_sample.py"),
                          "40", "32", "11", "4", "256", "32"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    st = json.loads(res.stdout.strip().splitlines()[-1])
    assert st["rows"] >= 90 and st["mismatches"] == [], st
    assert st["rng_bad"] == 0 and st["argmax_bad"] == 0 and st["copies_bad"] == 0, st
    # batches whose rows sample from the logits alone ran again as a chained step's launch
    # (DeviceSampler.launch(ahead_turn=): its own small staging): the same tokens
    assert st["ahead_runs"] >= 5 and st["ahead_bad"] == 0, st
    assert st["skipped"] <= 0.05 * st["rows"], st
    assert min(st["plans"]) >= 1, st          # ALL, SMALL, WIDE, FALLBACK each ran
