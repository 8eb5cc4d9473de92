"""A DFlash block drafter on the CUDA model (issue 30): dflash.DFlashDrafter's math (its module
docstring has the equations) on the device, and its contract for program/speculative.py.

    DFlashRunner      the launches: the target layers' outputs into the feature rows during a
                      verify (capture), the feed (fc, its norm, every drafter layer's context K/V
                      into the pool) and the block pass (embed [x_F, m, ...], the drafter layers
                      over the context and the whole block, the final norm, the target's lm_head,
                      argmax), over its own buffers (DFlashBuffers) and weights
    CudaDFlashDrafter the contract (`feed`, `draft`, `logits`, `join_kv_pool`, `hidden_layers`,
                      `max_draft_tokens`, `pages_ahead`), host arrays in and out for now

Its KV layers are the pool's last ones (CudaModel.new_kv_pool: extra layers paged with the
target's, each of the drafter's own num_key_value_heads and head_dim: DeviceKVPool(extra=)). Unlike the numpy
drafter, the block pass stores the block's own K/V in the row's pages at F .. F + bs - 1 (the
non-causal paged attention then reads context and block alike): positions past the frontier,
which the next feed overwrites before any read, but pages the row must hold (`pages_ahead`).
"""
from __future__ import annotations

import math

import numpy as np

from ..batch import ForwardBatch
from .drafter import host_rows, token_pieces
from .kernel_set import paged_attention_group
from .runner import attention_splits, combine_launch, part_rows_needed


def _buffers(dcfg, n_cap: int, num_sms: int, f32: bool) -> dict:
    """name -> (shape, dtype) of DFlashBuffers (and so of the memory plan's share)."""
    H, I, F = dcfg.hidden_size, dcfg.intermediate_size, len(dcfg.target_layer_ids)
    nh, nkv, hd = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    gin = np.float32 if f32 else np.uint16
    rows = part_rows_needed(n_cap, nkv, num_sms)
    return {"feat": ((n_cap, F * H), gin), "h": ((n_cap, H), np.float32),
            "x": ((n_cap, H), gin), "proj": ((n_cap, max((nh + 2 * nkv) * hd, 2 * I)), np.float32),
            "q": ((n_cap, nh * hd), np.float32), "act": ((n_cap, max(nh * hd, I)), gin),
            "part": ((rows, nh, hd), np.float32), "ml": ((rows, nh, 2), np.float32)}


def buffer_bytes(dcfg, n_cap: int, num_sms: int, f32: bool) -> int:
    """Device bytes of DFlashBuffers (the memory plan's share), each rounded as the arena does."""
    return sum((math.prod(shape) * np.dtype(dt).itemsize + 255) // 256 * 256
               for shape, dt in _buffers(dcfg, n_cap, num_sms, f32).values())


class DFlashBuffers:
    """The drafter's activations for up to n_cap tokens (the target's call capacity): `feat`
    the features of every token of a verify (GEMM input type), `h` its residual stream (fp32),
    `x` a normed copy, `proj` the q/k/v (then gate/up) projections, `q` the normed, rotated
    queries, `act` the attention output (then the SwiGLU's), `part` / `ml` the attention's
    splits."""

    def __init__(self, arena, dcfg, n_cap: int, num_sms: int, f32: bool):
        self.n_cap = int(n_cap)
        for name, (shape, dt) in _buffers(dcfg, n_cap, num_sms, f32).items():
            setattr(self, name, arena.take(shape, dt, "DFlash workspace"))


class DFlashRunner:
    """The drafter's launches, through the target's StepRunner primitives (launch, linear: the
    same cuBLASLt, dry runs and profiling) and its workspace's logits rows for the head."""

    def __init__(self, runner, dcfg, weights: dict, bufs: DFlashBuffers, first_layer: int):
        self.runner, self.cfg, self.w, self.bufs = runner, dcfg, weights, bufs
        self.first_layer = int(first_layer)      # the drafter's first KV layer in the pool
        self.layer_slot = {l: j for j, l in enumerate(dcfg.target_layer_ids)}
        self.scale = 1.0 / math.sqrt(dcfg.head_dim)
        G = dcfg.num_attention_heads // dcfg.num_key_value_heads
        self.subgroups = G // paged_attention_group(G, dcfg.head_dim)

    @property
    def kernels(self):
        return self.runner.kernels

    def capture(self, st, layer: int, n: int) -> None:
        """After target layer `layer` of a call of n tokens: its output (the residual stream,
        ws.h) into the feature rows' columns of that layer, when it is one of the features."""
        j = self.layer_slot.get(layer)
        if j is None:
            return
        H, F = self.cfg.hidden_size, len(self.cfg.target_layer_ids)
        self.runner.launch(st, self.kernels.store_columns, (n, (H + 255) // 256), (256,),
                           (self.bufs.feat, self.runner.res.ws.h, H, F * H, j * H))

    def _norm(self, st, out, x, w, rows, row_idx=None) -> None:
        H = self.cfg.hidden_size
        self.runner.launch(st, self.kernels.df_rmsnorm, (rows,), (1024 if rows <= 64 else 256,),
                           (out, x, w, row_idx if row_idx is not None else 0,
                            int(row_idx is not None), H, self.cfg.rms_norm_eps))

    def _qkv(self, st, meta, n, lw, kv, i) -> None:
        """proj = x @ w_in^T; q normed and rotated into bufs.q, k (normed, rotated) and v into
        drafter layer i's pages at each token's position (context_len + its index)."""
        c, b = self.cfg, self.bufs
        H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        P = (nh + 2 * nkv) * hd
        lay, a = meta.layout, self.first_layer + i
        self.runner.linear(st, b.x.ptr, lw["w_in"], b.proj.ptr, n, P, H)
        self.runner.launch(st, self.kernels.df_qk_norm_rope_kv, (n, nh + nkv),
                           ((hd + 31) // 32 * 32,),
                           (b.q, b.proj, P, lw["q_norm"], lw["k_norm"], kv.k[a], kv.v[a],
                            meta.positions, lay.n_cap, meta.token_row, meta.query_start,
                            meta.context_lens, meta.block_tables, lay.p_cap, kv.page_size,
                            c.rope_theta, c.rms_norm_eps))

    def feed(self, st, meta, n: int, kv) -> None:
        """The context K/V of the call's n positions in every drafter layer, from the features in
        bufs.feat: c = hidden_norm(fc(f)), k = rope(k_norm(k_proj c)), v = v_proj c."""
        c, b, W = self.cfg, self.bufs, self.w
        H, F = c.hidden_size, len(c.target_layer_ids)
        self.runner.linear(st, b.feat.ptr, W["fc"], b.h.ptr, n, H, F * H)
        self._norm(st, b.x, b.h, W["hidden_norm"], n)
        for i, lw in enumerate(W["layers"]):
            self._qkv(st, meta, n, lw, kv, i)

    def block(self, st, meta, n: int, n_out: int, kv) -> None:
        """The block pass over the call's rows (each [x_F, m, ..., m] at F .. F + bs - 1, its
        context F keys): drafter layers, the final norm of the meta's n_out output rows into
        ws.xf, their logits and argmax in the workspace (as the target's head)."""
        c, b, W, r = self.cfg, self.bufs, self.w, self.runner
        ws, TW = r.res.ws, r.res.weights
        H, I, V = c.hidden_size, c.intermediate_size, r.cfg.vocab_size
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        P = (nh + 2 * nkv) * hd
        lay = meta.layout
        r.launch(st, self.kernels.embed_gather, ((H + 255) // 256, n), (256,),
                 (b.h, TW["embed"], meta.token_ids, H))
        splits = attention_splits(n, nkv, r.res.num_sms)
        for i, lw in enumerate(W["layers"]):
            a = self.first_layer + i
            self._norm(st, b.x, b.h, lw["input_norm"], n)
            self._qkv(st, meta, n, lw, kv, i)
            r.launch(st, self.kernels.df_paged_attention, (n, nkv * self.subgroups, splits),
                     (128,),
                     (b.part, b.ml, b.q, kv.k[a], kv.v[a], meta.token_row, meta.query_start,
                      meta.context_lens, meta.block_tables, lay.p_cap, kv.page_size, splits,
                      self.scale, 0))
            r.launch(st, self.kernels.df_attn_combine, *combine_launch(n, nh, hd),
                     (b.act, b.part, b.ml, b.proj, P, splits, 0))
            r.linear(st, b.act.ptr, lw["w_out"], b.h.ptr, n, H, nh * hd, beta=1.0)
            self._norm(st, b.x, b.h, lw["post_norm"], n)
            r.linear(st, b.x.ptr, lw["w_gu"], b.proj.ptr, n, 2 * I, H)
            r.swiglu(st, b.act, b.proj, n, 2 * I, 0, I)
            r.linear(st, b.act.ptr, lw["w_down"], b.h.ptr, n, H, I, beta=1.0)
        self._norm(st, ws.xf, b.h, W["norm"], n_out, row_idx=meta.out_rows)
        r.linear(st, ws.xf.ptr, TW["lm_head"], ws.logits.ptr, n_out, V, H)
        r.launch(st, self.kernels.argmax, (n_out,), (1024,), (ws.tokens, ws.logits, V))


class CudaDFlashDrafter:
    """dflash.DFlashDrafter's contract on the device, over a CudaModel loaded with the drafter
    (load_cuda_model with speculative='dflash'). Host arrays in and out: the features cross to
    the host after each verify and back at the feed, the drafts come down with their hidden
    states (the device path keeps them on the GPU)."""

    def __init__(self, model):
        if getattr(model, "dflash", None) is None:
            raise ValueError("CudaDFlashDrafter: the CUDA model was loaded without a DFlash "
                             "drafter (speculative='dflash')")
        self.model = model
        cfg = model.dflash.cfg
        self.cfg = cfg
        self.hidden_layers = tuple(cfg.target_layer_ids)
        self.max_draft_tokens = cfg.block_size - 1
        # the block pass writes its K/V at F .. F + bs - 1: pages the row must hold
        self.pages_ahead = cfg.block_size - 1

    def join_kv_pool(self, kv) -> None:
        """The CUDA model's pools already hold the drafter's layers, last (new_kv_pool): check
        it is such a pool."""
        want = len(self.model.text.attention_layer_ids) + self.cfg.num_hidden_layers
        if len(kv.k) != want:
            raise ValueError(f"DFlash: the KV pool has {len(kv.k)} layers, the target's "
                             f"{len(self.model.text.attention_layer_ids)} and the drafter's "
                             f"{self.cfg.num_hidden_layers} make {want}")

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [N, V]: the target's lm_head over drafter hidden states [N, H]."""
        return self.model.head_logits(hidden)

    def feed(self, batch: ForwardBatch, features: np.ndarray, kv) -> None:
        """DFlashDrafter.feed's contract: every drafter layer's context K/V of the batch's
        positions from the target's features [N, F * H] (longer batches run as several calls
        of at most the model's token capacity)."""
        F, H = len(self.hidden_layers), self.cfg.hidden_size
        features = host_rows(features)
        if features.shape != (batch.num_tokens, F * H):
            raise ValueError(f"DFlash: features shape {features.shape} != ({batch.num_tokens}, "
                             f"{F * H})")
        for sub, idx in token_pieces(batch, self.model.n_cap):
            self.model.dflash_feed(sub, features[idx], kv)

    def draft(self, kv, anchors, context_lens, block_tables, *, with_hidden: bool = True) -> tuple:
        """The block pass of each row (DFlashDrafter.draft's contract): (int32 [B, bs - 1] the
        argmax drafts, float32 [B, bs - 1, H] their final-normed hidden states, or None without
        with_hidden: none copied down); rows in groups that fit one call."""
        bs = self.cfg.block_size
        anchors = np.asarray(anchors, np.int32)
        ctx = np.asarray(context_lens, np.int32)
        tables = np.asarray(block_tables, np.int32).reshape(len(ctx), -1)
        B = len(ctx)
        per_call = max(1, min(self.model.n_cap // bs, self.model.lg_cap // (bs - 1),
                              self.model.eager_layout.b_cap))
        ids = np.empty((B, bs - 1), np.int32)
        hidden = np.empty((B, bs - 1, self.cfg.hidden_size), np.float32) if with_hidden else None
        for r0 in range(0, B, per_call):
            r1 = min(B, r0 + per_call)
            ids[r0:r1], h = self.model.dflash_draft(kv, anchors[r0:r1], ctx[r0:r1],
                                                    tables[r0:r1], with_hidden=with_hidden)
            if with_hidden:
                hidden[r0:r1] = h
        return ids, hidden
