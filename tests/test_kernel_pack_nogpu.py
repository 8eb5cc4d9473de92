"""The kernel pack (PTX of the release geometries' kernels shipped in a wheel): it serves what the
cache lacks without compiling, only for the architecture and kernel source it was built from, and
a damaged entry is compiled instead of loaded. The release geometries pass the CUDA backend's
geometry checks, so every one of them can use its pack."""
import json

import pytest

from ninfer.core.cuda import kernels as K
from ninfer.errors import DeviceError
from ninfer.models.qwen3_5.cuda.kernel_set import check_geometry, geometry_specs, spec
from ninfer.models.qwen3_5.releases import RELEASES, release_config, release_specs

_PTX = ".version 8.0\n.target sm_90\n.visible .entry k(\n)\n{\n}\n"


def _no_compile(spec, cc):
    raise AssertionError(f"compiled {spec.factory} for {cc}: the pack should have served it")


@pytest.fixture
def pack(tmp_path, monkeypatch):
    d = tmp_path / "pack"
    d.mkdir()
    monkeypatch.setattr(K, "pack_dir", lambda: d)
    return d


def test_the_pack_serves_what_the_cache_lacks_without_compiling(tmp_path, pack, monkeypatch):
    sp = spec("silu_mul")
    (pack / f"{K.pack_key(sp, (9, 0))}.ptx").write_text(_PTX)
    monkeypatch.setattr(K, "compile_spec", _no_compile)
    cache = K.KernelCache((9, 0), tmp_path / "cache")
    assert cache.missing([sp]) == [] and cache.start_precompile([sp]).wait() == 0
    assert cache.ptx(sp) == _PTX and cache.from_pack == 1 and cache.compiled == 0
    assert not (tmp_path / "cache").exists()            # served from the pack, nothing copied


def test_the_pack_never_serves_another_arch_or_another_source(tmp_path, pack, monkeypatch):
    sp = spec("silu_mul")
    (pack / f"{K.pack_key(sp, (9, 0))}.ptx").write_text(_PTX)
    assert K.KernelCache((8, 0), tmp_path).missing([sp]) == [sp]
    # a kernel source edited after the pack was built: its key moves, the old PTX is not found
    assert K.pack_key(sp, (9, 0), source=K.source_text("act") + "\n# edited") \
        != K.pack_key(sp, (9, 0))
    # and the pack's key is not the cache's (the cache's names the compiler, the pack's cannot)
    assert K.pack_key(sp, (9, 0)) != K.cache_key(sp, (9, 0))


def test_a_damaged_pack_entry_is_compiled_instead(tmp_path, pack, monkeypatch):
    sp = spec("silu_mul")
    (pack / f"{K.pack_key(sp, (9, 0))}.ptx").write_text(_PTX[:30])     # cut short
    monkeypatch.setattr(K, "compile_spec", lambda spec, cc: _PTX)
    cache = K.KernelCache((9, 0), tmp_path / "cache")
    assert cache.missing([sp]) == [sp]
    assert cache.ptx(sp) == _PTX and cache.compiled == 1 and cache.from_pack == 0


def test_build_pack_writes_every_spec_for_every_arch(tmp_path, pack, monkeypatch):
    # an installed pack already holding one of them: building compiles it all the same
    (pack / f"{K.pack_key(spec('silu_mul'), (9, 0))}.ptx").write_text(_PTX)
    compiled = []

    def fake_compile(spec, cc):
        compiled.append((spec, cc))
        return _PTX.replace("sm_90", f"sm_{cc[0]}{cc[1]}")
    monkeypatch.setattr(K, "compile_spec", fake_compile)
    specs = [spec("silu_mul"), spec("rmsnorm"), spec("silu_mul")]
    out = tmp_path / "out"
    assert K.build_pack(specs, [(9, 0), (8, 0)], out, workers=0) == 4
    assert len(compiled) == 4
    index = json.loads((out / "index.json").read_text())
    assert index["archs"] == ["sm_90", "sm_80"] and index["kernels"] == 4
    monkeypatch.setattr(K, "pack_dir", lambda: out)
    monkeypatch.setattr(K, "compile_spec", _no_compile)
    for cc in ((9, 0), (8, 0)):
        cache = K.KernelCache(cc, tmp_path / "cache")
        assert f"sm_{cc[0]}{cc[1]}" in cache.ptx(spec("rmsnorm"))
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_every_release_geometry_is_one_the_cuda_backend_runs(name):
    cfg = release_config(name)
    check_geometry(cfg)                 # raises DeviceError for a geometry cuda refuses
    assert set(geometry_specs(cfg).values()) <= set(release_specs())


def test_paged_attention_splits_a_group_only_when_it_must():
    """16 query heads per kv head at head_dim 256 (122B-A10B, 397B-A17B) need 66 KB of merge
    space, past the 48 KB a numba kernel may declare: blocks of 8 heads. Every other release keeps
    its whole group per block (the kernel and cache key they had)."""
    from ninfer.models.qwen3_5.cuda.kernel_set import STATIC_SMEM_BYTES, paged_attention_group
    assert paged_attention_group(16, 256) == 8 and 4 * 4 * 16 * 258 > STATIC_SMEM_BYTES
    assert [paged_attention_group(G, 256) for G in (1, 2, 4, 6, 8)] == [1, 2, 4, 6, 8]
    assert paged_attention_group(12, 256) == 6                  # the largest divisor that fits
    for name in RELEASES:
        params = dict(geometry_specs(release_config(name))["paged_attention"].params)
        assert params.get("GS") == (8 if name in ("122b-a10b", "397b-a17b") else None), name


def test_decode_attention_on_tensor_cores_in_every_bf16_set():
    """paged_attention_mma (head_dim a multiple of 64) is in every release's bf16 set, its whole
    group a block but where G = 16 (122B-A10B, 397B-A17B: blocks of 8 heads); in no fp32 set
    (no tensor cores in float32 mode) and no quantized-KV set (its loads read bf16 pairs)."""
    from ninfer.models.qwen3_5.cuda.kernel_set import attention_mma_group
    for name in RELEASES:
        cfg = release_config(name)
        params = dict(geometry_specs(cfg)["paged_attention_mma"].params)
        assert params.get("GS") == (8 if name in ("122b-a10b", "397b-a17b") else None), name
        assert "paged_attention_mma" not in geometry_specs(cfg, f32=True)
        assert "paged_attention_mma" not in geometry_specs(cfg, kv_dtype="fp8")
    assert [attention_mma_group(G, 256) for G in (1, 4, 6, 8, 12, 16)] == [1, 4, 6, 8, 6, 8]
    assert attention_mma_group(4, 96) == 0 and attention_mma_group(7, 64) == 7


# ---- loading modules in threads, beside the weights --------------------------------------------
class _LoadingDriver:
    """cuModuleLoadData / GetFunction / Unload, recorded, with the loading threads' overlap."""

    def __init__(self, fail=None):
        import threading
        self.loaded, self.unloaded, self.fail = [], [], fail
        self._lock, self.active, self.most = threading.Lock(), 0, 0

    def cuModuleLoadData(self, image):
        import time
        with self._lock:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(0.02)                       # the driver's JIT, long enough to overlap
        with self._lock:
            self.active -= 1
            self.loaded.append(image)
        return (1 if self.fail and self.fail.encode() in image else 0), f"mod{len(self.loaded)}"

    def cuModuleGetFunction(self, module, name):
        return 0, f"fn:{module}"

    def cuModuleUnload(self, module):
        self.unloaded.append(module)
        return (0,)


def _fake_driver(monkeypatch, fake):
    from ninfer.core.cuda import driver as d
    monkeypatch.setattr(d, "driver", lambda: fake)

    def check(result, what=""):
        if result[0]:
            raise DeviceError(f"{what}: failed")
        return result[1] if len(result) > 1 else None
    monkeypatch.setattr(d, "check", check)


def _ptx_named(sp, cc):
    return _PTX.replace(".entry k(", f".entry {sp.factory}(")


def test_modules_load_side_by_side_once_each(tmp_path, monkeypatch):
    from ninfer.models.qwen3_5.cuda.kernel_set import KernelSet
    from ninfer.models.qwen3_5.releases import release_config
    fake = _LoadingDriver()
    _fake_driver(monkeypatch, fake)
    monkeypatch.setattr(K, "compile_spec", _ptx_named)
    cache = K.KernelCache((9, 0), tmp_path)
    ks = KernelSet(release_config("9b"), cache)
    for sp in ks.specs.values():               # cached: nothing for compiler processes
        cache.ptx(sp)
    bound = []
    loading = ks.start_loading(lambda: bound.append(1), threads=4)
    getattr(ks, "rmsnorm")                     # the caller needs one meanwhile (random fills)
    assert loading.wait() == 0
    assert fake.most > 1 and 1 <= len(bound) <= 4
    # every module loaded, each kept once: a module two threads loaded at once is unloaded
    assert len(fake.loaded) - len(fake.unloaded) == len(ks.specs)
    assert {ks.__dict__["_cache"].get(sp).name for sp in ks.specs.values()} == \
        {f"{sp.module}.{sp.factory}" for sp in ks.specs.values()}


def test_a_module_that_fails_to_load_reaches_the_caller(tmp_path, monkeypatch):
    from ninfer.models.qwen3_5.cuda.kernel_set import KernelSet
    from ninfer.models.qwen3_5.releases import release_config
    _fake_driver(monkeypatch, _LoadingDriver(fail="gdn_recurrent"))
    monkeypatch.setattr(K, "compile_spec", _ptx_named)
    cache = K.KernelCache((9, 0), tmp_path)
    ks = KernelSet(release_config("9b"), cache)
    for sp in ks.specs.values():
        cache.ptx(sp)
    loading = ks.start_loading(None, threads=3)
    with pytest.raises(DeviceError, match="cuModuleLoadData.*gdn_recurrent"):
        loading.wait()
