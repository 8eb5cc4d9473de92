"""Programmatic dependent launch (core/cuda/kernels.py): the PTX every kernel gets on sm_90+, the
switch, and the launch through cuLaunchKernelEx with the attribute, on fakes (no GPU). The GPU
suite runs every kernel this way on the H200 (docs/gpu.md)."""
import shutil
import subprocess

import pytest

from ninfer.core.cuda import kernels as K
from ninfer.models.qwen3_5.cuda.kernel_set import spec

WAIT, TRIGGER = "griddepcontrol.wait;", "griddepcontrol.launch_dependents;"


def _ptx(target="sm_90", version="8.0", entries=("a", "b")):
    body = "".join(f".visible .entry {e}(\n\t.param .u64 {e}_p0\n)\n{{\n\t.reg .b32 \t%r<4>;\n"
                   f"\tret;\n}}\n" for e in entries)
    return f".version {version}\n.target {target}\n.address_size 64\n\n{body}"


def test_every_entry_waits_then_lets_the_next_kernel_launch():
    out = K.with_grid_dependency(_ptx())
    bodies = out.split(".entry ")[1:]
    assert len(bodies) == 2
    for b in bodies:
        first = [ln.strip() for ln in b.split("{\n", 1)[1].splitlines()][:2]
        assert first == [WAIT, TRIGGER]        # the wait before anything of the kernel
    assert K.with_grid_dependency(out) == out  # once only
    assert out.replace(K.GRID_DEPENDENCY, "") == _ptx()


def test_a_kernel_that_places_its_wait_gets_it_there_and_nowhere_else():
    """kernels/ptx.grid_wait leaves GRID_WAIT_MARK (a PTX comment) where a kernel waits: that
    entry gets the two instructions in its place (its weight prefetch before them), the other
    entries at their start as before; unpatched, the mark stays a comment."""
    import pathlib
    import re
    ptx_py = pathlib.Path(K.__file__).resolve().parents[3] / "kernels" / "ptx.py"
    (mark,) = re.findall(r'^GRID_WAIT_MARK = "([^"]+)"', ptx_py.read_text(), re.M)
    assert mark == K.GRID_WAIT_MARK                 # (read as text: no numba needed)
    marked = _ptx().replace("\tret;\n}\n.visible .entry b",
                            "\tprefetch.global.L2 [%rd1];\n\t" + K.GRID_WAIT_MARK
                            + "\n\tret;\n}\n.visible .entry b", 1)
    assert marked.count(K.GRID_WAIT_MARK) == 1
    out = K.with_grid_dependency(marked)
    a, b = out.split(".entry ")[1:]
    a_lines = [ln.strip() for ln in a.split("{\n", 1)[1].splitlines()]
    assert a_lines[1:4] == ["prefetch.global.L2 [%rd1];", WAIT, TRIGGER]   # after the prefetch
    assert a.count(WAIT) == 1 and K.GRID_WAIT_MARK not in out
    assert [ln.strip() for ln in b.split("{\n", 1)[1].splitlines()][:2] == [WAIT, TRIGGER]
    assert K.with_grid_dependency(out) == out


def test_the_decode_gemv_waits_after_asking_for_its_weights(tmp_path):
    """The real decode GEMVs (kernels/gemv.py) and the MoE tail (its shared expert's rows):
    their PTX asks L2 for weight rows, then waits, and assembles for sm_90 with the wait placed
    there."""
    try:
        ptxs = [K.compile_spec(spec("gemv", M=2), (9, 0)),
                K.compile_spec(spec("gemv_norm", M=2, hidden=512), (9, 0)),
                K.compile_spec(spec("moe_down_combine", H=2048, inter=512, shared=512, K=8),
                               (9, 0))]
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    for i, ptx in enumerate(ptxs):
        assert ptx.count(K.GRID_WAIT_MARK) == 1
        out = K.with_grid_dependency(ptx)
        body = out.split(".entry ", 1)[1]
        assert body.count(WAIT) == 1
        assert 0 < body.index("prefetch.global.L2") < body.index(WAIT)
        ptxas = shutil.which("ptxas")
        if ptxas is not None:
            src = tmp_path / f"k{i}.ptx"
            src.write_text(out)
            r = subprocess.run([ptxas, "-arch=sm_90", str(src), "-o", str(tmp_path / "k.cubin")],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("target,version", [("sm_80", "8.0"), ("sm_89", "8.3"), ("sm_90", "7.7")])
def test_no_grid_dependency_where_the_ptx_cannot_hold_it(target, version):
    assert K.with_grid_dependency(_ptx(target, version)) is None


def test_no_entry_no_patch():
    assert K.with_grid_dependency(".version 8.0\n.target sm_90\n") is None
    assert K.with_grid_dependency(_ptx("sm_90a")) is not None


def test_a_real_kernel_with_the_grid_dependency_assembles_for_sm90(tmp_path):
    try:
        ptx = K.compile_spec(spec("silu_mul"), (9, 0))
    except Exception as exc:   # noqa: BLE001 - no NVVM/NVRTC here: nothing to check
        pytest.skip(f"numba-cuda cannot compile here: {exc}")
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on this machine")
    src = tmp_path / "k.ptx"
    src.write_text(K.with_grid_dependency(ptx))
    r = subprocess.run([ptxas, "-arch=sm_90", str(src), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


class _Driver:
    """cuda-python's driver as the launcher uses it: module loads and launches recorded; the
    launch-configuration classes are the real ones."""

    def __init__(self, version=13000):
        self.drv = pytest.importorskip("cuda.bindings.driver")
        self.images, self.calls, self.version = [], [], version

    def __getattr__(self, name):
        return getattr(self.drv, name)     # CUlaunchConfig, CUlaunchAttribute, ...

    def cuDriverGetVersion(self):
        return 0, self.version

    def cuModuleLoadData(self, image):
        self.images.append(image.rstrip(b"\0").decode())
        return 0, "module"

    def cuModuleGetFunction(self, module, name):
        return 0, "function"

    def cuLaunchKernel(self, *args):
        self.calls.append(("cuLaunchKernel", args))
        return (0,)

    def cuLaunchKernelEx(self, config, f, params, extra):
        self.calls.append(("cuLaunchKernelEx", (config, f, params, extra)))
        return (0,)


@pytest.fixture
def fake(monkeypatch):
    from ninfer.core.cuda import driver as d
    drv = _Driver()
    monkeypatch.setattr(d, "_drv", drv)
    monkeypatch.setenv(K.PDL_ENV, "1")
    return drv


class _Stream:
    handle = 0


def test_a_pdl_kernel_loads_waiting_and_launches_with_the_attribute(fake):
    sp = spec("silu_mul")
    k = K.Kernel.from_ptx(_ptx(entries=("k",)), sp, pdl=True)
    assert k.pdl and WAIT in fake.images[-1]
    args = [0x1000, 0x2000, 8, 0, 4][:len(sp.sig)]
    launch = k.prepare((3, 2), (128,), args)
    launch(_Stream())
    launch(_Stream())
    (n1, (cfg, fn, addr, extra)), (n2, (cfg2, *_)) = fake.calls
    assert n1 == n2 == "cuLaunchKernelEx" and cfg2 is cfg and fn == "function"
    assert addr == launch.params_addr and extra == 0
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (3, 2, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (128, 1, 1)
    assert cfg.numAttrs == 1
    attr = cfg.attrs[0]
    assert attr.id == fake.drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1


@pytest.mark.parametrize("pdl,target", [(False, "sm_90"), (True, "sm_80")])
def test_plain_launch_without_pdl_or_where_the_ptx_cannot_wait(fake, pdl, target):
    ptx = _ptx(target, entries=("k",))
    sp = spec("silu_mul")
    k = K.Kernel.from_ptx(ptx, sp, pdl=pdl)
    assert not k.pdl and fake.images[-1] == ptx
    k.launch(_Stream(), (1,), (32,), [0x1000, 0x2000, 8, 0, 4][:len(sp.sig)])
    assert [c[0] for c in fake.calls] == ["cuLaunchKernel"]


def test_pdl_only_when_asked_for_on_sm90_with_a_new_enough_driver(fake, monkeypatch):
    assert K.pdl_supported((9, 0))
    assert not K.pdl_supported((8, 9))
    fake.version = K.PDL_MIN_DRIVER - 10
    assert not K.pdl_supported((9, 0))
    fake.version = 13000
    for off in ("0", ""):
        monkeypatch.setenv(K.PDL_ENV, off)
        assert not K.pdl_supported((9, 0))
        assert not K.pdl_supported((9, 0), default=True)    # the variable wins
    monkeypatch.delenv(K.PDL_ENV)
    assert not K.pdl_supported((9, 0))          # off by default ...
    assert K.pdl_supported((9, 0), default=True)            # ... unless the model asks
    assert not K.pdl_supported((8, 9), default=True)


def test_the_cache_decides_once_and_loads_every_kernel_the_same_way(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(K, "compile_spec", lambda sp, cc: _ptx(entries=(sp.factory,)))
    cache = K.KernelCache((9, 0), tmp_path)
    assert cache.pdl is None
    a, b = cache.get(spec("silu_mul")), cache.get(spec("rmsnorm"))
    assert cache.pdl is True and a.pdl and b.pdl
    assert all(WAIT in img for img in fake.images)
    off = K.KernelCache((9, 0), tmp_path, pdl=False)
    assert not off.get(spec("silu_mul")).pdl and WAIT not in fake.images[-1]
