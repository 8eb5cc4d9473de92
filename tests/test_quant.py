"""Quantized weights on CPU (issue 13): the encoders against a float64 decode of the spec, the
converter's choices (which tensors, block layouts, uses, metadata), the FP8 release import on
synthetic checkpoints (multi-block, aligned and unaligned experts, bf16 scales, MTP), the
manifest rules of the quantized layouts, and the errors."""
import json
import re

import ml_dtypes
import numpy as np
import pytest
from ckpt_helpers import write_checkpoint

import ninfer.cli
from ninfer.artifact import Artifact, ArtifactWriter
from ninfer.convert import Quantize, convert_checkpoint
from ninfer.models import model_config
from ninfer.convert.quantize import encode, pack_int4
from ninfer.errors import ArtifactError, ConvertError
from ninfer.models.qwen3_5 import load_model
from ninfer.models.qwen3_5.load import read_text_params
from ninfer.models.qwen3_5.quant import dequantize
from ninfer.options import EngineOptions

FP8 = ml_dtypes.float8_e4m3fn
LAYOUT = {"fp8": "fp8_block", "int8": "int8_block", "int4": "int4_block"}


def decode64(layout, shape, block, stored, scale, zero=None):
    """docs/artifact.md 3.2.1, restated in float64: value = (q - zero) * scale per block."""
    *lead, R, C = shape
    br, bc = block
    if layout == "int4_block":
        b = np.asarray(stored, np.uint8).astype(np.int64)
        q = np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)[..., :C]
    else:
        q = np.asarray(stored).astype(np.float64)
    z = 8.0 if layout == "int4_block" and zero is None else 0.0
    if zero is not None:
        z = np.repeat(np.repeat(zero.astype(np.float64), br, -2), bc, -1)[..., :R, :C]
    s = np.repeat(np.repeat(np.asarray(scale, np.float64), br, -2), bc, -1)[..., :R, :C]
    return (q - z) * s


def weights(rng, S, n, C):
    w = rng.standard_normal((S, n, C)).astype(np.float32)
    w[:, :, :1] *= 20.0                        # an outlier column, as real projections have
    return w


# ---- encoders ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n, C", [(1, 1), (5, 127), (128, 128), (129, 129), (130, 300)])
@pytest.mark.parametrize("layout, block, asym", [
    ("fp8_block", (128, 128), False), ("int8_block", (1, 128), False),
    ("int8_block", (1, 300), False), ("int4_block", (1, 128), True),
    ("int4_block", (1, 128), False)])
def test_encode_error_bounds(layout, block, asym, n, C):
    rng = np.random.default_rng(n * 1000 + C)
    w = weights(rng, 2, n, C)
    stored, scale, zero = encode(layout, w, block, asym)
    br, bc = block
    assert scale.shape == (2, -(-n // br), -(-C // bc)) and scale.dtype == np.float32
    assert (zero is not None) == (layout == "int4_block" and asym)
    got = decode64(layout, w.shape, block, stored, scale, zero)
    s = np.repeat(np.repeat(scale.astype(np.float64), br, 1), bc, 2)[:, :n, :C]
    err = np.abs(got - w)
    if layout == "fp8_block":       # e4m3: 3 mantissa bits -> half an ulp, 2^-4 of |w| (or subnormal)
        assert stored.dtype == FP8
        assert np.all(err <= np.abs(w) * 2.0 ** -4 + s * 2.0 ** -10 + 1e-12)
    elif layout == "int8_block" or not asym:    # symmetric rounding: half a step
        assert np.all(err <= s * 0.5 * (1 + 1e-5))
    else:                           # zero point rounded too: at most one step at a clipped edge
        assert np.all(err <= s * (1 + 1e-5))
        assert np.mean(err / s) < 0.3
    amax = np.abs(w).max()
    assert np.abs(got).max() <= amax * (1 + 2 ** -4) + 1e-6


@pytest.mark.parametrize("layout,block,asym", [("fp8_block", (128, 128), False),
                                               ("int8_block", (1, 128), False),
                                               ("int4_block", (1, 64), True)])
def test_encode_in_pieces_is_the_same_bytes(monkeypatch, layout, block, asym):
    """encode() of a large matrix in pieces of whole block rows (threads) stores exactly what one
    piece does: rows not a multiple of the block, a partial last piece, stacked segments."""
    import ninfer.convert.quantize as Q
    rng = np.random.default_rng()
    monkeypatch.setattr(Q.os, "cpu_count", lambda: 4)
    # 166 rows (one block of 128 for fp8) of each segment; 4 whole segments of 40 rows
    for shape in ((2, 1000, 300), (6, 40, 300)):
        x = rng.standard_normal(shape).astype(np.float32) \
            * rng.uniform(0.01, 3.0, shape[:2] + (1,)).astype(np.float32)
        monkeypatch.setattr(Q, "ENCODE_PIECE", 1 << 30)
        whole = Q.encode(layout, x, block, asym)
        monkeypatch.setattr(Q, "ENCODE_PIECE", 50_000)
        pieces = Q.encode(layout, x, block, asym)
        for a, b in zip(whole, pieces):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and a.dtype == b.dtype
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_encode_all_zero_block_and_int4_nibble_order():
    stored, scale, zero = encode("int4_block", np.zeros((1, 2, 3), np.float32), (1, 128), True)
    assert np.array_equal(scale, np.ones((1, 2, 1), np.float32)) and not zero.any()
    assert decode64("int4_block", (1, 2, 3), (1, 128), stored, scale, zero).max() == 0
    # element 2k in bits 0-3, 2k+1 in bits 4-7; an odd count pads the last high nibble with 0
    assert pack_int4(np.array([[1, 2, 3]], np.uint8)).tolist() == [[0x21, 0x03]]
    w = np.array([[[-7.0, 0.0, 7.0]]], np.float32)                 # symmetric: codes q + 8
    stored, scale, _ = encode("int4_block", w, (1, 128), False)
    assert scale.item() == 1.0 and stored.tolist() == [[[0x81, 0x0F]]]


# ---- the converter's --quantize --------------------------------------------------------------

BIG = dict(hidden_size=160, intermediate_size=136, head_dim=32, linear_key_head_dim=32,
           linear_value_head_dim=32, moe_intermediate_size=40, shared_expert_intermediate_size=24,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True})
QUANT_LEAVES = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj|"
                          r"gate_proj|up_proj|down_proj)\.weight$|\.experts\.(gate_up_proj|down_proj)$")


def _source_values(ckpt, lg):
    t = ckpt.tensors
    if lg.endswith("experts.gate_up_proj") or lg.endswith("experts.down_proj"):
        base = "model." + lg[len("text."):].rsplit(".", 1)[0]
        E = sum(1 for n in t if n.startswith(base + ".") and n.endswith("down_proj.weight"))
        if lg.endswith("gate_up_proj"):
            return np.stack([np.concatenate([t[f"{base}.{e}.gate_proj.weight"],
                                             t[f"{base}.{e}.up_proj.weight"]]) for e in range(E)])
        return np.stack([t[f"{base}.{e}.down_proj.weight"] for e in range(E)])
    return t["lm_head.weight" if lg == "text.lm_head.weight" else "model." + lg[len("text."):]]


VARIANTS = {"fp8": {}, "int8": {}, "int4": {}, "int8-channel": dict(group=None),
            "int4-sym": dict(asymmetric=False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch, moe_inter", [("Qwen3_5ForCausalLM", 40),
                                             ("Qwen3_5MoeForCausalLM", 40),
                                             ("Qwen3_5MoeForCausalLM", 128)])
def test_quantize_converts_the_projections_only(tmp_path, variant, arch, moe_inter):
    ckpt = write_checkpoint(tmp_path / "ckpt", arch, dict(BIG, moe_intermediate_size=moe_inter),
                            sharded=True)
    fmt = variant.split("-")[0]
    out = convert_checkpoint(ckpt.path, tmp_path / "q.ninfer", progress=False,
                             recipe=Quantize(fmt, **VARIANTS[variant]))
    with Artifact(out, verify="eager") as art:
        md = art.manifest["metadata"]
        assert md["recipe"] == f"quantize-{fmt}" and md["quantization"]["format"] == fmt
        assert md["quantization"]["block"] == ([128, 128] if fmt == "fp8" else
                                               [1, None if variant == "int8-channel" else 128])
        assert md["quantization"]["asymmetric"] == (variant == "int4")
        uses = {u["binding"]: u["activation"] for u in art.uses}
        n_quant = 0
        for lg, b in art.manifest["bindings"].items():
            if not lg.startswith("text."):
                continue
            # the leaves above (not in_proj_a / in_proj_b, router, shared gate), and the
            # gate/up views of a quantized expert object
            want_quant = bool(QUANT_LEAVES.search(lg)) or ("view" in b and ".experts." in lg)
            assert art.is_quantized(lg) == want_quant, lg
            if not want_quant:
                if "view" not in b and lg != "text.lm_head.weight":
                    assert art.tensor(lg).tobytes() == _source_values(ckpt, lg).tobytes(), lg
                continue
            qt = art.quantized(lg)
            assert qt.layout == LAYOUT[fmt]
            got = dequantize(qt, lg)
            if "view" in b:                 # gate/up halves of the experts: their parent's rows
                parent = dequantize(art.quantized(b["object"]))
                I = got.shape[1]
                half = slice(0, I) if lg.endswith("gate_proj") else slice(I, 2 * I)
                assert np.array_equal(got, parent[:, half])
                continue
            n_quant += 1
            src = _source_values(ckpt, lg).astype(np.float32)
            ref = decode64(qt.layout, qt.shape, qt.block, qt.data, qt.scale, qt.zero)
            assert np.array_equal(got, ref.astype(np.float32)), f"{lg}: decoder != spec"
            step = np.abs(src).max() / {"fp8": 16, "int8": 127, "int4": 7}[fmt]
            assert np.abs(got - src).max() <= step, lg
            if lg.endswith("experts.gate_up_proj") and fmt == "fp8":   # never straddling gate/up
                assert qt.block == ((128, 128) if moe_inter % 128 == 0 else (1, 128))
            elif fmt == "fp8":
                assert qt.block == (128, 128)
            else:
                assert qt.block == (1, qt.shape[-1] if variant == "int8-channel" else 128)
                assert (qt.zero is not None) == (variant == "int4")
            assert uses[lg] == ("AllowA8" if fmt == "fp8" else "A16Only")
        assert n_quant > 0
        assert not art.is_quantized("text.lm_head.weight")
        assert not art.is_quantized("text.embed_tokens.weight")


@pytest.mark.parametrize("tied", [False, True])
def test_quantize_lm_head(tmp_path, tied):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", BIG, tied=tied)
    out = convert_checkpoint(ckpt.path, tmp_path / "q.ninfer", progress=False,
                             recipe=Quantize("int8", quantize_lm_head=True))
    with Artifact(out) as art:
        assert art.is_quantized("text.lm_head.weight")
        assert art.is_quantized("text.embed_tokens.weight") == tied     # one shared object
        head = dequantize(art.quantized("text.lm_head.weight"))
        src = ckpt.tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]
        assert np.abs(head - src.astype(np.float32)).max() <= np.abs(src.astype(np.float32)).max() / 127
        params = read_text_params(art, model_config(art).text)
        assert np.array_equal(params["lm_head"], head)
        assert (params["lm_head"] is params["embed"]) == tied          # one float32 copy


def test_lm_head_in_a_format_of_its_own(tmp_path, capsys):
    """--quantize int4 --lm-head-format int8: the body int4, the head int8 [1, 128] (what decode
    reads whole every token), said in metadata.quantization; the numpy reader decodes both."""
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", BIG)
    out = tmp_path / "q.ninfer"
    rc, _ = _cli(capsys, ckpt.path, out, "--quantize", "int4", "--lm-head-format", "int8")
    assert rc == 0
    with Artifact(out) as art:
        assert art.quantized("text.lm_head.weight").layout == "int8_block"
        assert art.quantized("text.layers.0.mlp.down_proj.weight").layout == "int4_block"
        q = art.manifest["metadata"]["quantization"]
        assert (q["format"], q["lm_head"], q["lm_head_format"]) == ("int4", True, "int8")
        head = dequantize(art.quantized("text.lm_head.weight"))
        src = ckpt.tensors["lm_head.weight"].astype(np.float32)
        assert np.abs(head - src).max() <= np.abs(src).max() / 127
        params = read_text_params(art, model_config(art).text)
        assert np.array_equal(params["lm_head"], head)


def test_numpy_backend_runs_quantized(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", BIG)
    out = convert_checkpoint(ckpt.path, tmp_path / "q.ninfer", progress=False, recipe=Quantize("int4"))
    with Artifact(out) as art:
        model = load_model(art, EngineOptions(purpose="scoring"))
        assert model.backend == "numpy"
        with pytest.raises(ArtifactError, match="is quantized \\(int4_block\\)"):
            art.tensor("text.layers.0.mlp.experts.down_proj")


# ---- FP8 releases (synthetic) ------------------------------------------------------------------

def fp8_release(path, arch, overrides, *, scale_dtype=np.float32, block=(128, 128), **kw):
    """A write_checkpoint checkpoint rewritten to the release's FP8 layout: projection weights
    (text and MTP) as float8_e4m3fn with weight_scale_inv [ceil(R/br), ceil(C/bc)]."""
    ckpt = write_checkpoint(path, arch, overrides, **kw)
    br, bc = block
    for name in [n for n in ckpt.tensors if QUANT_LEAVES.search(n) and "visual" not in n
                 and "in_proj_a" not in n and "in_proj_b" not in n]:
        w = ckpt.tensors[name].astype(np.float32)
        R, C = w.shape
        amax = np.zeros((-(-R // br), -(-C // bc)), np.float32)
        for i in range(amax.shape[0]):
            for j in range(amax.shape[1]):
                amax[i, j] = np.abs(w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]).max()
        inv = (amax / 448.0).astype(scale_dtype)
        full = np.repeat(np.repeat(inv.astype(np.float64), br, 0), bc, 1)[:R, :C]
        ckpt.tensors[name] = (w / full).astype(FP8)
        ckpt.tensors[name[:-len("weight")] + "weight_scale_inv"] = inv
    for f in path.glob("*.safetensors*"):
        f.unlink()
    from ckpt_helpers import _write_weights
    ckpt.files = []
    _write_weights(ckpt, kw.get("sharded", False), 3)
    cfg = ckpt.config
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block),
                                  "modules_to_not_convert": ["lm_head", "embed_tokens"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return ckpt


@pytest.mark.parametrize("moe_inter, scale_dtype, sharded", [
    (40, np.float32, True), (128, ml_dtypes.bfloat16, False), (136, np.float32, False)])
def test_fp8_release_import(tmp_path, moe_inter, scale_dtype, sharded):
    ckpt = fp8_release(tmp_path / "ckpt", "Qwen3_5MoeForConditionalGeneration",
                       dict(BIG, moe_intermediate_size=moe_inter), scale_dtype=scale_dtype,
                       sharded=sharded)
    out = convert_checkpoint(ckpt.path, tmp_path / "m.ninfer", progress=False)
    t = ckpt.tensors
    with Artifact(out, verify="eager") as art:
        assert art.manifest["metadata"]["recipe"] == "value-preserving"
        checked = 0
        for src, w in t.items():
            if w.dtype != FP8:
                continue
            inv = t[src[:-len("weight")] + "weight_scale_inv"].astype(np.float64)
            R, C = w.shape
            want = w.astype(np.float64) * np.repeat(np.repeat(inv, 128, 0), 128, 1)[:R, :C]
            lg = src.replace("model.language_model.", "text.")
            m = re.match(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", lg)
            if m:
                full = dequantize(art.quantized(m[1] + (".down_proj" if m[3] == "down_proj"
                                                        else ".gate_up_proj")))[int(m[2])]
                got = full[:R] if m[3] == "gate_proj" else full[R:] if m[3] == "up_proj" else full
            else:
                got = dequantize(art.quantized(lg))
            assert np.array_equal(got, want.astype(np.float32)), src
            checked += 1
        assert checked == sum(1 for w in t.values() if w.dtype == FP8)
        # the MTP layer is carried quantized too (no uses: it does not run yet)
        assert art.is_quantized("mtp.layers.0.self_attn.q_proj.weight")
        assert art.quantized("mtp.layers.0.mlp.experts.gate_up_proj").scale.dtype == scale_dtype
        assert not any(u["binding"].startswith("mtp.") for u in art.uses)
        gate_up = art.quantized("text.layers.0.mlp.experts.gate_up_proj")
        assert gate_up.block == ((128, 128) if moe_inter % 128 == 0 else (1, 128))


def test_fp8_release_dense_cli_and_numpy_model(tmp_path, capsys):
    ckpt = fp8_release(tmp_path / "ckpt", "Qwen3_5ForCausalLM", BIG, sharded=True)
    out = tmp_path / "m.ninfer"
    assert ninfer.cli.main(["convert", str(ckpt.path), str(out), "--quiet"]) == 0
    with Artifact(out) as art:
        load_model(art, EngineOptions(purpose="scoring"))
        assert art.quantized("text.layers.0.mlp.down_proj.weight").scale.shape == (2, 2)


# ---- errors ------------------------------------------------------------------------------------

def _cli(capsys, *argv):
    rc = ninfer.cli.main(["convert", *map(str, argv), "--quiet"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq", "compressed-tensors"])
def test_unsupported_source_quantization(tmp_path, capsys, method):
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    cfg = dict(ckpt.config, quantization_config={"quant_method": method, "bits": 4})
    (ckpt.path / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, ckpt.path, tmp_path / "o.ninfer")
    assert rc == 2 and err.count("\n") == 1 and f"quant_method {method!r} is not supported" in err
    assert not (tmp_path / "o.ninfer").exists()


@pytest.mark.parametrize("change, message", [
    ({"weight_block_size": None}, "per-tensor FP8"),
    ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
])
def test_unsupported_fp8_configs(tmp_path, change, message):
    ckpt = fp8_release(tmp_path / "ckpt", "Qwen3_5ForCausalLM", BIG)
    cfg = json.loads((ckpt.path / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (ckpt.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=message):
        convert_checkpoint(ckpt.path, tmp_path / "o.ninfer", progress=False)


def test_bad_fp8_tensors(tmp_path):
    name = "model.layers.0.linear_attn.out_proj.weight"
    ckpt = fp8_release(tmp_path / "a", "Qwen3_5ForCausalLM", BIG)
    for what, edit, message in [
            ("no scale", lambda t: t.pop(name[:-6] + "weight_scale_inv"),
             "float8 without weight_scale_inv"),
            ("bad scale shape", lambda t: t.update({name[:-6] + "weight_scale_inv":
                                                    np.ones((3, 3), np.float32)}),
             r"expected float32 or bfloat16 \[2, 1\]"),
            ("orphan scale", lambda t: t.update({"model.layers.0.foo.weight_scale_inv":
                                                 np.ones((1, 1), np.float32)}),
             "no weight 'model.layers.0.foo.weight'"),
            ("non-finite", lambda t: t.update({name[:-6] + "weight_scale_inv":
                                               np.full((2, 1), np.nan, np.float32)}),
             "non-finite scales")]:
        tensors = dict(ckpt.tensors)
        edit(tensors)
        bad = tmp_path / what.replace(" ", "_")
        bad.mkdir()
        (bad / "config.json").write_text((ckpt.path / "config.json").read_text())
        from safetensors.numpy import save_file
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(ConvertError, match=message):
            convert_checkpoint(bad, tmp_path / "o.ninfer", progress=False)
        assert not (tmp_path / "o.ninfer").exists()


def test_float8_without_quantization_config(tmp_path):
    ckpt = fp8_release(tmp_path / "ckpt", "Qwen3_5ForCausalLM", BIG)
    cfg = json.loads((ckpt.path / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="weight_scale_inv"):        # the scales: unexpected
        convert_checkpoint(ckpt.path, tmp_path / "o.ninfer", progress=False)
    from safetensors.numpy import save_file
    no_scales = {n: t for n, t in ckpt.tensors.items() if not n.endswith("weight_scale_inv")}
    for f in ckpt.path.glob("*.safetensors*"):
        f.unlink()
    save_file(no_scales, str(ckpt.path / "model.safetensors"))
    with pytest.raises(ConvertError, match="float8_e4m3fn but config.json has no FP8"):
        convert_checkpoint(ckpt.path, tmp_path / "o.ninfer", progress=False)


def test_quantize_an_fp8_release_and_flag_errors(tmp_path, capsys):
    ckpt = fp8_release(tmp_path / "ckpt", "Qwen3_5ForCausalLM", BIG)
    rc, err = _cli(capsys, ckpt.path, tmp_path / "o.ninfer", "--quantize", "int4")
    assert rc == 2 and "already quantized (FP8)" in err
    rc, err = _cli(capsys, ckpt.path, tmp_path / "o.ninfer", "--quantize-lm-head")
    assert rc == 2 and "--quantize-lm-head needs --quantize" in err
    rc, err = _cli(capsys, ckpt.path, tmp_path / "o.ninfer", "--lm-head-format", "int8")
    assert rc == 2 and "--lm-head-format needs --quantize" in err
    with pytest.raises(ConvertError, match="expected one of fp8, int8, int4"):
        Quantize("nf4")
    with pytest.raises(ConvertError, match="--quantize-lm-head 'nf4'"):
        Quantize("int4", quantize_lm_head="nf4")


# ---- manifest rules ----------------------------------------------------------------------------

def _write_quantized(path, config, **override):
    """One fp8 parent [3, 200] with its scale, the quant fields overridable."""
    q = {"shape": [3, 200], "block": [128, 128], "scale": "w.scale"}
    q.update(override.pop("quant", {}))
    with ArtifactWriter(path, config) as w:
        w.add_object("w.scale", override.pop("scale", np.ones((1, 2), np.float32)))
        with w.begin_object("w", override.pop("dtype", FP8), override.pop("shape", (3, 200)),
                            override.pop("layout", "fp8_block"), quant=q) as sink:
            sink.write(np.zeros((3, 200), FP8))
        w.bind("text.w", "w")


@pytest.mark.parametrize("override, message", [
    ({"quant": {"scale": "nope"}}, "scale object 'nope' does not exist"),
    ({"scale": np.ones((2, 2), np.float32)}, r"must be row_major float32 / bfloat16 / float16 "
                                             r"of shape \[1, 2\]"),
    ({"quant": {"zero": "w.scale"}}, "is symmetric: it has no zero points"),
    ({"quant": {"block": [0, 128]}}, "block"),
    ({"quant": {"shape": [3, 100]}}, "stored shape"),
    ({"layout": "int4_block"}, "layout int4_block stores uint8"),
])
def test_quant_manifest_rules(tmp_path, override, message):
    from ninfer.models.qwen3_5.config import parse_hf_config
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM", frontend=False)
    config = parse_hf_config(ckpt.config)
    with pytest.raises(ArtifactError, match=message):
        _write_quantized(tmp_path / "m.ninfer", config, **override)
    assert not (tmp_path / "m.ninfer").exists()


def test_docs_decoder_reads_quantized_artifacts(tmp_path):
    """docs/artifact.md's minimal reader plus its quantized decode, run as written, equal the
    numpy backend's decoder on every quantized binding (another reader can decode them)."""
    import pathlib
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "artifact.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM", BIG)
    for fmt in ("fp8", "int8", "int4"):
        path = convert_checkpoint(ckpt.path, tmp_path / f"{fmt}.ninfer", progress=False,
                                  recipe=Quantize(fmt))
        ns = {"path": str(path)}
        for block in blocks:
            exec(compile(block, "docs/artifact.md", "exec"), ns)
        with Artifact(path) as art:
            names = [b for b in art.binding_names() if art.is_quantized(b)]
            assert names
            for b in names:
                assert np.array_equal(ns["tensor"](b), dequantize(art.quantized(b))), (fmt, b)


@pytest.mark.parametrize("recipe", [Quantize("fp8"), Quantize("int4"), None])
def test_streaming_in_row_bands_changes_nothing(tmp_path, monkeypatch, recipe):
    """Tensors read in small row bands (whole 128-row fp8 blocks; the FP8 release's codes read
    straight from the file) give the same objects as read whole."""
    from ninfer.convert import source as source_mod
    if recipe is None:
        ckpt = fp8_release(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM",
                           dict(BIG, hidden_size=264, moe_intermediate_size=136))
    else:
        ckpt = write_checkpoint(tmp_path / "ckpt", "Qwen3_5MoeForCausalLM",
                                dict(BIG, hidden_size=264, moe_intermediate_size=136),
                                fused_experts=True)
    whole = convert_checkpoint(ckpt.path, tmp_path / "whole.ninfer", progress=False, recipe=recipe)
    monkeypatch.setattr(source_mod, "CHUNK_BYTES", 1024)
    banded = convert_checkpoint(ckpt.path, tmp_path / "banded.ninfer", progress=False,
                                recipe=recipe)
    with Artifact(whole) as a, Artifact(banded) as b:
        assert a.manifest["objects"] == b.manifest["objects"]
        assert any(o["layout"] != "row_major" for o in a.manifest["objects"])
