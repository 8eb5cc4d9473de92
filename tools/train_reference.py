"""Train the reference models (a dense and an MoE Qwen3.5, hybrid GDN + gated attention, each with
an MTP head) on the corpus of tools/reference_corpus.py, and write their compact form.

    python tools/train_reference.py train CORPUS_DIR OUT_DIR [--models dense,moe] [--steps N]
                                          [--time-budget S] [--device cuda]
    python tools/train_reference.py check          # CPU: torch model == ninfer's numpy model

torch is allowed here and only here (never in ninfer/). The model below is written from the
Qwen3.5 equations (ninfer/models/qwen3_5/layers.py is their numpy form); `check` verifies it against ninfer's numpy model
(itself checked against transformers) on a small random config, through the same compact-file ->
HF checkpoint -> `ninfer convert` path that the demo uses.

Training (per model): next-token loss over the full 248,320-id vocabulary, of which only the K ids
seen in the corpus have trainable (tied) embedding rows; the other rows are zero, so their logits
are exactly 0 (one log(V - K) term in the log-sum-exp). Plus the MTP loss (weight MTP_WEIGHT):
the MTP head reads [norm(embed(x[t+1])), norm(h[t])] (h = the main model's final-normed hidden
state, as vLLM feeds it) and predicts x[t+2]. Then a chat-tuned pass: chat conversations (loss on
the assistant's tokens only) mixed with pre-training windows.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 248320
IM_END, ENDOFTEXT = 248046, 248044
MTP_WEIGHT = 0.3
AUX_WEIGHT = 0.01               # MoE load balancing (Switch-style), keeps all experts in use
SEQ = 512
CHUNK = 64                      # delta-rule chunk

L, F = "linear_attention", "full_attention"
MODELS = {
    "dense": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
                  hidden_size=128, intermediate_size=384, num_hidden_layers=6,
                  layer_types=[L, L, F, L, L, F]),
    "moe": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                layer_types=[L, L, L, F], num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=128, shared_expert_intermediate_size=128,
                norm_topk_prob=True),
}
COMMON = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=32768,
              tie_word_embeddings=True, attention_bias=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                               "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2],
                               "mrope_interleaved": True},
              linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_hidden_layers=1,
              eos_token_id=[IM_END, ENDOFTEXT], torch_dtype="bfloat16")


def hf_config(kind: str) -> dict:
    return {**COMMON, **MODELS[kind]}


# ---- the model (torch) ---------------------------------------------------------------------------

def build_model(cfg: dict, num_kept: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as Fn

    H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]

    def rms(x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    class ZNorm(nn.Module):                           # zero-centred: x * (1 + w)
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return rms(x) * (1.0 + self.weight)

    def lin(i, o):
        m = nn.Linear(i, o, bias=False)
        nn.init.normal_(m.weight, std=i ** -0.5)
        return m

    class GDN(nn.Module):
        def __init__(self):
            super().__init__()
            self.nk, self.nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            self.dk, self.dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            kd, vd = self.nk * self.dk, self.nv * self.dv
            self.conv_dim, K = 2 * kd + vd, cfg["linear_conv_kernel_dim"]
            self.in_proj_qkv, self.in_proj_z = lin(H, self.conv_dim), lin(H, vd)
            self.in_proj_b, self.in_proj_a = lin(H, self.nv), lin(H, self.nv)
            self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, K, groups=self.conv_dim,
                                    bias=False, padding=K - 1)
            self.dt_bias = nn.Parameter(torch.ones(self.nv))
            self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, self.nv)))
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.ones(self.dv))   # plain (not zero-centred)
            self.out_proj = lin(vd, H)

        def forward(self, x, pos):
            B, T, _ = x.shape
            qkv = self.in_proj_qkv(x).transpose(1, 2)                       # [B, C, T]
            mixed = Fn.silu(self.conv1d(qkv)[..., :T]).transpose(1, 2)      # causal
            kd = self.nk * self.dk
            q = mixed[..., :kd].reshape(B, T, self.nk, self.dk).float()
            k = mixed[..., kd:2 * kd].reshape(B, T, self.nk, self.dk).float()
            v = mixed[..., 2 * kd:].reshape(B, T, self.nv, self.dv).float()
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
            rep = self.nv // self.nk
            q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
            beta = torch.sigmoid(self.in_proj_b(x).float())
            g = -torch.exp(self.A_log.float()) * Fn.softplus(self.in_proj_a(x).float()
                                                            + self.dt_bias.float())
            core = delta_rule_chunked(q * self.dk ** -0.5, k, v, g, beta)    # [B, T, nv, dv]
            z = self.in_proj_z(x).reshape(B, T, self.nv, self.dv).float()
            o = self.norm.weight * rms(core) * Fn.silu(z)
            return self.out_proj(o.reshape(B, T, -1).to(x.dtype))

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.nh, self.nkv, self.hd = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                          cfg["head_dim"])
            self.q_proj, self.k_proj = lin(H, 2 * self.nh * self.hd), lin(H, self.nkv * self.hd)
            self.v_proj, self.o_proj = lin(H, self.nkv * self.hd), lin(self.nh * self.hd, H)
            self.q_norm, self.k_norm = ZNorm(self.hd), ZNorm(self.hd)

        def forward(self, x, pos):
            B, T, _ = x.shape
            qg = self.q_proj(x).reshape(B, T, self.nh, 2 * self.hd)
            q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(B, T, -1)
            k = self.k_proj(x).reshape(B, T, self.nkv, self.hd)
            v = self.v_proj(x).reshape(B, T, self.nkv, self.hd)
            cos, sin = pos
            q = rotary(self.q_norm(q), cos, sin).to(v.dtype).transpose(1, 2)    # bf16 under
            k = rotary(self.k_norm(k), cos, sin).to(v.dtype).transpose(1, 2)    # autocast
            v = v.transpose(1, 2)
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
            o = o.transpose(1, 2).reshape(B, T, -1)
            return self.o_proj(o * torch.sigmoid(gate))

    class MLP(nn.Module):
        def __init__(self, inter):
            super().__init__()
            self.gate_proj, self.up_proj = lin(H, inter), lin(H, inter)
            self.down_proj = lin(inter, H)

        def forward(self, x):
            return self.down_proj(Fn.silu(self.gate_proj(x)) * self.up_proj(x))

    class MoE(nn.Module):
        """Every expert runs on every token and the top-k routing weights (zeros elsewhere) mix
        them: the same function as sparse dispatch, simpler for 4 tiny experts."""

        def __init__(self):
            super().__init__()
            E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
            self.E, self.k, self.I = E, cfg["num_experts_per_tok"], I
            self.gate = lin(H, E)
            self.experts = nn.Module()
            self.experts.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
            self.experts.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
            self.shared_expert = MLP(cfg["shared_expert_intermediate_size"])
            self.shared_expert_gate = lin(H, 1)
            self.aux = None

        def forward(self, x):
            p = torch.softmax(self.gate(x).float(), -1)                     # [B, T, E]
            w, ids = torch.topk(p, self.k, -1)
            w = w / w.sum(-1, keepdim=True)
            dense_w = torch.zeros_like(p).scatter(-1, ids, w)
            gu = torch.einsum("bth,eih->btei", x, self.experts.gate_up_proj.to(x.dtype))
            y = Fn.silu(gu[..., :self.I]) * gu[..., self.I:]
            y = torch.einsum("btei,ehi->bteh", y, self.experts.down_proj.to(x.dtype))
            routed = (y * dense_w.unsqueeze(-1).to(y.dtype)).sum(2)
            frac = torch.zeros_like(p).scatter(-1, ids, 1.0).mean((0, 1)) / self.k
            self.aux = self.E * (frac.detach() * p.mean((0, 1))).sum()
            return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    class Layer(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = ZNorm(H), ZNorm(H)
            if kind == F:
                self.self_attn = Attention()
            else:
                self.linear_attn = GDN()
            self.mixer = self.self_attn if kind == F else self.linear_attn
            self.mlp = MoE() if "num_experts" in cfg else MLP(cfg["intermediate_size"])

        def forward(self, h, pos):
            h = h + self.mixer(self.input_layernorm(h).to(h.dtype), pos)
            return h + self.mlp(self.post_attention_layernorm(h).to(h.dtype))

    class MTP(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = ZNorm(H), ZNorm(H)
            self.fc = lin(2 * H, H)
            self.layers = nn.ModuleList([Layer(F)])
            self.norm = ZNorm(H)

        def forward(self, next_emb, hidden, pos):
            x = torch.cat([self.pre_fc_norm_embedding(next_emb),
                           self.pre_fc_norm_hidden(hidden)], -1).to(next_emb.dtype)
            h = self.layers[0](self.fc(x), pos)
            return self.norm(h)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Parameter(torch.randn(num_kept, H) * 0.02)
            self.layers = nn.ModuleList([Layer(t) for t in cfg["layer_types"]])
            self.norm = ZNorm(H)
            self.mtp = MTP()
            rope = cfg["rope_parameters"]
            rd = int(cfg["head_dim"] * rope["partial_rotary_factor"])
            inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
            self.register_buffer("inv_freq", inv, persistent=False)

        def embed(self, idx):                  # idx: kept index, -1 = unseen -> zero vector
            e = self.embed_tokens[idx.clamp(min=0)]
            return e * (idx >= 0).unsqueeze(-1).to(e.dtype)

        def positions(self, T, device):
            freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * self.inv_freq
            emb = torch.cat([freqs, freqs], -1)
            return emb.cos(), emb.sin()

        def forward(self, idx, with_mtp=True):
            """idx [B, T] kept indices -> (hidden [B, T, H] final-normed,
            mtp hidden [B, T-1, H])."""
            pos = self.positions(idx.shape[1], idx.device)
            h = self.embed(idx)
            for layer in self.layers:
                h = layer(h, pos)
            h = self.norm(h)
            if not with_mtp:
                return h, None
            m = self.mtp(self.embed(idx[:, 1:]), h[:, :-1], self.positions(idx.shape[1] - 1,
                                                                           idx.device))
            return h, m

        def aux_loss(self):
            mods = [m for m in self.modules() if isinstance(m, MoE)]
            return sum(m.aux for m in mods) / len(mods) if mods else 0.0

    return Model()


def rotary(x, cos, sin):
    """x [B, T, h, d]; rotate-half on the first rotary_dim dims (MRoPE on text = plain RoPE)."""
    import torch
    rd = cos.shape[-1]
    half = rd // 2
    xr = x[..., :rd]
    rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([xr * c + rot * s, x[..., rd:]], -1)


def delta_rule_chunked(q, k, v, g, beta, chunk=CHUNK):
    """Gated delta rule, float32. q (scaled), k [B, T, h, dk]; v [B, T, h, dv]; g, beta [B, T, h].
    Per step: S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q. Within a chunk the u's
    solve (I + L) U = beta V - beta exp(G) K S0 (L strictly lower, WY form)."""
    import torch
    with torch.autocast(device_type=q.device.type, enabled=False):         # float32 throughout
        return _delta_rule_chunked(q.float(), k.float(), v.float(), g.float(), beta.float(), chunk)


def _delta_rule_chunked(q, k, v, g, beta, chunk):
    import torch
    B, T, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    tr = lambda x: x.transpose(1, 2)                                        # noqa: E731
    q, k, v, g, beta = tr(q), tr(k), tr(v), g.transpose(1, 2), beta.transpose(1, 2)
    if pad:
        P = torch.nn.functional.pad
        q, k, v = P(q, (0, 0, 0, pad)), P(k, (0, 0, 0, pad)), P(v, (0, 0, 0, pad))
        g, beta = P(g, (0, pad)), P(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, h, n, chunk), beta.reshape(B, h, n, chunk)
    G = g.cumsum(-1)                                                        # [B, h, n, C]
    idx = torch.arange(chunk, device=q.device)
    lower = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    diff = G[..., :, None] - G[..., None, :]
    decay_strict = torch.exp(diff.masked_fill(~lower, float("-inf")))
    decay_incl = torch.exp(diff.masked_fill(~incl, float("-inf")))
    Lmat = (beta[..., :, None] * (k @ k.transpose(-1, -2))) * decay_strict
    A = Lmat + torch.eye(chunk, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * torch.exp(G))[..., None] * k], -1)
    sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    Ub, W = sol[..., :dv], sol[..., dv:]
    qk = (q @ k.transpose(-1, -2)) * decay_incl
    S = torch.zeros(B, h, dk, dv, device=q.device, dtype=torch.float32)
    outs = []
    for c in range(n):
        U = Ub[:, :, c] - W[:, :, c] @ S
        eG = torch.exp(G[:, :, c])
        outs.append((q[:, :, c] * eG[..., None]) @ S + qk[:, :, c] @ U)
        last = G[:, :, c, -1:]
        S = S * torch.exp(last)[..., None] + (k[:, :, c] * torch.exp(last - G[:, :, c])[..., None]
                                              ).transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, h, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2)


# ---- export --------------------------------------------------------------------------------------

def export_tensors(model) -> dict:
    """{HF checkpoint name: float32 numpy array} (embedding: the kept rows only)."""
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("inv_freq") or ".mixer." in name:
            continue
        hf = name if name.startswith("mtp.") else "model." + name
        if hf == "model.embed_tokens":
            hf = "model.embed_tokens.weight"
        out[hf] = p.detach().float().cpu().numpy()
    return out


# ---- losses --------------------------------------------------------------------------------------

def lm_loss(model, hidden, target_idx, mask, num_unseen):
    """Mean -log p(target) over the full vocabulary: kept rows' logits, plus num_unseen logits
    fixed at 0; a target outside the kept set has logit 0."""
    import torch
    logits = hidden.to(model.embed_tokens.dtype) @ model.embed_tokens.t()
    logits = logits.float()
    lse = torch.logaddexp(torch.logsumexp(logits, -1), torch.tensor(math.log(num_unseen),
                                                                     device=logits.device))
    picked = logits.gather(-1, target_idx.clamp(min=0)[..., None])[..., 0]
    picked = torch.where(target_idx >= 0, picked, torch.zeros_like(picked))
    nll = (lse - picked) * mask
    return nll.sum() / mask.sum().clamp(min=1)


def step_losses(model, idx, mask, num_unseen):
    """(main loss, mtp loss) of windows idx [B, T] (kept indices), mask [B, T] on targets."""
    h, m = model(idx)
    main = lm_loss(model, h[:, :-1], idx[:, 1:], mask[:, 1:], num_unseen)
    mtp = lm_loss(model, m[:, :-1], idx[:, 2:], mask[:, 2:], num_unseen)
    return main, mtp


# ---- training ------------------------------------------------------------------------------------

def windows(ids: np.ndarray, seq: int) -> np.ndarray:
    n = len(ids) // seq
    return ids[:n * seq].reshape(n, seq)


def train_one(kind, corpus, device, steps, time_budget, log, batch=32):
    import torch
    torch.manual_seed(14)
    rng = np.random.default_rng(14)
    cfg = hf_config(kind)
    kept = corpus["vocab"]
    lut = np.full(VOCAB, -1, np.int64)
    lut[kept] = np.arange(kept.size)
    num_unseen = VOCAB - kept.size
    train = windows(lut[corpus["train"]], SEQ)
    chat = windows(lut[corpus["chat"]], SEQ)
    chat_mask = windows(corpus["chat_mask"].astype(np.float32), SEQ)
    model = build_model(cfg, kept.size).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[{kind}] params {n_params / 1e6:.2f} M (embedding rows {kept.size}), "
        f"{len(train)} windows of {SEQ}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    amp = torch.autocast(device, dtype=torch.bfloat16)     # float32 weights, bf16 matmuls

    def run_step(idx_np, mask_np, lr):
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.from_numpy(idx_np).to(device)
        mask = torch.from_numpy(mask_np).to(device)
        with amp:
            main, mtp = step_losses(model, idx, mask, num_unseen)
            loss = main + MTP_WEIGHT * mtp + AUX_WEIGHT * model.aux_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return main.item(), mtp.item()

    ones = np.ones((batch, SEQ), np.float32)
    # pre-training: time the first steps, then fix the count (recorded in the file's meta)
    t0 = time.time()
    total = steps
    step = 0
    warm = 30
    while True:
        if step == 5:
            t5 = time.time()                   # the first steps pay for CUDA warm-up
        if total is None and step == 15:
            per = (time.time() - t5) / 10
            total = max(20, int((time_budget - (t5 - t0)) / per))
            log(f"[{kind}] {per * 1e3:.0f} ms/step -> {total} pre-training steps")
        if total is not None and step >= total:
            break
        horizon = total or 10_000
        lr = 3e-3 * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(
            math.pi * min(step, horizon) / horizon)))
        pick = rng.integers(0, len(train), batch)
        main, mtp = run_step(train[pick], ones, lr)
        if step % 50 == 0 or step + 1 == total:
            log(f"[{kind}] step {step} loss {main:.3f} mtp {mtp:.3f} ({time.time() - t0:.0f} s)")
        step += 1
    pre_steps = step
    # chat-tuned pass: half chat windows (assistant tokens only), half pre-training windows
    chat_steps = max(2, pre_steps // 8)
    for s in range(chat_steps):
        half = batch // 2
        pc, pt = rng.integers(0, len(chat), half), rng.integers(0, len(train), batch - half)
        idx = np.concatenate([chat[pc], train[pt]])
        mask = np.concatenate([chat_mask[pc], ones[:batch - half]])
        main, mtp = run_step(idx, mask, 3e-4)
        if s % 20 == 0 or s == chat_steps - 1:
            log(f"[{kind}] chat step {s} loss {main:.3f} mtp {mtp:.3f}")
    model.eval()
    figures = evaluate(model, corpus, lut, num_unseen, device, amp)
    log(f"[{kind}] " + " ".join(f"{k} {v:.4f}" for k, v in figures.items()))
    meta = {"name": f"ninfer-ref-{kind}", "kind": kind, "seed": 14, "seq_len": SEQ,
            "batch": batch, "pre_training_steps": pre_steps, "chat_steps": chat_steps,
            "lr": 3e-3, "mtp_weight": MTP_WEIGHT, "aux_weight": AUX_WEIGHT,
            "params": n_params, "kept_rows": int(kept.size), "corpus": corpus["manifest"],
            "torch_figures": figures, "train_seconds": round(time.time() - t0, 1)}
    return cfg, meta, export_tensors(model)


def evaluate(model, corpus, lut, num_unseen, device, amp):
    """Perplexities on 64 training windows and on the held-out text (torch, float model)."""
    import torch
    out = {}
    sets = {"train": windows(lut[corpus["train"]], SEQ)[:64]}
    if corpus.get("heldout") is not None:
        sets["heldout"] = windows(lut[corpus["heldout"]], SEQ)[:64]
    with torch.no_grad(), amp:
        for name, w in sets.items():
            idx = torch.from_numpy(w).to(device)
            mask = torch.ones_like(idx, dtype=torch.float32)
            main, mtp = step_losses(model, idx, mask, num_unseen)
            out[f"{name}_ppl"] = math.exp(float(main))
            out[f"{name}_mtp_ppl"] = math.exp(float(mtp))
    return out


def load_corpus(d: pathlib.Path, heldout_ids=None) -> dict:
    c = {k: np.load(d / f"{k}.npy") for k in ("train", "chat", "chat_mask", "vocab")}
    c["manifest"] = json.loads((d / "manifest.json").read_text())
    c["heldout"] = np.load(d / "heldout.npy") if (d / "heldout.npy").is_file() else None
    return c


def cmd_train(args) -> int:
    from ninfer.reference_models import save_compact
    corpus = load_corpus(args.corpus)
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "train.log", "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()
    summary = {}
    for kind in args.models.split(","):
        cfg, meta, tensors = train_one(kind, corpus, args.device, args.steps, args.time_budget, log,
                                       batch=args.batch)
        save_compact(args.out / f"{kind}.npz", cfg, meta, corpus["vocab"], tensors)
        summary[kind] = meta["torch_figures"]
    log("SUMMARY " + json.dumps(summary))
    return 0


# ---- check: torch model == ninfer numpy model (CPU) ----------------------------------------------

def cmd_check(args) -> int:
    import tempfile

    import torch

    from ninfer.convert import convert_checkpoint
    from ninfer.reference_models import expand_to_checkpoint, save_compact
    from ninfer import Engine
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    worst = 0.0
    for kind in ("dense", "moe"):
        cfg = hf_config(kind)
        kept = np.unique(rng.integers(0, VOCAB, 300)).astype(np.int32)
        model = build_model(cfg, kept.size)
        with torch.no_grad():                  # non-trivial norms and a wide-range router
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and "linear_attn" not in name:
                    p.normal_(0.0, 0.2)
            tensors = export_tensors(model)
        # quantize first so torch and ninfer see the same (dequantized) weights
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            save_compact(tmp / "m.npz", cfg, {"check": True}, kept, tensors)
            from ninfer.reference_models import CompactModel
            cm = CompactModel(tmp / "m.npz")
            with torch.no_grad():
                for name, p in model.named_parameters():
                    hf = "mtp." + name[4:] if name.startswith("mtp.") else "model." + name
                    hf = "model.embed_tokens.weight" if name == "embed_tokens" else hf
                    w = cm.tensor(hf)
                    if name == "embed_tokens":
                        w = w[kept]
                    p.copy_(torch.from_numpy(_bf16_rounded(w)))
            expand_to_checkpoint(tmp / "m.npz", tmp / "hf")
            convert_checkpoint(tmp / "hf", tmp / "m.ninfer", progress=False)
            T = 150                                             # > 2 chunks, not a multiple
            ids = np.concatenate([rng.choice(kept, T - 5), rng.integers(0, VOCAB, 5)])
            lut = np.full(VOCAB, -1, np.int64)
            lut[kept] = np.arange(kept.size)
            with torch.no_grad():
                h, _ = model(torch.from_numpy(lut[ids])[None], with_mtp=False)
                emb = torch.from_numpy(cm.tensor("model.embed_tokens.weight"))
                ref = (h[0].double() @ torch.from_numpy(_bf16_rounded(emb.numpy())).double().t()
                       ).numpy()
            with Engine(str(tmp / "m.ninfer"), purpose="scoring") as eng:
                res = eng.score(ids, return_logits=True)
            got = res.logits
            err = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-9))
            print(f"{kind}: max |ninfer - torch| / max|logit| = {err:.2e} "
                  f"(max logit {np.max(np.abs(ref)):.2f})")
            worst = max(worst, err)
            if err > 1e-4:
                per = np.max(np.abs(got - ref), axis=1)
                print("per-position error:", np.array2string(per[::10], precision=3))
    ok = worst < 1e-4
    print("check", "ok" if ok else "FAILED")
    return 0 if ok else 1


def _bf16_rounded(w: np.ndarray) -> np.ndarray:
    """The float32 values the artifact's bfloat16 weights hold."""
    import ml_dtypes
    return np.asarray(w, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("corpus", type=pathlib.Path)
    t.add_argument("out", type=pathlib.Path)
    t.add_argument("--models", default="dense,moe")
    t.add_argument("--steps", type=int, default=None, help="pre-training steps per model")
    t.add_argument("--time-budget", type=float, default=60.0,
                   help="seconds of pre-training per model when --steps is not given")
    t.add_argument("--device", default="cuda")
    t.add_argument("--batch", type=int, default=32, help="windows of 512 tokens per step")
    t.set_defaults(fn=cmd_train)
    c = sub.add_parser("check")
    c.set_defaults(fn=cmd_check)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
