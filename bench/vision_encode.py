"""Vision encode time of the numpy tower (issue 18's benchmark, host side).

Both backends run the vision tower in numpy on the host (ninfer/models/qwen3_5/vision_tower.py; the CUDA
model takes its output as input embeddings), so an image's encode time is a CPU figure whatever
the GPU. This measures it for one square image at the Qwen3.5 tower shape (transformers'
Qwen3_5VisionConfig defaults: 27 blocks, hidden 1152, MLP 4304, 16 heads, patch 16, merge 2; the
merger's output width is the text model's hidden size, --out-hidden), random weights, against
the tower's FLOPs (GEMMs and attention products) at the numpy GEMM rate measured here on one
block-sized product.

    python bench/vision_encode.py --image 512 [--out-hidden 4096] [--depth 27]

Prints one JSON line: the grid, the merged tokens, GFLOP, encode seconds, achieved GFLOP/s, the
measured GEMM GFLOP/s and the encode time that rate would give.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from ninfer.models.qwen3_5.frontend.image_preprocess import VisionProcessing, process_image
from ninfer.models.qwen3_5.vision_tower import VisionConfig, VisionTower


def tower_flops(cfg: VisionConfig, n: int, frame: int) -> float:
    """Multiply-adds x 2 of one encode of n patches in frames of `frame` patches."""
    D, I, M2 = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2
    k_in = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    per_block = 2 * n * D * (3 * D + D + 2 * I) + 2 * 2 * n * frame * D      # GEMMs + QK^T, PV
    merger = 2 * (n // M2) * (D * M2) * (D * M2 + cfg.out_hidden_size)
    return float(2 * n * k_in * D + cfg.depth * per_block + merger)


def gemm_rate(m: int, k: int, n: int, repeat: int = 3) -> float:
    r = np.random.default_rng(0)
    a, b = r.standard_normal((m, k), np.float32), r.standard_normal((k, n), np.float32)
    a @ b
    t = time.perf_counter()
    for _ in range(repeat):
        a @ b
    return 2 * m * k * n * repeat / (time.perf_counter() - t) / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", type=int, default=512, help="image side in pixels (square)")
    p.add_argument("--out-hidden", type=int, default=4096, help="the text model's hidden size")
    p.add_argument("--depth", type=int, default=27)
    a = p.parse_args()
    cfg = VisionConfig(depth=a.depth, hidden_size=1152, num_heads=16, intermediate_size=4304,
                       in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       num_position_embeddings=2304, out_hidden_size=a.out_hidden)
    r = np.random.default_rng(1)
    params = {k: (0.02 * r.standard_normal(s)).astype(np.float32)
              for k, s in cfg.param_shapes().items()}
    tower = VisionTower(cfg, params)
    # Qwen3.5's preprocessor_config.json pixel range (shortest_edge 65536, longest_edge 16777216)
    proc = VisionProcessing(patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216)
    t = time.perf_counter()
    m = process_image(r.integers(0, 256, (a.image, a.image, 3), dtype=np.uint8), proc)
    t_pre = time.perf_counter() - t
    _, h, w = m.grid_thw
    t = time.perf_counter()
    out = tower.encode(m.pixels, [m.grid_thw])
    t_enc = time.perf_counter() - t
    gflop = tower_flops(cfg, h * w, h * w) / 1e9
    rate = gemm_rate(h * w, cfg.hidden_size, cfg.intermediate_size)
    print(json.dumps({"image": a.image, "grid_thw": list(m.grid_thw), "tokens": int(out.shape[0]),
                      "depth": cfg.depth, "out_hidden": cfg.out_hidden_size,
                      "preprocess_s": round(t_pre, 3), "encode_s": round(t_enc, 2),
                      "gflop": round(gflop, 1), "achieved_gflops": round(gflop / t_enc, 1),
                      "gemm_gflops": round(rate, 1), "at_gemm_rate_s": round(gflop / rate, 2),
                      "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
