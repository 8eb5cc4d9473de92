"""The int4 quality work of issue 24 (docs/performance.md, "int4: what was tried"): GPTQ's
row-wise clipping choice and scale refit, and the `--group-size` option, each against an
independent float64 oracle (least squares, the spec's decode restated in tests/test_quant.py)."""
import contextlib

import numpy as np
import pytest
from fixture_utils import fixture_dir
from test_quant import decode64

from ninfer.artifact import Artifact
from ninfer.convert import Quantize, gptq
from ninfer.convert.quantize import encode, encode_calibrated
from ninfer.errors import ConvertError
from ninfer.models.qwen3_5.quant import dequantize


def problem(seed, n=40, C=192, tokens=2048):
    """Weights with an outlier column and inputs with correlated, uneven channels."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, C))
    w[:, 0] *= 6.0
    x = rng.standard_normal((tokens, C)) @ (np.eye(C) + 0.3 * rng.standard_normal((C, C)))
    x[:, rng.choice(C, 3, replace=False)] *= 8.0
    return w, x


def out_err(x, w, deq):
    return float(np.linalg.norm(x @ (deq - w).T))


def calibrated(w, x, group, asym=True, **knobs):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in knobs.items():
            mp.setattr(gptq, k, v)
        stored, scale, zero = encode_calibrated("int4_block", w, x.T @ x, group, asym)
    return decode64("int4_block", (1, *w.shape), (1, group), stored, scale, zero)[0]


@pytest.mark.parametrize("group, asym", [(128, True), (64, True), (32, True), (64, False)])
def test_refinements_lower_the_output_error(group, asym):
    """The row-wise clipping choice and then the scale refit never raise the layer-output error
    ||x (w' - w)^T|| of GPTQ without them (each row keeps the better), and GPTQ beats plain
    rounding."""
    w, x = problem(group + asym)
    plain = calibrated(w, x, group, asym, JOINT_CLIP=False, REFIT=0)
    new = calibrated(w, x, group, asym)
    rtn = decode64("int4_block", (1, *w.shape), (1, group),
                   *encode("int4_block", w[None].astype(np.float32), (1, group), asym))[0]
    joint = calibrated(w, x, group, asym, REFIT=0)
    assert out_err(x, w, joint) <= out_err(x, w, plain) * (1 + 1e-9)
    assert out_err(x, w, new) <= out_err(x, w, joint) * (1 + 1e-9)
    assert out_err(x, w, new) < 0.7 * out_err(x, w, rtn)


def test_refit_scales_solve_the_least_squares_problem():
    """For fixed codes and zeros, each row's refit scales minimise ||x (w - sum_g s_g a_g)^T||:
    the same optimum as numpy's lstsq on the design matrix [x a_g^T] (up to float32 storage)."""
    w, x = problem(7, n=12, C=96)
    h = x.T @ x
    grid = gptq._Grid(4, True, 32)
    scale, zero = grid.params(w, 1.0)
    codes = np.clip(np.rint(w / grid.expand(scale, 96)) + grid.expand(zero, 96), 0, 15)
    got = gptq._refit_scales(w, h, codes, scale, zero, grid)
    a = codes - grid.expand(zero, 96)
    for r in range(len(w)):
        design = np.stack([x[:, c0:c1] @ a[r, c0:c1] for c0, c1 in grid.spans(96)], 1)
        want = np.linalg.lstsq(design, x @ w[r], rcond=None)[0]
        np.testing.assert_allclose(got[r], want, rtol=1e-6)
        assert got[r].dtype == np.float64 and np.array_equal(got[r], got[r].astype(np.float32))


# ---- --group-size --------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64])
def test_group_size_option_writes_and_decodes(tmp_path, group):
    """`convert --quantize int4 --group-size G`: metadata and every int4 binding say block
    [1, G]; the numpy reader decodes the stored codes exactly as the spec (decode64) and as
    plain rounding of the source with groups of G."""
    import ninfer.cli
    out = tmp_path / "q.ninfer"
    assert ninfer.cli.main(["convert", str(fixture_dir("dense")), str(out), "--quiet",
                            "--quantize", "int4", "--group-size", str(group)]) == 0
    ref = tmp_path / "bf16.ninfer"
    assert ninfer.cli.main(["convert", str(fixture_dir("dense")), str(ref), "--quiet"]) == 0
    with Artifact(out, verify="eager") as art, Artifact(ref) as src:
        assert art.manifest["metadata"]["quantization"]["block"] == [1, group]
        names = [n for n in art.manifest["bindings"] if art.is_quantized(n)]
        assert names
        for name in names:
            qt = art.quantized(name)
            assert qt.layout == "int4_block" and qt.block == (1, group)
            spec = decode64(qt.layout, qt.shape, qt.block, qt.data, qt.scale, qt.zero)
            got = dequantize(qt, name)
            assert np.array_equal(got, spec.astype(np.float32)), name
            w = np.asarray(src.tensor(name), np.float32)
            rtn = encode("int4_block", w.reshape(-1, *w.shape[-2:]), (1, group), True)
            assert np.array_equal(qt.data.reshape(rtn[0].shape), rtn[0]), name


def test_group_size_errors(tmp_path, capsys):
    import ninfer.cli
    src, out = str(fixture_dir("dense")), tmp_path / "o.ninfer"
    for extra, msg in ((["--quantize", "int4", "--group-size", "48"], "invalid choice: 48"),
                       (["--quantize", "fp8", "--group-size", "64"], "needs --quantize int8"),
                       (["--group-size", "64"], "needs --quantize int8")):
        with pytest.raises(SystemExit) if "48" in extra else contextlib.nullcontext():
            rc = ninfer.cli.main(["convert", src, str(out), "--quiet", *extra])
            assert rc != 0
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
        assert not out.exists()
    for bad in (48, 100, 0, "64"):
        with pytest.raises(ConvertError, match="group"):
            Quantize("int4", group=bad)
    with pytest.raises(ConvertError, match="int4 group 48"):       # an int4 head beside int8
        Quantize("int8", group=48, quantize_lm_head="int4")


def test_default_group_sizes():
    """int4 with a calibration text defaults to the measured CALIBRATED_INT4_GROUP, everything
    else to 128; an explicit group always wins."""
    from ninfer.convert import quantize
    assert quantize.CALIBRATED_INT4_GROUP % quantize.INT4_GROUP_UNIT == 0
    cases = {("int4", "text", "auto"): quantize.CALIBRATED_INT4_GROUP, ("int4", None, "auto"): 128,
             ("int8", "text", "auto"): 128, ("int4", "text", 128): 128, ("int8", None, None): None}
    for (fmt, cal, group), want in cases.items():
        recipe = Quantize(fmt, calibration=cal, group=group)
        assert recipe.group == want and recipe.describe()["block"] == [1, want], (fmt, cal, group)
