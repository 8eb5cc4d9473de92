"""Quantized weights end to end against transformers (issue 13): the FP8 release-layout fixtures
imported value-preserving, and the bf16 fixtures converted with --quantize, score the logits that
transformers computes from the same weights decoded independently (tools/make_quant_fixtures.py:
torch decode from docs/artifact.md, float32 model). No torch here."""
import numpy as np
import pytest
from fixture_utils import (NUMPY_REL_TOL, assert_logits_close, fixture_dir,
                           read_checkpoint_tensors)

from ninfer import Engine
from ninfer.artifact import Artifact
from ninfer.convert import Quantize, convert_checkpoint

FP8_FIXTURES = ("fp8_dense", "fp8_moe")
SCALE = ".weight_scale_inv"


def _logits(path, ids, **options):
    with Engine(path, purpose="scoring", **options) as engine:
        return engine.score(np.asarray(ids, np.int32), return_logits=True).logits


@pytest.fixture(scope="module")
def fp8_artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    return {n: convert_checkpoint(fixture_dir(n), out / f"{n}.ninfer", progress=False)
            for n in FP8_FIXTURES}


@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_fp8_release_logits_match_transformers(name, fp8_artifacts):
    with np.load(fixture_dir(name) / "quant_reference.npz") as z:
        for s in (0, 1):
            ids, ref = z[f"ids_{s}"], z[f"logits_{s}"]
            for chunk in (512, 7):
                assert_logits_close(_logits(fp8_artifacts[name], ids, prefill_chunk=chunk), ref,
                                    f"{name} T={len(ids)} chunk {chunk}", NUMPY_REL_TOL)


def _logical(source: str) -> str:
    return "text." + source[len("model.language_model."):]


@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_fp8_release_import_keeps_bytes_and_scales(name, fp8_artifacts):
    src = read_checkpoint_tensors(name)
    scaled = {n[:-len(SCALE)] + ".weight" for n in src if n.endswith(SCALE)}
    assert scaled, "the fixture has no FP8 weights"
    with Artifact(fp8_artifacts[name]) as art:
        objects = {o["name"]: o for o in art.manifest["objects"]}
        uses = {u["binding"]: u["activation"] for u in art.uses}
        assert art.manifest["metadata"]["quantization"] == {"format": "fp8", "from": "checkpoint",
                                                            "block": [128, 128]}
        for n in scaled:
            w, inv = src[n], src[n[:-len(".weight")] + SCALE]
            lg, e, part = _logical(n), None, slice(None)
            if ".experts." in lg:                           # per expert -> the fused objects
                base, e, proj, _ = lg.rsplit(".", 3)
                lg = base + (".down_proj" if proj == "down_proj" else ".gate_up_proj")
                rows = w.shape[0]
                part = {"gate_proj": slice(0, rows), "up_proj": slice(rows, 2 * rows)}.get(
                    proj, slice(None))
            qt = art.quantized(lg)
            assert qt.layout == "fp8_block" and uses[lg] == "AllowA8", lg
            data = qt.data if e is None else qt.data[int(e)]
            assert data[part].tobytes() == w.tobytes(), f"{n}: fp8 bytes changed"
            scale = qt.scale if e is None else qt.scale[int(e)]
            assert scale.dtype == inv.dtype, f"{n}: scale dtype {scale.dtype} != {inv.dtype}"
            if qt.block[0] == 1:    # gate/up halves of 40 rows: each row carries its block's scale
                assert name == "fp8_moe" and part != slice(None)
                assert np.array_equal(scale[part], np.repeat(inv, 128, axis=0)[:w.shape[0]]), n
            else:
                assert qt.block == (128, 128) and part == slice(None)
                assert np.array_equal(scale, inv), f"{n}: scales changed"
            assert objects[lg]["quant"]["scale"] == lg + ".scale"
        for b in art.binding_names():               # everything else: bf16 byte for byte
            if not art.is_quantized(b) and b.startswith("text.") and b in uses:
                assert uses[b] == "A16Only", b


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_quantized_conversion_matches_transformers(name, fmt, tmp_path):
    path = convert_checkpoint(fixture_dir(name), tmp_path / "q.ninfer", progress=False,
                              recipe=Quantize(fmt))
    with np.load(fixture_dir(name) / "quantized.npz") as z:
        ids, ref, recorded = z["ids"], z[f"{fmt}_logits"], list(z[f"{fmt}_checksums"])
    with Artifact(path) as art:
        objects = {o["name"]: o for o in art.manifest["objects"]}
        sums = []
        for b, binding in art.manifest["bindings"].items():
            if "view" not in binding and art.is_quantized(b):
                o = objects[b]
                sums += [o["checksum"], objects[o["quant"]["scale"]]["checksum"]]
    if sums != recorded:
        pytest.fail(f"{name} --quantize {fmt}: the quantized bytes differ from those the reference "
                    "was computed from (the encoder changed?): rerun "
                    "`python tools/make_quant_fixtures.py dense moe` if that was intended")
    assert_logits_close(_logits(path, ids), ref, f"{name} --quantize {fmt}", NUMPY_REL_TOL)
