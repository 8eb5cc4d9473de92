"""Artifact mutation fuzzer (issue 17): a few hundred random mutations of a small valid artifact
(byte flips in the header, manifest and payload, random overwrites, zeroed ranges, truncation,
appended and inserted bytes). Every mutant must either raise ArtifactError or load exactly what
the original holds (config, bindings' bytes, uses, resources): any other exception, a hang or a
silently different tensor is a reader bug. The seed is fresh each run and printed on failure."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ninfer.artifact import Artifact
from ninfer.artifact import format as fmt
from ninfer.errors import ArtifactError
from ninfer.models import model_config
from test_artifact import write_basic

NUM_MUTANTS = 300


def snapshot(path) -> dict:
    """Everything a loader reads from the artifact, verified eagerly."""
    with Artifact(path, verify="eager") as art:
        art.verify_all()
        out = {"config": repr(model_config(art)), "name": art.name, "uses": repr(art.uses)}
        for name in art.binding_names():
            a = art.tensor(name)
            out[f"binding:{name}"] = (str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes())
        for name in art.resource_names():
            out[f"resource:{name}"] = art.resource(name)
        return out


def mutate(data: bytes, rng, regions) -> tuple[bytes, str]:
    b = bytearray(data)
    kind = str(rng.choice(["flip", "flip-header", "flip-manifest", "flip-payload", "set",
                           "zero-range", "truncate", "append", "insert"]))
    if kind.startswith("flip"):
        lo, hi = regions.get(kind[5:], (0, len(b)))
        i = int(rng.integers(lo, hi))
        b[i] ^= 1 << int(rng.integers(0, 8))
        return bytes(b), f"{kind} byte {i}"
    if kind == "set":
        i = int(rng.integers(0, len(b)))
        b[i] = int(rng.integers(0, 256))
        return bytes(b), f"set byte {i} = {b[i]}"
    if kind == "zero-range":
        i = int(rng.integers(0, len(b)))
        n = int(rng.integers(1, 64))
        b[i:i + n] = bytes(len(b[i:i + n]))
        return bytes(b), f"zero {n} bytes at {i}"
    if kind == "truncate":
        n = int(rng.integers(0, len(b)))
        return bytes(b[:n]), f"truncate to {n}"
    extra = rng.integers(0, 256, size=int(rng.integers(1, 200)), dtype=np.uint8).tobytes()
    if kind == "append":
        return bytes(b) + extra, f"append {len(extra)} bytes"
    i = int(rng.integers(0, len(b)))
    return bytes(b[:i]) + extra + bytes(b[i:]), f"insert {len(extra)} bytes at {i}"


def test_mutants_are_refused_or_identical(tmp_path):
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    rng = np.random.default_rng(seed)
    original_path = tmp_path / "basic.ninfer"
    write_basic(original_path, np.random.default_rng(seed))
    original = snapshot(original_path)
    data = original_path.read_bytes()
    header = fmt.unpack_header(data, len(data), "x")
    start, n = header["manifest_offset"], header["manifest_nbytes"]
    regions = {"header": (0, fmt.HEADER_NBYTES), "manifest": (start, start + n),
               "payload": (fmt.HEADER_NBYTES, start) if start > fmt.HEADER_NBYTES
               else (start + n, len(data))}
    path = tmp_path / "mutant.ninfer"
    refused = identical = 0
    for _ in range(NUM_MUTANTS):
        mutant, what = mutate(data, rng, regions)
        path.write_bytes(mutant)
        try:
            got = snapshot(path)
        except ArtifactError:
            refused += 1
            continue
        except Exception as exc:  # noqa: BLE001 - the failure this test looks for
            pytest.fail(f"seed {seed}, {what}: {type(exc).__name__}: {exc}")
        assert got == original, f"seed {seed}, {what}: loaded, but not what was written"
        identical += 1
    os.remove(path)
    assert refused + identical == NUM_MUTANTS and refused > NUM_MUTANTS // 2
