"""Calibrated quantization (--calibration, ninfer/convert/calibrate.py and gptq.py): GPTQ codes against plain
rounding on the layer-output error they exist to reduce, their consistency with the spec's decode
(docs/artifact.md 3.2.1), the input statistics collected from a real forward, and the converter
path end to end on the fixtures (dense and MoE: per-expert statistics)."""
import numpy as np
import pytest
from fixture_utils import fixture_dir
from test_quant import decode64

from ninfer import Engine
from ninfer.artifact import Artifact
from ninfer.convert import Quantize, calibrate, convert_checkpoint, gptq
from ninfer.convert.convert import hessians_for_checkpoint
from ninfer.convert.quantize import encode, encode_calibrated
from ninfer.errors import ConvertError

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 6


def correlated_inputs(rng, tokens, C):
    """Inputs with correlated channels and a few large ones (as a norm's output has)."""
    x = rng.standard_normal((tokens, C)) @ (np.eye(C) + 0.3 * rng.standard_normal((C, C)))
    x[:, rng.choice(C, 3, replace=False)] *= 8.0
    return x


@pytest.mark.parametrize("layout, group, asym", [("int4_block", 128, True), ("int4_block", 64, False),
                                                 ("int4_block", 96, True), ("int8_block", 128, False),
                                                 ("fp8_block", (128, 128), False),
                                                 ("fp8_block", (16, 96), False)])
def test_gptq_reduces_output_error_and_decodes_by_the_spec(layout, group, asym):
    rng = np.random.default_rng(sum(np.atleast_1d(group)) + asym)
    n, C = 48, 256
    w = rng.standard_normal((n, C)).astype(np.float32)
    x = correlated_inputs(rng, 1024, C)
    h = x.T @ x
    stored, scale, zero = encode_calibrated(layout, w, h, group, asym)
    block = group if layout == "fp8_block" else (1, group)
    assert scale.shape == (1, -(-n // block[0]), -(-C // block[1])) and scale.dtype == np.float32
    assert (zero is not None) == asym
    got = decode64(layout, (1, n, C), block, stored, scale, zero)[0]
    rtn = decode64(layout, (1, n, C), block, *encode(layout, w[None], block, asym))[0]
    out_err = lambda deq: np.linalg.norm(x @ (deq - w).T)        # noqa: E731
    assert out_err(got) < 0.8 * out_err(rtn), (out_err(got), out_err(rtn))
    # every stored value is on its group's grid: decoding the stored codes reproduces the layer
    # the error figures above were measured on (no hidden float copy)
    if layout == "int4_block":
        codes = np.stack([stored[0] & 15, stored[0] >> 4], -1).reshape(n, -1)[:, :C]
        assert codes.max() <= 15
    elif layout == "fp8_block":         # same block scales as plain rounding, finite codes
        assert np.array_equal(scale, encode(layout, w[None], block)[1])
        assert np.all(np.isfinite(stored.astype(np.float32)))
    else:
        assert np.abs(stored.astype(np.int64)).max() <= 127


def test_gptq_without_correlation_is_plain_rounding(monkeypatch):
    """H = I and no clipping search or scale refit: nothing to compensate, the codes are
    encode()'s exactly."""
    monkeypatch.setattr(gptq, "CLIP_GRID", np.array([1.0]))
    monkeypatch.setattr(gptq, "REFIT", 0)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((20, 200)).astype(np.float32)
    for layout, asym in (("int4_block", True), ("int4_block", False), ("int8_block", False),
                         ("fp8_block", False)):
        block = (128, 128) if layout == "fp8_block" else (1, 128)
        got = encode_calibrated(layout, w, np.eye(200), block if layout == "fp8_block" else 128,
                                asym)
        want = encode(layout, w[None], block, asym)
        for a, b in zip(got, want):
            assert (a is None and b is None) or np.array_equal(
                a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                b.view(np.uint8) if b.dtype.itemsize == 1 else b), layout


def test_input_hessians_are_the_projection_inputs(tmp_path):
    """Layer 0's in_proj_qkv input is input_layernorm(embed(ids)): its statistics equal x^T x of
    that, recomputed here in float64; every projection kind is seen; expert statistics are
    symmetric positive semi-definite (or None for an expert too few tokens reached)."""
    path = convert_checkpoint(fixture_dir("moe"), tmp_path / "bf16.ninfer", progress=False)
    hess = calibrate.input_hessians(path, TEXT, 64)
    with Engine(path, purpose="scoring") as engine:
        ids = np.asarray(engine.tokenize(TEXT)[:64], np.int64)
        cfg = engine.model.text
        with Artifact(path) as art:
            embed = np.asarray(art.tensor("text.embed_tokens.weight"), np.float64)
            w = np.asarray(art.tensor("text.layers.0.input_layernorm.weight"), np.float64)
    x = embed[ids]
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * (1.0 + w)
    h0 = hess["text.layers.0.linear_attn.in_proj_qkv.weight"]
    assert np.allclose(h0, x.T @ x, rtol=1e-4, atol=1e-4 * np.abs(h0).max())
    assert np.array_equal(h0, hess["text.layers.0.linear_attn.in_proj_z.weight"])
    for name, h in hess.items():
        for e in (h if isinstance(h, list) else [h]):
            if e is not None:
                assert np.allclose(e, e.T) and np.linalg.eigvalsh(e).min() > -1e-6 * np.trace(e)
        if ".experts." in name:
            assert len(h) == cfg.num_experts and any(e is not None for e in h), name
    kinds = {n.split(".", 3)[3] for n in hess}
    assert kinds >= {"mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                     "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.down_proj.weight",
                     "linear_attn.out_proj.weight", "self_attn.q_proj.weight",
                     "self_attn.o_proj.weight"}


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_calibrated_conversion_end_to_end(name, tmp_path):
    rtn = convert_checkpoint(fixture_dir(name), tmp_path / "rtn.ninfer", progress=False,
                             recipe=Quantize("int4"))
    cal = convert_checkpoint(fixture_dir(name), tmp_path / "cal.ninfer", progress=False,
                             recipe=Quantize("int4", calibration=TEXT, calibration_tokens=64))
    with Artifact(cal, verify="eager") as a, Artifact(rtn) as b:
        assert a.manifest["metadata"]["quantization"]["method"] == "gptq"
        assert b.manifest["metadata"]["quantization"]["method"] == "round"
        differ = [n for n in a.manifest["bindings"] if a.is_quantized(n)
                  and not np.array_equal(a.quantized(n).data, b.quantized(n).data)]
        assert differ, "calibration changed no codes"
    with Engine(cal, purpose="scoring") as engine:
        res = engine.score(engine.tokenize(TEXT)[:40])
        assert np.all(np.isfinite(res.logprobs))


def test_calibration_errors(tmp_path):
    with pytest.raises(ConvertError, match="need at least 2"):
        convert_checkpoint(fixture_dir("dense"), tmp_path / "x.ninfer", progress=False,
                           recipe=Quantize("int4", calibration=""))
    assert not (tmp_path / "x.ninfer").exists()


def test_calibration_cli(tmp_path, capsys):
    import ninfer.cli
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    src, out = fixture_dir("dense"), tmp_path / "o.ninfer"
    for extra, msg in (([], "needs --quantize"),
                       (["--quantize", "int4", "--calibration", str(tmp_path / "missing")],
                        "cannot read")):
        argv = ["convert", str(src), str(out), "--quiet", *extra]
        if "--calibration" not in extra:
            argv += ["--calibration", str(text)]
        assert ninfer.cli.main(argv) != 0
        assert msg in capsys.readouterr().err
        assert not out.exists()
    assert ninfer.cli.main(["convert", str(src), str(out), "--quiet", "--quantize", "int8",
                            "--calibration", str(text)]) == 0
    with Artifact(out) as art:
        assert art.manifest["metadata"]["quantization"]["method"] == "gptq"


def test_sequential_calibration_sees_the_quantized_layers_before(tmp_path):
    """Sequential mode: layer 0's statistics equal one-shot's (it sees only embeddings), later
    layers' differ (their inputs pass through quantized layers), and the weights the later
    layers were calibrated against are exactly the ones the artifact stores."""
    src = fixture_dir("moe")
    recipe = Quantize("int4", calibration=TEXT, calibration_tokens=64)
    path = convert_checkpoint(src, tmp_path / "seq.ninfer", progress=False, recipe=recipe)
    oneshot = hessians_for_checkpoint(src, TEXT, 64)
    first = [n for n in oneshot if n.startswith("text.layers.0.") and ".experts." not in n]
    later = [n for n in oneshot if n.startswith("text.layers.2.") and ".experts." not in n]
    assert first and later
    assert all(np.array_equal(recipe.hessians[n], oneshot[n]) for n in first)
    assert not any(np.allclose(recipe.hessians[n], oneshot[n]) for n in later)
    from ninfer.models.qwen3_5.quant import dequantize
    with Artifact(path) as art, \
            Artifact(convert_checkpoint(src, tmp_path / "bf16.ninfer", progress=False)) as ref:
        for name in ("text.layers.1.mlp.experts.gate_up_proj", first[0]):
            w = np.asarray(ref.tensor(name), np.float32)
            want = recipe._dequantized(name, w, recipe.hessians[name])
            assert np.array_equal(dequantize(art.quantized(name), name), want), name
