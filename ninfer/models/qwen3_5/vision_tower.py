"""The Qwen3.5 vision tower in numpy (the reference for every backend) and MRoPE positions.

Transformers' Qwen3_5VisionModel, step by step:
- patch embedding: Conv3d with kernel = stride = (temporal patch, patch, patch) on the processor's
  flattened patches, i.e. one GEMM [N, C*T*P*P] x [C*T*P*P, D] + bias;
- learned position embeddings: the square side x side table resampled to each frame's (h, w) grid
  by bilinear interpolation with align_corners=True, in the patches' merge-block order;
- 2-D rotary: head_dim/4 frequencies for the patch row and as many for the column, laid out
  [row | col | row | col] over the whole head and applied with rotate_half;
- blocks: LayerNorm -> qkv -> rotary -> softmax attention within each frame (cu_seqlens: a video's
  temporal patches attend separately) -> proj; LayerNorm -> fc1 -> gelu(tanh) -> fc2;
- merger: LayerNorm per patch, each merge x merge block concatenated, fc1 -> exact GELU -> fc2 to
  the text hidden size: one embedding per `<|image_pad|>` / `<|video_pad|>` token.

The MRoPE positions of a vision prompt (transformers' get_rope_index) are the Frontend's:
frontend/media.py rope_positions.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ...errors import ArtifactError
from .load import model_config

LN_EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        if d.get("deepstack_visual_indexes"):
            raise ArtifactError("vision_config.deepstack_visual_indexes: deepstack features are "
                                "not implemented (Qwen3.5 releases have none)")
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ArtifactError(f"vision_config.hidden_act {act!r} is not supported")
        rope = d.get("rope_parameters") or {}
        return cls(depth=d["depth"], hidden_size=d["hidden_size"], num_heads=d["num_heads"],
                   intermediate_size=d["intermediate_size"], in_channels=d.get("in_channels", 3),
                   patch_size=d["patch_size"], temporal_patch_size=d.get("temporal_patch_size", 2),
                   spatial_merge_size=d.get("spatial_merge_size", 2),
                   num_position_embeddings=d["num_position_embeddings"],
                   out_hidden_size=d["out_hidden_size"], hidden_act=act,
                   rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def param_shapes(self) -> dict:
        D, I, M = self.hidden_size, self.intermediate_size, self.spatial_merge_size
        T, P, C = self.temporal_patch_size, self.patch_size, self.in_channels
        shapes = {"vision.patch_embed.proj.weight": (D, C, T, P, P),
                  "vision.patch_embed.proj.bias": (D,),
                  "vision.pos_embed.weight": (self.num_position_embeddings, D),
                  "vision.merger.norm.weight": (D,), "vision.merger.norm.bias": (D,),
                  "vision.merger.linear_fc1.weight": (D * M * M, D * M * M),
                  "vision.merger.linear_fc1.bias": (D * M * M,),
                  "vision.merger.linear_fc2.weight": (self.out_hidden_size, D * M * M),
                  "vision.merger.linear_fc2.bias": (self.out_hidden_size,)}
        for i in range(self.depth):
            b = f"vision.blocks.{i}."
            shapes.update({b + "norm1.weight": (D,), b + "norm1.bias": (D,),
                           b + "norm2.weight": (D,), b + "norm2.bias": (D,),
                           b + "attn.qkv.weight": (3 * D, D), b + "attn.qkv.bias": (3 * D,),
                           b + "attn.proj.weight": (D, D), b + "attn.proj.bias": (D,),
                           b + "mlp.linear_fc1.weight": (I, D), b + "mlp.linear_fc1.bias": (I,),
                           b + "mlp.linear_fc2.weight": (D, I), b + "mlp.linear_fc2.bias": (D,)})
        return shapes


def read_vision_params(artifact, cfg: VisionConfig) -> dict:
    """{logical name: float32 array} of the tower, shapes checked against the config."""
    out = {}
    for name, shape in cfg.param_shapes().items():
        if not artifact.has(name):
            raise ArtifactError(f"missing vision binding {name!r} (expected shape {list(shape)})")
        arr = np.ascontiguousarray(artifact.tensor(name), dtype=np.float32)
        if tuple(arr.shape) != shape:
            raise ArtifactError(f"binding {name!r}: shape {list(arr.shape)} != expected "
                                f"{list(shape)}")
        out[name] = arr
    return out


# ---- pieces --------------------------------------------------------------------------------------

def layer_norm(x, w, b, eps=LN_EPS):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return ((x - mu) / np.sqrt(var + eps)) * w + b


def gelu_tanh(x):
    # x * x * x, not x ** 3: float32 pow is 12x slower here (0.55 s vs 0.045 s for 1024 x 4304)
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + 0.044715 * x * x * x)))


def _erf(x):
    """erf to ~1e-7 absolute (Abramowitz & Stegun 7.1.26 is 1.5e-7; this is W. J. Cody's
    rational form via the complementary function, in float64)."""
    x = np.asarray(x, np.float64)
    t = 1.0 / (1.0 + 0.5 * np.abs(x))
    y = 1.0 - t * np.exp(-x * x - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (
        0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (
            1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    return np.where(x >= 0, y, -y)


def gelu_erf(x):
    return (0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))).astype(np.float32)


def _block_order(h: int, w: int, m: int) -> tuple:
    """(row, col) of each patch of an h x w frame in merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // m, m, w // m, m)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).ravel(),
            cols.reshape(shape).transpose(0, 2, 1, 3).ravel())


def pos_embed_taps(side: int, grid_thw, m: int) -> tuple:
    """The bilinear (align_corners=True) resampling of a side x side position table to each
    grid as four taps per patch: (index int32 [N, 4] of table rows, weight float32 [N, 4])."""
    index, weight = [], []
    for t, h, w in grid_thw:
        rows, cols = _block_order(h, w, m)
        per_axis = []
        for idx, size in ((rows, h), (cols, w)):
            src = idx.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            lo = np.floor(src)
            taps = np.stack([lo, lo + 1], 1).astype(np.int64)
            wts = np.clip(1 - np.abs(src[:, None] - taps), 0, None).astype(np.float32)
            per_axis.append((np.clip(taps, 0, side - 1), wts))
        (ht, hw), (wt, ww) = per_axis
        index.append(np.tile((ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4), (t, 1)))
        weight.append(np.tile((hw[:, :, None] * ww[:, None, :]).reshape(-1, 4), (t, 1)))
    return (np.concatenate(index).astype(np.int32),
            np.concatenate(weight).astype(np.float32))


def interpolated_pos_embed(table: np.ndarray, grid_thw, m: int) -> np.ndarray:
    """The position table resampled to each grid, [N, D]: the four taps summed in order (as
    the device tower's vis_pos_embed)."""
    side = int(round(np.sqrt(table.shape[0])))
    index, weight = pos_embed_taps(side, grid_thw, m)
    emb = table[index[:, 0]] * weight[:, 0, None]
    for j in range(1, 4):
        emb += table[index[:, j]] * weight[:, j, None]
    return emb.astype(np.float32)


def vision_rotary(grid_thw, m: int, head_dim: int, theta: float) -> tuple:
    """cos, sin [N, head_dim] of the 2-D rotary (row frequencies, then column ones, twice)."""
    quarter = head_dim // 2
    inv_freq = (1.0 / theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter)).astype(
        np.float32)
    pos = np.concatenate([np.tile(np.stack(_block_order(h, w, m), 1), (t, 1))
                          for t, h, w in grid_thw]).astype(np.float32)          # [N, 2]
    freqs = pos[:, :, None] * inv_freq                                          # [N, 2, hd/4]
    ang = np.concatenate([freqs[:, 0], freqs[:, 1]], -1)
    ang = np.concatenate([ang, ang], -1)
    return np.cos(ang), np.sin(ang)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


# ---- the tower -----------------------------------------------------------------------------------

class VisionTower:
    """Numpy vision tower: `encode(pixels, grid_thw)` -> float32 [N / merge^2, out_hidden]."""

    CACHE_BYTES = 64 << 20       # recent encodings kept by content hash (a later turn's image)

    def __init__(self, cfg: VisionConfig, params: dict):
        self.cfg, self.p = cfg, params
        self._cache = OrderedDict()  # Media.digest -> float32 [tokens, out_hidden], LRU order
        self._cache_bytes = 0

    def encode_medium(self, m) -> np.ndarray:
        """One Frontend Media's embeddings; equal content (pixels and grid) is encoded once while
        it stays among the most recent CACHE_BYTES of encodings. The arrays are read-only."""
        key = m.digest
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        out = self.encode(m.pixels, [m.grid_thw])
        out.setflags(write=False)
        self._cache[key] = out
        self._cache_bytes += out.nbytes
        while self._cache_bytes > self.CACHE_BYTES and len(self._cache) > 1:
            self._cache_bytes -= self._cache.popitem(last=False)[1].nbytes
        return out

    @classmethod
    def from_artifact(cls, artifact) -> "VisionTower":
        vision = model_config(artifact).vision
        if not vision:
            raise ArtifactError(f"{artifact.name}: the model has no vision tower (a text-only "
                                "checkpoint)")
        cfg = VisionConfig.from_dict(vision)
        return cls(cfg, read_vision_params(artifact, cfg))

    def encode(self, pixels: np.ndarray, grid_thw) -> np.ndarray:
        cfg, p = self.cfg, self.p
        grid_thw = [tuple(int(v) for v in g) for g in grid_thw]
        n = sum(t * h * w for t, h, w in grid_thw)
        pixels = np.asarray(pixels, np.float32)
        if pixels.shape != (n, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2):
            raise ValueError(f"pixels {list(pixels.shape)} do not match grids {grid_thw}")
        m = cfg.spatial_merge_size
        w = p["vision.patch_embed.proj.weight"].reshape(cfg.hidden_size, -1)
        x = pixels @ w.T + p["vision.patch_embed.proj.bias"]
        x = x + interpolated_pos_embed(p["vision.pos_embed.weight"], grid_thw, m)
        cos, sin = vision_rotary(grid_thw, m, cfg.head_dim, cfg.rope_theta)
        # full attention within each frame: a video's temporal patches are separate sequences
        bounds = np.cumsum([0] + [h * w for t, h, w in grid_thw for _ in range(t)])
        for i in range(cfg.depth):
            x = x + self._attention(layer_norm(x, p[f"vision.blocks.{i}.norm1.weight"],
                                               p[f"vision.blocks.{i}.norm1.bias"]),
                                    i, cos, sin, bounds)
            b = f"vision.blocks.{i}.mlp."
            hmid = layer_norm(x, p[f"vision.blocks.{i}.norm2.weight"],
                              p[f"vision.blocks.{i}.norm2.bias"]) @ p[b + "linear_fc1.weight"].T \
                + p[b + "linear_fc1.bias"]
            hmid = gelu_tanh(hmid) if cfg.hidden_act == "gelu_pytorch_tanh" else gelu_erf(hmid)
            x = x + hmid @ p[b + "linear_fc2.weight"].T + p[b + "linear_fc2.bias"]
        y = layer_norm(x, p["vision.merger.norm.weight"], p["vision.merger.norm.bias"])
        y = y.reshape(-1, cfg.hidden_size * m * m)
        y = gelu_erf(y @ p["vision.merger.linear_fc1.weight"].T
                     + p["vision.merger.linear_fc1.bias"])
        y = y @ p["vision.merger.linear_fc2.weight"].T + p["vision.merger.linear_fc2.bias"]
        return y.astype(np.float32)

    def _attention(self, x, i, cos, sin, bounds):
        cfg, p = self.cfg, self.p
        a = f"vision.blocks.{i}.attn."
        N, H, hd = len(x), cfg.num_heads, cfg.head_dim
        qkv = (x @ p[a + "qkv.weight"].T + p[a + "qkv.bias"]).reshape(N, 3, H, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]                              # [N, H, hd]
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        out = np.empty_like(q)
        scale = np.float32(hd ** -0.5)
        for s, e in zip(bounds[:-1], bounds[1:]):
            scores = np.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * scale
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            out[s:e] = np.einsum("hqk,khd->qhd", scores, v[s:e])
        return out.reshape(N, -1) @ p[a + "proj.weight"].T + p[a + "proj.bias"]


# ---- the models' media entry ---------------------------------------------------------------------

class MediaEncoding:
    """What both backends' models share for media (a mixin): `vision`, the numpy tower on the
    host (set by the loader for a multimodal checkpoint), and `encode_media`, the Program's entry.
    The CUDA model runs this very tower too and takes its output as input embeddings."""
    vision = None                # VisionTower of a multimodal checkpoint

    def load_vision(self, artifact) -> None:
        if self.config.vision:
            self.vision = VisionTower.from_artifact(artifact)

    @property
    def encode_media(self):
        """The vision tower's entry for the Program (None for a text-only model)."""
        return None if self.vision is None else self._encode_media

    def _encode_media(self, prompt_ids, media, positions):
        ids = self.config.special_token_ids
        return prompt_media(self.vision, prompt_ids, media, positions,
                            (ids.get("image_token_id"), ids.get("video_token_id")))


# ---- a vision prompt, ready for the Program ------------------------------------------------------

@dataclass(frozen=True, eq=False)
class PromptMedia:
    """What a sequence with media needs at every step: its MRoPE positions and the tower's
    output at its placeholder tokens. Immutable, so a ResumeState can carry it as is."""
    positions: np.ndarray        # int32 [3, T] of the prompt
    delta: int                   # a token at index i >= T sits at i + delta on all three axes
    rows: np.ndarray             # int64 [k] prompt indices of the placeholders, ascending
    embeds: np.ndarray           # float32 [k, H]

    def positions_for(self, start: int, count: int) -> np.ndarray:
        idx = np.arange(start, start + count)
        T = self.positions.shape[1]
        out = np.broadcast_to(idx + self.delta, (3, count)).astype(np.int32)
        inside = idx < T
        out[:, inside] = self.positions[:, idx[inside]]
        return out

    def rows_in(self, start: int, count: int) -> tuple:
        """(offsets within [start, start + count), embeddings) of the placeholders there."""
        a, b = np.searchsorted(self.rows, [start, start + count])
        return self.rows[a:b] - start, self.embeds[a:b]


def prompt_media(tower: VisionTower, prompt_ids, media, positions, pad_ids) -> PromptMedia:
    """Encode each medium (through the tower's content-hash cache) and pair the output with the
    prompt's placeholder tokens."""
    parts = [tower.encode_medium(m) for m in media]
    embeds = np.concatenate(parts) if parts else \
        np.zeros((0, tower.cfg.out_hidden_size), np.float32)
    ids = np.asarray(prompt_ids)
    rows = np.nonzero(np.isin(ids, [i for i in pad_ids if i is not None]))[0].astype(np.int64)
    positions = np.asarray(positions, np.int32)
    if len(rows) != len(embeds) or positions.shape != (3, len(ids)):
        raise ValueError(f"{len(rows)} placeholder tokens for {len(embeds)} media embeddings")
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return PromptMedia(positions, delta, rows, embeds.astype(np.float32))
