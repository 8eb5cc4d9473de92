"""Build the oracle fixtures: tiny random Qwen3.5 checkpoints plus transformers' reference outputs.

Regenerate (maintainers only; CI never runs this, it reads the committed files), from the repository
root with a Python that has torch and transformers (the maintainers' venv, not the project's):

    python tools/make_fixtures.py                   # all fixtures, into tests/fixtures/
    python tools/make_fixtures.py dense moe         # some of them
    python tools/make_fixtures.py --out OTHER_DIR   # elsewhere (e.g. to diff against the committed)

The committed files were made with torch 2.13.0+cpu, transformers 5.24.0, numpy 2.4, tokenizers
0.23, on CPU; the exact versions are recorded in each reference.npz. Output is deterministic for
given versions (every fixture has its own seed; a rerun reproduced every array bit for bit).

Each fixture `tests/fixtures/<name>/` is a Hugging Face checkpoint directory in the real release
layout (config.json, generation_config.json, bf16 *.safetensors, sharded ones with their index,
a tiny tokenizer) and a `reference.npz`:

    prefill_lengths          int32 [S]        lengths of the scored sequences (1, 5, 37, 70)
    prefill_ids_{s}          int32 [T]        random token ids
    prefill_logits_{s}       float32 [T, V]   logits of one full forward pass (no cache)
    greedy_prompt_{g}        int32 [P]        g in {0, 1}
    greedy_tokens_{g}        int32 [16]       generate(do_sample=False, max_new_tokens=16), cached
    greedy_margins_{g}       float32 [16]     top-1 minus top-2 logit at each step (>= 0.05)
    mrope_ids                int32 [30]       random ids ...
    mrope_positions          int32 [3, 30]    ... at (t, h, w) positions of text + a 2x3x3 grid + text
    mrope_logits             float32 [30, V]  logits of one forward with those position_ids
    fp32_vs_fp64_rel         float32 []       max|fp32 - fp64| / max|fp64| over all prefill logits
    hf_decode_vs_prefill_rel float32 []       transformers' own cached decode vs full forward
    versions                 str              torch / transformers / numpy versions

The reference logits are computed in float32 from the bf16-rounded weights: the model is built in
float32, re-initialised with a large std (so logits are far from flat and the routing has no ties),
cast to bf16 and saved; the saved directory is loaded back with `dtype=torch.float32` (an exact
upcast) and only that reloaded model produces the references. Loading back also proves the saved
names and shapes are what transformers expects (no missing / unexpected keys, mtp.* aside).

The `*_cond_gen` fixtures use the multimodal release layout (`model.language_model.*`,
`model.visual.*`, `lm_head.weight`) and carry `mtp.*` tensors shaped like the release MTP head
(fc [H, 2H], three zero-centred norms, one full-attention decoder layer); transformers ignores
mtp on load, so those are written here. MoE experts are stored per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) as the official checkpoints are; transformers'
save_pretrained reverts its fused in-memory layout to that form by itself.
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (GenerationConfig, Qwen3_5Config, Qwen3_5ForCausalLM,
                          Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
PREFILL_LENGTHS = (1, 5, 37, 70)     # 70 > 64: transformers' GDN chunk size, so two chunks
GREEDY_PROMPT_LENGTHS = (6, 29)
MROPE_LAYOUT = (6, (2, 3, 3), 6)    # text tokens, a vision grid (t, h, w), text tokens
GREEDY_NEW_TOKENS = 16
MIN_GREEDY_MARGIN = 0.05             # a logit gap no fp32 noise of another implementation flips
EOS_ID, BOS_ID = 2, 1
SPECIAL_IDS = dict(image_token_id=256, video_token_id=257, vision_start_token_id=258,
                   vision_end_token_id=259)   # in-vocab for the tiny models; prompts avoid them
ADDED_TOKENS = {0: "<|im_start|>", BOS_ID: "<|endoftext|>", EOS_ID: "<|im_end|>",
                256: "<|image_pad|>", 257: "<|video_pad|>", 258: "<|vision_start|>",
                259: "<|vision_end|>"}


def rope(head_dim, factor, section, theta=10_000_000.0):
    assert sum(section) * 2 == int(head_dim * factor), "mrope_section must cover rotary_dim / 2"
    return dict(rope_type="default", rope_theta=theta, partial_rotary_factor=factor,
                mrope_section=list(section), mrope_interleaved=True)


BASE_TEXT = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                 max_position_embeddings=4096, rope_parameters=rope(16, 0.25, (1, 1, 0)),
                 eos_token_id=EOS_ID, bos_token_id=BOS_ID, tie_word_embeddings=False)
MOE_TEXT = dict(BASE_TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                shared_expert_intermediate_size=32, norm_topk_prob=True)
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, in_channels=3,
                   patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                   num_position_embeddings=16, hidden_act="gelu_pytorch_tanh")

# name -> (seed, builder key, text config overrides, save options)
FIXTURES = {
    "dense": (1, "dense", dict(hidden_size=40, intermediate_size=80, head_dim=32,
                               rope_parameters=rope(32, 0.25, (2, 1, 1))), {}),
    "dense_tied": (2, "dense", dict(tie_word_embeddings=True, num_hidden_layers=5), {}),
    "moe": (3, "moe", {}, {}),
    # multimodal layouts: 4 rotary frequencies whose MRoPE axes differ between the interleaved
    # and the contiguous section layouts, and a small theta so those frequencies matter
    "cond_gen": (4, "cond_gen", dict(rope_parameters=rope(16, 0.5, (2, 1, 1), theta=1000.0)), {}),
    "moe_cond_gen": (5, "moe_cond_gen", dict(moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16,
                                             rope_parameters=rope(16, 0.5, (2, 1, 1),
                                                                  theta=1000.0)), {}),
    "odd_heads": (6, "dense", dict(
        num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2, head_dim=20,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                     "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12,
        linear_value_head_dim=8, rope_parameters=rope(20, 0.6, (3, 2, 1), theta=10000.0)), {}),
    "sharded": (7, "dense", dict(num_hidden_layers=6), dict(max_shard_size="60KB")),
}


# ---- building ------------------------------------------------------------------------------------

def build_model(kind: str, text: dict):
    if kind == "dense":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    if kind == "moe":
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])
    if kind == "cond_gen":
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, **SPECIAL_IDS,
                            tie_word_embeddings=text["tie_word_embeddings"])
        return Qwen3_5ForConditionalGeneration(cfg)
    if kind == "moe_cond_gen":
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, **SPECIAL_IDS,
                               tie_word_embeddings=text["tie_word_embeddings"])
        return Qwen3_5MoeForConditionalGeneration(cfg)
    raise ValueError(kind)


def init_std(name: str) -> tuple[float, float]:
    """(mean, std) of the random re-initialisation of one parameter, chosen for lively logits:
    zero-centred norms get weights around 0, the gated GDN norm around 1, the decay parameters a
    spread of time scales (A in ~[0.02, 2.7]) so some GDN heads remember across the whole prompt."""
    if name.endswith("linear_attn.norm.weight"):
        return 1.0, 0.15
    if name.endswith("norm.weight") or name.endswith("layernorm.weight") or "norm1" in name \
            or "norm2" in name:
        return 0.0, 0.15
    if name.endswith("A_log"):
        return -1.5, 1.2
    if name.endswith("dt_bias"):
        return 0.0, 0.5
    if "conv1d" in name:
        return 0.0, 0.35
    if "embed_tokens" in name:
        return 0.0, 0.5
    if name.endswith("mlp.gate.weight"):       # MoE router: large spread -> no near-ties in top-k
        return 0.0, 0.5
    if name.endswith(".bias"):
        return 0.0, 0.05
    return 0.0, 0.15


@torch.no_grad()
def reinit_(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        mean, std = init_std(name)
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std + mean)


def text_config_of(model):
    cfg = model.config
    return cfg.text_config if hasattr(cfg, "text_config") else cfg


def mtp_tensors(model, kind: str, seed: int) -> dict:
    """Random bf16 tensors in the release MTP layout: mtp.fc [H, 2H], mtp.{pre_fc_norm_embedding,
    pre_fc_norm_hidden, norm} [H], mtp.layers.0.* = one full-attention decoder layer (dense MLP or
    MoE with per-expert weights, like the main layers of that checkpoint)."""
    tcfg = copy.deepcopy(text_config_of(model))
    tcfg.layer_types = ["full_attention"]
    tcfg.num_hidden_layers = 1
    layer_cls = Qwen3_5MoeDecoderLayer if kind.startswith("moe") else Qwen3_5DecoderLayer
    layer = layer_cls(tcfg, 0)
    reinit_(layer, seed + 1000)
    H = tcfg.hidden_size
    out = {}
    for name, t in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":            # fused [E, 2I, H] -> per expert
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name == "mlp.experts.down_proj":             # [E, H, I]
            for e in range(t.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[f"mtp.layers.0.{name}"] = t
    g = torch.Generator().manual_seed(seed + 2000)
    out["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) * 0.15
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.randn(H, generator=g) * 0.15
    return {k: v.to(torch.bfloat16).contiguous() for k, v in out.items()}


def save_checkpoint(model, kind: str, seed: int, out: pathlib.Path, save_opts: dict) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.bfloat16).save_pretrained(out, **save_opts)
    tcfg = text_config_of(model)
    gen = dict(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, BOS_ID], pad_token_id=BOS_ID,
               do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(out, tcfg.vocab_size)
    if kind.endswith("cond_gen"):
        # transformers drops mtp.* on load; the release keeps one MTP layer next to the model
        weights = out / "model.safetensors"
        assert weights.exists(), "cond_gen fixtures are single-file"
        tensors = load_file(weights)
        tensors.update(mtp_tensors(model, kind, seed))
        save_file(tensors, weights, metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        cfg["text_config"]["mtp_num_hidden_layers"] = 1
        cfg["text_config"]["mtp_use_dedicated_embeddings"] = False
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    assert tcfg.vocab_size == 512


# ---- tokenizer -----------------------------------------------------------------------------------

def tiny_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json covering exactly ids [0, vocab_size): the Qwen-style added
    tokens at the ids of ADDED_TOKENS, the 256 byte symbols and trained merges in the other ids.
    The models are random, so the text is gibberish; it exists because a real checkpoint directory
    carries one and the Engine's Frontend reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    free_ids = [i for i in range(vocab_size) if i not in ADDED_TOKENS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(free_ids), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = tokenizer_corpus()
    tok.train_from_iterator(corpus, trainer)
    doc = json.loads(tok.to_str())
    trained = sorted(doc["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert len(trained) == len(free_ids), f"trained {len(trained)} pieces, need {len(free_ids)}"
    doc["model"]["vocab"] = {piece: free_ids[k] for k, (piece, _) in enumerate(trained)}
    # tokenizers keeps an added token's id only if the model vocabulary has it (else it appends)
    doc["model"]["vocab"].update({t: i for i, t in ADDED_TOKENS.items()})
    doc["added_tokens"] = [dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False,
                                normalized=False, special=True)
                           for i, t in sorted(ADDED_TOKENS.items())]
    text = json.dumps(doc, ensure_ascii=False, indent=1)
    check = Tokenizer.from_str(text)
    assert check.get_vocab_size() == vocab_size
    assert check.decode(check.encode("Tiny fixtures.").ids) == "Tiny fixtures."
    assert all(check.token_to_id(t) == i for i, t in ADDED_TOKENS.items())
    assert check.encode("a<|im_end|>").ids[-1] == EOS_ID
    return text


def tokenizer_corpus() -> list:
    """Fixed pseudo-text for the merges (seeded PCG64, so independent of anything else here)."""
    syllables = ("qwen", "del", "ta", "net", "gat", "ed", "at", "ten", "tion", "to", "ken", "mo",
                 "ex", "pert", "rou", "ter", "lay", "er", "norm", "ro", "pe", "ca", "che", "page",
                 "state", "slot", "in", "fer", "ence", "num", "py", " ", ",", ".", "\n", "0", "7")
    rng = np.random.default_rng(20260101)
    picks = rng.integers(0, len(syllables), size=(400, 24))
    return ["".join(syllables[i] for i in row) for row in picks]


def write_tokenizer(out: pathlib.Path, vocab_size: int) -> None:
    (out / "tokenizer.json").write_text(tiny_tokenizer_json(vocab_size) + "\n")
    cfg = dict(tokenizer_class="Qwen2Tokenizer", bos_token=None, eos_token=ADDED_TOKENS[EOS_ID],
               pad_token=ADDED_TOKENS[BOS_ID], model_max_length=4096, add_prefix_space=False)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ---- verification and references -----------------------------------------------------------------

def load_back(out: pathlib.Path, cls, dtype=torch.float32):
    # eager attention and eager experts: the plainest math transformers has, and fp64-capable
    model, info = cls.from_pretrained(out, dtype=dtype, attn_implementation="eager",
                                      experts_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if k != "error_msgs" and
           [x for x in v if not str(x).startswith("mtp.")]}
    if bad or info.get("error_msgs"):
        raise SystemExit(f"{out.name}: transformers reload is not clean: {info}")
    return model.eval()


def check_saved_dtypes(out: pathlib.Path) -> int:
    total = 0
    for f in sorted(out.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if t.dtype != torch.bfloat16:
                raise SystemExit(f"{out.name}: {name} saved as {t.dtype}, want bfloat16")
            total += t.numel()
    return total


def random_ids(rng: np.random.Generator, length: int, vocab: int) -> np.ndarray:
    avoid = set(SPECIAL_IDS.values())
    ids = [i for i in rng.integers(0, vocab, size=4 * length + 8) if int(i) not in avoid]
    return np.asarray(ids[:length], dtype=np.int64)


@torch.no_grad()
def full_logits(model, ids: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(np.asarray(ids, np.int64))[None]
    return model(input_ids=x, use_cache=False).logits[0].double().numpy()


@torch.no_grad()
def greedy(model, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' cached greedy decoding, plus its per-step logits (for margins and the
    decode-vs-prefill self-check)."""
    gc = GenerationConfig(do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS,
                          min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    x = torch.from_numpy(prompt)[None]
    res = model.generate(input_ids=x, generation_config=gc, output_logits=True,
                         return_dict_in_generate=True, use_cache=True)
    new = res.sequences[0, len(prompt):].numpy()
    logits = torch.stack(res.logits, dim=1)[0].double().numpy()
    return new, logits


def mrope_positions() -> np.ndarray:
    """[3, T] (t, h, w) positions shaped like a prompt with one video grid, the way Qwen's
    get_rope_index lays them out: text i -> (i, i, i); grid cell (a, b, c) -> base + (a, b, c);
    the text after it resumes at 1 + the largest position used. t != h != w inside the grid, so
    unlike plain text positions this pins down which rotary frequencies MRoPE gives each axis."""
    n_before, (gt, gh, gw), n_after = MROPE_LAYOUT
    text = np.arange(n_before)
    a, b, c = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
    grid = n_before + np.stack([a.ravel(), b.ravel(), c.ravel()])
    after = grid.max() + 1 + np.arange(n_after)
    return np.concatenate([np.stack([text] * 3), grid, np.stack([after] * 3)], axis=1)


@torch.no_grad()
def logits_at_positions(model, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(np.asarray(ids, np.int64))[None]
    pos = torch.from_numpy(positions.astype(np.int64))[:, None, :]              # [3, 1, T]
    return model(input_ids=x, position_ids=pos, use_cache=False).logits[0].double().numpy()


def margins(step_logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(step_logits, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def make_references(name: str, out: pathlib.Path, cls, seed: int, vocab: int) -> dict:
    model = load_back(out, cls)
    model64 = load_back(out, cls, dtype=torch.float64)
    rng = np.random.default_rng(seed)
    ref: dict = {"prefill_lengths": np.asarray(PREFILL_LENGTHS, np.int32)}
    worst64 = 0.0
    for s, length in enumerate(PREFILL_LENGTHS):
        ids = random_ids(rng, length, vocab)
        if length >= 37:                     # cover both ends of the embedding table
            ids[3], ids[-2] = 0, vocab - 1
        lg = full_logits(model, ids)
        worst64 = max(worst64, rel(lg, full_logits(model64, ids)))
        ref[f"prefill_ids_{s}"] = ids.astype(np.int32)
        ref[f"prefill_logits_{s}"] = lg.astype(np.float32)

    worst_decode = 0.0
    multimodal = name.endswith("cond_gen")
    for g, plen in enumerate(GREEDY_PROMPT_LENGTHS):
        for attempt in range(400):
            prompt = random_ids(rng, plen, vocab)
            new, step_logits = greedy(model, prompt)
            m = margins(step_logits)
            # in the multimodal layouts ids 256-259 are vision placeholders: keep them out of the
            # continuation too, so an Engine that treats them specially still compares cleanly
            clean = not (multimodal and set(new.tolist()) & set(SPECIAL_IDS.values()))
            if len(new) == GREEDY_NEW_TOKENS and m.min() >= MIN_GREEDY_MARGIN and clean:
                break
        else:
            raise SystemExit(f"{name}: no greedy prompt with margin >= {MIN_GREEDY_MARGIN}")
        # the cached continuation must be the argmax of an uncached forward over the whole text
        whole = full_logits(model, np.concatenate([prompt, new]))
        uncached = whole[plen - 1:-1]
        assert np.array_equal(uncached.argmax(-1), new), f"{name}: HF cached != uncached greedy"
        worst_decode = max(worst_decode, rel(step_logits, uncached))
        ref[f"greedy_prompt_{g}"] = prompt.astype(np.int32)
        ref[f"greedy_tokens_{g}"] = new.astype(np.int32)
        ref[f"greedy_margins_{g}"] = m.astype(np.float32)

    positions = mrope_positions()
    ids = random_ids(rng, positions.shape[1], vocab)
    lg = logits_at_positions(model, ids, positions)
    worst64 = max(worst64, rel(lg, logits_at_positions(model64, ids, positions)))
    # a wrong axis-to-frequency assignment must show: plain text positions give other logits
    assert rel(full_logits(model, ids), lg) > 1e-2, f"{name}: MRoPE positions change nothing"
    ref.update(mrope_ids=ids.astype(np.int32), mrope_positions=positions.astype(np.int32),
               mrope_logits=lg.astype(np.float32))

    ref["fp32_vs_fp64_rel"] = np.float32(worst64)
    ref["hf_decode_vs_prefill_rel"] = np.float32(worst_decode)
    ref["versions"] = np.asarray(f"torch {torch.__version__}; transformers "
                                 f"{transformers.__version__}; numpy {np.__version__}")
    return ref


def make_fixture(name: str, root: pathlib.Path = ROOT) -> None:
    seed, kind, overrides, save_opts = FIXTURES[name]
    text = dict(MOE_TEXT if kind.startswith("moe") else BASE_TEXT, **overrides)
    torch.manual_seed(seed)
    model = build_model(kind, text)
    reinit_(model, seed)
    final = root / name
    out = root / f".{name}.partial"          # a failed run leaves the committed fixture intact
    save_checkpoint(model, kind, seed, out, save_opts)
    n_params = check_saved_dtypes(out)
    ref = make_references(name, out, type(model), seed, text["vocab_size"])
    np.savez_compressed(out / "reference.npz", **ref)
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    out = final
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name:14s} params={n_params:7d} dir={size / 1024:6.0f} KiB "
          f"fp32-vs-fp64={float(ref['fp32_vs_fp64_rel']):.1e} "
          f"hf-decode-vs-prefill={float(ref['hf_decode_vs_prefill_rel']):.1e} "
          f"min-margin={min(float(ref[f'greedy_margins_{g}'].min()) for g in (0, 1)):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"fixtures to build (default all: {list(FIXTURES)})")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT,
                    help="parent directory of the fixture folders (default: tests/fixtures)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    for name in args.names or FIXTURES:
        if name not in FIXTURES:
            raise SystemExit(f"unknown fixture {name!r}; known: {list(FIXTURES)}")
        make_fixture(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
