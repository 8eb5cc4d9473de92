"""`python -m ninfer warmup [ARTIFACT | --releases] [--arch 90]`: compile the CUDA kernels a model
needs (or every Qwen3.5 release's) into the kernel cache ahead of its first start, no GPU needed
with --arch (a container build, a CI step). The cache is the one Engine(backend="cuda") reads:
`$NINFER_KERNEL_CACHE`, else `kernels` under `$NINFER_CACHE_DIR` or ~/.cache/ninfer. Its entries
are keyed by kernel source, geometry, architecture and compiler version (docs/gpu.md), so a
warm-up for one GPU never serves another.
"""
from __future__ import annotations

import re
import time

from .errors import DeviceError, Error


def add_warmup_parser(sub) -> None:
    w = sub.add_parser("warmup", help="compile a model's CUDA kernels into the kernel cache "
                                      "ahead of its first start (no GPU needed with --arch)")
    w.add_argument("artifact", nargs="?",
                   help="a .ninfer file (default: the built-in demo model)")
    w.add_argument("--arch", help="target compute capability: 90 (H100/H200), 89 (L4/L40), 80 "
                                  "(A100), ...; default: this machine's GPU")
    w.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the compute dtype the model will run in (each has its kernels; "
                        "default bfloat16)")
    w.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "fp8", "int8"),
                   help="the KV cache storage the model will run with (fp8 / int8 have their "
                        "own attention kernels; default bfloat16: unquantized)")
    w.add_argument("--workers", type=int, default=None, metavar="N",
                   help="compiler processes (default: one per kernel to compile, at most one "
                        "per CPU)")
    w.add_argument("--releases", action="store_true",
                   help="compile the kernels of every Qwen3.5 release geometry (0.8B ... "
                        "397B-A17B) instead of one artifact's: a machine or image that will run "
                        "any of them")
    w.add_argument("--cache-dir", help="default: $NINFER_KERNEL_CACHE, else kernels/ under "
                                       "$NINFER_CACHE_DIR or ~/.cache/ninfer")
    w.set_defaults(handler=warmup_command)


def parse_arch(text: str) -> tuple:
    """'90', 'sm_90', '9.0' -> (9, 0)."""
    m = re.fullmatch(r"(?:sm_?)?(\d)\.?(\d)", text.strip().lower())
    if m is None:
        raise Error(f"--arch {text}: expected a compute capability such as 90, sm_90 or 9.0")
    return int(m.group(1)), int(m.group(2))


def _this_gpu_arch() -> tuple:
    from .core.cuda.driver import Device
    try:
        device = Device(0)
    except (DeviceError, ImportError) as exc:
        raise Error(f"no usable GPU here ({exc}); name the target with --arch "
                    "(90 for H100/H200, 89 for L4/L40, 80 for A100)") from None
    try:
        return device.cc
    finally:
        device.close()


def warmup_command(args) -> int:
    from .artifact import Artifact
    from .commands import _artifact_or_demo
    from .models import model_config
    from .models.qwen3_5.cuda.kernel_set import KernelSet
    from .core.cuda.kernels import KernelCache
    if args.workers is not None and args.workers < 0:
        raise Error(f"--workers {args.workers}: must be >= 0 (0: compile in this process)")
    cc = parse_arch(args.arch) if args.arch else _this_gpu_arch()
    cache = KernelCache(cc, args.cache_dir)
    t0 = time.perf_counter()
    if args.releases:
        if args.artifact or args.dtype != "bfloat16" or args.kv_dtype != "bfloat16":
            raise Error("--releases: the release geometries' bfloat16 kernels; give no artifact "
                        "and no --dtype (nor --kv-dtype)")
        from .models.qwen3_5.releases import release_specs
        specs = release_specs()
        compiled = cache.start_precompile(specs, args.workers).wait()
        print(f"kernels of the Qwen3.5 releases for sm_{cc[0]}{cc[1]}: {compiled} compiled, "
              f"{len(specs) - compiled} already cached or shipped, in {cache.dir} "
              f"({time.perf_counter() - t0:.1f} s)")
        return 0
    path, _ = _artifact_or_demo(args.artifact)
    from .models.qwen3_5.cuda import qweights
    from .models.qwen3_5.cuda.weight_load import quant_plans
    with Artifact(path) as artifact:
        cfg = model_config(artifact).text
        quant = qweights.formats(quant_plans(cfg, artifact).values())    # packed weights' kernels
    kv_dtype = None if args.kv_dtype == "bfloat16" else args.kv_dtype
    kernels = KernelSet(cfg, cache, f32=args.dtype == "float32", quant=quant,
                        kv_dtype=kv_dtype)                           # refuses as cuda does
    compiled = kernels.start_precompile(args.workers).wait()
    kv = f", {kv_dtype} KV" if kv_dtype else ""
    print(f"kernels for sm_{cc[0]}{cc[1]} ({args.dtype}{kv}): {compiled} compiled, "
          f"{len(kernels.specs) - compiled} already cached or shipped, in {cache.dir} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0
