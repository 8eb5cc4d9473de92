"""The numpy layers of the Qwen3.5 text model: token mixers (Gated DeltaNet, gated attention) and
channel mixers (dense SwiGLU, sparse MoE). Each is a pure function of its float32 parameters, the
packed hidden states [N, H] of one ForwardBatch, and the pools it reads and writes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import ops
from .batch import ForwardBatch
from .config import TextConfig


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What every layer of one forward call shares (built once per call)."""
    batch: ForwardBatch
    lengths: np.ndarray          # [B] new tokens per row
    cos: np.ndarray              # [N, rotary_dim] MRoPE tables
    sin: np.ndarray
    kv_pages: np.ndarray         # [N] where each new token's K/V goes
    kv_offsets: np.ndarray


class GatedDeltaNet:
    """Linear-attention mixer. State per sequence: conv inputs [C, K-1] and S [Hv, dk, dv]."""
    reads_kv = False            # the pool it is handed: the StatePool (model._trunk)

    def __init__(self, p: dict, cfg: TextConfig, ordinal: int):
        self.p, self.ordinal = p, ordinal
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = cfg.linear_key_dim
        self.eps = cfg.rms_norm_eps
        self.neg_A = -np.exp(p["A_log"])                       # [nv], fixed per layer

    def __call__(self, x: np.ndarray, plan: StepPlan, state) -> np.ndarray:
        p = self.p
        qkv = ops.linear(x, p["in_proj_qkv"])                   # [N, 2Kd+Vd], pre-conv
        z = ops.linear(x, p["in_proj_z"])
        beta = ops.sigmoid(ops.linear(x, p["in_proj_b"]))       # [N, nv]
        g = self.neg_A * ops.softplus(ops.linear(x, p["in_proj_a"]) + p["dt_bias"])
        conv_pool = state.conv[self.ordinal]
        rec_pool = state.recurrent[self.ordinal]
        core = np.empty((x.shape[0], self.nv, self.dv), np.float32)
        b = plan.batch
        decode_rows = [r for r in range(b.num_rows) if plan.lengths[r] == 1]
        prefill_rows = [r for r in range(b.num_rows) if plan.lengths[r] > 1]
        if decode_rows:
            self._decode(decode_rows, qkv, g, beta, plan, conv_pool, rec_pool, core)
        for r in prefill_rows:
            s, e = int(b.query_start[r]), int(b.query_start[r + 1])
            slot = int(b.state_slots[r])
            fresh = b.context_lens[r] == 0
            conv0 = np.zeros_like(conv_pool[slot]) if fresh else conv_pool[slot]
            rec0 = np.zeros_like(rec_pool[slot]) if fresh else rec_pool[slot]
            mixed, conv_pool[slot] = ops.causal_conv1d(qkv[s:e], conv0, p["conv_w"])
            q, k, v = self._split_heads(ops.silu(mixed))
            core[s:e], rec_pool[slot] = ops.gated_delta_chunked(q, k, v, g[s:e], beta[s:e], rec0)
        normed = ops.rmsnorm_gated(core, z.reshape(core.shape), p["gdn_norm"], self.eps)
        return ops.linear(normed.reshape(x.shape[0], -1), p["out_proj"])

    def _decode(self, rows, qkv, g, beta, plan, conv_pool, rec_pool, core) -> None:
        """All single-token rows in one recurrent step, their heads flattened together."""
        b = plan.batch
        tok = np.asarray(b.query_start)[rows]
        slots = np.asarray(b.state_slots)[rows]
        fresh = (np.asarray(b.context_lens)[rows] == 0)
        conv0, rec0 = conv_pool[slots], rec_pool[slots]        # gathers: one copy each
        conv0[fresh], rec0[fresh] = 0.0, 0.0                    # a sequence start reads zero State
        # conv over one step, every row at once: window = previous K-1 inputs + this one
        window = np.concatenate([conv0, qkv[tok][:, :, None]], axis=2)      # [R, C, K]
        mixed = np.einsum("rck,ck->rc", window, self.p["conv_w"])
        conv_pool[slots] = window[:, :, 1:]
        q, k, v = self._split_heads(ops.silu(mixed))                        # [R, nv, d]
        R = len(rows)
        o, rec = ops.gated_delta_recurrent(
            q.reshape(1, R * self.nv, self.dk), k.reshape(1, R * self.nv, self.dk),
            v.reshape(1, R * self.nv, self.dv), g[tok].reshape(1, -1), beta[tok].reshape(1, -1),
            rec0.reshape(R * self.nv, self.dk, self.dv))
        rec_pool[slots] = rec.reshape(R, self.nv, self.dk, self.dv)
        core[tok] = o.reshape(R, self.nv, self.dv)

    def _split_heads(self, mixed: np.ndarray) -> tuple:
        """[T, 2Kd+Vd] conv output -> q, k [T, nv, dk] (normalised, q scaled, expanded from the
        key heads: value head h reads key head h // (nv/nk)) and v [T, nv, dv]."""
        T, kd = mixed.shape[0], self.key_dim
        q = ops.l2norm(mixed[:, :kd].reshape(T, self.nk, self.dk), 1e-6)
        k = ops.l2norm(mixed[:, kd:2 * kd].reshape(T, self.nk, self.dk), 1e-6)
        v = mixed[:, 2 * kd:].reshape(T, self.nv, self.dv)
        rep = self.nv // self.nk
        if rep > 1:
            q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
        return q * np.float32(1.0 / math.sqrt(self.dk)), k, v


class GatedAttention:
    """Full attention with an output gate: per head q_proj emits [query(hd), gate(hd)]."""
    reads_kv = True             # the pool it is handed: the KVPool (model._trunk)

    def __init__(self, p: dict, cfg: TextConfig, ordinal: int):
        self.p, self.ordinal = p, ordinal
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.hd)

    def __call__(self, x: np.ndarray, plan: StepPlan, kv) -> np.ndarray:
        p, N, hd = self.p, x.shape[0], self.hd
        qg = ops.linear(x, p["q_proj"], p.get("q_bias")).reshape(N, self.nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(N, self.nh * hd)
        k = ops.linear(x, p["k_proj"], p.get("k_bias")).reshape(N, self.nkv, hd)
        v = ops.linear(x, p["v_proj"], p.get("v_bias")).reshape(N, self.nkv, hd)
        q = ops.apply_rotary(ops.rmsnorm_zero_centred(q, p["q_norm"], self.eps), plan.cos, plan.sin)
        k = ops.apply_rotary(ops.rmsnorm_zero_centred(k, p["k_norm"], self.eps), plan.cos, plan.sin)
        k_pool, v_pool = kv.k[self.ordinal], kv.v[self.ordinal]
        ops.write_paged_kv(k_pool, v_pool, k, v, plan.kv_pages, plan.kv_offsets)
        b = plan.batch
        o = ops.paged_attention(q, k_pool, v_pool, b.block_tables, b.context_lens, b.query_start,
                                self.scale)
        return ops.linear(o.reshape(N, -1) * ops.sigmoid(gate), p["o_proj"], p.get("o_bias"))


class DenseMLP:
    def __init__(self, p: dict):
        self.p = p

    def __call__(self, x: np.ndarray) -> np.ndarray:
        p = self.p
        return ops.swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"])


class SparseMoE:
    """Routed experts (softmax top-k) plus a shared expert gated by sigmoid(shared_expert_gate x)."""

    def __init__(self, p: dict, cfg: TextConfig):
        self.p = p
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: np.ndarray) -> np.ndarray:
        p = self.p
        weights, ids = ops.route_topk(ops.linear(x, p["router"]), self.top_k, self.normalize)
        routed = self.routed(x, ids, weights)
        shared = ops.swiglu(x, p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"])
        return routed + ops.sigmoid(ops.linear(x, p["shared_expert_gate"])) * shared

    def routed(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The routed experts' weighted sum [N, H] for the chosen ids / weights [N, top_k] (an
        expert-parallel shard overrides it to run only its own experts: ninfer/parallel)."""
        return ops.moe_experts(x, ids, weights, self.p["experts_gate_up"], self.p["experts_down"])
