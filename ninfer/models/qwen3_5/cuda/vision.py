"""The vision tower on the device: the numpy tower's arithmetic (vision_tower.py, its reference)
as cuBLASLt GEMMs and the kernels of kernels/vision.py, on a stream of its own.

    pixels (fp32, cast on the device) -> GEMM patch_embed (+ bias + the position table's
    bilinear taps)                                                          h [n, D] fp32
    [LayerNorm -> GEMM qkv -> bias + 2-D rotary, head-major q k v
     -> per frame: O = softmax(q k^T) v in one tensor-core kernel (bf16: vis_flash_attention),
       or S = q k^T (batched over heads) -> softmax -> O = P v (float32, or flash=False)
     -> GEMM proj (+= h) + bias
     LayerNorm -> GEMM fc1 -> bias + GELU -> GEMM fc2 (+= h) + bias] x depth
    -> LayerNorm -> [n / m^2, m^2 D] -> GEMM fc1 -> bias + GELU (erf) -> GEMM fc2 + bias

GEMM inputs are bf16 (fp32 in a dtype="float32" model, equal to the numpy tower up to rounding
order), GEMM outputs and the residual fp32. Without the flash kernel the attention scores of a
frame of L patches take L x L per head: they are computed in passes of at most `score_bytes`
(heads together, or query rows of one head), so a 2048 x 2048 image (16,384 patches) needs no
16 GiB. The position
table's taps (four rows and weights per patch) and the rotary's cos / sin are the numpy tower's
own functions, computed on the host per image (their size is the image's, not the model's) and
copied with the pixels; the table itself stays on the device.

Buffers are fixed for `max_patches` patches (one image or video frame group at a time); a
larger input goes to the numpy tower given as `host` (correct, slow: seconds per megapixel),
or is refused (ValueError) without one. `load_device_vision` builds the tower of a CUDA model
(its arena share is `plan_bytes`, a part of the model's memory plan).
"""
from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from ....core.cuda import driver as _d
from ....errors import DeviceError
from ..vision_tower import LN_EPS, VisionConfig, VisionTower, pos_embed_taps, vision_rotary
from .kernel_set import flash_vision, vision_specs

log = logging.getLogger(__name__)
SCORE_BYTES = 256 << 20         # attention scores (fp32) and probabilities of one pass
LT_WORKSPACE = 32 << 20         # the tower's own cuBLASLt workspace (it runs beside the steps)
THREADS = 256
FA_WARPS, FA_ROWS = 4, 64       # vis_flash_attention's warps, query rows a block (kernels/vision.py)


def _gemm_weight_names(cfg: VisionConfig) -> list:
    names = ["vision.patch_embed.proj.weight", "vision.merger.linear_fc1.weight",
             "vision.merger.linear_fc2.weight"]
    for i in range(cfg.depth):
        b = f"vision.blocks.{i}."
        names += [b + "attn.qkv.weight", b + "attn.proj.weight", b + "mlp.linear_fc1.weight",
                  b + "mlp.linear_fc2.weight"]
    return names


def _buffer_shapes(cfg: VisionConfig, n: int, score_bytes: int, f32: bool) -> dict:
    """name -> (shape, dtype) of the workspace for n patches."""
    D, I, H, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
    m2 = cfg.spatial_merge_size ** 2
    pix = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    gin = np.float32 if f32 else np.uint16
    scores = max(int(score_bytes) // (4 + np.dtype(gin).itemsize), 1)
    return {"h": ((n, D), np.float32), "x": ((n, max(D, pix)), gin),
            "big": ((n, max(3 * D, I, pix)), np.float32), "act": ((n, max(I, D)), gin),
            "q": ((H, n, hd), gin), "k": ((H, n, hd), gin), "v": ((H, n, hd), gin),
            "s": ((scores,), np.float32), "p": ((scores,), gin),
            "pos_index": ((n, 4), np.int32), "pos_weight": ((n, 4), np.float32),
            "cos": ((n, hd), np.float32), "sin": ((n, hd), np.float32),
            "zeros": ((max(I, m2 * D, pix),), np.float32),
            "out": ((n // m2, cfg.out_hidden_size), np.float32)}


def _score_bytes(cfg: VisionConfig, f32: bool, flash: bool, score_bytes: int) -> int:
    """The score buffers' bytes: none (one element) where vis_flash_attention runs."""
    return 0 if flash and flash_vision(f32, cfg.head_dim) else int(score_bytes)


def device_bytes(cfg: VisionConfig, max_patches: int, f32: bool = False,
                 score_bytes: int = SCORE_BYTES, align: int = 256, flash: bool = True) -> int:
    """Device bytes of the tower's weights and workspace (an arena to carve them from)."""
    score_bytes = _score_bytes(cfg, f32, flash, score_bytes)
    wb = 4 if f32 else 2
    total = 0
    gemm = set(_gemm_weight_names(cfg))
    for name, shape in cfg.param_shapes().items():
        n = int(np.prod(shape)) * (wb if name in gemm else 4)
        total += -(-n // align) * align
    for shape, dtype in _buffer_shapes(cfg, max_patches, score_bytes, f32).values():
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        total += -(-n // align) * align
    return total


class DeviceVisionTower(VisionTower):
    """VisionTower (its encode_medium cache and its config) whose encode runs on the device.
    Given what it runs with: an arena for its weights and buffers, a kernel cache, a cuBLASLt
    handle of its own (its workspace is not shared with a model's step on another stream), the
    stream, and bind (makes the context current in the calling thread: the media encoder's)."""

    def __init__(self, cfg: VisionConfig, params: dict, *, arena, kernels, lt, stream,
                 bind=lambda: None, f32: bool = False, max_patches: int = 16384,
                 score_bytes: int = SCORE_BYTES, host: VisionTower = None,
                 flash: bool = True):
        super().__init__(cfg, {})
        self.host = host                    # the numpy tower past max_patches (or None)
        self._lanes = self._busy = self._events = None      # (share_sms)
        self.owned = ()                     # what close() releases besides the pinned buffers
        m2 = cfg.spatial_merge_size ** 2
        if max_patches < m2 or max_patches % m2:
            raise ValueError(f"max_patches {max_patches}: a positive multiple of {m2}")
        self.f32, self.lt, self.stream, self.bind = bool(f32), lt, stream, bind
        self.max_patches = int(max_patches)
        self.gin = np.float32 if f32 else np.uint16
        # flash: the attention as vis_flash_attention (bf16; the scores never leave the chip),
        # wherever it can run: on the H200 the 27B tower's 4,096 patches take 38 ms an image
        # with it, 64 with the GEMMs (docs/performance.md). float32 runs the GEMMs.
        self.flash = bool(flash) and flash_vision(self.f32, cfg.head_dim)
        score_bytes = _score_bytes(cfg, self.f32, self.flash, score_bytes)
        specs = vision_specs(self.f32, cfg.head_dim, flash=self.flash)
        self._k = {name: kernels.get(s) for name, s in specs.items()}
        bind()
        self.buf = {name: arena.take(shape, dtype, f"vision {name}") for name, (shape, dtype)
                    in _buffer_shapes(cfg, self.max_patches, score_bytes, self.f32).items()}
        self.score_elements = self.buf["s"].shape[0]
        self._side = int(round(np.sqrt(cfg.num_position_embeddings)))
        gemm = set(_gemm_weight_names(cfg))
        pix = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        inputs = self.max_patches * pix * 4 + sum(
            self.buf[k].nbytes for k in ("pos_index", "pos_weight", "cos", "sin"))
        largest = max(int(np.prod(s)) for s in cfg.param_shapes().values()) * 4
        self._staging = _d.PinnedBuffer(max(inputs, largest))   # kept: each encode's inputs
        self._out_host = _d.PinnedBuffer(self.buf["out"].nbytes)
        self.w = {}
        try:
            for name, shape in cfg.param_shapes().items():
                host = np.asarray(params[name], np.float32)
                if name in gemm:                    # [out, in]: y = x @ W^T
                    host = self._gin(host.reshape(shape[0], -1))
                self.w[name] = arena.take(host.shape, host.dtype, name)
                self._copy_in(self.w[name].ptr, host)
                self.stream.synchronize()           # (the staging bytes are the next one's)
            self._copy_in(self.buf["zeros"].ptr, np.zeros(self.buf["zeros"].shape, np.float32))
            self.stream.synchronize()
        except BaseException:
            self.close()
            raise

    # ---- host <-> device --------------------------------------------------------------------
    def _gin(self, a: np.ndarray) -> np.ndarray:
        """fp32 -> the GEMM input dtype: itself, or bf16 bits rounded to nearest even (as the
        kernels' f32_to_bf16)."""
        a = np.ascontiguousarray(a, np.float32)
        return a if self.f32 else a.astype(ml_dtypes.bfloat16).view(np.uint16)

    def _copy_in(self, dst: int, host: np.ndarray, offset: int = 0) -> int:
        """Queue host -> dst through the staging bytes at `offset`; returns the offset after
        them (the caller synchronises before those bytes are written again)."""
        raw = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        self._staging.array[offset: offset + raw.size] = raw
        _d.copy_htod_async(dst, self._staging.ptr + offset, raw.size, self.stream)
        return offset + raw.size

    def close(self) -> None:
        for name in ("_staging", "_out_host"):
            buf = getattr(self, name, None)
            if buf is not None:
                buf.free()
            setattr(self, name, None)
        owned, self.owned = self.owned, ()
        for close in owned:
            close()
        for event in self._events or ():
            event.destroy()
        self._events = None

    # ---- launches ---------------------------------------------------------------------------
    def _launch(self, name, grid, args, block=THREADS):
        self._k[name].launch(self.stream, grid, (block,), args)

    def _gemm(self, x, w, y, m, n, k, beta=0.0, **kw):
        self.lt.gemm(self.stream, x, w, y, m, n, k, beta, **kw)

    def _cols(self, width: int) -> int:
        return -(-width // THREADS)

    # ---- the tower --------------------------------------------------------------------------
    def share_sms(self, stream, lt, busy) -> None:
        """Encode on `stream` and `lt` (a share of the SMs: driver.SmStream, GEMMs sized for
        it) while busy() says the model's steps run, else on the tower's own (every SM): a
        lone image chat's TTFT gets the whole device, decoding rows beside an encode keep most
        of their speed (docs/performance.md). The lane is chosen again before each layer, and
        at most two layers are queued ahead of the device, so steps that start (or stop)
        mid-image take effect within a layer or two."""
        self._lanes = ((self.stream, self.lt), (stream, lt))
        self._busy = busy
        self._events = [_d.Event(timing=False) for _ in range(3)]  # handoff, two layers' ends

    def _lane(self, layer: int) -> None:
        """(share_sms) Wait for layer - 2 to finish, then queue what follows on the lane
        busy() asks for, after what was queued on the other."""
        if self._lanes is None:
            return
        handoff, *paced = self._events
        if layer >= 2:
            paced[layer % 2].synchronize()
        stream, lt = self._lanes[bool(self._busy())]
        if stream is not self.stream:
            handoff.record(self.stream)
            stream.wait(handoff)
            self.stream, self.lt = stream, lt

    def _layer_queued(self, layer: int) -> None:
        if self._lanes is not None:
            self._events[1 + layer % 2].record(self.stream)

    def encode(self, pixels: np.ndarray, grid_thw) -> np.ndarray:
        cfg, b, w = self.cfg, self.buf, self.w
        grid_thw = [tuple(int(v) for v in g) for g in grid_thw]
        n = sum(t * h * ww for t, h, ww in grid_thw)
        pix = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        pixels = np.asarray(pixels, np.float32)
        if pixels.shape != (n, pix):
            raise ValueError(f"pixels {list(pixels.shape)} do not match grids {grid_thw}")
        if n > self.max_patches:
            if self.host is not None:
                return self.host.encode(pixels, grid_thw)
            raise ValueError(f"{n} patches: the device tower holds at most {self.max_patches}")
        self._lane(0)
        D, H, hd, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.spatial_merge_size
        I, m2, gb = cfg.intermediate_size, m * m, np.dtype(self.gin).itemsize
        self.bind()
        # the inputs: fp32 pixels into big, cast there to the patch GEMM's [n, pix] rows at x's
        # start (x is sized for the wider of pix and D); the position taps and cos / sin as the
        # numpy tower's
        cos, sin = vision_rotary(grid_thw, m, hd, cfg.rope_theta)
        index, weight = pos_embed_taps(self._side, grid_thw, m)
        off = 0
        for dst, host in ((b["big"].ptr, pixels), (b["pos_index"].ptr, index),
                          (b["pos_weight"].ptr, weight), (b["cos"].ptr, cos), (b["sin"].ptr, sin)):
            off = self._copy_in(dst, host, off)
        self._launch("vis_bias_act", (n, self._cols(pix)), (b["x"], b["big"], b["zeros"], pix, 0))
        # patch embedding: h = pixels @ W^T + bias + pos
        self._gemm(b["x"].ptr, w["vision.patch_embed.proj.weight"].ptr, b["h"].ptr, n, D, pix)
        self._launch("vis_pos_embed", (n, self._cols(D)),
                     (b["h"], w["vision.patch_embed.proj.bias"], w["vision.pos_embed.weight"],
                      b["pos_index"], b["pos_weight"], D))
        frames = [(h * ww) for t, h, ww in grid_thw for _ in range(t)]
        for i in range(cfg.depth):
            self._lane(i)
            p = f"vision.blocks.{i}."
            self._launch("vis_layernorm", (n,), (b["x"], b["h"], w[p + "norm1.weight"],
                                                 w[p + "norm1.bias"], D, LN_EPS))
            self._gemm(b["x"].ptr, w[p + "attn.qkv.weight"].ptr, b["big"].ptr, n, 3 * D, D)
            self._launch("vis_qkv_rope", (n, H), (b["q"], b["k"], b["v"], b["big"],
                                                  w[p + "attn.qkv.bias"], b["cos"], b["sin"],
                                                  n, H, hd), block=max(32, -(-hd // 32) * 32))
            self._attention(frames, n, gb)          # -> O [n, D] in act
            self._gemm(b["act"].ptr, w[p + "attn.proj.weight"].ptr, b["h"].ptr, n, D, D, 1.0)
            self._launch("vis_add_bias", (n, self._cols(D)), (b["h"], w[p + "attn.proj.bias"], D))
            self._launch("vis_layernorm", (n,), (b["x"], b["h"], w[p + "norm2.weight"],
                                                 w[p + "norm2.bias"], D, LN_EPS))
            self._gemm(b["x"].ptr, w[p + "mlp.linear_fc1.weight"].ptr, b["big"].ptr, n, I, D)
            act = 1 if cfg.hidden_act == "gelu_pytorch_tanh" else 2
            self._launch("vis_bias_act", (n, self._cols(I)),
                         (b["act"], b["big"], w[p + "mlp.linear_fc1.bias"], I, act))
            self._gemm(b["act"].ptr, w[p + "mlp.linear_fc2.weight"].ptr, b["h"].ptr, n, D, I, 1.0)
            self._launch("vis_add_bias", (n, self._cols(D)),
                         (b["h"], w[p + "mlp.linear_fc2.bias"], D))
            self._layer_queued(i)
        # merger: LayerNorm per patch, each merge block's m^2 patches as one row (they are
        # consecutive: the patches come in merge-block order), fc1 -> GELU (erf) -> fc2
        r, wide = n // m2, m2 * D
        self._launch("vis_layernorm", (n,), (b["x"], b["h"], w["vision.merger.norm.weight"],
                                             w["vision.merger.norm.bias"], D, LN_EPS))
        self._gemm(b["x"].ptr, w["vision.merger.linear_fc1.weight"].ptr, b["big"].ptr, r, wide,
                   wide)
        self._launch("vis_bias_act", (r, self._cols(wide)),
                     (b["act"], b["big"], w["vision.merger.linear_fc1.bias"], wide, 2))
        out_h = cfg.out_hidden_size
        self._gemm(b["act"].ptr, w["vision.merger.linear_fc2.weight"].ptr, b["out"].ptr, r,
                   out_h, wide)
        self._launch("vis_add_bias", (r, self._cols(out_h)),
                     (b["out"], w["vision.merger.linear_fc2.bias"], out_h))
        nbytes = r * out_h * 4
        _d.copy_dtoh_async(self._out_host.ptr, b["out"].ptr, nbytes, self.stream)
        self.stream.synchronize()
        return self._out_host.array[:nbytes].view(np.float32).reshape(r, out_h).copy()

    def _attention(self, frames, n: int, gb: int) -> None:
        """Softmax attention within each frame (`frames`: their patch counts, in order): O
        [n, D] into act. flash: vis_flash_attention, the scores on the chip. Else GEMMs, O in
        fp32 into big (read as rows of D), in passes whose scores fit the score buffers (every
        head at once, or query rows of one head), then cast into act."""
        cfg, b = self.cfg, self.buf
        H, hd, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        scale = float(hd ** -0.5)
        start = 0
        if self.flash:
            for L in frames:
                self._launch("vis_flash_attention", (-(-L // FA_ROWS), H),
                             (b["act"], b["q"], b["k"], b["v"], n, L, start, D, scale),
                             block=32 * FA_WARPS)
                start += L
            return
        for L in frames:
            if L * L * H <= self.score_elements:
                heads, rows = H, L
            else:
                heads, rows = 1, max(1, min(L, self.score_elements // L))
            for h0 in range(0, H, heads):
                hg = min(heads, H - h0)
                for q0 in range(0, L, rows):
                    qb = min(rows, L - q0)
                    q = b["q"].ptr + ((h0 * n + start + q0) * hd) * gb
                    k = b["k"].ptr + ((h0 * n + start) * hd) * gb
                    v = b["v"].ptr + ((h0 * n + start) * hd) * gb
                    self._gemm(q, k, b["s"].ptr, qb, L, hd, batch=hg,
                               strides=(n * hd, n * hd, qb * L))
                    self._launch("vis_softmax", (hg * qb,), (b["p"], b["s"], L, scale))
                    o = b["big"].ptr + ((start + q0) * D + h0 * hd) * 4
                    self._gemm(b["p"].ptr, v, o, qb, hd, L, w_kn=True, batch=hg,
                               strides=(n * hd, qb * L, hd), ldc=D)
            start += L
        self._launch("vis_bias_act", (n, self._cols(D)), (b["act"], b["big"], b["zeros"], D, 0))

def plan_bytes(cfg: VisionConfig, max_patches: int, f32: bool = False) -> int:
    """A CUDA model's arena share for its device tower (load_device_vision's: flash where it
    can run): weights, buffers, cuBLASLt workspace."""
    return device_bytes(cfg, max_patches, f32) + LT_WORKSPACE + 256


def load_device_vision(cfg: VisionConfig, params: dict, *, arena, kernels, bind, f32: bool,
                       max_patches: int, sm_count: int = 0, device=None,
                       busy=lambda: False) -> DeviceVisionTower:
    """The device tower of a CUDA model: its cuBLASLt handle (a workspace of its own: the
    media encoder's thread runs it beside the model's steps) and stream, both released by its
    close(); the numpy tower on the same parameters encodes images past max_patches.
    sm_count > 0 (and the model's `device`): while busy() (the model's steps run), the tower's
    kernels go to a stream of that many SMs (a green context's, driver.SmStream) and its GEMMs
    are sized for them, the other SMs left to the steps (DeviceVisionTower.share_sms); a
    driver without green contexts gets every SM always."""
    from ....core.cuda.cublaslt import CublasLt
    bind()
    streams, closes, tower = [], [], None

    def releases():                 # every stream synchronized first
        return [s.synchronize for s in streams] + closes + [s.destroy for s in streams]
    try:
        ws = arena.take((LT_WORKSPACE,), np.uint8, "vision cuBLASLt workspace")
        stream = _d.Stream()
        streams.append(stream)
        lt = CublasLt(ws.ptr, LT_WORKSPACE, f32=f32)
        closes.append(lt.close)
        share = None
        if sm_count > 0 and device is not None:
            try:
                share = _d.SmStream(device, sm_count)
                streams.append(share)
            except DeviceError as exc:
                log.warning("the vision tower takes every SM beside the steps: %s", exc)
        tower = DeviceVisionTower(cfg, params, arena=arena, kernels=kernels, lt=lt,
                                  stream=stream, bind=bind, f32=f32, max_patches=max_patches,
                                  host=VisionTower(cfg, params))
        if share is not None:
            # (encodes are one at a time, each synchronized: the lanes share the workspace)
            share_lt = CublasLt(ws.ptr, LT_WORKSPACE, f32=f32, sm_count=share.sm_count)
            closes.append(share_lt.close)
            tower.share_sms(share, share_lt, busy)
    except BaseException:
        if tower is not None:
            tower.close()           # (its pinned buffers; it owns nothing else yet)
        for release in releases():
            release()
        raise
    tower.owned = tuple(releases())
    return tower
