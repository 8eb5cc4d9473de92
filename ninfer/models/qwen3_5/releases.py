"""The Qwen3.5 release geometries, for the kernel pack a release wheel ships (setup.py,
NINFER_KERNEL_PACK) and `ninfer warmup --releases`: the fields of each release's text config that
choose its CUDA kernels. Values from the releases' published configurations; a field not listed
takes the family's value (TextConfig's default: head_dim 256, GDN heads of 128 x 128, conv 4,
M-RoPE (11, 11, 10) interleaved, normalised top-k). Nothing here decides how a model runs: its
artifact's config does. A checkpoint whose geometry differs only misses the pack and compiles its
kernels at first use (kernels are keyed by their exact parameters, never matched loosely).
"""
from __future__ import annotations

import time

from .config import FULL_ATTENTION, LINEAR_ATTENTION, TextConfig

RELEASES = {
    "0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16),
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
               num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16),
    "4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32),
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32),
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48),
    "35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_value_heads=32, is_moe=True,
                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512),
    "122b-a10b": dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=2, linear_num_value_heads=64, is_moe=True,
                      num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
                      shared_expert_intermediate_size=1024),
    "397b-a17b": dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                      num_key_value_heads=2, linear_num_value_heads=64, is_moe=True,
                      num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
                      shared_expert_intermediate_size=1024),
}


def release_config(name: str) -> TextConfig:
    kw = dict(RELEASES[name])
    kw["layer_types"] = tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION
                              for i in range(kw["num_hidden_layers"]))
    return TextConfig(**kw)


def runs_on_cuda(name: str) -> bool:
    """Whether the CUDA backend takes this geometry (check_geometry): every release does."""
    from ...errors import DeviceError
    from .cuda.kernel_set import check_geometry
    try:
        check_geometry(release_config(name))
    except DeviceError:
        return False
    return True


def release_specs(names=None) -> list:
    """Every bf16 kernel spec of the release geometries the CUDA backend runs (each once), with
    what speculative decoding adds (the MTP head's prologue, the verify's snapshot and
    acceptance kernels): an Engine with speculative='mtp' compiles nothing at start either."""
    from .cuda.kernel_set import geometry_specs, mtp_specs, speculation_specs
    specs = {}
    for name in names or RELEASES:
        if runs_on_cuda(name):
            cfg = release_config(name)
            for part in (geometry_specs(cfg), mtp_specs(), speculation_specs(cfg)):
                specs.update(dict.fromkeys(part.values()))
    return list(specs)


def build_release_pack(out_dir, archs: str, workers: int = None) -> tuple:
    """The kernel pack of every release geometry for `archs` ("90,89,80") in `out_dir`:
    (kernels written, seconds)."""
    from ...core.cuda.kernels import build_pack
    from ...warmup import parse_arch
    ccs = [parse_arch(a) for a in archs.split(",") if a.strip()]
    t0 = time.perf_counter()
    n = build_pack(release_specs(), ccs, out_dir, workers)
    return n, time.perf_counter() - t0
