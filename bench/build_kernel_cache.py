"""Fill the AOT kernel cache (PTX, no GPU needed) for the benchmark shapes and the GPU tests.

    PYTHONPATH=. NINFER_KERNEL_CACHE=<dir> python bench/build_kernel_cache.py [--cc 9.0]
"""
import argparse
import json
import sys
import time

sys.path.insert(0, "tests/gpu")
sys.path.insert(0, "tests")


def all_specs():
    from bench_decode import SHAPES, make_config  # noqa: F401
    from ninfer.models.qwen3_5.cuda.kernel_set import geometry_specs, spec
    from tiny_model import tiny_config
    out = set()
    from fixture_utils import fixture_dir, fixture_names
    from ninfer.models.qwen3_5.config import parse_hf_config
    fixtures = [parse_hf_config(json.loads((fixture_dir(n) / "config.json").read_text())).text
                for n in fixture_names()]
    for cfg in [make_config(n).text for n in SHAPES] + \
            [tiny_config(moe=m).text for m in (False, True)] + fixtures:
        out |= set(geometry_specs(cfg).values())
    out |= {spec("random_bf16"), spec("random_f32")}
    # parametrisations of tests/gpu/test_ops_gpu.py
    out |= {spec("conv_silu", K=4, dk=32, dv=64, nk=2, nv=4), spec("conv_state_update", K=4, C=384)}
    for dk, dv in ((32, 32), (128, 128), (64, 32)):
        out.add(spec("gdn_recurrent", dk=dk, dv=dv, nk=2, nv=4))
    for hd, rot, nh, nkv, secs, inter in ((64, 16, 4, 2, (3, 3, 2), True),
                                          (256, 64, 6, 1, (11, 11, 10), True),
                                          (128, 32, 2, 2, (6, 5, 5), False)):
        out.add(spec("qk_norm_rope_kv", hd=hd, rot=rot, nh=nh, nkv=nkv, sec_t=secs[0],
                     sec_h=secs[1], sec_w=secs[2], interleaved=inter))
    for hd, G, nkv, GS in ((64, 2, 2, 2), (256, 6, 1, 6), (128, 1, 3, 1), (128, 4, 2, 4),
                           (256, 6, 2, 3), (128, 4, 1, 2)):
        out.add(spec("paged_attention", hd=hd, G=G, nkv=nkv, GS=GS))
        out.add(spec("attn_combine", hd=hd, nh=G * nkv))
    for hd, G, nkv in ((64, 2, 2), (128, 1, 3), (128, 4, 2), (20, 3, 2), (256, 6, 1), (256, 6, 4)):
        out |= {spec("q_to_bf16", hd=hd, G=G, nkv=nkv), spec("kv_gather", hd=hd, nkv=nkv),
                spec("causal_softmax", G=G), spec("causal_softmax_reg", G=G),
                spec("attn_gate_tc", hd=hd, G=G, nkv=nkv)}
    for G in (1, 2, 4, 6):
        out.add(spec("causal_softmax_reg", G=G))
    out.add(spec("conv_silu_chunk", K=4, dk=32, dv=64, nk=2, nv=4))
    for dv in (128, 256):
        out |= {spec("gated_rmsnorm4", dv=dv), spec("gated_rmsnorm4", True, dv=dv)}
    for E, K, norm in ((4, 2, True), (256, 8, True), (60, 3, False)):
        out.add(spec("router_topk", E=E, K=K, norm=norm))
    for H, I, K in ((64, 32, 2), (2048, 512, 8)):
        out |= {spec("expert_gate_up", H=H, inter=I), spec("expert_down", H=H, inter=I),
                spec("moe_combine", H=H, K=K)}
    return sorted(out, key=repr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cc", default="9.0")
    args = ap.parse_args()
    cc = tuple(int(x) for x in args.cc.split("."))
    from ninfer.core.cuda.kernels import KernelCache
    cache = KernelCache(cc)
    t0 = time.time()
    specs = all_specs()
    compiled = cache.start_precompile(specs).wait()       # one process per CPU
    print(f"{len(specs)} kernels, {compiled} compiled in {time.time() - t0:.1f}s -> {cache.dir}")


if __name__ == "__main__":
    main()
