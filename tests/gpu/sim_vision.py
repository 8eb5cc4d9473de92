"""The device vision tower (ninfer/models/qwen3_5/cuda/vision.py) on numba-cuda's CPU simulator
(sim_model.py's fake device: kernels simulated, cuBLASLt's GEMMs as numpy products).

* kernels: each kernel of kernels/vision.py, both storage variants, on a few rows against float64
  oracles (the simulator's warp shuffles cost ~1 s a block: few rows);
* tower: the whole launch sequence against the numpy tower on a tiny random tower, an image of
  4 x 6 patches and a video of 2 frames of 4 x 4 in one call (attention within each frame),
  float32 and bfloat16, GELU tanh and erf, the attention scores in one pass and in passes of a
  few query rows of one head, and bf16's tensor-core attention (flash). The two block-reduction kernels (LayerNorm, softmax) run as numpy
  twins of their arithmetic there (simulated, one call would take minutes); the kernels part
  checks them. Prints JSON: {"kernel/<name>/<dtype>": rel. error, "tower/<act>/<dtype>/<passes>":
  rel. error against the numpy tower}.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_vision.py
"""
import json
import pathlib
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sim_model   # noqa: E402  (simulator patches and the fake device)

from ninfer.core.cuda.arena import Arena   # noqa: E402
from ninfer.models.qwen3_5 import cuda_model as cm   # noqa: E402
from ninfer.models.qwen3_5.cuda import vision as dv   # noqa: E402
from ninfer.models.qwen3_5.vision_tower import VisionConfig, VisionTower   # noqa: E402

dv.THREADS = 32          # one warp a block: the simulator runs a Python thread per GPU thread


def tower_config(act="gelu_pytorch_tanh") -> VisionConfig:
    return VisionConfig(depth=2, hidden_size=16, num_heads=2, intermediate_size=40,
                        in_channels=3, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                        num_position_embeddings=16, out_hidden_size=24, hidden_act=act)


def params(cfg, seed=5) -> dict:
    r = np.random.default_rng(seed)
    return {k: (r.standard_normal(s) / np.sqrt(s[-1] if len(s) > 1 else 4)).astype(np.float32)
            for k, s in cfg.param_shapes().items()}


def widen(a, f32):
    return a if f32 else (a.astype(np.uint32) << 16).view(np.float32)


def kernel_errors() -> dict:
    """Each kernel once per storage variant on a few rows, against float64."""
    from ninfer.core.cuda.kernels import _import_kernel_module
    from sim_model import FakeCUDAArray, cuda
    mod = _import_kernel_module("vision")
    r = np.random.default_rng(3)
    out = {}

    def run(name, f32, grid, block, *args):
        plain = name in ("vis_add_bias", "vis_pos_embed")        # (no storage variant)
        fn = cuda.jit(getattr(mod, name)(**({} if plain else {"f32": f32})))
        fn[grid, (block,)](*[FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in args])

    def err(got, want):
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))
    for f32 in (True, False):
        tag, st = ("f32" if f32 else "bf16"), (np.float32 if f32 else np.uint16)
        rows, w = 3, 40
        x = r.standard_normal((rows, w)).astype(np.float32) * 3 + 1
        g, b = r.standard_normal(w).astype(np.float32), r.standard_normal(w).astype(np.float32)
        o = np.zeros(rows * w, st)
        run("vis_layernorm", f32, (rows,), 32, o, x.ravel(), g, b, w, np.float32(1e-6))
        x64 = x.astype(np.float64)
        want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-6) \
            * g + b
        out[f"kernel/vis_layernorm/{tag}"] = err(widen(o, f32).reshape(rows, w), want)
        for act in (1, 2):
            bias = r.standard_normal(w).astype(np.float32)
            o = np.zeros(rows * w, st)
            run("vis_bias_act", f32, (rows, 2), 32, o, x.ravel(), bias, w, act)
            v = x64 + bias
            want = 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3))) \
                if act == 1 else 0.5 * v * (1 + np.vectorize(__import__("math").erf)(v / np.sqrt(2)))
            out[f"kernel/vis_bias_act{act}/{tag}"] = err(widen(o, f32).reshape(rows, w), want)
        s = r.standard_normal((rows, 50)).astype(np.float32) * 4
        o = np.zeros(rows * 50, st)
        run("vis_softmax", f32, (rows,), 32, o, s.ravel(), 50, np.float32(0.3))
        e = np.exp((s.astype(np.float64) - s.max(-1, keepdims=True)) * 0.3)
        out[f"kernel/vis_softmax/{tag}"] = err(widen(o, f32).reshape(rows, 50),
                                               e / e.sum(-1, keepdims=True))
        n, H, hd = 3, 2, 6
        qkv = r.standard_normal((n, 3, H, hd)).astype(np.float32)
        bias = r.standard_normal(3 * H * hd).astype(np.float32)
        ang = r.standard_normal((n, hd))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        q, k, v = (np.zeros(H * n * hd, st) for _ in range(3))
        run("vis_qkv_rope", f32, (n, H), 32, q, k, v, qkv.ravel(), bias, cos.ravel(),
            sin.ravel(), n, H, hd)
        full = qkv.astype(np.float64) + bias.reshape(3, H, hd)

        def rot(a):
            half = hd // 2
            rh = np.concatenate([-a[..., half:], a[..., :half]], -1)
            return a * cos[:, None] + rh * sin[:, None]
        for name, got, want in (("q", q, rot(full[:, 0])), ("k", k, rot(full[:, 1])),
                                ("v", v, full[:, 2])):
            out[f"kernel/vis_qkv_rope_{name}/{tag}"] = err(
                widen(got, f32).reshape(H, n, hd), want.transpose(1, 0, 2))
    h = r.standard_normal((rows, w)).astype(np.float32)
    bias = r.standard_normal(w).astype(np.float32)
    hh = h.ravel().copy()
    run("vis_add_bias", True, (rows, 2), 32, hh, bias, w)
    out["kernel/vis_add_bias/f32"] = err(hh.reshape(rows, w), h.astype(np.float64) + bias)
    table = r.standard_normal((9, w)).astype(np.float32)           # a 3 x 3 position table
    index = r.integers(0, 9, (rows, 4)).astype(np.int32)
    weight = r.random((rows, 4)).astype(np.float32)
    hh = h.ravel().copy()
    run("vis_pos_embed", True, (rows, 2), 32, hh, bias, table.ravel(), index.ravel(),
        weight.ravel(), w)
    want = h.astype(np.float64) + bias + (table.astype(np.float64)[index]
                                          * weight[:, :, None]).sum(1)
    out["kernel/vis_pos_embed/f32"] = err(hh.reshape(rows, w), want)
    # the tensor-core attention (bf16 only): a frame of 70 patches at row 5 of 80 (two blocks
    # of query rows, two steps of keys, both partial), head dims 8 (one k-step) and 24 (two,
    # the second half padding); the output's other rows and columns keep their poison
    for hd in (8, 24):
        H, n, start, L = 2, 80, 5, 70
        width = H * hd + 6
        q, k, v = (r.standard_normal((H, n, hd)).astype(np.float32) * (2.0 if i == 0 else 1.0)
                   for i in range(3))
        bits = [a.astype(ml_dtypes.bfloat16).view(np.uint16) for a in (q, k, v)]
        o = np.full((n, width), 0x7FC1, np.uint16)          # (a NaN pattern)
        scale = np.float32(hd ** -0.5)
        fn = cuda.jit(mod.vis_flash_attention(hd))
        fn[(2, H), (128,)](FakeCUDAArray(o.ravel()), *[FakeCUDAArray(x.ravel().view(np.uint32))
                                                       for x in bits], n, L, start, width, scale)
        q64, k64, v64 = (widen(x, False).astype(np.float64)[:, start:start + L] for x in bits)
        sc = np.einsum("hqd,hkd->hqk", q64, k64) * float(scale)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        want = np.einsum("hqk,hkd->qhd", p / p.sum(-1, keepdims=True), v64).reshape(L, H * hd)
        got = widen(o, False).reshape(n, width)
        out[f"kernel/vis_flash_attention{hd}/bf16"] = err(got[start:start + L, :H * hd], want)
        rest = np.ones((n, width), bool)
        rest[start:start + L, :H * hd] = False
        assert np.all(o.reshape(n, width)[rest] == 0x7FC1), "flash attention wrote past its rows"
    return out


class _Twin:
    """LayerNorm / softmax as numpy over the machine's memory: the kernels' own arithmetic
    (checked by kernel_errors), in milliseconds instead of minutes."""

    def __init__(self, machine, name, f32):
        self.m, self.name, self.f32 = machine, name, f32

    def launch(self, stream, grid, block, args):
        ptr = lambda a: int(getattr(a, "ptr", a))           # noqa: E731
        rows = grid[0]
        if self.name == "vis_layernorm":
            out, x, w, b, width, eps = args
            xs = self.m.typed(ptr(x), np.float32)[:rows * width].reshape(rows, width)
            mean = xs.mean(-1, keepdims=True)
            y = (xs - mean) / np.sqrt(((xs - mean) ** 2).mean(-1, keepdims=True) + eps) \
                * self.m.typed(ptr(w), np.float32)[:width] + self.m.typed(ptr(b), np.float32)[:width]
        else:
            out, s, width, scale = args
            xs = self.m.typed(ptr(s), np.float32)[:rows * width].reshape(rows, width)
            e = np.exp((xs - xs.max(-1, keepdims=True)) * np.float32(scale))
            y = e / e.sum(-1, keepdims=True)
        y = y.astype(np.float32).ravel()
        if self.f32:
            self.m.typed(ptr(out), np.float32)[:y.size] = y
        else:
            import ml_dtypes
            self.m.typed(ptr(out), np.uint16)[:y.size] = y.astype(ml_dtypes.bfloat16).view(
                np.uint16)


class _Lane(sim_model.Stream):
    """A stream that counts the handoffs it waits for."""
    waits = 0

    def wait(self, event):
        self.waits += 1


def main():
    grids = [(1, 4, 6), (2, 4, 4)]
    out = kernel_errors() if "tower" not in sys.argv[1:] else {}
    if "kernels" in sys.argv[1:]:
        print(json.dumps(out))
        return
    for act in ("gelu_pytorch_tanh", "gelu"):
        cfg = tower_config(act)
        p = params(cfg)
        n = sum(t * h * w for t, h, w in grids)
        pixels = np.random.default_rng(7).standard_normal(
            (n, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2)).astype(np.float32)
        want = VisionTower(cfg, p).encode(pixels, grids)
        for dtype in ("float32", "bfloat16"):
            f32 = dtype == "float32"
            for passes, score_bytes, flash in (("one", dv.SCORE_BYTES, False),
                                               ("rows", 8 * 40, False),
                                               ("flash", dv.SCORE_BYTES, True),
                                               ("lanes", dv.SCORE_BYTES, True)):
                if passes != "one" and act == "gelu" or flash and f32:   # (once per dtype)
                    continue
                machine = sim_model.Machine(dv.device_bytes(cfg, 64, f32, score_bytes, flash=flash)
                                           + (1 << 20))
                sim_model.install(machine)
                tower = dv.DeviceVisionTower(
                    cfg, p, arena=Arena(machine.mem.size), kernels=cm.KernelCache((9, 0)),
                    lt=cm.CublasLt(0, 0, f32=f32), stream=_Lane(), f32=f32,
                    max_patches=64, score_bytes=score_bytes, flash=flash)
                for name in ("vis_layernorm", "vis_softmax"):
                    tower._k[name] = _Twin(machine, name, f32)
                if passes == "lanes":       # share_sms: busy() flips, the lane every layer
                    share, flips = _Lane(), iter(range(1 << 20))
                    tower.share_sms(share, cm.CublasLt(0, 0, f32=f32),
                                    busy=lambda: next(flips) % 2 == 1)
                got = tower.encode(pixels, grids)
                if passes == "lanes" and not (share.waits and tower._lanes[0][0].waits):
                    raise AssertionError("share_sms: no handoff between the lanes")
                assert got.shape == want.shape, (got.shape, want.shape)
                out[f"tower/{act}/{dtype}/{passes}"] = float(np.linalg.norm(got - want)
                                                      / np.linalg.norm(want))
                tower.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
