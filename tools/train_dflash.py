"""Train a DFlash block-diffusion drafter (z-lab's DFlash v1 architecture) for each reference model
(ninfer/demo_models/{dense,moe}.npz) and write its compact form (<name>-dflash.npz).

    python tools/train_dflash.py train CORPUS_DIR [--models dense,moe] [--time-budget S]
                                       [--windows N] [--out ninfer/demo_models]
    python tools/train_dflash.py eval [--models dense,moe] [--corpus CORPUS_DIR] [--untrained]

CORPUS_DIR: tools/reference_corpus.py's output (train.npy, heldout.npy). `eval` prints the held-out
figures of the shipped drafters (or, --untrained, of a freshly initialised one: ~0).

torch is allowed here and only here (never in ninfer/). The target is the reference model of
tools/train_reference.py, frozen, with the weights the engine sees (compact int8 dequantized, then
rounded to bfloat16), run in float32. The drafter, written from the DFlash equations:

  c_t = RMSNorm(f_t fc^T; hidden_norm), f_t = the target's residual stream after the decoder
        layers target_layer_ids at position t, concatenated;
  a block at anchor a: tokens [x_a, M, ..., M] at positions a .. a+bs-1, embedded by the target's
  embedding; each layer (Qwen3 attention + SwiGLU MLP, plain-weight RMSNorms, q/k norms, RoPE over
  the full head) lets every block query attend, non-causally, to the context keys/values of
  positions < a (k_proj/v_proj of c_t) and to the bs block keys; then RMSNorm(norm) and the
  target's tied lm_head. Block position j >= 1 drafts the token at a + j.

Labels: the target's greedy token at a + j (argmax over all 248,320 ids: the unseen ids' logits
are exactly 0). Loss: full-vocabulary cross-entropy, weighted exp(-(j - 1) / 4) per position.

Data: corpus windows (teacher-forced text) mixed with self-distillation sequences (z-lab's recipe:
the drafter sees what speculative decoding sees): train.npy prompts of GEN_PROMPT tokens continued
greedily by the frozen target for GEN_TOKENS tokens, by Jacobi iteration (the whole sequence re-run,
no KV cache; at most GEN_PASSES passes, so a late tail may be a not-yet-converged iterate). Their
anchors lie in the generated part, where the labels (always the exact teacher-forced greedy tokens)
are the generated tokens themselves.
A step takes a generated batch with probability GEN_MIX. --init starts from a drafter file.
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
sys.path.insert(0, str(ROOT / "tools"))

from train_reference import VOCAB, _bf16_rounded, build_model, windows  # noqa: E402

SEQ = 512
BS = 8
TARGET_LAYER_IDS = {"dense": [1, 3, 5], "moe": [0, 2, 3]}
# <|image_pad|> (248056) is not among the reference models' kept ids (its row is zero), so the
# mask token is <|im_start|>: kept and trained (chat data), and never generated (it only opens a
# turn, after the <|im_end|> that stops generation).
MASK_TOKEN, MASK_NAME = 248045, "<|im_start|>"
SEED = 14
ANCHORS = 48                    # anchors per training window
BATCH = 4                       # windows per step
LR = 2e-3
EVAL_STRIDE = 3                 # held-out anchors: every 3rd position of every window
GEN_PROMPT = (64, 192)          # self-distillation prompt lengths (uniform, one per chunk)
GEN_TOKENS = 64                 # greedy tokens generated per prompt
GEN_CHUNK = 32                  # prompts generated together
GEN_PASSES = 32                 # Jacobi passes at most (exact when converged sooner)
GEN_MIX = 0.75                  # share of steps on generated sequences


def drafter_config(kind: str) -> dict:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "intermediate_size": 384, "rms_norm_eps": 1e-6,
            "rope_theta": 10000000.0, "vocab_size": VOCAB, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "max_position_embeddings": 32768, "block_size": BS,
            "dflash_config": {"target_layer_ids": TARGET_LAYER_IDS[kind], "block_size": BS,
                              "mask_token_id": MASK_TOKEN}}


# ---- the drafter (torch) -------------------------------------------------------------------------

def build_drafter(cfg: dict):
    import torch
    import torch.nn as nn
    import torch.nn.functional as Fn

    H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_feat = len(cfg["dflash_config"]["target_layer_ids"]) * H

    class Norm(nn.Module):                            # plain weight: x / rms(x) * w
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

    def lin(i, o):
        m = nn.Linear(i, o, bias=False)
        nn.init.normal_(m.weight, std=0.02)           # Qwen3's initializer_range
        return m

    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def rope(x, pos):
        """x [B, T, h, hd], pos [B, T] (or [T]) absolute positions; rotate-half, full head."""
        ang = pos.to(torch.float64)[..., None] * inv_freq
        ang = torch.cat([ang, ang], -1).float()
        cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
        if cos.dim() == 3:                            # [T, 1, hd] -> broadcast over B
            cos, sin = cos[None], sin[None]
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = lin(H, nh * hd), lin(H, nkv * hd)
            self.v_proj, self.o_proj = lin(H, nkv * hd), lin(nh * hd, H)
            self.q_norm, self.k_norm = Norm(hd), Norm(hd)

        def kv(self, x, pos):
            B, T, _ = x.shape
            k = rope(self.k_norm(self.k_proj(x).reshape(B, T, nkv, hd)), pos)
            return k, self.v_proj(x).reshape(B, T, nkv, hd)

        def forward(self, h, pos, ctx, ctx_pos, mask):
            B, T, _ = h.shape
            q = rope(self.q_norm(self.q_proj(h).reshape(B, T, nh, hd)), pos)
            kb, vb = self.kv(h, pos)
            kc, vc = self.kv(ctx, ctx_pos)
            k, v = torch.cat([kc, kb], 1), torch.cat([vc, vb], 1)
            rep = nh // nkv                           # query head j reads kv head j // rep
            k = k.repeat_interleave(rep, 2).transpose(1, 2)
            v = v.repeat_interleave(rep, 2).transpose(1, 2)
            o = Fn.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                                scale=hd ** -0.5)
            return self.o_proj(o.transpose(1, 2).reshape(B, T, nh * hd))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            I = cfg["intermediate_size"]
            self.gate_proj, self.up_proj, self.down_proj = lin(H, I), lin(H, I), lin(I, H)

        def forward(self, x):
            return self.down_proj(Fn.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = Norm(H), Norm(H)
            self.self_attn, self.mlp = Attention(), MLP()

        def forward(self, x, pos, ctx, ctx_pos, mask):
            x = x + self.self_attn(self.input_layernorm(x), pos, ctx, ctx_pos, mask)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Drafter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = lin(n_feat, H)
            self.hidden_norm, self.norm = Norm(H), Norm(H)
            self.layers = nn.ModuleList([Layer() for _ in range(cfg["num_hidden_layers"])])

        def forward(self, feats, x, pos, mask):
            """feats [B, S, n*H] target features of positions 0..S-1; x [B, Q, H] the blocks'
            embeddings, pos [B, Q] their positions; mask [B, Q, S + Q] (True: attend).
            -> [B, Q, H] final-normed hidden states (logits = g E^T)."""
            ctx = self.hidden_norm(self.fc(feats))
            ctx_pos = torch.arange(feats.shape[1], device=feats.device)
            for layer in self.layers:
                x = layer(x, pos, ctx, ctx_pos, mask)
            return self.norm(x)

    return Drafter()


def block_inputs(anchors, S: int):
    """anchors [B, A] -> (positions [B, A*BS], mask [B, A*BS, S + A*BS]): a block query sees the
    context keys before its anchor and its own block's BS keys (not other blocks')."""
    import torch
    B, A = anchors.shape
    pos = (anchors[:, :, None] + torch.arange(BS)).reshape(B, A * BS)
    qa = anchors.repeat_interleave(BS, 1)                                   # [B, Q]
    ctx = torch.arange(S)[None, None, :] < qa[:, :, None]                   # [B, Q, S]
    grp = torch.arange(A).repeat_interleave(BS)
    own = (grp[:, None] == grp[None, :]).expand(B, -1, -1)                   # [B, Q, Q]
    return pos, torch.cat([ctx, own], -1)


# ---- the target (frozen) -------------------------------------------------------------------------

class Target:
    """The reference model as the engine sees it, plus its kept-id lookup."""

    def __init__(self, kind: str):
        import torch
        from ninfer.reference_models import EMBED, CompactModel, model_path
        cm = CompactModel(model_path(kind))
        self.kind, self.kept = kind, cm.kept_ids
        self.lut = np.full(VOCAB, -1, np.int64)
        self.lut[self.kept] = np.arange(self.kept.size)
        # the smallest id outside the kept set: the full-vocabulary argmax when all kept logits < 0
        self.first_unseen = int(np.flatnonzero(self.lut < 0)[0])
        self.model = build_model(cm.config, self.kept.size)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                hf = "mtp." + name[4:] if name.startswith("mtp.") else "model." + name
                hf = EMBED if name == "embed_tokens" else hf
                w = cm.tensor(hf)
                p.copy_(torch.from_numpy(_bf16_rounded(w[self.kept] if hf == EMBED else w)))
        self.model.eval().requires_grad_(False)
        self.E = self.model.embed_tokens.detach()                            # [K, H] kept rows

    def embed(self, kept_idx):
        return self.model.embed(kept_idx)

    def argmax(self, logits):
        """Full-vocabulary greedy token of kept-row logits [..., K], as a kept index, or -1 for
        the first unseen id (logit 0 beats every kept logit)."""
        import torch
        best, idx = logits.max(-1)
        kept_wins = (best > 0) | ((best == 0) & (torch.from_numpy(self.kept)[idx]
                                                 < self.first_unseen))
        return torch.where(kept_wins, idx, torch.full_like(idx, -1))

    def run(self, kept_idx, layer_ids):
        """kept_idx [B, T] -> (features [B, T, n*H] float32, greedy labels y [B, T])."""
        import torch
        m = self.model
        with torch.no_grad():
            pos = m.positions(kept_idx.shape[1], kept_idx.device)
            h, feats = m.embed(kept_idx), []
            for i, layer in enumerate(m.layers):
                h = layer(h, pos)
                if i in layer_ids:
                    feats.append(h)
            y = self.argmax(m.norm(h) @ self.E.t())
        return torch.cat(feats, -1), y


def generate(target, train_ids, layer_ids, seconds, rng, log):
    """Self-distillation chunks (toks, feats, y, prompt_len) generated for `seconds`: GEN_CHUNK
    random train.npy prompts, continued by GEN_TOKENS greedy tokens of the target."""
    import torch
    chunks, t0, agree, passes = [], time.time(), [], []
    while time.time() - t0 < seconds:
        P = int(rng.integers(GEN_PROMPT[0], GEN_PROMPT[1] + 1))
        starts = rng.integers(0, len(train_ids) - P - GEN_TOKENS, GEN_CHUNK)
        toks = torch.from_numpy(target.lut[np.stack([train_ids[s:s + P + GEN_TOKENS]
                                                     for s in starts])])
        with torch.no_grad():           # Jacobi: guess (the corpus text), re-run, until fixed
            for it in range(GEN_PASSES):  # each pass fixes >= 1 more token
                h, _ = target.model(toks[:, :-1], with_mtp=False)
                new = target.argmax(h[:, P - 1:] @ target.E.t())
                if torch.equal(new, toks[:, P:]):
                    break
                toks[:, P:] = new
            passes.append(it + 1)
        f, y = target.run(toks, layer_ids)
        agree.append(float((y[:, P - 1:-1] == toks[:, P:]).float().mean()))
        chunks.append((toks, f, y, P))
    log(f"[{target.kind}] generated {len(chunks)} x {GEN_CHUNK} sequences of {GEN_TOKENS} tokens: "
        f"{time.time() - t0:.1f} s, {np.mean(passes):.1f} passes per chunk "
        f"(labels == generated tokens: {np.mean(agree):.4f})")
    return chunks


def sample_anchors(rng, lo, hi, n):
    """n sorted anchors in lo .. hi-1 for each of BATCH rows -> [BATCH, n]."""
    import torch
    return torch.from_numpy(np.stack([np.sort(rng.choice(np.arange(lo, hi), n, replace=False))
                                      for _ in range(BATCH)]))


def precompute(target, ids: np.ndarray, layer_ids, log, chunk=8):
    import torch
    w = torch.from_numpy(target.lut[ids])
    feats, ys = [], []
    t0 = time.time()
    for s in range(0, len(w), chunk):
        f, y = target.run(w[s:s + chunk], layer_ids)
        feats.append(f)
        ys.append(y)
    log(f"[{target.kind}] target features + labels of {len(w)} windows x {w.shape[1]}: "
        f"{time.time() - t0:.1f} s")
    return w, torch.cat(feats), torch.cat(ys)


# ---- loss and evaluation -------------------------------------------------------------------------

def position_weights():
    import torch
    return torch.exp(-torch.arange(BS - 1, dtype=torch.float32) / 4.0)      # j = 1 .. BS-1


def block_logits(drafter, target, toks, feats, anchors):
    """toks [B, S] kept indices, feats [B, S, nH], anchors [B, A] -> kept-row logits of the
    drafted positions [B, A, BS-1, K]."""
    import torch
    B, A = anchors.shape
    first = toks.gather(1, anchors)                                          # x_a
    mask_idx = int(target.lut[MASK_TOKEN])
    blk = torch.full((B, A, BS), mask_idx, dtype=torch.long)
    blk[:, :, 0] = first
    pos, mask = block_inputs(anchors, toks.shape[1])
    g = drafter(feats, target.embed(blk.reshape(B, A * BS)), pos, mask)
    g = g.reshape(B, A, BS, -1)[:, :, 1:].reshape(B * A * (BS - 1), -1)
    return (g @ target.E.t()).reshape(B, A, BS - 1, -1)          # one mm (bmm is slower on CPU)


def block_labels(y, anchors):
    """y [B, S] the target's greedy labels -> [B, A, BS-1]: y[a + j - 1], j = 1 .. BS-1."""
    import torch
    idx = anchors[:, :, None] + torch.arange(BS - 1)
    return y.gather(1, idx.reshape(len(y), -1)).reshape(idx.shape)


def weighted_ce(logits, labels, num_unseen):
    import torch
    logits = logits.float()
    lse = torch.logaddexp(torch.logsumexp(logits, -1), torch.tensor(math.log(num_unseen)))
    picked = logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    nll = lse - torch.where(labels >= 0, picked, torch.zeros_like(picked))
    w = position_weights()
    return (nll * w).sum(-1).mean() / w.sum()


def evaluate(drafter, target, toks, feats, y, log=None):
    """Greedy acceptance over every EVAL_STRIDE-th anchor of each window: accepted = number of
    leading j with d_j == y[a + j - 1]."""
    import torch
    anchors = torch.arange(1, toks.shape[1] - BS + 1, EVAL_STRIDE)
    acc = []
    with torch.no_grad():
        for i in range(len(toks)):
            a = anchors[None]
            d = target.argmax(block_logits(drafter, target, toks[i:i + 1], feats[i:i + 1], a))
            ok = (d == block_labels(y[i:i + 1], a))[0]                       # [A, BS-1]
            acc.append(ok.int().cumprod(-1))
    lead = torch.cat(acc).float()                                            # [N, BS-1]
    return {"block_size": BS, "anchors": int(lead.shape[0]), "windows": int(len(toks)),
            "mean_accepted": round(float(lead.sum(-1).mean()), 4),
            "tokens_per_step": round(1.0 + float(lead.sum(-1).mean()), 4),
            # P(the first j drafts are all accepted), j = 1 .. BS-1
            "accept_rate_by_position": [round(float(v), 4) for v in lead.mean(0)]}


def heldout_windows(corpus):
    if corpus is not None and (corpus / "heldout.npy").is_file():
        ids = np.load(corpus / "heldout.npy")
    else:                           # the committed held-out text, tokenized as the corpus was
        import tokenizers
        from ninfer.models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json
        tok = tokenizers.Tokenizer.from_str(cached_qwen3_5_tokenizer_json().decode("utf-8"))
        text = (ROOT / "ninfer/demo_models/heldout.txt").read_text(encoding="utf-8")
        ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int32)
    return windows(ids, SEQ)


# ---- train / eval --------------------------------------------------------------------------------

def export(drafter) -> dict:
    return {n: p.detach().float().numpy() for n, p in drafter.state_dict().items()}


def load_drafter(path):
    """A compact drafter -> torch module with the engine's weights (dequantized, bf16-rounded)."""
    import torch
    from ninfer.reference_models import CompactDrafter
    cd = CompactDrafter(path)
    drafter = build_drafter(cd.config)
    drafter.load_state_dict({n: torch.from_numpy(_bf16_rounded(cd.tensor(n))) for n in cd.names})
    return drafter.eval(), cd


def train_one(kind, corpus, args, log):
    import torch
    from ninfer.reference_models import save_compact_drafter
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    cfg = drafter_config(kind)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    target = Target(kind)
    num_unseen = VOCAB - target.kept.size
    train_ids = np.load(corpus / "train.npy")
    train = windows(train_ids, SEQ)
    pick = np.sort(rng.choice(len(train), min(args.windows, len(train)), replace=False))
    t0 = time.time()
    toks, feats, y = precompute(target, train[pick], layer_ids, log)
    pre_s = time.time() - t0
    t0 = time.time()
    gen = generate(target, train_ids, layer_ids, args.gen_seconds, rng, log)
    gen_s = time.time() - t0
    init = args.init.format(kind=kind) if args.init else None
    drafter = load_drafter(init)[0].train() if init else build_drafter(cfg)
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"[{kind}] drafter params {n_params / 1e6:.3f} M" + (f", from {init}" if init else ""))
    heldout = precompute(target, heldout_windows(args.corpus), layer_ids, log)
    if init:                                                 # its figures are in its __meta__
        from ninfer.reference_models import CompactDrafter
        start = CompactDrafter(init).meta.get("heldout")
    else:
        start = evaluate(drafter, target, *heldout)          # sanity: ~0
        log(f"[{kind}] untrained drafter, held-out: {json.dumps(start)}")
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    # the schedule follows the elapsed fraction of the time budget (or of --steps): the machine
    # is shared, so a step count fixed from the first steps' speed would miss the budget
    t1, step, warm = time.time(), 0, 30
    while True:
        done = step / args.steps if args.steps else (time.time() - t1) / args.time_budget
        if done >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = lr
        if gen and rng.random() < GEN_MIX:      # anchor P-1 drafts the first generated token
            t, f, yy, P = gen[rng.integers(len(gen))]
            anchors = sample_anchors(rng, P - 1, t.shape[1] - BS + 1, ANCHORS)
        else:
            t, f, yy = toks, feats, y
            anchors = sample_anchors(rng, 1, SEQ - BS + 1, ANCHORS)
        b = torch.from_numpy(rng.choice(len(t), BATCH, replace=False))
        logits = block_logits(drafter, target, t[b], f[b], anchors)
        loss = weighted_ce(logits, block_labels(yy[b], anchors), num_unseen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            log(f"[{kind}] step {step} loss {loss.item():.3f} ({time.time() - t1:.0f} s)")
        step += 1
    train_s = time.time() - t1
    # figures of the shipped weights: save, reload (int8 -> bf16), evaluate, save with them
    out = args.out / f"{kind}-dflash.npz"
    meta = {"name": f"ninfer-ref-{kind}-dflash", "target": kind, "seed": SEED,
            "torch": torch.__version__, "target_layer_ids": layer_ids,
            "mask_token": {"id": MASK_TOKEN, "text": MASK_NAME},
            "recipe": {"seq_len": SEQ, "block_size": BS, "anchors_per_window": ANCHORS,
                       "windows_per_step": BATCH, "optimizer": "AdamW", "lr": args.lr,
                       "betas": [0.9, 0.95], "weight_decay": 0.01, "warmup": warm,
                       "schedule": "cosine to 0.1", "grad_clip": 1.0,
                       "loss": "full-vocabulary CE, weight exp(-(j-1)/4)",
                       "labels": "target greedy", "train_windows": int(len(toks)),
                       "init": init and pathlib.Path(init).name,
                       "self_distillation": {
                           "prompts": "random train.npy windows", "prompt_len": list(GEN_PROMPT),
                           "greedy_tokens": GEN_TOKENS,
                           "sequences": len(gen) * GEN_CHUNK, "steps_share": GEN_MIX,
                           "anchors": "generated part (first at prompt_len - 1)",
                           "seconds": round(gen_s, 1)}},
            "steps": step, "time_budget_seconds": args.time_budget,
            "precompute_seconds": round(pre_s, 1),
            "train_seconds": round(train_s, 1), "params": n_params}
    save_compact_drafter(out, cfg, meta, export(drafter))
    figures = evaluate(load_drafter(out)[0], target, *heldout)
    log(f"[{kind}] held-out: {json.dumps(figures)}")
    meta["heldout"] = figures
    meta["heldout_init" if init else "heldout_untrained"] = start
    save_compact_drafter(out, cfg, meta, export(drafter))
    return meta


def eval_file(kind, path, corpus, log, untrained=False):
    import torch
    target = Target(kind)
    if untrained:
        torch.manual_seed(SEED)
        drafter = build_drafter(drafter_config(kind)).eval()
    else:
        drafter, _ = load_drafter(path)
    layer_ids = drafter_config(kind)["dflash_config"]["target_layer_ids"]
    toks, feats, y = precompute(target, heldout_windows(corpus), layer_ids, log)
    t0 = time.time()
    figures = evaluate(drafter, target, toks, feats, y)
    log(f"[{kind}{' untrained' if untrained else ''}] held-out: {json.dumps(figures)} "
        f"({time.time() - t0:.0f} s)")
    return figures


def cmd_train(args) -> int:
    import torch
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for kind in args.models.split(","):
        meta = train_one(kind, args.corpus, args, lambda m: print(m, flush=True))
        summary[kind] = meta["heldout"]
    print("SUMMARY " + json.dumps(summary))
    return 0


def cmd_eval(args) -> int:
    import torch
    from ninfer.reference_models import drafter_path
    torch.set_num_threads(args.threads)
    for kind in args.models.split(","):
        path = None if args.untrained else drafter_path(kind)
        eval_file(kind, path, args.corpus, lambda m: print(m, flush=True), args.untrained)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("corpus", type=pathlib.Path)
    t.add_argument("--models", default="dense,moe")
    t.add_argument("--out", type=pathlib.Path, default=ROOT / "ninfer/demo_models")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--time-budget", type=float, default=660.0,
                   help="seconds of drafter training per model when --steps is not given")
    t.add_argument("--windows", type=int, default=600,
                   help="train.npy windows of 512 tokens whose target features are precomputed")
    t.add_argument("--gen-seconds", type=float, default=150.0,
                   help="seconds of self-distillation generation per model (0: corpus only)")
    t.add_argument("--init", default=None,
                   help="start from this drafter file ({kind} -> the model's name)")
    t.add_argument("--lr", type=float, default=LR)
    t.add_argument("--threads", type=int, default=2)
    t.set_defaults(fn=cmd_train)
    e = sub.add_parser("eval")
    e.add_argument("--models", default="dense,moe")
    e.add_argument("--corpus", type=pathlib.Path, default=None,
                   help="corpus dir with heldout.npy (default: tokenize the committed text)")
    e.add_argument("--untrained", action="store_true")
    e.add_argument("--threads", type=int, default=2)
    e.set_defaults(fn=cmd_eval)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
