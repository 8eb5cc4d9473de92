"""The device vision tower (ninfer/models/qwen3_5/cuda/vision.py) in images per second, random
weights of a release tower geometry, one image per call, beside the numpy tower's time for the
smallest size (the host path it replaces):

    PYTHONPATH=.:bench python3 bench/bench_vision.py [--geometry 27b] [--sizes 448,1024,2048]
    PYTHONPATH=.:bench python3 bench/bench_vision.py --engine 9b [--sizes 1024] [--direct]

Prints a table: pixels, patches, ms per image, images/s, the GEMMs' TFLOP/s. --profile: then the
GPU time of one encode per launch kind at each size (an event pair around each launch), beside
the call's wall time. --engine SHAPE: through ninfer.Engine (cuda) on a random multimodal
checkpoint of that text geometry (bench_decode.SHAPES) with the release tower: TTFT of a chat of
one image of each size + ~100 text tokens (a new image each time: no media or context cache
hit), beside the same text alone; then a B=1 greedy decode's tok/s alone and while images
encode back to back on the tower (its media encoder's thread and stream)."""
import argparse
import json
import pathlib
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # ckpt_helpers
from ninfer.core.cuda import driver as d  # noqa: E402
from ninfer.core.cuda.arena import Arena
from ninfer.core.cuda.cublaslt import CublasLt
from ninfer.core.cuda.kernels import KernelCache
from ninfer.models.qwen3_5.cuda import vision as dv
from ninfer.models.qwen3_5.vision_tower import VisionConfig, VisionTower

# the towers of the release configurations (vision_config of each checkpoint: one tower, its
# merger's output the text model's hidden size)
GEOMETRIES = {
    "27b": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                num_position_embeddings=2304, out_hidden_size=5120),
    "9b": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
               num_position_embeddings=2304, out_hidden_size=4096),
    "35b-a3b": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                    num_position_embeddings=2304, out_hidden_size=2048),
}


def gemm_flops(cfg: VisionConfig, n: int, frames) -> float:
    D, I, m2 = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2
    per_layer = 2 * n * D * (3 * D + D + 2 * I) + sum(4 * L * L * D for L in frames)
    merger = 2 * (n // m2) * (m2 * D) * (m2 * D + cfg.out_hidden_size)
    return 2 * n * D * 1536 + cfg.depth * per_layer + merger


def profile(tower, pixels, grid) -> None:
    """One encode with an event pair around each GEMM and kernel launch: GPU ms per kind."""
    events = []
    gemm, launch = tower._gemm, tower._launch

    def timed(fn, kind):
        def call(*a, **kw):
            e0, e1 = d.Event(), d.Event()
            e0.record(tower.stream)
            fn(*a, **kw)
            e1.record(tower.stream)
            events.append((kind(a, kw), e0, e1))
        return call
    tower._gemm = timed(gemm, lambda a, kw: (f"gemm n={a[4]} k={a[5]}"
                                             + (f" batch={kw['batch']}" if "batch" in kw else "")))
    tower._launch = timed(launch, lambda a, kw: a[0])
    t = time.perf_counter()
    try:
        tower.encode(pixels, grid)
    finally:
        tower._gemm, tower._launch = gemm, launch
    wall = 1e3 * (time.perf_counter() - t)
    kinds = {}
    for kind, e0, e1 in events:
        ms, calls = kinds.get(kind, (0.0, 0))
        kinds[kind] = (ms + e0.elapsed_ms(e1), calls + 1)
        e0.destroy()
        e1.destroy()
    total = sum(ms for ms, _ in kinds.values())
    print(f"\n{len(pixels)} patches: wall {wall:.1f} ms (events on), GPU {total:.1f} ms in "
          f"{len(events)} launches")
    for kind, (ms, calls) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"  {kind:32s} {ms:8.2f} ms  {calls:5d} calls  {1e3 * ms / calls:8.1f} us each")


def multimodal_artifact(shape: str, geometry: str, workdir: pathlib.Path) -> pathlib.Path:
    """A random ConditionalGeneration artifact: `shape`'s text model, the `geometry` tower, the
    tiny test tokenizer of tests/fixtures/cond_gen (its vision tokens 256..259) and the release
    image processor (patch 16, merge 2, up to 16,777,216 pixels)."""
    from bench_engine import checkpoint_plan, random_source
    from ckpt_helpers import text_tensor_shapes, vision_tensor_shapes
    from ninfer.convert.convert import convert_checkpoint
    out = workdir / f"{shape}-vl.ninfer"
    if out.exists():
        return out
    src = workdir / f"{shape}-vl-hf"
    src.mkdir(parents=True, exist_ok=True)
    text, _, _ = checkpoint_plan(shape)
    vision = dict(GEOMETRIES[geometry], in_channels=3, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, hidden_act="gelu_pytorch_tanh",
                  out_hidden_size=text["hidden_size"])
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text, "vision_config": vision, "image_token_id": 256,
              "video_token_id": 257, "vision_start_token_id": 258, "vision_end_token_id": 259,
              "tie_word_embeddings": False}
    (src / "config.json").write_text(json.dumps(config))
    fixture = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(fixture / "cond_gen" / f, src / f)
    proc = json.loads((fixture / "vision" / "preprocessor_config.json").read_text())
    proc.update(patch_size=16, size={"shortest_edge": 65536, "longest_edge": 16777216})
    (src / "preprocessor_config.json").write_text(json.dumps(proc))
    shapes = text_tensor_shapes(text, "model.language_model.")
    shapes["lm_head.weight"] = [text["vocab_size"], text["hidden_size"]]
    shapes.update(vision_tensor_shapes(vision))
    convert_checkpoint(src, out, progress=False, open_source=random_source(shape, shapes))
    shutil.rmtree(src)
    return out


def engine_figures(args) -> None:
    from ninfer.models.qwen3_5.cuda_model import CudaModel
    workdir = pathlib.Path(args.workdir)
    geometry = args.geometry if args.geometry in GEOMETRIES else "9b"
    t0 = time.perf_counter()
    path = multimodal_artifact(args.engine, geometry, workdir)
    print(f"{args.engine} + {geometry} tower: artifact in {time.perf_counter() - t0:.0f} s")
    for sms in [None if x == "auto" else int(x) for x in args.tower_sms.split(",")]:
        CudaModel.vision_sm_count = sms
        print(f"\ntower on {'every' if sms == 0 else sms or 'the default share of'} SMs"
              + (" while steps run (a green context's stream, its GEMMs sized for them)"
                 if sms != 0 else ""))
        engine_rows(path, args)


def engine_rows(path: pathlib.Path, args) -> None:
    """One Engine: the TTFT table, then B=1 decode alone and beside the tower."""
    import threading
    import ninfer
    from ninfer.api import SamplingParams
    r = np.random.default_rng(1)
    words = " ".join(f"t{int(i)}" for i in r.integers(1, 90, 100))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def chat(side):
        content = [{"type": "text", "text": words}]
        if side:
            img = r.integers(0, 256, (side, side, 3), dtype=np.uint8)
            content.insert(0, {"type": "image", "image": img})
        return [{"role": "user", "content": content}]
    t0 = time.perf_counter()
    with ninfer.Engine(path, backend="cuda", max_concurrency=2, max_context=20480) as engine:
        vision = engine._core.program.model.vision
        print(f"Engine ready in {time.perf_counter() - t0:.1f} s; tower: "
              f"{type(vision).__name__}, lanes (SMs): "
              f"{[getattr(st, 'sm_count', 'all') for st, _ in vision._lanes or [(vision.stream, 0)]]}")
        print("| image | prompt tokens | TTFT ms (best of 3) | text alone ms |")
        print("|---|---|---|---|")
        for size in [int(x) for x in args.sizes.split(",")]:
            ttft, alone, tokens = [], [], 0
            for _ in range(4):
                res = engine.generate(chat(size), one, enable_thinking=False)
                ttft.append(res.time_to_first_token)
                tokens = res.num_prompt_tokens
                alone.append(engine.generate(chat(0), one, enable_thinking=False)
                             .time_to_first_token)
            print(f"| {size}x{size} | {tokens} | {1e3 * min(ttft[1:]):.1f} | "
                  f"{1e3 * min(alone[1:]):.1f} |", flush=True)
        # decode beside the tower: the media encoder's encode, back to back, in a thread
        tower = engine._core.program.model.vision
        size = int(args.sizes.split(",")[0])
        side = size // 16
        pixels = r.standard_normal((side * side, 1536)).astype(np.float32)
        gen = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        rates = {}
        for label in ("alone", "beside the tower"):
            stop, encoded = threading.Event(), [0]

            def encode_loop():
                while not stop.is_set():
                    tower.encode(pixels, [(1, side, side)])
                    encoded[0] += 1
            if label != "alone":
                threading.Thread(target=encode_loop, daemon=True).start()
                time.sleep(0.2)
            t = time.perf_counter()
            res = engine.generate(chat(0), gen, enable_thinking=False)
            rates[label] = (len(res.token_ids) - 1) / (time.perf_counter() - t
                                                       - res.time_to_first_token)
            stop.set()
            time.sleep(0.3)
            print(f"decode B=1 {label}: {rates[label]:.1f} tok/s"
                  + (f" ({encoded[0]} images of {size}x{size} encoded meanwhile)"
                     if label != "alone" else ""), flush=True)
        print(f"decode beside the tower / alone: {rates['beside the tower'] / rates['alone']:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="27b", choices=sorted(GEOMETRIES))
    ap.add_argument("--sizes", default="448,1024,2048")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--numpy", action="store_true", help="also time the numpy tower (448 only)")
    ap.add_argument("--profile", action="store_true", help="GPU time per launch kind")
    ap.add_argument("--gemm-attention", action="store_true",
                    help="the attention as GEMMs + vis_softmax, not vis_flash_attention (bf16's "
                         "default)")
    ap.add_argument("--engine", help="a text geometry: TTFT of image chats through the Engine")
    ap.add_argument("--workdir", default="/tmp/ninfer-bench")
    ap.add_argument("--tower-sms", default="auto",
                    help="with --engine: the tower on N SMs while steps run (0: every SM "
                         "always, auto: the default share); a list measures each "
                         "(CudaModel.vision_sm_count)")
    args = ap.parse_args()
    if args.engine:
        return engine_figures(args)
    cfg = VisionConfig(in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       **GEOMETRIES[args.geometry])
    sizes = [int(s) for s in args.sizes.split(",")]
    r = np.random.default_rng(0)
    params = {k: (r.standard_normal(s) / np.sqrt(s[-1] if len(s) > 1 else 4)).astype(np.float32)
              for k, s in cfg.param_shapes().items()}
    f32 = args.dtype == "float32"
    max_patches = max(sizes) ** 2 // 256
    dev = d.Device(0)
    arena = Arena(dv.device_bytes(cfg, max_patches, f32, flash=not args.gemm_attention)
                  + (64 << 20))
    ws = arena.take((32 << 20,), np.uint8, "cuBLASLt workspace")
    lt = CublasLt(ws.ptr, 32 << 20, f32=f32)
    t0 = time.perf_counter()
    tower = dv.DeviceVisionTower(cfg, params, arena=arena, kernels=KernelCache(dev.cc), lt=lt,
                                 stream=dev.stream, f32=f32, max_patches=max_patches,
                                 flash=not args.gemm_attention)
    kind = args.dtype + (", flash" if tower.flash else ", GEMM attention")
    print(f"{args.geometry} tower ({kind}): set up in {time.perf_counter() - t0:.1f} s "
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
    if args.profile:
        for size in sizes:
            profile(tower, r.standard_normal(((size // 16) ** 2, 1536)).astype(np.float32),
                    [(1, size // 16, size // 16)])
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
