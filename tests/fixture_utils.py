"""Helpers for the oracle fixtures in tests/fixtures/ (made by tools/make_fixtures.py; see the
README there).

No torch here: the references are plain numpy arrays. Conversion goes through the real converter,
so every golden test exercises convert -> artifact -> model end to end.
"""
from __future__ import annotations

import json
import pathlib
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

FIXTURES_DIR = pathlib.Path(__file__).resolve().parent / "fixtures"

# Whole-model tolerance (issue 2, "Done when"): max|got - ref| / max|ref| over a logits block.
# transformers' own fp32-vs-fp64 error on these fixtures is ~5e-6, so this leaves room for a
# different (but correct) summation order while any real math slip lands far above it.
GOLDEN_REL_TOL = 1e-3
# The numpy backend computes in fp32 like the reference, differing only in summation order: it
# measured <= 6e-5 on every fixture (worst: `sharded`, 6 layers, whose own fp32-vs-fp64 error is
# 1.9e-5; layer by layer the numpy hidden states are as close to fp64 as transformers' fp32 ones).
# This tighter bound ("aim far lower") still catches slips that 1e-3 could let through; rounding
# the normed activations to bf16, for instance, gives 5e-2.
NUMPY_REL_TOL = 2.5e-4


@dataclass(frozen=True)
class Sequence:
    ids: np.ndarray            # int32 [T]
    logits: np.ndarray         # float32 [T, V]: logits after each prefix ids[:t+1]


@dataclass(frozen=True)
class PositionedSequence:
    ids: np.ndarray            # int32 [T]
    positions: np.ndarray      # int32 [3, T]: (t, h, w) MRoPE positions, text + a vision grid + text
    logits: np.ndarray         # float32 [T, V]


@dataclass(frozen=True)
class Continuation:
    prompt: np.ndarray         # int32 [P]
    tokens: np.ndarray         # int32 [16]: transformers' greedy continuation (EOS not honoured)
    margins: np.ndarray        # float32 [16]: top-1 minus top-2 logit at each step


@dataclass(frozen=True)
class Reference:
    name: str
    sequences: tuple           # (Sequence, ...) lengths 1, 5, 37, 70
    continuations: tuple       # (Continuation, ...)
    mrope: PositionedSequence
    fp32_vs_fp64_rel: float    # transformers' own fp32 noise on this fixture
    versions: str


def fixture_names() -> list:
    """Every fixture directory that holds a checkpoint and its reference, sorted."""
    return sorted(p.name for p in FIXTURES_DIR.iterdir() if not p.name.startswith(".")
                  and (p / "config.json").is_file() and (p / "reference.npz").is_file())


def fixture_dir(name: str) -> pathlib.Path:
    path = FIXTURES_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no fixture {name!r} under {FIXTURES_DIR}")
    return path


def load_reference(name: str) -> Reference:
    with np.load(fixture_dir(name) / "reference.npz") as z:
        seqs = tuple(Sequence(z[f"prefill_ids_{s}"], z[f"prefill_logits_{s}"])
                     for s in range(len(z["prefill_lengths"])))
        conts = []
        while f"greedy_prompt_{len(conts)}" in z:
            g = len(conts)
            conts.append(Continuation(z[f"greedy_prompt_{g}"], z[f"greedy_tokens_{g}"],
                                      z[f"greedy_margins_{g}"]))
        mrope = PositionedSequence(z["mrope_ids"], z["mrope_positions"], z["mrope_logits"])
        return Reference(name, seqs, tuple(conts), mrope, float(z["fp32_vs_fp64_rel"]),
                         str(z["versions"]))


def convert_fixture(name: str, out_dir) -> pathlib.Path:
    """Convert one fixture checkpoint to `<out_dir>/<name>.ninfer` with the project's converter."""
    from ninfer.convert import convert_checkpoint

    out = pathlib.Path(out_dir) / f"{name}.ninfer"
    if not out.exists():
        convert_checkpoint(fixture_dir(name), out, progress=False)
    return out


_ST_DTYPES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn}


def read_checkpoint_tensors(name: str) -> dict:
    """Every tensor of a fixture checkpoint (all shards), bf16 as ml_dtypes.bfloat16. A tiny
    independent safetensors reader: safetensors' numpy loader cannot produce bfloat16."""
    tensors = {}
    for f in sorted(fixture_dir(name).glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__", None)
        for key, info in header.items():
            begin, end = info["data_offsets"]
            buf = raw[8 + n + begin:8 + n + end]
            tensors[key] = np.frombuffer(buf, _ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref| (the golden metric); inf for a shape mismatch or non-finite."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return float("inf")
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def assert_logits_close(got, ref, what: str, tol: float = GOLDEN_REL_TOL) -> float:
    """Assert the golden metric is within `tol`; the message names the worst position and value."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: logits shape {got.shape} != reference {ref.shape}"
    err = rel_err(got, ref)
    if not err <= tol:
        diff = np.abs(np.nan_to_num(got.astype(np.float64), nan=np.inf) - ref)
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        per_pos = diff.reshape(diff.shape[0], -1).max(axis=1) / np.max(np.abs(ref)) \
            if diff.ndim > 1 else diff
        first_bad = int(np.argmax(per_pos > tol)) if diff.ndim > 1 else None
        raise AssertionError(
            f"{what}: max|diff|/max|ref| = {err:.3e} > {tol:.0e} (worst at index {worst}: "
            f"got {got[worst]!r}, ref {ref[worst]!r}; first position over tol: {first_bad})")
    return err


def reference_logprobs(seq: Sequence) -> np.ndarray:
    """log p(ids[t+1] | ids[:t+1]) from the reference logits, float64 [T-1]."""
    lg = seq.logits[:-1].astype(np.float64)
    m = lg.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(lg - m).sum(axis=-1, keepdims=True)))[:, 0]
    return lg[np.arange(len(lg)), seq.ids[1:]] - lse
