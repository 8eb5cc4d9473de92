"""The device vision tower (ninfer/models/qwen3_5/cuda/vision.py) in images per second, random
weights of a release tower geometry, one image per call, beside the numpy tower's time for the
smallest size (the host path it replaces):

    PYTHONPATH=.:bench python3 bench/bench_vision.py [--geometry 27b] [--sizes 448,1024,2048]

Prints a table: pixels, patches, ms per image, images/s, the GEMMs' TFLOP/s."""
import argparse
import time

import numpy as np

from ninfer.core.cuda import driver as d
from ninfer.core.cuda.arena import Arena
from ninfer.core.cuda.cublaslt import CublasLt
from ninfer.core.cuda.kernels import KernelCache
from ninfer.models.qwen3_5.cuda import vision as dv
from ninfer.models.qwen3_5.vision_tower import VisionConfig, VisionTower

# the towers of the release configurations (vision_config of each checkpoint)
GEOMETRIES = {
    "27b": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                num_position_embeddings=2304, out_hidden_size=5120),
    "9b": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
               num_position_embeddings=2304, out_hidden_size=4096),
}


def gemm_flops(cfg: VisionConfig, n: int, frames) -> float:
    D, I, m2 = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2
    per_layer = 2 * n * D * (3 * D + D + 2 * I) + sum(4 * L * L * D for L in frames)
    merger = 2 * (n // m2) * (m2 * D) * (m2 * D + cfg.out_hidden_size)
    return 2 * n * D * 1536 + cfg.depth * per_layer + merger


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="27b", choices=sorted(GEOMETRIES))
    ap.add_argument("--sizes", default="448,1024,2048")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--numpy", action="store_true", help="also time the numpy tower (448 only)")
    args = ap.parse_args()
    cfg = VisionConfig(in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       **GEOMETRIES[args.geometry])
    sizes = [int(s) for s in args.sizes.split(",")]
    r = np.random.default_rng(0)
    params = {k: (r.standard_normal(s) / np.sqrt(s[-1] if len(s) > 1 else 4)).astype(np.float32)
              for k, s in cfg.param_shapes().items()}
    f32 = args.dtype == "float32"
    max_patches = max(sizes) ** 2 // 256
    dev = d.Device(0)
    arena = Arena(dv.device_bytes(cfg, max_patches, f32) + (64 << 20))
    ws = arena.take((32 << 20,), np.uint8, "cuBLASLt workspace")
    lt = CublasLt(ws.ptr, 32 << 20, f32=f32)
    t0 = time.perf_counter()
    tower = dv.DeviceVisionTower(cfg, params, arena=arena, kernels=KernelCache(dev.cc), lt=lt,
                                 stream=dev.stream, f32=f32, max_patches=max_patches)
    print(f"{args.geometry} tower ({args.dtype}): set up in {time.perf_counter() - t0:.1f} s "
          f"(kernels, weights)")
    print("| pixels | patches | ms / image | images/s | GEMM TFLOP/s |")
    print("|---|---|---|---|---|")
    for size in sizes:
        side = size // 16
        grid = [(1, side, side)]
        pixels = r.standard_normal((side * side, 1536)).astype(np.float32)
        tower.encode(pixels, grid)                    # warm: cuBLASLt plans
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            tower.encode(pixels, grid)
            times.append(time.perf_counter() - t)
        best = min(times)
        flops = gemm_flops(cfg, side * side, [side * side])
        print(f"| {size}x{size} | {side * side} | {1e3 * best:.1f} | {1 / best:.1f} | "
              f"{flops / best / 1e12:.0f} |", flush=True)
    if args.numpy:
        side = sizes[0] // 16
        pixels = r.standard_normal((side * side, 1536)).astype(np.float32)
        t = time.perf_counter()
        VisionTower(cfg, params).encode(pixels, [(1, side, side)])
        print(f"numpy tower, {sizes[0]}x{sizes[0]}: {time.perf_counter() - t:.1f} s")
    tower.close()
    lt.close()
    arena.close()
    dev.close()


if __name__ == "__main__":
    main()
