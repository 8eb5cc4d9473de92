"""A DFlash block-diffusion drafter (`dflash.*` in the artifact), numpy backend.

DFlash (z-lab) drafts a whole block in one parallel pass, conditioned on the target's hidden
features. Its geometry is DFlashConfig (config.py); the equations, with every RMSNorm the plain
x / rms(x) * w of Qwen3 and RoPE rotate-half over the full head_dim with 1-D positions:

    features  f_t = concat_l h_l(t), l in target_layer_ids: the target's residual stream after
              decoder layer l at position t (before the final norm), for every position it ran
    context   c_t = norm_hidden(fc(f_t)); drafter layer i keeps, for every context position t,
              k_t = rope(norm_k(k_proj_i c_t), t) and v_t = v_proj_i c_t   (feed: its KV pages)
    block     at a row's frontier F (x_F sampled, not run): tokens [x_F, m, ..., m] (block_size,
              m = mask_token_id) at positions F .. F + bs - 1, x = embed(tokens) (the target's);
              per layer: h = norm_in(x); q, k, v of the block from h (q, k normed, roped); each
              block query attends over the context keys 0 .. F-1 and every block key (non-causal);
              x += o_proj(attn); x += mlp(norm_post(x))
    drafts    g = norm(x); draft d_j = argmax(g_j @ lm_head^T) for j = 1 .. bs-1 (the target's
              lm_head): d_j is the drafter's guess of the token at F + j

A verify of [x_F, d_1 .. d_k] is then exactly MTP's (program/speculative.py), and the accepted
positions' features are the next feed. The drafter's KV layers join the target's KVPool as its last
layers (`join_kv_pool`: the same pages and block tables, so Snapshots and prefix checkpoints carry
them); the block's own keys are never stored. Positions >= F hold no drafter entries that count.
"""
from __future__ import annotations

import math

import numpy as np

from ... import ops
from ...errors import ArtifactError
from .batch import ForwardBatch
from .config import DFlashConfig, TextConfig
from .load import ParamReader
from .model import DraftHead
from .state import KVPool

PREFIX = "dflash."


def dflash_param_shapes(cfg: DFlashConfig) -> dict:
    """{logical name: shape} of the drafter's own tensors (the embedding and lm_head are the
    target's)."""
    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {PREFIX + "fc.weight": (H, len(cfg.target_layer_ids) * H),
              PREFIX + "hidden_norm.weight": (H,), PREFIX + "norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        p = f"{PREFIX}layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
            p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I)})
    return shapes


def read_dflash_params(artifact, cfg: DFlashConfig) -> dict:
    """{"fc", "hidden_norm", "norm", "layers": [{...}]} float32; ArtifactError when a tensor is
    missing or mis-shaped."""
    reader, shapes = ParamReader(artifact), dflash_param_shapes(cfg)

    def read(name: str) -> np.ndarray:
        return reader(PREFIX + name, shapes[PREFIX + name])
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        layers.append({
            "input_norm": read(p + "input_layernorm.weight"),
            "post_norm": read(p + "post_attention_layernorm.weight"),
            **{n: read(p + f"self_attn.{n}.weight")
               for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
            **{n: read(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")}})
    return {"fc": read("fc.weight"), "hidden_norm": read("hidden_norm.weight"),
            "norm": read("norm.weight"), "layers": layers}


def rope_cos_sin(positions, head_dim: int, theta: float) -> tuple:
    """Plain 1-D RoPE tables [N, head_dim] (rotate-half over the whole head)."""
    p = np.asarray(positions, np.int64)
    return ops.mrope_cos_sin(np.stack([p, p, p]), head_dim, theta, (head_dim // 2, 0, 0),
                             interleaved=False)


class DFlashDrafter:
    """The drafter over a target NumpyModel's embedding and lm_head (shared arrays, no copy).
    hidden_layers: the target layers whose outputs the feed reads (Model.verify_forward's
    `hidden_layers`); max_draft_tokens: block_size - 1."""

    def __init__(self, cfg: DFlashConfig, text: TextConfig, params: dict, embed: np.ndarray,
                 lm_head: np.ndarray):
        cfg.validate(text)
        self.cfg, self.text, self.p = cfg, text, params
        self._embed = embed
        self._head = DraftHead(lm_head)
        self.hidden_layers = tuple(cfg.target_layer_ids)
        self.max_draft_tokens = cfg.block_size - 1
        self.pages_ahead = 0              # (the block's own K/V is never stored here)
        self._first_layer = 0             # the drafter's first KV layer in the pool it uses
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    @classmethod
    def from_artifact(cls, artifact, target) -> "DFlashDrafter":
        """target: the NumpyModel of the same artifact; ArtifactError when the artifact carries
        no DFlash drafter."""
        cfg = target.config.dflash
        if cfg is None:
            raise ArtifactError(f"{getattr(artifact, 'path', 'artifact')}: no DFlash drafter "
                                "(convert with --dflash DRAFTER_DIR)")
        return cls(cfg, target.text, read_dflash_params(artifact, cfg), target._embed,
                   target._lm_head)

    # ---- pools ------------------------------------------------------------------------------------
    def _layer_shape(self, num_pages: int, page_size: int) -> tuple:
        return (num_pages, page_size, self.cfg.num_key_value_heads, self.cfg.head_dim)

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        """The drafter's layers' KV alone, paged like the target's (tests, benches)."""
        shape, n = self._layer_shape(num_pages, page_size), self.cfg.num_hidden_layers
        return KVPool(page_size, [np.zeros(shape, np.float32) for _ in range(n)],
                      [np.zeros(shape, np.float32) for _ in range(n)])

    def join_kv_pool(self, kv: KVPool) -> None:
        """Append the drafter's layers to a target's KVPool and use them from now on: one page
        ledger, and every copy of a page (Snapshot, checkpoint) holds them."""
        if not kv.k:
            raise ValueError("DFlash: join_kv_pool needs a target pool with attention layers")
        self._first_layer = len(kv.k)
        shape = self._layer_shape(kv.num_pages, kv.page_size)
        for _ in range(self.cfg.num_hidden_layers):
            kv.k.append(np.zeros(shape, np.float32))
            kv.v.append(np.zeros(shape, np.float32))

    # ---- compute ----------------------------------------------------------------------------------
    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [N, V]: the target's lm_head over drafter hidden states [N, H]."""
        return self._head.logits(hidden)

    def draft_argmax(self, hidden: np.ndarray) -> np.ndarray:
        return self._head.argmax(hidden)

    def feed(self, batch: ForwardBatch, features: np.ndarray, kv: KVPool) -> None:
        """Write every drafter layer's context KV of the batch's positions from the target's
        features there ([N, len(hidden_layers) * H]); the batch's token ids are not read."""
        cfg = self.cfg
        features = np.asarray(features, np.float32)
        if features.shape != (batch.num_tokens, len(self.hidden_layers) * cfg.hidden_size):
            raise ValueError(f"DFlash: features shape {features.shape} != ({batch.num_tokens}, "
                             f"{len(self.hidden_layers) * cfg.hidden_size})")
        batch.validate(kv.page_size)
        if int(np.max(batch.block_tables, initial=-1)) >= kv.num_pages:
            raise ValueError(f"DFlash: block table names a page >= {kv.num_pages}")
        pages, offsets = ops.kv_slot_mapping(batch.block_tables, batch.context_lens,
                                             batch.query_start, kv.page_size)
        c = ops.rmsnorm(ops.linear(features, self.p["fc"]), self.p["hidden_norm"], cfg.rms_norm_eps)
        cos, sin = rope_cos_sin(_positions(batch), cfg.head_dim, cfg.rope_theta)
        for i, layer in enumerate(self.p["layers"]):
            k, v = self._kv(layer, c, cos, sin)
            ops.write_paged_kv(kv.k[self._first_layer + i], kv.v[self._first_layer + i], k, v,
                               pages, offsets)

    def draft_hidden(self, kv: KVPool, anchors, context_lens, block_tables) -> np.ndarray:
        """The block pass of each row: anchors[r] = x_F (the sampled token at its frontier F =
        context_lens[r]; the drafter's KV covers positions < F). Returns the final-normed hidden
        states [B, block_size - 1, H] of block positions 1 .. bs-1 (draft j from [:, j-1])."""
        cfg, eps, bs = self.cfg, self.cfg.rms_norm_eps, self.cfg.block_size
        anchors = np.asarray(anchors, np.int64)
        ctx = np.asarray(context_lens, np.int64)
        tables = np.asarray(block_tables, np.int64).reshape(len(ctx), -1)
        B = len(ctx)
        if anchors.shape != (B,) or (B and (anchors.min() < 0 or anchors.max() >= self.text.vocab_size)):
            raise ValueError(f"DFlash: anchors must be {B} token ids in [0, {self.text.vocab_size})")
        tokens = np.full((B, bs), cfg.mask_token_id, np.int64)
        tokens[:, 0] = anchors
        x = self._embed[tokens.reshape(-1)].astype(np.float32)              # [B*bs, H]
        cos, sin = rope_cos_sin((ctx[:, None] + np.arange(bs)).reshape(-1), cfg.head_dim,
                                cfg.rope_theta)
        nh, hd = cfg.num_attention_heads, cfg.head_dim
        for i, layer in enumerate(self.p["layers"]):
            h = ops.rmsnorm(x, layer["input_norm"], eps)
            q = ops.linear(h, layer["q_proj"]).reshape(-1, nh, hd)
            q = ops.apply_rotary(ops.rmsnorm(q, layer["q_norm"], eps), cos, sin)
            k, v = self._kv(layer, h, cos, sin)
            k_pool, v_pool = kv.k[self._first_layer + i], kv.v[self._first_layer + i]
            o = np.empty_like(q)
            for r in range(B):
                blk = slice(r * bs, (r + 1) * bs)
                F = int(ctx[r])
                pages = tables[r, :-(-F // kv.page_size)] if F else tables[r, :0]
                keys = np.concatenate([k_pool[pages].reshape(-1, *k.shape[1:])[:F], k[blk]])
                vals = np.concatenate([v_pool[pages].reshape(-1, *v.shape[1:])[:F], v[blk]])
                o[blk] = _attend(q[blk], keys, vals, self.scale)
            x = x + ops.linear(o.reshape(len(x), -1), layer["o_proj"])
            x = x + ops.swiglu(ops.rmsnorm(x, layer["post_norm"], eps), layer["gate_proj"],
                               layer["up_proj"], layer["down_proj"])
        g = ops.rmsnorm(x, self.p["norm"], eps).reshape(B, bs, -1)
        return np.ascontiguousarray(g[:, 1:])

    def draft(self, kv: KVPool, anchors, context_lens, block_tables, *,
              with_hidden: bool = True) -> tuple:
        """The block pass and its argmax drafts: (int32 [B, bs - 1] drafts d_1 .. d_{bs-1},
        float32 [B, bs - 1, H] their final-normed hidden states: draft_hidden's, or None
        without with_hidden: the speculator asks for them only for rows drafting within a mask,
        and the CUDA drafter then copies none to the host)."""
        g = self.draft_hidden(kv, anchors, context_lens, block_tables)
        ids = self.draft_argmax(g.reshape(-1, g.shape[-1])) if g.size else \
            np.zeros(g.shape[:2], np.int32)
        return np.asarray(ids, np.int32).reshape(g.shape[:2]), g if with_hidden else None

    def _kv(self, layer: dict, x: np.ndarray, cos, sin) -> tuple:
        eps, nkv, hd = self.cfg.rms_norm_eps, self.cfg.num_key_value_heads, self.cfg.head_dim
        k = ops.linear(x, layer["k_proj"]).reshape(-1, nkv, hd)
        v = ops.linear(x, layer["v_proj"]).reshape(-1, nkv, hd)
        return ops.apply_rotary(ops.rmsnorm(k, layer["k_norm"], eps), cos, sin), v


def _positions(batch: ForwardBatch) -> np.ndarray:
    """Each new token's position in its row (context_lens + its index among the row's new)."""
    qs = np.asarray(batch.query_start, np.int64)
    rows = np.repeat(np.arange(len(qs) - 1), np.diff(qs))
    return np.asarray(batch.context_lens, np.int64)[rows] + np.arange(qs[-1]) - qs[rows]


def _attend(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, scale: float) -> np.ndarray:
    """Non-causal GQA attention: q [n, nh, hd] over keys, vals [L, nkv, hd] -> [n, nh, hd]
    (query head h reads KV head h // (nh / nkv))."""
    n, nh, hd = q.shape
    nkv = keys.shape[1]
    qh = np.moveaxis(q, 1, 0).reshape(nkv, (nh // nkv) * n, hd)
    s = (qh @ keys.transpose(1, 2, 0)) * np.float32(scale)                  # [nkv, g*n, L]
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ np.moveaxis(vals, 1, 0)                                         # [nkv, g*n, hd]
    return np.moveaxis(o.reshape(nh, n, hd), 0, 1)
