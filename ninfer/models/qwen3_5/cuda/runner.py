"""The launch sequence of one forward step on the device (eager, or recorded into a graph).

    embed -> [rmsnorm -> GEMM w_in -> mixer kernels -> GEMM w_out (+= residual, beta 1)
              rmsnorm -> GEMM gate|up -> silu_mul  -> GEMM down  (+= residual)] x layers
          -> rmsnorm(selected rows) -> GEMM lm_head -> argmax

The residual stream `h` is fp32; GEMM inputs are bf16 (written by the kernel before the GEMM);
GEMM outputs are fp32. Every buffer is a fixed workspace region, so a step allocates nothing.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import FULL_ATTENTION, TextConfig


class Workspace:
    """Fixed activation buffers for up to `n_cap` tokens and `lg_cap` logits rows."""

    def __init__(self, arena, cfg: TextConfig, n_cap: int, lg_cap: int, part_rows: int):
        take = arena.take
        H, V = cfg.hidden_size, cfg.vocab_size
        C, Vd, nv = cfg.linear_conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        widths_in, widths_act = [], [H]
        if cfg.linear_layer_ids:
            widths_in.append(C + Vd + 2 * nv)
            widths_act.append(Vd)
        if cfg.attention_layer_ids:
            widths_in.append(2 * nh * hd + 2 * nkv * hd)
            widths_act.append(nh * hd)
        if cfg.is_moe:
            E, Is = cfg.num_experts, cfg.shared_expert_intermediate_size
            widths_in.append(E + 2 * Is + 1)
            widths_act.append(Is)
        else:
            widths_in.append(2 * cfg.intermediate_size)
            widths_act.append(cfg.intermediate_size)
        n = n_cap
        ws = "workspace"
        self.h = take((n, H), np.float32, ws)
        self.x = take((n, H), np.uint16, ws)
        self.act = take((n, max(widths_act)), np.uint16, ws)
        self.proj = take((n, max(widths_in)), np.float32, ws)
        self.mid = take((n, max(C if cfg.linear_layer_ids else 1,
                                nh * hd if cfg.attention_layer_ids else 1)), np.float32, ws)
        self.core = take((n, max(Vd, 1)), np.float32, ws)
        if cfg.attention_layer_ids:
            self.part = take((part_rows, nh, hd), np.float32, ws)
            self.ml = take((part_rows, nh, 2), np.float32, ws)
        if cfg.is_moe:
            K, I = cfg.num_experts_per_tok, cfg.moe_intermediate_size
            self.ids = take((n * K,), np.int32, ws)
            self.wts = take((n * K,), np.float32, ws)
            self.mact = take((n * K, I), np.float32, ws)
            self.my = take((n * K, H), np.float32, ws)
            self.shared = take((n, H), np.float32, ws)
        self.xf = take((lg_cap, H), np.uint16, ws)
        self.logits = take((lg_cap, V), np.float32, ws)
        self.tokens = take((lg_cap,), np.int32, ws)


def attention_splits(n: int, nkv: int, num_sms: int) -> int:
    """Key splits per (token, kv head): enough blocks to cover the SMs twice, at most 32."""
    return max(1, min(32, math.ceil(2 * num_sms / max(n * nkv, 1))))


def part_rows_needed(n_cap: int, nkv: int, num_sms: int) -> int:
    return max(n * attention_splits(n, nkv, num_sms) for n in
               list(range(1, min(n_cap, 2 * num_sms) + 1)) + [n_cap])


class StepRunner:
    """Issues one step's launches. `dry=True` resolves GEMM plans and kernels without launching
    (done before graph capture, so capture never asks cuBLASLt's heuristic or loads a module)."""

    def __init__(self, model):
        self.m = model
        self.cfg: TextConfig = model.text
        self.dry = False

    # -- primitives --------------------------------------------------------------------------------
    def gemm(self, st, x, w, y, m, n, k, beta=0.0):
        if self.dry:
            self.m.lt.plan(m, n, k, beta)
            return
        self.m.lt.gemm(st, x, w, y, m, n, k, beta)

    def launch(self, st, kernel, grid, block, args, smem=0):
        k = getattr(self.m.kernels, kernel)
        if self.dry:
            return
        k.launch(st, grid, block, args, smem)

    # -- the step ----------------------------------------------------------------------------------
    def run(self, st, meta, n: int, b: int, n_out: int, kv, state, out_start: int = 0):
        cfg, ws, W = self.cfg, self.m.ws, self.m.weights
        H = cfg.hidden_size
        self.launch(st, "embed_gather", ((H + 255) // 256, n), (256,),
                    (ws.h, W["embed"], meta.token_ids, H))
        n_attn = n_lin = 0
        for i, lw in enumerate(W["layers"]):
            self.rmsnorm(st, ws.x, ws.h, lw["input_norm"], n)
            if cfg.layer_types[i] == FULL_ATTENTION:
                self.attention(st, meta, n, lw, kv, n_attn)
                n_attn += 1
            else:
                self.gdn(st, meta, n, b, lw, state, n_lin)
                n_lin += 1
            self.rmsnorm(st, ws.x, ws.h, lw["post_norm"], n)
            if cfg.is_moe:
                self.moe(st, n, lw)
            else:
                self.mlp(st, n, lw)
        self.head(st, meta, n_out, out_start)

    def head(self, st, meta, n_out: int, out_start: int = 0):
        cfg, ws, W = self.cfg, self.m.ws, self.m.weights
        H, V = cfg.hidden_size, cfg.vocab_size
        self.rmsnorm(st, ws.xf, ws.h, W["norm"], n_out, row_idx=meta.out_rows + 4 * out_start)
        self.gemm(st, ws.xf.ptr, W["lm_head"].ptr, ws.logits.ptr, n_out, V, H)
        self.launch(st, "argmax", (n_out,), (1024,), (ws.tokens, ws.logits, V))

    def rmsnorm(self, st, out, x, w, rows, row_idx=None):
        H = self.cfg.hidden_size
        block = 1024 if rows <= 64 else 256
        self.launch(st, "rmsnorm", (rows,), (block,),
                    (out, x, w, row_idx if row_idx is not None else 0, int(row_idx is not None),
                     H, self.cfg.rms_norm_eps))

    def gdn(self, st, meta, n, b, lw, state, l):
        cfg, ws = self.cfg, self.m.ws
        H, C, Vd = cfg.hidden_size, cfg.linear_conv_dim, cfg.linear_value_dim
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        P = C + Vd + 2 * nv
        self.gemm(st, ws.x.ptr, lw["w_in"].ptr, ws.proj.ptr, n, P, H)
        blk = (max(dk, dv) + 31) // 32 * 32
        self.launch(st, "conv_silu", (n, 2 * nk + nv), (blk,),
                    (ws.mid, ws.proj, P, lw["conv_w"], state.conv[l], meta.token_row,
                     meta.query_start, meta.context_lens, meta.state_slots))
        self.launch(st, "conv_state_update", ((C + 127) // 128, b), (128,),
                    (state.conv[l], ws.proj, P, meta.query_start, meta.context_lens,
                     meta.state_slots))
        self.launch(st, "gdn_recurrent", (b, nv, dv // 32), (128,),
                    (ws.core, ws.mid, ws.proj, P, C + Vd + nv, C + Vd, lw["a_log"], lw["dt_bias"],
                     state.recurrent[l], meta.query_start, meta.context_lens, meta.state_slots))
        self.launch(st, "gated_rmsnorm", (n, nv), (min(128, (dv + 31) // 32 * 32),),
                    (ws.act, ws.core, ws.proj, P, C, lw["norm_w"], dv, cfg.rms_norm_eps))
        self.gemm(st, ws.act.ptr, lw["w_out"].ptr, ws.h.ptr, n, H, Vd, beta=1.0)

    def attention(self, st, meta, n, lw, kv, a):
        cfg, ws = self.cfg, self.m.ws
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        P = 2 * nh * hd + 2 * nkv * hd
        lay = meta.layout
        self.gemm(st, ws.x.ptr, lw["w_in"].ptr, ws.proj.ptr, n, P, H)
        self.launch(st, "qk_norm_rope_kv", (n, nh + nkv), (hd,),
                    (ws.mid, ws.proj, P, lw["q_norm"], lw["k_norm"], kv.k[a], kv.v[a],
                     meta.positions, lay.n_cap, meta.token_row, meta.query_start,
                     meta.context_lens, meta.block_tables, lay.p_cap, kv.page_size,
                     cfg.rope_theta, cfg.rms_norm_eps))
        splits = attention_splits(n, nkv, self.m.device.num_sms)
        self.launch(st, "paged_attention", (n, nkv, splits), (128,),
                    (ws.part, ws.ml, ws.mid, kv.k[a], kv.v[a], meta.token_row, meta.query_start,
                     meta.context_lens, meta.block_tables, lay.p_cap, kv.page_size, splits,
                     1.0 / math.sqrt(hd)))
        self.launch(st, "attn_combine", (n, nh), (hd,), (ws.act, ws.part, ws.ml, ws.proj, P, splits))
        self.gemm(st, ws.act.ptr, lw["w_out"].ptr, ws.h.ptr, n, H, nh * hd, beta=1.0)

    def mlp(self, st, n, lw):
        cfg, ws = self.cfg, self.m.ws
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gemm(st, ws.x.ptr, lw["w_gu"].ptr, ws.proj.ptr, n, 2 * I, H)
        self.launch(st, "silu_mul", ((I + 255) // 256, n), (256,), (ws.act, ws.proj, 2 * I, 0, I))
        self.gemm(st, ws.act.ptr, lw["w_down"].ptr, ws.h.ptr, n, H, I, beta=1.0)

    def moe(self, st, n, lw):
        cfg, ws = self.cfg, self.m.ws
        H, E, K = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
        I, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        P = E + 2 * Is + 1
        self.gemm(st, ws.x.ptr, lw["w_rs"].ptr, ws.proj.ptr, n, P, H)
        self.launch(st, "router_topk", (n,), (256,), (ws.ids, ws.wts, ws.proj, P))
        self.launch(st, "silu_mul", ((Is + 255) // 256, n), (256,), (ws.act, ws.proj, P, E, Is))
        self.gemm(st, ws.act.ptr, lw["shared_down"].ptr, ws.shared.ptr, n, H, Is)
        self.launch(st, "expert_gate_up", (n * K, (I + 3) // 4), (128,),
                    (ws.mact, ws.x, lw["experts_gu"], ws.ids, K))
        self.launch(st, "expert_down", (n * K, (H + 3) // 4), (128,),
                    (ws.my, ws.mact, lw["experts_down"], ws.ids))
        self.launch(st, "moe_combine", ((H + 255) // 256, n), (256,),
                    (ws.h, ws.my, ws.wts, ws.shared, ws.proj.ptr + 4 * (E + 2 * Is), P))
