"""Device weight layout: which arrays the CUDA model holds, fused for fewer, larger GEMMs.

Per layer (bf16 matrices [out, in], fp32 vectors):
  GDN   w_in = [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]     -> proj cols [qkv | z | b | a]
        conv_w [C, K], a_log [nv], dt_bias [nv], norm_w [dv], w_out [H, Vd]
  attn  w_in = [q_proj (query|gate per head); k_proj; v_proj], q_norm, k_norm [hd], w_out [H, nh*hd]
  dense w_gu = [gate_proj; up_proj], w_down
  MoE   w_rs = [router; shared gate_proj; shared up_proj; shared_expert_gate]  -> [E | 2*Is | 1]
        experts_gu [E, 2I, H], experts_down [E, H, I], shared_down [H, Is]
Sources: an artifact (logical names of docs/internals.md) or a seeded random fill on the GPU.
A dtype="float32" model holds every bf16 matrix as fp32 (widened on the device at load, exact).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ....errors import ArtifactError
from ..config import FULL_ATTENTION, TextConfig

BF16, F32 = "bf16", "f32"


def layer_plan(cfg: TextConfig, i: int) -> dict:
    """name -> (shape, dtype, [(logical source, rows)] or None for vectors/whole tensors)."""
    H, p = cfg.hidden_size, f"text.layers.{i}."
    out = {"input_norm": ((H,), F32, [(p + "input_layernorm.weight", None)]),
           "post_norm": ((H,), F32, [(p + "post_attention_layernorm.weight", None)])}
    if cfg.layer_types[i] == FULL_ATTENTION:
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = p + "self_attn."
        out["w_in"] = ((2 * nh * hd + 2 * nkv * hd, H), BF16,
                       [(a + "q_proj.weight", 2 * nh * hd), (a + "k_proj.weight", nkv * hd),
                        (a + "v_proj.weight", nkv * hd)])
        out["q_norm"] = ((hd,), F32, [(a + "q_norm.weight", None)])
        out["k_norm"] = ((hd,), F32, [(a + "k_norm.weight", None)])
        out["w_out"] = ((H, nh * hd), BF16, [(a + "o_proj.weight", H)])
    else:
        C, Vd, nv = cfg.linear_conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        g = p + "linear_attn."
        out["w_in"] = ((C + Vd + 2 * nv, H), BF16,
                       [(g + "in_proj_qkv.weight", C), (g + "in_proj_z.weight", Vd),
                        (g + "in_proj_b.weight", nv), (g + "in_proj_a.weight", nv)])
        out["conv_w"] = ((C, cfg.linear_conv_kernel_dim), F32, [(g + "conv1d.weight", None)])
        out["a_log"] = ((nv,), F32, [(g + "A_log", None)])
        out["dt_bias"] = ((nv,), F32, [(g + "dt_bias", None)])
        out["norm_w"] = ((cfg.linear_value_head_dim,), F32, [(g + "norm.weight", None)])
        out["w_out"] = ((H, Vd), BF16, [(g + "out_proj.weight", H)])
    m = p + "mlp."
    if cfg.is_moe:
        E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out["w_rs"] = ((E + 2 * Is + 1, H), BF16,
                       [(m + "gate.weight", E), (m + "shared_expert.gate_proj.weight", Is),
                        (m + "shared_expert.up_proj.weight", Is),
                        (m + "shared_expert_gate.weight", 1)])
        out["experts_gu"] = ((E, 2 * I, H), BF16, [(m + "experts.gate_up_proj", None)])
        out["experts_down"] = ((E, H, I), BF16, [(m + "experts.down_proj", None)])
        out["shared_down"] = ((H, Is), BF16, [(m + "shared_expert.down_proj.weight", H)])
    else:
        I = cfg.intermediate_size
        out["w_gu"] = ((2 * I, H), BF16, [(m + "gate_proj.weight", I), (m + "up_proj.weight", I)])
        out["w_down"] = ((H, I), BF16, [(m + "down_proj.weight", H)])
    return out


def mtp_plan(cfg: TextConfig) -> dict:
    """The MTP head's arrays (models/qwen3_5/mtp.py; the embedding and lm_head are the target's):
    fc [H, 2H] (the embedding's half first), its input norms and final norm, and one full-
    attention decoder layer laid out as layer_plan lays out the model's (sources mtp.layers.0.)."""
    H = cfg.hidden_size
    one = dataclasses.replace(cfg, layer_types=(FULL_ATTENTION,), num_hidden_layers=1)
    out = {"fc": ((H, 2 * H), BF16, [("mtp.fc.weight", None)]),
           "norm_embedding": ((H,), F32, [("mtp.pre_fc_norm_embedding.weight", None)]),
           "norm_hidden": ((H,), F32, [("mtp.pre_fc_norm_hidden.weight", None)]),
           "norm": ((H,), F32, [("mtp.norm.weight", None)])}
    for name, (shape, dt, sources) in layer_plan(one, 0).items():
        out[name] = (shape, dt, [("mtp.layers.0." + src[len("text.layers.0."):], rows)
                                 for src, rows in sources])
    return out


def dflash_plans(dcfg) -> list:
    """A DFlash drafter's arrays (models/qwen3_5/dflash.py; the embedding and lm_head are the
    target's), as [(index, plan)]: ("dflash", None) fc [H, F*H] over the F target layers'
    features, its norm and the final norm; ("dflash", i) per drafter layer, laid out as
    layer_plan lays out an attention layer but without the output gate: w_in = [q_proj; k_proj;
    v_proj] -> proj cols [q (nh*hd) | k | v]."""
    H, I = dcfg.hidden_size, dcfg.intermediate_size
    nh, nkv, hd = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    p = "dflash."
    top = {"fc": ((H, len(dcfg.target_layer_ids) * H), BF16, [(p + "fc.weight", None)]),
           "hidden_norm": ((H,), F32, [(p + "hidden_norm.weight", None)]),
           "norm": ((H,), F32, [(p + "norm.weight", None)])}
    plans = [(("dflash", None), top)]
    for i in range(dcfg.num_hidden_layers):
        a, m = f"{p}layers.{i}.self_attn.", f"{p}layers.{i}.mlp."
        plans.append((("dflash", i), {
            "input_norm": ((H,), F32, [(f"{p}layers.{i}.input_layernorm.weight", None)]),
            "post_norm": ((H,), F32, [(f"{p}layers.{i}.post_attention_layernorm.weight", None)]),
            "w_in": ((nh * hd + 2 * nkv * hd, H), BF16,
                     [(a + "q_proj.weight", nh * hd), (a + "k_proj.weight", nkv * hd),
                      (a + "v_proj.weight", nkv * hd)]),
            "q_norm": ((hd,), F32, [(a + "q_norm.weight", None)]),
            "k_norm": ((hd,), F32, [(a + "k_norm.weight", None)]),
            "w_out": ((H, nh * hd), BF16, [(a + "o_proj.weight", H)]),
            "w_gu": ((2 * I, H), BF16, [(m + "gate_proj.weight", I), (m + "up_proj.weight", I)]),
            "w_down": ((H, I), BF16, [(m + "down_proj.weight", H)])}))
    return plans


def model_plan(cfg: TextConfig) -> dict:
    V, H = cfg.vocab_size, cfg.hidden_size
    return {"embed": ((V, H), BF16, [("text.embed_tokens.weight", None)]),
            "lm_head": ((V, H), BF16, [("text.lm_head.weight", None)]),
            "norm": ((H,), F32, [("text.norm.weight", None)])}


def element_bytes(dt: str, f32: bool = False) -> int:
    """Device bytes of one element of a plan dtype (bf16 matrices are fp32 in a float32 model)."""
    return 2 if dt == BF16 and not f32 else 4


def plan_bytes(cfg: TextConfig, tied: bool = False, f32: bool = False,
               qplans: dict = None, mtp: bool = False, dflash=None,
               int8_head_rows: int = 0) -> int:
    """Device bytes of the weights; `qplans` (weight_load.quant_plans): the matrices held as
    packed codes (qweights.py), counted by their segments; `mtp`: the MTP head's too; `dflash`
    (a DFlashConfig): that drafter's too; `int8_head_rows`: the MTP drafts' int8 head of that
    many lm_head rows (qweights.int8_head_plan)."""
    from .qweights import int8_head_plan
    total = int8_head_plan(int8_head_rows, cfg.hidden_size).nbytes() if int8_head_rows else 0
    qplans = qplans or {}
    plans = [("", model_plan(cfg))] + [(i, layer_plan(cfg, i)) for i in range(cfg.num_hidden_layers)]
    if mtp:
        plans.append(("mtp", mtp_plan(cfg)))
    if dflash is not None:
        plans += dflash_plans(dflash)
    for idx, plan in plans:
        for name, (shape, dt, _) in plan.items():
            segs = qplans.get((idx, name))
            if segs is not None:
                total += sum(s.nbytes() if s.layout != "bf16" or not f32 else 2 * s.nbytes()
                             for s in segs)
                continue
            if tied and name == "lm_head":
                continue
            total += (int(np.prod(shape)) * element_bytes(dt, f32) + 255) // 256 * 256
    return total


def read_host(artifact, shape, dtype, sources, expected: dict = None) -> np.ndarray:
    """Gather one device array's host image from the artifact (bf16 -> uint16 bits, f32).
    `expected`: logical name -> shape (load.text_param_shapes); the numpy model's reader checks
    the same shapes and finiteness, so both backends refuse the same artifacts."""
    import ml_dtypes
    parts = []
    for name, rows in sources:
        if not artifact.has(name):
            raise ArtifactError(f"missing binding {name!r}")
        if artifact.is_quantized(name):
            # a quantized binding the kernels do not read packed (the embedding of a model whose
            # tied lm_head was quantized): its values, decoded as the numpy backend decodes them
            from ..quant import dequantize
            a = dequantize(artifact.quantized(name), name)
        else:
            a = np.asarray(artifact.tensor(name))
        want = (expected or {}).get(name)
        if want is not None and tuple(a.shape) != tuple(want):
            # equal sizes in another layout (experts [E, H, 2I]) would load as wrong numbers
            raise ArtifactError(f"binding {name!r}: shape {list(a.shape)} != expected {list(want)}")
        if rows is not None and (a.ndim != 2 or a.shape[0] != rows or a.shape[1] != shape[-1]):
            raise ArtifactError(f"binding {name!r}: shape {list(a.shape)} != [{rows}, {shape[-1]}]")
        parts.append(a.reshape(-1))
    flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if flat.size != int(np.prod(shape)):
        raise ArtifactError(f"binding {sources[0][0]!r}: {flat.size} values, expected shape "
                            f"{list(shape)}")
    if dtype == BF16:
        # (copy=False: a bf16 artifact's view goes straight on; one host pass fewer)
        host = np.ascontiguousarray(flat.astype(ml_dtypes.bfloat16, copy=False)
                                    .view(np.uint16)).reshape(shape)
        finite = _bf16_all_finite(host)
    else:
        host = np.ascontiguousarray(flat, dtype=np.float32).reshape(shape)
        finite = bool(np.all(np.isfinite(host)))
    if not finite:
        names = ", ".join(repr(n) for n, _ in sources)
        raise ArtifactError(f"binding {names}: contains non-finite values"
                            + (" (in bfloat16)" if dtype == BF16 else ""))
    return host


def _bf16_all_finite(bits: np.ndarray, chunk: int = 1 << 18) -> bool:
    """No inf/nan among bf16 bit patterns (exponent all ones; also a float32 too large for
    bf16). In chunks that stay in the CPU's cache, through one reused buffer: over whole GB-sized
    tensors the temporaries went to memory and the scan ran at ~2 GB/s a thread, now several
    times that (bench/bench_load.py)."""
    flat = bits.reshape(-1)
    scratch = np.empty(min(chunk, flat.size), np.uint16)
    for i in range(0, flat.size, chunk):
        part = flat[i: i + chunk]
        exp = scratch[: part.size]
        np.bitwise_and(part, 0x7F80, out=exp)
        if exp.max() == 0x7F80:
            return False
    return True


def is_tied(artifact) -> bool:
    """True when lm_head binds the embedding's stored bytes (share one device copy)."""
    try:
        e, h = artifact.tensor("text.embed_tokens.weight"), artifact.tensor("text.lm_head.weight")
    except Exception:   # noqa: BLE001 - absence is reported by read_host later
        return False
    return e.shape == h.shape and e.dtype == h.dtype and \
        e.__array_interface__["data"][0] == h.__array_interface__["data"][0]


# Random fill (benchmarks): (scale, offset) per array kind; matrices ~ U(-1,1)/sqrt(fan_in).
def random_spec(name: str, shape) -> tuple:
    if name.startswith("dflash.") and name.endswith("norm"):
        return 0.1, 1.0                 # (a DFlash drafter's norms are plain: x * w, w ~ 1)
    name = name.removeprefix("dflash.")
    if name in ("input_norm", "post_norm", "norm", "q_norm", "k_norm"):
        return 0.1, 0.0
    if name == "norm_w":
        return 0.1, 1.0
    if name == "a_log":
        return 0.5, 0.0
    if name == "dt_bias":
        return 0.5, 0.0
    if name == "conv_w":
        return 0.5, 0.0
    fan_in = shape[-1]
    return float(np.sqrt(3.0 / fan_in)), 0.0
