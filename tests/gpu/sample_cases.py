"""Random sampling requests and the host oracle's answer with its decision margins, shared by the
simulator run (tests/gpu/sim_sample.py) and the GPU test (tests/gpu/test_sample_gpu.py).

The device must return sampling.sample_row's token, except for a draw whose float64 decision
lies within EPS (relative) of a boundary, where a different summation order may fall on the other
side: u * total near a step of the CDF, the top-p cumulative mass near top_p, a weight near the
min-p threshold, or (penalised values may round differently under FMA on the GPU) two distinct
values within VALUE_EPS at the top-k cut or the greedy top.
"""
from __future__ import annotations

import numpy as np

from ninfer.models.qwen3_5.cuda.sampler import SampleRow
from ninfer.models.qwen3_5.program.sampling import (SamplingSpec, apply_mask, apply_penalties,
                                                    counter_uniform, sample_row)

EPS = 1e-9            # relative to the quantity compared (mass, weight, u * total)
VALUE_EPS = 1e-12     # relative, between distinct penalised logits


def oracle(logits, row: SampleRow):
    """(token, ambiguous reason or None) of the host sampler for one row."""
    spec = row.spec
    token, _ = sample_row(logits, spec, row.prompt_ids, row.generated_ids, row.position, row.mask)
    z = apply_penalties(logits, spec, row.prompt_ids, row.generated_ids)
    if row.mask is not None:
        apply_mask(z, row.mask)
    V = len(z)
    if spec.is_greedy:
        top = z.max()
        below = z[z < top]
        if len(below) and np.isfinite(top) and top - below.max() < VALUE_EPS * (1 + abs(top)):
            return token, "greedy near-tie"
        return token, None
    zt = z / spec.temperature
    order = np.lexsort((np.arange(V), -zt))
    k = spec.top_k if 0 < spec.top_k < V else V
    if k < V:
        a, b = zt[order[k - 1]], zt[order[k]]
        if a != b and np.isfinite(a) and a - b < VALUE_EPS * (1 + abs(a)):
            return token, "top-k near-tie"
    m = zt.max()
    kept = order[:k]
    w = np.exp(zt[kept] - m)
    L = k
    if spec.top_p < 1.0:
        c = np.cumsum(w) / w.sum()
        if np.min(np.abs(c - spec.top_p)) < EPS:
            return token, "top-p mass at the cut"
        L = int(np.searchsorted(c, spec.top_p, side="left")) + 1
    if spec.min_p > 0.0:
        near = (np.abs(w[:L] - spec.min_p) < EPS) & (zt[kept[:L]] != m)
        if near.any():
            return token, "min-p weight at the threshold"
        L = min(L, int(np.count_nonzero(w[:L] >= spec.min_p)))
    ids = np.sort(kept[:L])
    ww = np.exp(zt[ids] - m)
    ids, ww = ids[ww > 0], ww[ww > 0]
    cdf = np.cumsum(ww)
    x = counter_uniform(spec.seed, row.position) * cdf[-1]
    if np.min(np.abs(cdf - x)) < EPS * cdf[-1]:
        return token, "u * total at a CDF step"
    return token, None


def random_logits(r, V, kind):
    if kind == "normal":
        return (r.standard_normal(V) * r.choice([0.5, 2.0, 6.0])).astype(np.float32)
    if kind == "peaked":                 # a realistic LM row: a few strong ids over a long tail
        x = r.standard_normal(V) * 1.5
        x[r.choice(V, 5, replace=False)] += r.uniform(5, 15, 5)
        return x.astype(np.float32)
    if kind == "ties":                   # few distinct levels: ties at every threshold
        return (np.round(r.standard_normal(V) * 2) / 2).astype(np.float32)
    if kind == "flat":
        return np.zeros(V, np.float32)
    if kind == "tail":                   # a smooth long tail: top-p's nucleus spans many ids
        return (r.standard_normal(V) * 2.0).astype(np.float32)
    raise ValueError(kind)


def random_row(r, V, *, greedy_share=0.15):
    temperature = 0.0 if r.random() < greedy_share else float(r.choice([0.3, 0.7, 1.0, 1.6]))
    top_k = int(r.choice([0, 0, 1, 2, 7, 50, V - 1, V, V + 5]))
    top_p = float(r.choice([1.0, 1.0, 0.95, 0.5, 1e-6, 0.999]))
    min_p = float(r.choice([0.0, 0.0, 0.05, 0.3, 0.999, 1.0]))
    rep = float(r.choice([1.0, 1.0, 1.3, 0.8]))
    pres = float(r.choice([0.0, 0.0, 0.5, -0.4]))
    freq = float(r.choice([0.0, 0.0, 0.25]))
    spec = SamplingSpec(seed=int(r.integers(0, 2**63)) * 2 + int(r.integers(0, 2)),
                        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep,
                        logit_bias=random_bias(r, V) if r.random() < 0.3 else ())
    prompt = r.integers(0, V, int(r.integers(0, 60))).astype(np.int32)
    gen = r.integers(0, V, int(r.integers(0, 30))).astype(np.int32)
    if len(gen) > 3:
        gen[: len(gen) // 2] = gen[0]                    # repeats: counts > 1
    mask = None
    kind = r.choice(["none", "none", "random", "single", "short"])
    if kind == "random":
        mask = r.random(V) < 0.3
        mask[int(r.integers(0, V))] = True
    elif kind == "single":
        mask = np.zeros(V, np.bool_)
        mask[int(r.integers(0, V))] = True
    elif kind == "short":                # a tokenizer vocabulary shorter than the embedding
        mask = r.random(V - int(r.integers(1, 50))) < 0.8
        mask[0] = True
    return SampleRow(spec, int(r.integers(0, 1 << 40)), prompt, gen, mask)


def random_bias(r, V):
    """A logit_bias: a few ids pushed up or down (-100 bans), sorted by id, as SamplingSpec has it."""
    ids = np.sort(r.choice(V, int(r.integers(1, 12)), replace=False))
    return tuple((int(t), float(r.choice([-100.0, -3.5, 0.25, 2.0, 7.0, 100.0]))) for t in ids)


def nucleus_rows(r, V, n):
    """Top-p alone over a smooth tail (seeded; some with min-p or penalties): the nucleus is
    wider than a small candidate cap, so the device's cut-bin plan (WIDE) runs."""
    out = []
    for _ in range(n):
        spec = SamplingSpec(seed=int(r.integers(0, 2**62)), temperature=float(r.choice([0.7, 1.0])),
                            top_p=float(r.choice([0.5, 0.8, 0.9, 0.95])),
                            min_p=float(r.choice([0.0, 0.0, 0.01])),
                            repetition_penalty=float(r.choice([1.0, 1.2])))
        out.append(("tail", SampleRow(spec, int(r.integers(0, 1 << 40)),
                                      r.integers(0, V, 30).astype(np.int32),
                                      r.integers(0, V, 10).astype(np.int32), None)))
    return out


def boundary_rows(r, V):
    """Hand-picked edge cases: each (logits kind, spec fields, mask kind)."""
    out = []
    edges = [dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_k=V),
             dict(temperature=1.0, top_k=V + 10), dict(temperature=1.0, top_p=1e-9),
             dict(temperature=1.0, top_p=1.0), dict(temperature=1.0, min_p=0.999),
             dict(temperature=1.0, min_p=1.0), dict(temperature=0.5, top_k=3, top_p=0.7, min_p=0.1),
             dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),
             dict(temperature=1.0, top_k=5), dict(temperature=2.0, top_p=0.6),
             # top-p cutting through tied values inside a small top-k (its shared-memory path)
             dict(temperature=1.0, top_k=50, top_p=0.31),
             dict(temperature=1.0, top_k=20, top_p=0.5, min_p=0.5)]
    for kind in ("ties", "flat", "peaked"):
        for e in edges:
            spec = SamplingSpec(seed=int(r.integers(0, 2**62)), **e)
            gen = r.integers(0, V, 10).astype(np.int32)
            out.append((kind, SampleRow(spec, int(r.integers(0, 1 << 30)),
                                        r.integers(0, V, 20).astype(np.int32), gen, None)))
    single = np.zeros(V, np.bool_)
    single[V // 3] = True
    for e in (dict(temperature=1.0), dict(temperature=0.0),
              dict(temperature=0.7, top_k=1, top_p=0.1)):
        spec = SamplingSpec(seed=5, is_constrained=True, **e)
        out.append(("normal", SampleRow(spec, 77, np.zeros(0, np.int32), np.zeros(0, np.int32),
                                        single)))
    # logit_bias: +100 on one id decides a greedy row and a top-k 1 row; -100 on every id but
    # two leaves a sampled row those two; a bias on a penalised id applies after the penalty
    for e, bias in ((dict(temperature=0.0), ((V // 2, 100.0),)),
                    (dict(temperature=1.0, top_k=1), ((V - 1, 100.0),)),
                    (dict(temperature=1.0), tuple((t, -100.0) for t in range(V) if t not in (3, 9))),
                    (dict(temperature=1.0, repetition_penalty=1.5, top_p=0.9), ((0, 2.0), (1, -2.0)))):
        spec = SamplingSpec(seed=6, logit_bias=bias, **e)
        out.append(("peaked", SampleRow(spec, 99, np.array([0, 1, 2], np.int32),
                                        np.array([1], np.int32), None)))
    return out
