"""Quantized-weight fixtures: FP8 release-layout checkpoints and transformers references for the
converter's `--quantize` formats (issue 13). Maintainers only, like tools/make_fixtures.py (whose
builders it reuses); needs torch + transformers:

    python tools/make_quant_fixtures.py              # all of the below
    python tools/make_quant_fixtures.py fp8_dense    # some

1. `tests/fixtures/fp8_dense`, `tests/fixtures/fp8_moe`: tiny random Qwen3.5 checkpoints in the
   layout of Qwen's FP8 releases (`*ForConditionalGeneration`, `quantization_config` fp8 e4m3
   with weight_block_size [128, 128] and dynamic activations, every attention / GDN / MLP /
   expert projection of the text model stored float8_e4m3fn with
   `weight_scale_inv` [ceil(out/128), ceil(in/128)]; MoE experts per expert; the rest bf16 and
   named in modules_to_not_convert). Dimensions cross 128 so that scales have partial blocks;
   fp8_dense is sharded (two files + index) with float32 scales, fp8_moe single-file with bf16
   scales and experts of 40 rows (gate/up blocks do not tile the fused [2I, H] object). No MTP
   layer (size; the converter only carries it, tests/test_quant.py checks an FP8 one).
   `quant_reference.npz` there: ids_{s} / logits_{s} (s = 0, 1: lengths 5 and 37) of transformers
   in float32 on weights dequantized here, w = fp8 * scale_inv[r // 128, c // 128] (the
   FineGrainedFP8 semantics), written as an unquantized float32 checkpoint and loaded back.
   (Not transformers' own `FineGrainedFP8Config(dequantize=True)` load: in transformers 5.18 it
   derives the block as rows // scale_rows, which is wrong for partial blocks such as these; its
   GPU FP8Linear and vLLM index r // 128 over ceil-sized scales, as here. On dimensions that are
   multiples of 128 its Fp8Dequantize and ninfer's decoder agree exactly.)
2. `tests/fixtures/{dense,moe}/quantized.npz`: for fmt in fp8, int8, int4, the fixture converted
   with `python -m ninfer convert --quantize fmt`, its quantized objects decoded here in torch from
   the spec (docs/artifact.md 3.2.1, not ninfer's decoder) into a float32 checkpoint, and
   transformers' logits on `prefill_ids_2` of reference.npz: {fmt}_logits [37, V]; {fmt}_checksums
   the artifact's checksums of those objects, so a test can tell "the quantizer changed (rerun
   this tool)" from "the decoder or model is wrong".
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import make_fixtures as mf  # noqa: E402

ROOT = mf.ROOT
BLOCK = 128
QUANT_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                "gate_proj", "up_proj", "down_proj")
FP8_FIXTURES = {
    # name: (seed, builder kind, text overrides, scale dtype, shards)
    "fp8_dense": (11, "cond_gen", dict(
        hidden_size=136, intermediate_size=144, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=True,
        rope_parameters=mf.rope(32, 0.25, (2, 1, 1))), torch.float32, 2),
    "fp8_moe": (12, "moe_cond_gen", dict(
        hidden_size=136, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=4, moe_intermediate_size=40, shared_expert_intermediate_size=48,
        tie_word_embeddings=True, rope_parameters=mf.rope(32, 0.25, (2, 1, 1))),
        torch.bfloat16, 1),
}
QUANT_SOURCES = ("dense", "moe")
FORMATS = ("fp8", "int8", "int4")


# ---- FP8 release layout ----------------------------------------------------------------------------

def is_quantized_module(name: str) -> bool:
    """The release's rule: 2-D projection weights of the text model and the MTP layer."""
    if not name.endswith(".weight") or "visual" in name or "shared_expert_gate" in name:
        return False
    if not (name.startswith("model.language_model.layers.") or name.startswith("mtp.layers.")):
        return False
    return name.rsplit(".", 2)[-2] in QUANT_LEAVES


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (float8_e4m3fn [R, C], scale_inv float32 [ceil(R/128), ceil(C/128)])."""
    R, C = w.shape
    nr, nc = -(-R // BLOCK), -(-C // BLOCK)
    pad = torch.zeros(nr * BLOCK, nc * BLOCK, dtype=torch.float32)
    pad[:R, :C] = w.float()
    amax = pad.reshape(nr, BLOCK, nc, BLOCK).abs().amax(dim=(1, 3))
    inv = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (pad / expand(inv, R, C, pad=True)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q[:R, :C].contiguous(), inv


def expand(per_block: torch.Tensor, R: int, C: int, pad: bool = False) -> torch.Tensor:
    e = per_block.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return e if pad else e[:R, :C]


def make_fp8_fixture(name: str) -> None:
    seed, kind, overrides, scale_dtype, shards = FP8_FIXTURES[name]
    text = dict(mf.MOE_TEXT if kind.startswith("moe") else mf.BASE_TEXT, **overrides)
    torch.manual_seed(seed)
    model = mf.build_model(kind, text)
    mf.reinit_(model, seed)
    final, out = ROOT / name, ROOT / f".{name}.partial"
    mf.save_checkpoint(model, kind, seed, out, {})
    bf16 = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    cfg = json.loads((out / "config.json").read_text())
    # no MTP layer (size): an FP8 one is only carried, never run; tests/test_quant.py covers it
    bf16 = {n: t for n, t in bf16.items() if not n.startswith("mtp.")}
    cfg["text_config"]["mtp_num_hidden_layers"] = 0
    tensors, keep = {}, set()
    for n, t in bf16.items():
        if is_quantized_module(n):
            q, inv = fp8_blocks(t)
            tensors[n], tensors[n[:-len("weight")] + "weight_scale_inv"] = q, inv.to(scale_dtype)
        else:
            tensors[n] = t
            if t.ndim == 2 and n.endswith(".weight"):
                keep.add(n[:-len(".weight")])
    write_shards(out, tensors, shards)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                  "modules_to_not_convert": sorted(keep)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    deq = {n: t for n, t in tensors.items() if not n.endswith("weight_scale_inv")}
    for n in deq:
        inv = tensors.get(n[:-len("weight")] + "weight_scale_inv")
        deq[n] = deq[n].float() if inv is None else \
            deq[n].float() * expand(inv.float(), *deq[n].shape)
    ref = references(out, deq, type(model), seed, text["vocab_size"])
    np.savez_compressed(out / "quant_reference.npz", **ref)
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    for f in final.iterdir():
        f.chmod(0o644)                  # safetensors writes 0600
    size = sum(f.stat().st_size for f in final.iterdir())
    print(f"{name:10s} dir={size / 1024:5.0f} KiB fp8 tensors="
          f"{sum(t.dtype == torch.float8_e4m3fn for t in tensors.values())}")


def write_shards(out: pathlib.Path, tensors: dict, shards: int) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n] for n in names}, out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n].contiguous() for n in part}, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


# ---- references ------------------------------------------------------------------------------------

def float32_checkpoint(src: pathlib.Path, tensors: dict) -> pathlib.Path:
    """A temporary unquantized copy of checkpoint `src` holding `tensors` in float32."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="quantref-"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, tmp / "model.safetensors",
              metadata={"format": "pt"})
    return tmp


def references(src: pathlib.Path, deq: dict, cls, seed: int, vocab: int) -> dict:
    tmp = float32_checkpoint(src, deq)
    try:
        model = mf.load_back(tmp, cls)
        rng = np.random.default_rng(seed)
        ref = {}
        for s, length in enumerate((5, 37)):
            ids = mf.random_ids(rng, length, vocab)
            ref[f"ids_{s}"] = ids.astype(np.int32)
            ref[f"logits_{s}"] = mf.full_logits(model, ids).astype(np.float32)
    finally:
        shutil.rmtree(tmp)
    ref["versions"] = np.asarray(f"torch {torch.__version__}; transformers "
                                 f"{mf.transformers.__version__}; numpy {np.__version__}")
    return ref


# ---- --quantize references -------------------------------------------------------------------------

def decode(qt) -> torch.Tensor:
    """docs/artifact.md 3.2.1 in torch: value = (q - zero) * scale per [br, bc] block."""
    *lead, R, C = qt.shape
    br, bc = qt.block
    raw = torch.from_numpy(np.array(qt.data).view(np.uint8))
    if qt.layout == "fp8_block":
        q = raw.view(torch.float8_e4m3fn).double()
    elif qt.layout == "int8_block":
        q = raw.view(torch.int8).double()
    else:
        b = raw.to(torch.int16)
        q = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)[..., :C].double()

    def per_element(t):
        t = torch.from_numpy(np.array(t, np.float32)).double()
        return t.repeat_interleave(br, -2)[..., :R, :].repeat_interleave(bc, -1)[..., :C]
    zero = per_element(qt.zero) if qt.zero is not None else \
        (8.0 if qt.layout == "int4_block" else 0.0)
    return ((q - zero) * per_element(qt.scale)).float()


def source_names(logical: str, value: torch.Tensor) -> dict:
    """Logical text tensor -> {ForCausalLM source name: tensor} (experts back to per expert)."""
    name = "model." + logical[len("text."):]
    if name.endswith("experts.gate_up_proj"):
        base, inter = name[:-len("gate_up_proj")], value.shape[1] // 2
        return {f"{base}{e}.{p}.weight": value[e, rows] for e in range(value.shape[0])
                for p, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None)))}
    if name.endswith("experts.down_proj"):
        base = name[:-len("down_proj")]
        return {f"{base}{e}.down_proj.weight": value[e] for e in range(value.shape[0])}
    return {name: value}


def make_quantized_reference(name: str) -> None:
    from ninfer.artifact import Artifact
    from ninfer.convert import Quantize, convert_checkpoint

    src = ROOT / name
    cls = {"dense": mf.Qwen3_5ForCausalLM, "moe": mf.Qwen3_5MoeForCausalLM}[name]
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    with np.load(src / "reference.npz") as z:
        ids = z["prefill_ids_2"]
    out = {"ids": ids}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            path = convert_checkpoint(src, pathlib.Path(tmp) / f"{fmt}.ninfer", progress=False,
                                      recipe=Quantize(fmt))
            deq = dict(tensors)
            sums = []
            with Artifact(path) as art:
                objects = {o["name"]: o for o in art.manifest["objects"]}
                for b, binding in art.manifest["bindings"].items():
                    if "view" in binding or not art.is_quantized(b):
                        continue                    # (gate/up views: their parent is decoded)
                    o = objects[b]
                    sums += [o["checksum"], objects[o["quant"]["scale"]]["checksum"]]
                    deq.update(source_names(b, decode(art.quantized(b))))
            ckpt = float32_checkpoint(src, deq)
            try:
                model = mf.load_back(ckpt, cls)
                out[f"{fmt}_logits"] = mf.full_logits(model, ids).astype(np.float32)
            finally:
                shutil.rmtree(ckpt)
            out[f"{fmt}_checksums"] = np.asarray(sums)
            print(f"{name}/{fmt}: {len(sums) // 2} quantized bindings")
    out["versions"] = np.asarray(f"torch {torch.__version__}; transformers "
                                 f"{mf.transformers.__version__}; numpy {np.__version__}")
    np.savez_compressed(src / "quantized.npz", **out)


def main(argv=None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or [*FP8_FIXTURES, *QUANT_SOURCES]
    torch.set_num_threads(2)
    for name in names:
        if name in FP8_FIXTURES:
            make_fp8_fixture(name)
        elif name in QUANT_SOURCES:
            make_quantized_reference(name)
        else:
            raise SystemExit(f"unknown {name!r}; known: {[*FP8_FIXTURES, *QUANT_SOURCES]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
