"""Ahead-of-time kernel cache and our own launcher.

A kernel is named by a `KernelSpec`: the module under `kernels/` that holds its numba-cuda source,
the factory there that returns the Python function (geometry baked in as compile-time constants),
the factory's parameters, and a C-like signature (`"f32*"`, `"u16*"`, `"i32"`, `"f32"`, ...).

    spec --key--> <cache>/<key>.ptx   key = sha256(source files, factory, params, signature, arch,
                                                   numba-cuda version)
         miss --> the kernel pack shipped in a release wheel: ninfer/kernels/prebuilt/<pack key>.ptx
                  (pack key: the same without the compiler version; any numba-cuda's PTX is valid)
         miss --> numba.cuda.compile_ptx(fn, sig, cc=arch)  (only place numba is imported)
         load --> cuModuleLoadData -> cuModuleGetFunction -> Kernel
    Kernel.launch(grid, block, args) packs the arguments with ctypes and calls cuLaunchKernel;
    Kernel.prepare(...) packs once and returns a Launch whose call only launches.

Programmatic dependent launch (NINFER_PDL=1 on sm_90+, `pdl_supported`): at load every entry gets two PTX
instructions first, `griddepcontrol.wait` (nothing of the kernel runs before the previous kernel
in the stream has finished and its writes are visible) then `griddepcontrol.launch_dependents`
(the next kernel may be scheduled now), and the kernel is launched with cuLaunchKernelEx and the
programmatic-stream-serialization attribute. The next kernel's blocks are then resident and
waiting when this one ends, instead of being launched after it: the launch gap between two
dependent kernels overlaps the kernel before. The model decides the default (`pdl_supported`):
on for a bf16 MoE model (its many small kernels measured 5% faster a decode step), off for the
dense ones (no faster on the H200: a graph's gap is already about a microsecond; docs/gpu.md).
Every kernel of ours waits before its first instruction, so the order of memory effects is the
plain stream's, except a kernel that places its wait itself (kernels/ptx.grid_wait: the decode
GEMV asks for its weight rows first, which nothing writes); kernels we do not build (cuBLASLt)
are launched as before.

Numba's dispatcher is never used: the cache turns numba into a compiler, and a warm cache needs no
numba import at all.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import pathlib
import re
import tempfile
import threading
from dataclasses import dataclass, field

from ...errors import DeviceError
from . import driver as _d

# The sources live in the top-level kernels/ (the design card's place for them); setuptools maps
# that folder into the package as `ninfer.kernels` (setup.py package_dir), so a wheel and an
# editable install find them the same way: importlib. A source tree run without an install
# (PYTHONPATH=.) has no `ninfer.kernels`; it reads the folder beside the package instead.
_SOURCE_TREE_KERNELS = pathlib.Path(__file__).resolve().parents[3] / "kernels"


def _kernel_package():
    """(importable package name, folder of the sources as a Traversable)."""
    try:
        import importlib.resources
        return "ninfer.kernels", importlib.resources.files("ninfer.kernels")
    except ModuleNotFoundError:
        return None, _SOURCE_TREE_KERNELS


KERNELS_DIR = _kernel_package()[1]

# C-like argument types: name -> (ctypes type, numba type name, is_pointer)
ARG_TYPES = {
    "f32*": (ctypes.c_uint64, "float32", True),
    "u16*": (ctypes.c_uint64, "uint16", True),      # bf16 storage
    "u32*": (ctypes.c_uint64, "uint32", True),      # bf16 pairs (vector loads)
    "u64*": (ctypes.c_uint64, "uint64", True),
    "u8*": (ctypes.c_uint64, "uint8", True),        # packed quantized codes
    "f64*": (ctypes.c_uint64, "float64", True),
    "i32*": (ctypes.c_uint64, "int32", True),
    "f32": (ctypes.c_float, "float32", False),
    "i32": (ctypes.c_int32, "int32", False),
    "i64": (ctypes.c_int64, "int64", False),
    "u32": (ctypes.c_uint32, "uint32", False),
}


INT_RANGES = {"i32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1), "i64": (-2**63, 2**63 - 1)}


@dataclass(frozen=True)
class KernelSpec:
    module: str                     # file kernels/<module>.py
    factory: str                    # function there returning the kernel's Python function
    sig: tuple                      # argument type names from ARG_TYPES
    params: tuple = ()              # sorted (name, value) pairs passed to the factory

    @classmethod
    def of(cls, module: str, factory: str, sig, **params) -> "KernelSpec":
        for t in sig:
            if t not in ARG_TYPES:
                raise ValueError(f"kernel {module}.{factory}: unknown argument type {t!r}")
        return cls(module, factory, tuple(sig), tuple(sorted(params.items())))


# compile_spec's options: part of the key, so changing them recompiles
COMPILE_OPTIONS = dict(opt=True, lineinfo=False)


def _toolchain_id() -> str:
    """The compiler's identity from package metadata (no numba import: a warm cache never loads
    the compiler). libnvvm itself is not in it: a different NVVM under the same numba-cuda gives
    PTX that is still valid (the driver JIT-compiles any older PTX), only maybe slower; clear the
    cache (or point NINFER_KERNEL_CACHE elsewhere) after changing the CUDA toolkit."""
    from importlib.metadata import PackageNotFoundError, version
    parts = []
    for dist in ("numba-cuda", "numba"):
        try:
            parts.append(f"{dist}={version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist}=unknown")
    return ";".join(parts) + f";{sorted(COMPILE_OPTIONS.items())}"


def source_text(module: str) -> str:
    # every kernel may import the shared helpers (common.py) and the inline-PTX intrinsics (ptx.py)
    files = [KERNELS_DIR / "common.py", KERNELS_DIR / "ptx.py", KERNELS_DIR / f"{module}.py"]
    try:
        return "\n".join(f.read_text(encoding="utf-8") for f in files)
    except OSError as exc:
        raise DeviceError(f"kernel source {module!r} not found under {KERNELS_DIR}: {exc}") from exc


def cache_key(spec: KernelSpec, cc: tuple, source: str = None, version: str = None) -> str:
    h = hashlib.sha256()
    for part in (source if source is not None else source_text(spec.module),
                 spec.module, spec.factory, repr(spec.params), ",".join(spec.sig),
                 f"sm_{cc[0]}{cc[1]}", version if version is not None else _toolchain_id()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def pack_key(spec: KernelSpec, cc: tuple, source: str = None) -> str:
    """The name of `spec`'s PTX in the kernel pack: cache_key without the compiler's identity
    (the pack was compiled elsewhere; its PTX is valid under any numba-cuda, and the driver
    JIT-compiles it for the GPU at hand)."""
    return cache_key(spec, cc, source, version="pack")


def pack_dir():
    """The kernel pack: PTX of the Qwen3.5 release geometries' kernels, in the package beside the
    sources (ninfer/kernels/prebuilt). setup.py builds it into a wheel when NINFER_KERNEL_PACK
    names architectures (docs/gpu.md); a source checkout has none unless built there."""
    return KERNELS_DIR / "prebuilt"


def pack_entry(spec: KernelSpec, cc: tuple):
    """The pack's PTX for `spec` on `cc`, or None (absent, or not one whole kernel)."""
    try:
        ptx = (pack_dir() / f"{pack_key(spec, cc)}.ptx").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return ptx if _whole_kernel(ptx) else None


def build_pack(specs, archs, out_dir, workers: int = None) -> int:
    """Compile every spec for every architecture into `out_dir` as a kernel pack (pack keys, an
    index.json naming the compiler); the number of kernels written. Compiles in parallel
    processes through a private cache, so nothing is read from or left in the user's."""
    import json
    import shutil
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = list(dict.fromkeys(specs))
    with tempfile.TemporaryDirectory(prefix="ninfer-pack-") as tmp:
        for cc in archs:
            cache = KernelCache(cc, tmp, use_pack=False)
            cache.start_precompile(specs, workers).wait()
            for sp in specs:
                shutil.copyfile(cache.dir / f"{cache_key(sp, cc)}.ptx",
                                out / f"{pack_key(sp, cc)}.ptx")
    (out / "index.json").write_text(json.dumps(
        {"toolchain": _toolchain_id(), "archs": [f"sm_{a}{b}" for a, b in archs],
         "kernels": len(specs) * len(archs)}, indent=1))
    return len(specs) * len(archs)


def default_cache_dir() -> pathlib.Path:
    """$NINFER_KERNEL_CACHE, else `kernels` in ninfer's cache folder ($NINFER_CACHE_DIR, else
    ~/.cache/ninfer: where the demo model and the tokenizer cache live too)."""
    env = os.environ.get("NINFER_KERNEL_CACHE")
    if env:
        return pathlib.Path(env)
    root = os.environ.get("NINFER_CACHE_DIR")
    if root:
        return pathlib.Path(root) / "kernels"
    return pathlib.Path(os.path.expanduser("~")) / ".cache" / "ninfer" / "kernels"


_ENTRY = re.compile(r"\.visible\s+\.entry\s+([A-Za-z0-9_$]+)\s*\(")
_ENTRY_BODY = re.compile(r"(\.entry\s[^{]*\{[ \t]*\n)")
_TARGET = re.compile(r"^\s*\.target\s+sm_(\d+)", re.M)
_VERSION = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)", re.M)
GRID_DEPENDENCY = "\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n"
GRID_WAIT_MARK = "// ninfer: grid dependency wait"     # kernels/ptx.grid_wait's PTX comment
PDL_ENV = "NINFER_PDL"
PDL_MIN_DRIVER = 12030          # stream capture of programmatic launches (CUDA 12.3)


def pdl_supported(cc: tuple, default: bool = False) -> bool:
    """Programmatic dependent launch for kernels loaded on a device of compute capability `cc`:
    asked for (NINFER_PDL=1; 0: never; unset: `default`, the model's choice, docs/gpu.md),
    sm_90+ and a driver of CUDA 12.3 or later (graph capture of such launches)."""
    asked = os.environ.get(PDL_ENV)
    if not (asked == "1" or (asked is None and default)) or tuple(cc) < (9, 0):
        return False
    version = _d.check(_d.driver().cuDriverGetVersion(), "cuDriverGetVersion")
    return int(version or 0) >= PDL_MIN_DRIVER


def with_grid_dependency(ptx: str):
    """`ptx` with GRID_DEPENDENCY first in every entry's body (module docstring), or in place of
    the entry's GRID_WAIT_MARK where the kernel placed its wait itself (kernels/ptx.grid_wait:
    weight loads issued before it overlap the kernel before); None when the PTX cannot hold it
    (a target below sm_90, a PTX ISA below 7.8). ptxas takes the instructions before the body's
    register declarations."""
    target, version = _TARGET.search(ptx), _VERSION.search(ptx)
    if not target or int(target.group(1)) < 90 or not version \
            or (int(version.group(1)), int(version.group(2))) < (7, 8):
        return None
    if "griddepcontrol.wait" in ptx:
        return ptx
    parts = _ENTRY_BODY.split(ptx)           # [before, head, body, head, body, ...]
    if len(parts) == 1:
        return None
    out = [parts[0]]
    for head, body in zip(parts[1::2], parts[2::2]):
        if GRID_WAIT_MARK in body:
            body = body.replace(GRID_WAIT_MARK, GRID_DEPENDENCY.strip())
        else:
            body = GRID_DEPENDENCY + body
        out += [head, body]
    return "".join(out)


def entry_name(ptx: str) -> str:
    names = _ENTRY.findall(ptx)
    if len(names) != 1:
        raise DeviceError(f"expected one kernel entry in the PTX, found {len(names)}")
    return names[0]


_PKG = "ninfer_kernel_sources"


def _import_kernel_module(module: str):
    """Import kernels/<module>.py: as `ninfer.kernels.<module>` when installed, else as a
    submodule of a private package over the source tree's folder (no sys.path games)."""
    import importlib
    import importlib.util
    import sys
    package = _kernel_package()[0]
    if package is not None:
        return importlib.import_module(f"{package}.{module}")
    if _PKG not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            _PKG, KERNELS_DIR / "__init__.py", submodule_search_locations=[str(KERNELS_DIR)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[_PKG] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"{_PKG}.{module}")


def compile_spec(spec: KernelSpec, cc: tuple) -> str:
    """numba-cuda -> PTX for `cc` (no GPU needed)."""
    from . import numba_shim
    cuda, types = numba_shim.import_numba_cuda()
    mod = _import_kernel_module(spec.module)
    fn = getattr(mod, spec.factory)(**dict(spec.params))
    sig = tuple(getattr(types, ARG_TYPES[t][1]) if not ARG_TYPES[t][2]
                else types.CPointer(getattr(types, ARG_TYPES[t][1])) for t in spec.sig)
    with numba_shim.target_device(cc):
        ptx, _ = cuda.compile_ptx(fn, sig, cc=cc, **COMPILE_OPTIONS)
    return ptx


def _read_entry(path: pathlib.Path):
    """A cached PTX, or None when absent or not one whole kernel (a file cut short by a crash
    or a full disk before the atomic writes; it is compiled again and replaced)."""
    try:
        ptx = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return ptx if _whole_kernel(ptx) else None


def _whole_kernel(ptx: str) -> bool:
    return len(_ENTRY.findall(ptx)) == 1 and ptx.rstrip().endswith("}")


def _write_entry(directory: pathlib.Path, key: str, ptx: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # a private temporary name: processes and threads (two models loading at once, the workers of
    # a precompile) may write the same entry; the rename is atomic, so readers see a whole file
    # or none
    fd, tmp = tempfile.mkstemp(prefix=f"{key}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ptx)
        os.replace(tmp, directory / f"{key}.ptx")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _compile_entry(spec: KernelSpec, cc: tuple, directory: str):
    """Compile `spec` into the cache (in a compile_worker process). Returns None, or the error
    as text, naming nothing: the caller knows which kernel it asked for."""
    try:
        _write_entry(pathlib.Path(directory), cache_key(spec, cc), compile_spec(spec, cc))
        return None
    except Exception as exc:  # noqa: BLE001 - reported by Precompile.wait, naming the kernel
        return f"{type(exc).__name__}: {exc}"


class Precompile:
    """Kernels compiling into the cache in other processes (KernelCache.start_precompile).

    Each process is a fresh `python -m ninfer.core.cuda.compile_worker` fed its share of the specs
    as JSON: unlike multiprocessing's spawn, it never re-imports the caller's main script (an
    Engine made at the top level of a user's script without a __main__ guard would start itself
    again), and it imports ninfer from the caller's own sys.path."""

    def __init__(self, specs: list, cache: "KernelCache"):
        self.specs, self._cache = specs, cache
        self._procs = []          # (Popen, its specs, stdout file, stderr file)

    def start(self, batches: list, cc: tuple, directory: pathlib.Path) -> None:
        import json
        import subprocess
        import sys
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for batch in batches:
            job = json.dumps({"cc": list(cc), "dir": str(directory),
                              "specs": [[sp.module, sp.factory, list(sp.sig), list(sp.params)]
                                        for sp in batch]})
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            proc = subprocess.Popen([sys.executable, "-m", "ninfer.core.cuda.compile_worker"],
                                    stdin=subprocess.PIPE, stdout=out, stderr=err, text=True,
                                    env=env)
            proc.stdin.write(job)
            proc.stdin.close()
            self._procs.append((proc, batch, out, err))

    def wait(self) -> int:
        """Block until every kernel is compiled; the number compiled. A kernel that failed to
        compile raises DeviceError naming it."""
        import json
        failed = []
        procs, self._procs = self._procs, []
        for proc, batch, out, err in procs:
            proc.wait()
            out.seek(0)
            err.seek(0)
            try:
                errors = json.loads(out.read().strip().splitlines()[-1])["errors"]
            except (IndexError, ValueError, KeyError, TypeError):
                tail = err.read()[-2000:].strip()
                errors = [[i, f"the compiler process exited {proc.returncode}: {tail}"]
                          for i in range(len(batch))]
            out.close()
            err.close()
            failed += [f"{batch[i].module}.{batch[i].factory}{dict(batch[i].params)}: {text}"
                       for i, text in errors]
        if failed:
            raise DeviceError(f"{len(failed)} kernel(s) failed to compile: " + "; ".join(failed))
        if procs:
            self._cache.compiled += len(self.specs)
        return len(self.specs)


class KernelCache:
    """Compile-once, load-once: PTX on disk, modules in this process."""

    def __init__(self, cc: tuple, cache_dir=None, use_pack: bool = True, pdl: bool = None,
                 pdl_default: bool = False):
        self.cc = tuple(cc)
        self.use_pack = use_pack    # False: building a pack (compile what the cache lacks)
        # programmatic dependent launch; None: pdl_supported(cc, pdl_default) at the first load
        self.pdl = pdl
        self.pdl_default = pdl_default
        self.dir = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
        self._loaded: dict = {}
        self._lock = threading.Lock()
        self.compiled = 0       # cache misses this process
        self.from_pack = 0      # kernels the pack served this process

    def _cached(self, spec: KernelSpec):
        """The cache's PTX for `spec`, else the pack's, else None."""
        cached = _read_entry(self.dir / f"{cache_key(spec, self.cc)}.ptx")
        if cached is None and self.use_pack:
            cached = pack_entry(spec, self.cc)
            self.from_pack += cached is not None
        return cached

    def ptx(self, spec: KernelSpec) -> str:
        cached = self._cached(spec)
        if cached is not None:
            return cached
        key = cache_key(spec, self.cc)
        ptx = compile_spec(spec, self.cc)
        self.compiled += 1
        _write_entry(self.dir, key, ptx)
        return ptx

    def missing(self, specs) -> list:
        """The specs (each once, in order) whose PTX is neither in the cache (whole) nor in the
        pack."""
        return [sp for sp in dict.fromkeys(specs)
                if _read_entry(self.dir / f"{cache_key(sp, self.cc)}.ptx") is None
                and not (self.use_pack and pack_entry(sp, self.cc) is not None)]

    def start_precompile(self, specs, workers: int = None) -> "Precompile":
        """Compile the missing ones of `specs` into the cache in `workers` processes (default:
        one per missing spec, at most one per CPU; 0: here, now, one after another). numba's
        compiler is pure Python and holds the GIL, so processes are what runs them side by
        side, and the caller (loading weights) keeps its own thread. `wait()` on the result."""
        todo = self.missing(specs)
        workers = min(len(todo), os.cpu_count() or 1) if workers is None \
            else min(workers, len(todo))
        job = Precompile(todo, self)
        if workers == 0:
            for sp in todo:
                self.ptx(sp)
        else:
            job.start([todo[i::workers] for i in range(workers)], self.cc, self.dir)
        return job

    def close(self) -> None:
        """Unload this cache's modules (after every graph that launches them is destroyed)."""
        with self._lock:
            loaded, self._loaded = list(self._loaded.values()), {}
        for k in loaded:
            _d.check(_d.driver().cuModuleUnload(k.module), f"cuModuleUnload({k.name})")

    def get(self, spec: KernelSpec) -> "Kernel":
        """The loaded kernel. Loading (the driver JIT-compiles the PTX for this GPU: ~0.2 s a
        module on a cold driver cache) runs outside the lock, so threads load different modules
        side by side; two threads loading the same one keep the first and unload the other."""
        with self._lock:
            k = self._loaded.get(spec)
        if k is not None:
            return k
        if self.pdl is None:
            self.pdl = pdl_supported(self.cc, self.pdl_default)
        k = Kernel.from_ptx(self.ptx(spec), spec, pdl=self.pdl)
        with self._lock:
            first = self._loaded.setdefault(spec, k)
        if first is not k:
            _d.check(_d.driver().cuModuleUnload(k.module), f"cuModuleUnload({k.name})")
        return first


def pack_args(sig: tuple, args) -> tuple:
    """ctypes values + the void*[] array that cuLaunchKernel reads. Returns (keepalive, address)."""
    if len(args) != len(sig):
        raise ValueError(f"kernel expects {len(sig)} arguments ({', '.join(sig)}), got {len(args)}")
    vals = []
    for t, a in zip(sig, args):
        ctype, _, is_ptr = ARG_TYPES[t]
        if is_ptr:
            a = getattr(a, "ptr", a)
            if not isinstance(a, int) or a < 0:
                raise ValueError(f"kernel argument of type {t} must be a device address, got {a!r}")
        elif t in INT_RANGES and not INT_RANGES[t][0] <= a <= INT_RANGES[t][1]:
            # ctypes would wrap it silently (an offset past 2^31 turning negative)
            raise ValueError(f"kernel argument of type {t} out of range: {a}")
        vals.append(ctype(a))
    ptrs = (ctypes.c_void_p * max(len(vals), 1))(*[ctypes.addressof(v) for v in vals])
    return (vals, ptrs), ctypes.addressof(ptrs)


@dataclass
class Launch:
    """A kernel launch with arguments packed once; calling it only launches."""
    kernel: "Kernel"
    grid: tuple
    block: tuple
    smem: int
    keep: tuple = field(repr=False)
    params_addr: int = 0
    config: object = field(default=None, repr=False)    # cuLaunchKernelEx's, built once

    def __call__(self, stream) -> None:
        if self.kernel.pdl:
            if self.config is None:
                self.config = launch_config(self.grid, self.block, self.smem)
            self.kernel._launch_ex(self.config, stream, self.params_addr)
        else:
            self.kernel._launch(self.grid, self.block, self.smem, stream, self.params_addr)


def launch_config(grid, block, smem):
    """A CUlaunchConfig with the programmatic-stream-serialization attribute (its stream is set
    at each launch)."""
    drv = _d.driver()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


class Kernel:
    def __init__(self, module, function, spec: KernelSpec, name: str, pdl: bool = False):
        self.module, self.function, self.spec, self.name = module, function, spec, name
        self.pdl = pdl              # launched programmatically (its PTX waits first)
        self._smem_limit = 48 * 1024

    @classmethod
    def from_ptx(cls, ptx: str, spec: KernelSpec, pdl: bool = False) -> "Kernel":
        drv = _d.driver()
        name = entry_name(ptx)
        if pdl:
            waiting = with_grid_dependency(ptx)
            pdl = waiting is not None
            ptx = waiting or ptx
        module = _d.check(drv.cuModuleLoadData(ptx.encode() + b"\0"),
                          f"cuModuleLoadData({spec.module}.{spec.factory})")
        fn = _d.check(drv.cuModuleGetFunction(module, name.encode()),
                      f"cuModuleGetFunction({spec.module}.{spec.factory})")
        return cls(module, fn, spec, f"{spec.module}.{spec.factory}", pdl)

    def _ensure_smem(self, smem: int) -> None:
        if smem > self._smem_limit:
            drv = _d.driver()
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _d.check(drv.cuFuncSetAttribute(self.function, attr, smem),
                     f"cuFuncSetAttribute({self.name}, smem={smem})")
            self._smem_limit = smem

    def _launch(self, grid, block, smem, stream, params_addr) -> None:
        _d.STATS.launches += 1
        _d.check(_d.driver().cuLaunchKernel(self.function, grid[0], grid[1], grid[2],
                                            block[0], block[1], block[2], smem,
                                            stream.handle, params_addr, 0),
                 f"cuLaunchKernel({self.name})")

    def _launch_ex(self, config, stream, params_addr) -> None:
        _d.STATS.launches += 1
        config.hStream = stream.handle
        _d.check(_d.driver().cuLaunchKernelEx(config, self.function, params_addr, 0),
                 f"cuLaunchKernelEx({self.name})")

    def prepare(self, grid, block, args, smem: int = 0) -> Launch:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if min(grid) < 1 or min(block) < 1:
            raise ValueError(f"{self.name}: empty launch grid={grid} block={block}")
        self._ensure_smem(smem)
        keep, addr = pack_args(self.spec.sig, args)
        return Launch(self, grid, block, smem, keep, addr)

    def launch(self, stream, grid, block, args, smem: int = 0) -> None:
        self.prepare(grid, block, args, smem)(stream)
