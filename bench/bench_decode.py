"""Real-size decode and prefill benchmark of the CUDA backend, random bf16 weights made on the GPU.

    PYTHONPATH=. python bench/bench_decode.py [--shapes 27b,35b-a3b,9b,2b] [--out results.json]

Per shape: decode tok/s at B = 1, 2, 4, 8 and context 2K / 32K (graph replay, argmax on the device,
one sync per step as an engine needs), host time per decode step, prefill tok/s at 512 / 4096 /
16384 tokens; each against its physical limit measured in the same run:
  decode  : bytes moved per step (weights read + KV read + GDN state read/write) / copy bandwidth
  prefill : FLOPs (2 * matmul params * tokens + causal attention) / bf16 GEMM rate (cuBLASLt 8192^3)

Each shape runs in a Python process of its own (the ceilings measured once, first): on the GPU a
process's later model decodes ~1.5-2% slower than its first (H100, 2026-12-07: `--shapes 9b,9b`
in one process, 6.85 then 6.97 ms at B = 1, 7.60 then 7.71 at B = 8), so every shape after the
first read pessimistic. `--in-process` runs them one after another in this process, as before.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

from ninfer.core.cuda import driver as d
from ninfer.core.cuda.arena import Arena
from ninfer.core.cuda.cublaslt import CublasLt, algo_rows
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, TextConfig
from ninfer.models.qwen3_5.cuda import moe_route
from ninfer.models.qwen3_5.cuda_model import CudaModel
from ninfer.options import EngineOptions

from isolate import run_child


def layer_types(n, interval=4):
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n))


SHAPES = {
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                linear_num_value_heads=48),
    "35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
                    is_moe=True, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, intermediate_size=512),
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16,
               linear_num_value_heads=32),
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
               num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16,
               linear_num_value_heads=16),
}


def make_config(name) -> ModelConfig:
    kw = dict(SHAPES[name])
    kw["layer_types"] = layer_types(kw["num_hidden_layers"])
    arch = "Qwen3_5MoeForCausalLM" if kw.get("is_moe") else "Qwen3_5ForCausalLM"
    return ModelConfig(architecture=arch, text=TextConfig(**kw))


def copy_bandwidth(dev, arena, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 5 timed
    copies of `nbytes` after a warm-up; the two buffers go back to `arena`."""
    st = dev.stream
    a = arena.take((nbytes,), np.uint8, "bw src")
    b = arena.take((nbytes,), np.uint8, "bw dst")
    d.memset_d8_async(a.ptr, 1, nbytes, st)
    e0, e1 = d.Event(), d.Event()
    times = []
    for _ in range(6):
        e0.record(st)
        d.copy_dtod_async(b.ptr, a.ptr, nbytes, st)
        e1.record(st)
        e1.synchronize()
        times.append(e0.elapsed_ms(e1) / 1e3)
    arena.give(a)
    arena.give(b)
    return 2 * nbytes / float(np.median(times[1:]))


def measure_ceilings(dev):
    """Copy bandwidth (read + write bytes) and cuBLASLt bf16 GEMM rate (random data)."""
    st = dev.stream
    nbytes = 4 << 30
    arena = Arena(2 * nbytes + (8192 * 8192 * 2) * 2 + 8192 * 8192 * 4 + (64 << 20))
    try:
        from ninfer.models.qwen3_5.cuda.kernel_set import spec
        from ninfer.core.cuda.kernels import KernelCache
        fill = KernelCache(dev.cc).get(spec("random_bf16"))
        bw = copy_bandwidth(dev, arena, nbytes)
        e0, e1 = d.Event(), d.Event()
        n = 8192
        x = arena.take((n, n), np.uint16, "gemm x")
        w = arena.take((n, n), np.uint16, "gemm w")
        y = arena.take((n, n), np.float32, "gemm y")
        ws = arena.take((32 << 20,), np.uint8, "lt ws")
        for t in (x, w):
            fill.launch(st, (65535,), (256,), (t, n * n, 7, 1.0, 0.0))
        lt = CublasLt(ws.ptr, 32 << 20)
        lt.gemm(st, x.ptr, w.ptr, y.ptr, n, n, n)
        times = []
        for _ in range(8):
            e0.record(st)
            lt.gemm(st, x.ptr, w.ptr, y.ptr, n, n, n)
            e1.record(st)
            e1.synchronize()
            times.append(e0.elapsed_ms(e1) / 1e3)
        rate = 2 * n ** 3 / float(np.median(times[1:]))
    finally:
        st.synchronize()
        arena.close()
    return bw, rate


def weight_bytes(cfg: TextConfig, B: int) -> float:
    """bf16 weight bytes one decode step reads (embedding rows only; MoE: distinct experts)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    total = V * H * 2 + B * H * 2
    for kind in cfg.layer_types:
        if kind == FULL_ATTENTION:
            nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            total += (2 * nh * hd + 2 * nkv * hd) * H * 2 + H * nh * hd * 2
        else:
            total += (cfg.linear_conv_dim + 2 * cfg.linear_value_dim + 2 * cfg.linear_num_value_heads) * H * 2
        if cfg.is_moe:
            E, K, I, Is = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, \
                cfg.shared_expert_intermediate_size
            experts = min(E, B * K)
            total += (E + 3 * Is + 1) * H * 2 + experts * 3 * I * H * 2
        else:
            total += 3 * cfg.intermediate_size * H * 2
    return float(total)


def step_bytes(cfg: TextConfig, B: int, ctx: int) -> float:
    kv = B * ctx * len(cfg.attention_layer_ids) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    st = B * len(cfg.linear_layer_ids) * 2 * 4 * cfg.linear_num_value_heads * \
        cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return weight_bytes(cfg, B) + kv + st


def matmul_params(cfg: TextConfig) -> float:
    """Parameters one token multiplies in the decoder layers (MoE: the K routed experts + shared
    expert + router); the lm_head is counted separately (prefill applies it to the last token)."""
    H = cfg.hidden_size
    p = 0
    for kind in cfg.layer_types:
        if kind == FULL_ATTENTION:
            nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            p += (2 * nh * hd + 2 * nkv * hd) * H + H * nh * hd
        else:
            p += (cfg.linear_conv_dim + 2 * cfg.linear_value_dim + 2 * cfg.linear_num_value_heads) * H
        if cfg.is_moe:
            p += (cfg.num_experts + 3 * cfg.shared_expert_intermediate_size + 1) * H + \
                cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * H
        else:
            p += 3 * cfg.intermediate_size * H
    return float(p)


def prefill_flops(cfg: TextConfig, T: int) -> float:
    """Decoder GEMMs for T tokens + causal attention (QK^T and PV) + lm_head for the last token."""
    attn = 4 * (T * (T + 1) / 2) * cfg.num_attention_heads * cfg.head_dim * len(cfg.attention_layer_ids)
    return 2 * matmul_params(cfg) * T + attn + 2 * cfg.vocab_size * cfg.hidden_size


def rescore(res: dict) -> dict:
    """Recompute the prefill limits of stored results with the current FLOP count."""
    for r in res["rows"]:
        if r["kind"] == "prefill":
            cfg = make_config(r["shape"]).text
            flops = prefill_flops(cfg, r["T"])
            t = r["ms"] / 1e3
            r.update(tflops=flops / t / 1e12, limit_ms=flops / res["gemm_rate"] * 1e3,
                     ratio=flops / res["gemm_rate"] / t)
    return res


def decode_batch(B, ctx, page_size, pages_per_row, rng, V):
    tables = np.arange(B * pages_per_row, dtype=np.int32).reshape(B, pages_per_row)
    return ForwardBatch(token_ids=rng.integers(0, V, B).astype(np.int32),
                        positions=ForwardBatch.text_positions([ctx] * B, [1] * B),
                        query_start=np.arange(B + 1, dtype=np.int32),
                        context_lens=np.full(B, ctx, np.int32), block_tables=tables,
                        state_slots=np.arange(B, dtype=np.int32))


def time_prefill(model, batch, kv, state, reps=2):
    model.decode_greedy(batch, kv, state)           # warm-up (plans, modules)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.decode_greedy(batch, kv, state)
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_shape(name, bw, rate, prefill_sizes, contexts, batch_sizes, steps, log, profile=False,
                cores_upto=0, invariant=False, variants=({},), route_caps=(), own_algos=False):
    cfg_m = make_config(name)
    cfg = cfg_m.text
    page = 16
    max_ctx = max(list(contexts) + list(prefill_sizes)) + 16
    opts = EngineOptions(backend="cuda", max_concurrency=max(batch_sizes), max_context=max_ctx,
                         page_size=page, prefill_chunk=max(prefill_sizes),
                         batch_invariant=invariant)
    t0 = time.perf_counter()
    model = CudaModel(cfg_m, opts, random_seed=1234, max_tokens=max(prefill_sizes))
    model.stream.synchronize()
    log(f"[{name}] model built in {time.perf_counter() - t0:.1f}s "
        f"(arena {model.arena.capacity / 2**30:.1f} GiB)")
    pages_per_row = (max_ctx + page - 1) // page + 1
    kv = model.new_kv_pool(max(batch_sizes) * pages_per_row, page)
    state = model.new_state_pool(max(batch_sizes))
    rng = np.random.default_rng(0)
    rows = []
    ev0, ev1 = d.Event(), d.Event()
    for variant, ctx, B in [(v, c, b) for v in variants for c in contexts for b in batch_sizes]:
        # the runner's settings of this row (variants: --gemv-max-mb, --fuse-moe-tail, ...); the
        # graphs captured again under them where they change
        if any(getattr(model.runner, k) != v for k, v in variant.items()):
            for k, v in variant.items():
                setattr(model.runner, k, v)
            for g in model.graphs.take_all():
                g.destroy()
        batch = decode_batch(B, ctx, page, pages_per_row, rng, cfg.vocab_size)
        for _ in range(3):
            model.decode_greedy(batch, kv, state)
        host, gpu_ms, parts = [], [], []
        t0 = time.perf_counter()
        for _ in range(steps):
            ev0.record(model.stream)
            model.decode_greedy(batch, kv, state)
            ev1.record(model.stream)
            ev1.synchronize()
            host.append(model.last_host_us)
            parts.append(model.last_host_breakdown_us)
            gpu_ms.append(ev0.elapsed_ms(ev1))
        wall = (time.perf_counter() - t0) / steps
        limit_s = step_bytes(cfg, B, ctx) / bw
        step_s = float(np.median(gpu_ms)) / 1e3
        rows.append(dict(shape=name, kind="decode", B=B, ctx=ctx, step_ms=step_s * 1e3,
                         gemv_max_mb=model.runner.gemv_max_bytes >> 20,
                         fused_moe_tail=cfg.is_moe and model.runner.fused_tail(
                             B, model.weights["layers"][0]),
                         norms_fused=sum(model.runner.norm_fused(B, lw[k]) for lw in
                                         model.weights["layers"] for k in ("w_in", "w_rs", "w_gu")
                                         if k in lw),
                         attn_mma=bool(cfg.attention_layer_ids) and model.runner.attention_mma(),
                         wide_kernels=model.runner.wide_kernels,
                         router_fused=cfg.is_moe and model.runner.router_fused(
                             B, model.weights["layers"][0]),
                         wall_ms=wall * 1e3, tok_s=B / wall, host_us=float(np.median(host)),
                         host_parts_us=[float(x) for x in np.median(np.array(parts), 0)],
                         limit_ms=limit_s * 1e3, ratio=limit_s / step_s))
        log(json.dumps(rows[-1]))
        if profile and B == 1:
            model.options = dataclasses.replace(opts, graphs=False)   # eager, same kernels
            model.runner.profile = []
            model.decode_greedy(batch, kv, state)
            prof = model.runner.profile_summary()
            model.options = opts
            log(f"[{name}] decode B=1 ctx={ctx} time by kernel (ms, eager): " +
                json.dumps({k: round(v, 3) for k, v in sorted(prof.items(), key=lambda kv: -kv[1])}))
    for T in prefill_sizes:
        toks = rng.integers(0, cfg.vocab_size, T).astype(np.int32)
        table = np.arange(pages_per_row, dtype=np.int32).reshape(1, -1)
        batch = ForwardBatch.single(toks, 0, table, 0)
        t = time_prefill(model, batch, kv, state)
        extra = {}
        if own_algos and algo_rows(T) != T:
            # the same prefill with every GEMM on its own shape's algorithm (cuBLASLt's plans
            # past 8 rows share their power of two's by default: cublaslt.SHARED_ALGO_FROM)
            model.lt.share_algos = False
            extra["ms_own_algos"] = time_prefill(model, batch, kv, state) * 1e3
            model.lt.share_algos = True
        if T <= cores_upto:
            # the same prefill with attention on the CUDA-core kernel (the tensor-core path off)
            saved, model.attn_tc_min_tokens = model.attn_tc_min_tokens, 1 << 30
            extra["ms_cores"] = time_prefill(model, batch, kv, state) * 1e3
            model.attn_tc_min_tokens = saved
        route = getattr(model.ws, "route_dev", None)
        default_route = model.runner.moe_device_route
        routes = [False]
        if route is not None and route.enabled:
            # the MoE routing on the device (experts_routed: no sync a MoE layer; the default
            # where the route is enabled: cuBLASLt's grouped GEMM or ours, route.own) and on
            # the host (experts_grouped): `ms` is the default's, the other beside it
            model.runner.moe_device_route = not default_route
            extra["ms_host_route" if default_route else "ms_device_route"] = \
                time_prefill(model, batch, kv, state) * 1e3
            if default_route:
                extra["ms_device_route"] = t * 1e3
            model.runner.moe_device_route = True
            extra["device_route_gemm"] = "ours" if route.own else "cublaslt"
            if route.own:
                pairs = T * cfg.num_experts_per_tok
                extra["device_route_cap"] = moe_route.device_cap(pairs, cfg.num_experts,
                                                                 model.ws.grouped_rows)
                # other padded blocks (--route-caps: rows an expert forced, 0 = ours alone)
                for cap in route_caps:
                    if cfg.num_experts * cap + pairs > model.ws.grouped_rows:
                        continue            # (the workspace's rows bound the block)
                    model.runner.moe_cap = cap
                    extra[f"ms_device_route_cap{cap}"] = time_prefill(model, batch, kv,
                                                                      state) * 1e3
                model.runner.moe_cap = None
            routes.append(True)
        for on in routes if profile else ():
            model.runner.moe_device_route = on
            model.runner.profile = []
            model.decode_greedy(batch, kv, state)
            prof = model.runner.profile_summary()
            log(f"[{name}] prefill {T}{' (MoE routed on the device)' if on else ''} time by "
                "kernel (ms, events around each launch): " +
                json.dumps({k: round(v, 2) for k, v in sorted(prof.items(), key=lambda kv: -kv[1])}))
        model.runner.moe_device_route = default_route
        flops = prefill_flops(cfg, T)
        # the weights a prefill must read at least once (MoE: every expert some token routes
        # to): at small T a MoE prefill is bound by these bytes, not by its FLOPs
        read = weight_bytes(cfg, T)
        rows.append(dict(shape=name, kind="prefill", T=T, ms=t * 1e3, tok_s=T / t,
                         tflops=flops / t / 1e12, limit_ms=flops / rate * 1e3,
                         ratio=flops / rate / t, read_ms=read / bw * 1e3,
                         roof_ratio=max(flops / rate, read / bw) / t, **extra))
        log(json.dumps(rows[-1]))
    model.close()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="27b,35b-a3b,9b,2b")
    ap.add_argument("--prefill", default="512,4096,16384")
    ap.add_argument("--contexts", default="2048,32768")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel times of the B=1 decode and of every prefill size")
    ap.add_argument("--cores-upto", type=int, default=0,
                    help="also time prefills of up to this many tokens with attention on the "
                         "CUDA-core kernel (tensor-core path off)")
    ap.add_argument("--gemv-max-mb", default=None,
                    help="decode rows at each of these decode-GEMV thresholds, MB of weights "
                         "(comma-separated; runner.gemv_max_bytes; default: the model's)")
    ap.add_argument("--route-caps", default="",
                    help="MoE prefills routed on the device with our grouped GEMM: also time "
                         "these padded blocks, rows an expert (comma-separated; 0: our GEMM "
                         "alone; runner.moe_cap; the default block is moe_route.device_cap)")
    ap.add_argument("--fuse-moe-tail", default=None,
                    help="decode rows with the MoE tail in one launch for calls of up to N "
                         "tokens (N) and/or in four launches (0), comma-separated "
                         "(runner.fuse_moe_tail, fused_tail_tokens; default: the model's)")
    ap.add_argument("--fuse-norm", default=None,
                    help="decode rows with the norms in the decode GEMV's prologue where the "
                         "product takes it (1) and/or as their own kernel (0), comma-separated "
                         "(runner.fuse_norm)")
    ap.add_argument("--attn-mma", default=None,
                    help="decode rows with the attention on tensor cores (1, "
                         "kernels/attention_mma.py) and/or the CUDA-core kernel (0), "
                         "comma-separated (runner.attn_mma)")
    ap.add_argument("--fuse-router", default=None,
                    help="decode rows with the MoE top-k in the experts' gate|up GEMV's "
                         "prologue (1) and/or as its own kernel (0), comma-separated "
                         "(runner.fuse_router)")
    ap.add_argument("--wide-kernels", default=None,
                    help="decode rows with the wide elementwise kernels (1: the SwiGLU four "
                         "columns a thread, the gated norm a warp a head) and/or the narrow ones "
                         "(0), comma-separated (runner.wide_kernels)")
    ap.add_argument("--own-algos", action="store_true",
                    help="prefills of a length that is not a power of two also timed with every "
                         "GEMM on its own shape's algorithm (ms_own_algos; by default cuBLASLt "
                         "plans past 8 rows take their power of two's)")
    ap.add_argument("--table", default=None, help="print the table of a results JSON and exit")
    ap.add_argument("--in-process", dest="isolate", action="store_false",
                    help="run the shapes one after another in this process (by default each "
                         "runs in a process of its own)")
    # (a shape's own process: the ceilings measured by the parent, "bw,rate"; rows to --out)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    given = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(given)
    if args.table:
        with open(args.table) as f:
            print_table(rescore(json.load(f)))
        return 0
    log = lambda s: print(s, flush=True)   # noqa: E731
    dev = d.Device(0)
    if args.child:
        bw, rate = (float(x) for x in args.child.split(","))
    else:
        bw, rate = measure_ceilings(dev)
        log(f"device {dev.name} sm_{dev.cc[0]}{dev.cc[1]} {dev.num_sms} SMs; copy bandwidth "
            f"{bw / 1e12:.2f} TB/s; cuBLASLt bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    results = dict(device=dev.name, copy_bw=bw, gemm_rate=rate, rows=[])
    for name in args.shapes.split(","):
        if args.isolate and not args.child:
            results["rows"] += shape_in_child(name, given, bw, rate, log)
        else:
            results["rows"] += shape_here(name, bw, rate, args, log)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    if not args.child:
        print_table(results)
    return 0


def shape_here(name: str, bw: float, rate: float, args, log) -> list:
    """One shape's rows, measured in this process (an error row if it failed)."""
    ints = lambda s: [int(x) for x in s.split(",") if x]   # noqa: E731
    try:
        return bench_shape(name, bw, rate, ints(args.prefill), ints(args.contexts),
                           ints(args.batches), args.steps, log, args.profile, args.cores_upto,
                           variants=runner_variants(args), route_caps=ints(args.route_caps),
                           own_algos=args.own_algos)
    except Exception as exc:   # noqa: BLE001 - report and continue with the next shape
        log(f"[{name}] FAILED: {type(exc).__name__}: {exc}")
        return [dict(shape=name, kind="error", error=str(exc))]


def shape_in_child(name: str, given: list, bw: float, rate: float, log) -> list:
    """One shape's rows, measured by this script in a process of its own: the same arguments
    (argparse takes the last of a repeated option, so the appended ones rule), the ceilings
    measured here, its rows back through a JSON file (an error row if the process failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        rc = run_child([os.path.abspath(__file__), *given, "--shapes", name, "--out", out,
                        "--child", f"{bw!r},{rate!r}"])
        if rc == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)["rows"]
    log(f"[{name}] FAILED: its process exited with {rc}")
    return [dict(shape=name, kind="error", error=f"process exited with {rc}")]


def runner_variants(args) -> list:
    """The StepRunner settings the decode rows run under: every combination of the values
    given (--gemv-max-mb MB, --fuse-moe-tail N: the MoE tail in one launch for calls of up to N
    tokens, 0: in four; --fuse-norm 1/0; --attn-mma 1/0; --fuse-router 1/0; --wide-kernels 1/0), in
    the order given; [{}]: the model's own."""
    ints = lambda s: [int(x) for x in s.split(",") if x] if s else []   # noqa: E731
    axes = [[{"gemv_max_bytes": mb << 20} for mb in ints(args.gemv_max_mb)],
            [{"fuse_moe_tail": bool(n), **({"fused_tail_tokens": n} if n else {})}
             for n in ints(args.fuse_moe_tail)],
            [{"fuse_norm": bool(n)} for n in ints(args.fuse_norm)],
            [{"attn_mma": bool(n)} for n in ints(args.attn_mma)],
            [{"fuse_router": bool(n)} for n in ints(args.fuse_router)],
            [{"wide_kernels": bool(n)} for n in ints(args.wide_kernels)]]
    out = [{}]
    for axis in [a for a in axes if a]:
        out = [{**v, **a} for v in out for a in axis]
    return out


def print_table(res):
    print(f"\n{res['device']}: copy {res['copy_bw'] / 1e12:.2f} TB/s, GEMM {res['gemm_rate'] / 1e12:.0f} TFLOP/s")
    print("| shape | kind | B / T | ctx | tok/s | step ms | host us | limit ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if r["kind"] == "decode":
            print(f"| {r['shape']} | decode | {r['B']} | {r['ctx']} | {r['tok_s']:.1f} | "
                  f"{r['step_ms']:.2f} | {r['host_us']:.0f} | {r['limit_ms']:.2f} | {r['ratio']:.2f} |")
        elif r["kind"] == "prefill":
            print(f"| {r['shape']} | prefill | {r['T']} | 0 | {r['tok_s']:.0f} | {r['ms']:.1f} | - | "
                  f"{r['limit_ms']:.1f} | {r['ratio']:.2f} |")
        else:
            print(f"| {r['shape']} | error | {r.get('error', '')[:80]} |")
    reads = [r for r in res["rows"] if r["kind"] == "prefill" and "read_ms" in r]
    if reads:
        print("\nprefill against the larger of its limits (FLOPs at the GEMM rate, weights read "
              "once at the copy rate):")
        for r in reads:
            print(f"  {r['shape']} T={r['T']}: GEMM {r['limit_ms']:.1f} ms, weights "
                  f"{r['read_ms']:.1f} ms -> ratio {r['roof_ratio']:.2f}")
    routed = [r for r in res["rows"] if r["kind"] == "prefill" and "ms_device_route" in r]
    if routed:
        print("\nMoE prefill routed on the device (its grouped GEMM in brackets):")
        for r in routed:
            caps = {k[len("ms_device_route_cap"):]: round(v, 1) for k, v in r.items()
                    if k.startswith("ms_device_route_cap")}
            print(f"  {r['shape']} T={r['T']}: {r['ms_device_route']:.1f} ms "
                  f"({r.get('device_route_gemm', '?')}, block {r.get('device_route_cap', '-')}; "
                  f"host route: {r.get('ms_host_route', r['ms']):.1f} ms)"
                  + (f"; other blocks: {caps}" if caps else ""))
    # the same prefill under another setting, beside the default's `ms`
    for key, title, default in (
            ("ms_own_algos", "every GEMM on its own shape's algorithm (not its power of two's)",
             "shared"),
            ("ms_cores", "attention on the CUDA-core kernel (tensor-core path off)",
             "tensor cores")):
        other = [r for r in res["rows"] if r["kind"] == "prefill" and key in r]
        if other:
            print(f"\nprefill with {title}:")
            for r in other:
                print(f"  {r['shape']} T={r['T']}: {r[key]:.1f} ms ({default}: {r['ms']:.1f} ms)")

if __name__ == "__main__":
    sys.exit(main())
