"""The kernels one Qwen3.5 geometry needs: specs (module, factory, signature, baked constants)
resolved through the AOT cache into loaded `Kernel`s. The signatures are the kernels' own
(each kernels/*.py module's SIGNATURES); this module adds the geometry."""
from __future__ import annotations

import ast

from ....core.cuda import kernels as K
from ....core.cuda.kernels import KernelCache, KernelSpec
from ....errors import DeviceError
from ..config import TextConfig
from . import gdn_chunk as gc
from . import moe_route
from . import qweights as qw

GEMV_MAX_M = 8              # kernels/gemv.MAX_M (runner.GEMV_MAX_M)

# the kernel modules (kernels/<module>.py) of the set; each declares its kernels' argument types
# in a SIGNATURES literal beside them (kernels/__init__.py)
MODULES = ("norm", "act", "fill", "conv", "gdn", "gdn_chunk", "gdn_chunk_tc", "rope_kv",
           "attention", "attention_tc", "attention_mma", "moe", "sample", "quant_gemv", "act_quant", "vision",
           "speculate", "gemv", "grouped_gemm")


def declared_signatures(module: str) -> dict:
    """kernels/<module>.py's SIGNATURES, kernel -> argument types, read from the source text
    (importing the module would import numba, which a warm kernel cache never needs). A value may
    be the name of a tuple literal assigned at the module's top level."""
    try:
        text = (K.KERNELS_DIR / f"{module}.py").read_text(encoding="utf-8")
    except OSError as exc:
        raise DeviceError(f"kernel source {module!r} not found under {K.KERNELS_DIR}: "
                          f"{exc}") from exc
    tree = ast.parse(text)
    assigned = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    if "SIGNATURES" not in assigned:
        raise DeviceError(f"kernels/{module}.py declares no SIGNATURES")
    table = assigned["SIGNATURES"]
    sigs = {}
    for key, value in zip(table.keys, table.values):
        if isinstance(value, ast.Name):          # a shared tuple (sample.py's SAMPLE_ARGS)
            value = assigned[value.id]
        sigs[ast.literal_eval(key)] = tuple(ast.literal_eval(value))
    return sigs


def _collect_signatures() -> dict:
    sigs = {}
    for module in MODULES:
        for name, sig in declared_signatures(module).items():
            if name in sigs:
                raise DeviceError(f"kernel {name!r} declared by kernels/{sigs[name][0]}.py and "
                                  f"kernels/{module}.py")
            sigs[name] = (module, name, sig)
    return sigs


# kernel name -> (module, factory, argument types); the factory has the kernel's name
SIGS = _collect_signatures()


# kernels with an fp32-storage variant (dtype="float32"): factory parameter f32=True, and every
# bf16 ("u16*") or bf16-pair ("u32*") argument of theirs becomes "f32*"
F32_VARIANTS = frozenset(("rmsnorm", "gated_rmsnorm", "gated_rmsnorm4", "silu_mul", "silu_mul4",
                          "embed_gather", "random_bf16", "qk_norm_rope_kv", "paged_attention",
                          "attn_combine", "expert_gate_up", "expert_down", "qgemv", "dequant",
                          "vis_layernorm", "vis_bias_act", "vis_qkv_rope", "vis_softmax",
                          "mtp_prologue", "store_columns", "head_quant_int8"))


# kernels with a quantized-KV variant (kv_dtype "fp8" / "int8": factory parameter kvq) -> the
# positions of their K and V pool arguments and the type those take (byte codes, their scales
# inside each page: kernels/common.py kvq_row). The model's dtype does not enter them (the pools
# are codes either way, every other argument is fp32), so both dtypes share one variant.
KVQ_VARIANTS = {"qk_norm_rope_kv": ((5, 6), "u8*"), "paged_attention": ((3, 4), "u16*"),
                "kv_gather": ((2, 3), "u16*")}


def spec(name: str, f32: bool = False, **params) -> KernelSpec:
    module, factory, sig = SIGS[name]
    if f32:
        if name not in F32_VARIANTS:
            raise ValueError(f"kernel {name!r} has no float32 variant")
        sig = tuple("f32*" if t in ("u16*", "u32*") else t for t in sig)
        params["f32"] = True
    return KernelSpec.of(module, factory, sig, **params)


VISION_KERNELS = ("vis_layernorm", "vis_bias_act", "vis_add_bias", "vis_pos_embed", "vis_qkv_rope",
                  "vis_softmax")


def vision_specs(f32: bool = False, head_dim: int = 72, flash: bool = True) -> dict:
    """The device vision tower's kernels (cuda/vision.py), apart from a text geometry's: a
    text-only model's start compiles or loads none of them. `flash` (bf16, head_dim a multiple
    of 8; the releases' is 72): the tensor-core attention for that head_dim in place of the
    GEMM attention's vis_softmax."""
    specs = {name: spec(name, f32=f32 and name in F32_VARIANTS) for name in VISION_KERNELS}
    if flash and flash_vision(f32, head_dim):
        del specs["vis_softmax"]
        specs["vis_flash_attention"] = spec("vis_flash_attention", hd=head_dim)
    return specs


def flash_vision(f32: bool, head_dim: int) -> bool:
    """vis_flash_attention can run this tower's attention (bf16 mma fragments of 8 columns)."""
    return not f32 and head_dim % 8 == 0


# the MTP drafts' int8 head (EngineOptions.draft_head "int8"): int8 codes in (1, 128) blocks
INT8_HEAD_FORMAT = ("int8_block", False, 1)


def mtp_specs(f32: bool = False) -> dict:
    """What the MTP drafter's step adds to a geometry's kernels (its decoder layer is a full-
    attention layer of the same geometry, its MLP the model's): the fc input's two norms, and
    the int8 draft head's: its quantization at load and the packed GEMVs that read it."""
    return {"mtp_prologue": spec("mtp_prologue", f32=f32),
            "head_quant_int8": spec("head_quant_int8", f32=f32),
            **quant_specs({INT8_HEAD_FORMAT}, f32)}


def dflash_specs(dcfg, f32: bool = False, kv_dtype: str = None) -> dict:
    """What a DFlash drafter's steps add (models/qwen3_5/dflash.py; cuda/dflash.py DFlashRunner):
    the target layers' outputs into the feature rows (store_columns), and its
    Qwen3 decoder layers' own variants under "df_" names: plain RMSNorms (x * w), q / k norm and
    full-head 1-D RoPE over an ungated projection, the block's attention over all its row's keys
    (non-causal) and the ungated output merge. Its KV layers are the pool's (kv_dtype: the
    quantized-KV variants, as the target's)."""
    hd, nh, nkv = dcfg.head_dim, dcfg.num_attention_heads, dcfg.num_key_value_heads
    G = nh // nkv
    GS = paged_attention_group(G, hd)
    specs = {"store_columns": spec("store_columns", f32),
             "df_rmsnorm": spec("rmsnorm", f32, plain=True),
             "df_qk_norm_rope_kv": spec("qk_norm_rope_kv", f32, hd=hd, rot=hd, nh=nh, nkv=nkv,
                                        sec_t=hd // 2, sec_h=0, sec_w=0, interleaved=False,
                                        gated=False, plain=True),
             "df_paged_attention": spec("paged_attention", f32, hd=hd, G=G, nkv=nkv,
                                        **({"GS": GS} if GS != G else {}), causal=False),
             "df_attn_combine": spec("attn_combine", f32, hd=hd, nh=nh, gated=False)}
    if kv_dtype is not None:
        for name in ("df_qk_norm_rope_kv", "df_paged_attention"):
            specs[name] = kvq_spec(specs[name].factory, kv_dtype, **dict(specs[name].params))
    return specs


def fused_moe_tail(cfg: TextConfig) -> bool:
    """Whether a bf16 MoE geometry's decode tail runs as one launch (kernels/moe.py
    moe_down_combine): a shared expert of bf16 pairs, H a multiple of the kernel's rows a block,
    K + 1 warps a block."""
    Is = cfg.shared_expert_intermediate_size
    return (cfg.is_moe and Is > 0 and Is % 2 == 0 and cfg.moe_intermediate_size % 2 == 0
            and cfg.hidden_size % 4 == 0 and cfg.num_experts_per_tok + 1 <= 32)


def norm_gemv_fits(hidden: int, m: int) -> bool:
    """Whether kernels/gemv.py's gemv_norm takes m rows of `hidden`: whole 512-byte spans, the
    bf16 rows and the m * 4 warps' partial sums within its static shared memory (NORM_SMEM,
    48 KB)."""
    return hidden % 256 == 0 and m * hidden * 2 + m * 4 * 4 <= 48 * 1024


def speculation_specs(cfg: TextConfig) -> dict:
    """The kernels a speculative verify adds to a geometry's (issue 25; not loaded until the
    CUDA verify path uses them): the delta rule's S and the conv window written after every
    token of a row into its snapshot State slots, the acceptance (kernels/speculate.py), the
    kept snapshot copied over each row's State and the MTP feed's metadata behind a verify."""
    specs = {"spec_accept": spec("spec_accept"), "state_select": spec("state_select"),
             "spec_feed": spec("spec_feed")}
    if not cfg.linear_layer_ids:
        return specs
    return {**specs,
            "gdn_recurrent_snap": spec("gdn_recurrent_snap", dk=cfg.linear_key_head_dim,
                                       dv=cfg.linear_value_head_dim,
                                       nk=cfg.linear_num_key_heads,
                                       nv=cfg.linear_num_value_heads),
            "conv_state_update_snap": spec("conv_state_update_snap", K=cfg.linear_conv_kernel_dim,
                                           C=cfg.linear_conv_dim)}


def qgemv_name(layout: str, bm: int, asym: bool) -> str:
    return f"qgemv_{layout}_{bm}" + ("_z" if asym else "")


def dequant_name(layout: str, asym: bool) -> str:
    return f"dequant_{layout}" + ("_z" if asym else "")


def qmma_name(layout: str, asym: bool, split: int = 1) -> str:
    return f"qmma_{layout}" + ("_z" if asym else "") + (f"_s{split}" if split > 1 else "")


def quant_specs(quant, f32: bool = False) -> dict:
    """The packed-weight kernels of each (layout, asym[, split]) in `quant` (cuda/qweights.py
    formats): the CUDA-core GEMV (every shape, and the float32 model's exact decode), the
    tensor-core one (bf16 models, qweights.mma_ok shapes; `split` scale blocks per step, 1 when
    left out) and the prefill tile's dequantization; for fp8 in a bf16 model the prefill's
    activation quantization too (the block-scaled fp8 GEMM's input, qweights.w8a8_ok)."""
    specs = {}
    if not f32 and any(q[0] == "fp8_block" for q in quant):
        specs["act_quant_fp8"] = spec("act_quant_fp8")
    for layout, asym, *rest in sorted(quant):
        split = rest[0] if rest else 1
        if not f32:
            params = {"split": split} if split > 1 else {}
            specs[qmma_name(layout, asym, split)] = spec("qmma", layout=layout, asym=bool(asym),
                                                         **params)
        for bm in qw.BMS:
            specs[qgemv_name(layout, bm, asym)] = spec("qgemv", f32, layout=layout, bm=bm,
                                                       asym=bool(asym))
        specs[dequant_name(layout, asym)] = spec("dequant", f32, layout=layout, asym=bool(asym))
    return specs


def kvq_spec(name: str, kv_dtype: str, **params) -> KernelSpec:
    """The quantized-KV variant of kernel `name` (KVQ_VARIANTS) with the base spec's geometry."""
    if name not in KVQ_VARIANTS:
        raise ValueError(f"kernel {name!r} has no quantized-KV variant")
    module, factory, sig = SIGS[name]
    at, kind = KVQ_VARIANTS[name]
    sig = tuple(kind if i in at else t for i, t in enumerate(sig))
    params.pop("f32", None)
    return KernelSpec.of(module, factory, sig, **params, kvq=kv_dtype)


def geometry_specs(cfg: TextConfig, f32: bool = False, quant=frozenset(),
                   kv_dtype: str = None) -> dict:
    """name -> KernelSpec for every kernel the model of `cfg` launches; `f32`: the fp32-storage
    variants (dtype="float32": no tensor-core prefill attention, weights widened at load);
    `quant`: the (layout, asym, split) formats of its packed weights; `kv_dtype` "fp8" / "int8":
    the quantized-KV variants of the kernels that write and read the pools (same names)."""
    if kv_dtype is not None:
        specs = geometry_specs(cfg, f32, quant)
        for name in set(KVQ_VARIANTS) & set(specs):
            specs[name] = kvq_spec(name, kv_dtype, **dict(specs[name].params))
        specs.pop("paged_attention_mma", None)      # (bf16 pools only)
        return specs
    if quant:
        return {**geometry_specs(cfg, f32), **quant_specs(quant, f32)}
    if f32:
        return _f32_specs(cfg)
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    K, dk, dv = cfg.linear_conv_kernel_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    sec = tuple(cfg.mrope_section) + (0, 0, 0)
    specs = {n: spec(n) for n in ("rmsnorm", "gated_rmsnorm", "silu_mul", "silu_mul4",
                                  "embed_gather",
                                  "argmax", "sample_prep", "sample_stats", "sample",
                                  "random_bf16", "random_f32")}
    # the decode GEMV (kernels/gemv.py), a kernel per token count (StepRunner.gemv_fits)
    specs.update({f"gemv{m}": spec("gemv", M=m) for m in range(1, GEMV_MAX_M + 1)})
    # ... with the norm before the product in its prologue (StepRunner.normed), for the token
    # counts whose rows fit its shared memory, where some normed product can take the GEMV
    # (a MoE layer's router + shared gate|up; the input projections of hidden <= 2048)
    H = cfg.hidden_size
    if cfg.is_moe or H <= 2048:
        specs.update({f"gemv_norm{m}": spec("gemv_norm", M=m, hidden=H)
                      for m in range(1, GEMV_MAX_M + 1) if norm_gemv_fits(H, m)})
    if cfg.linear_layer_ids:
        specs["conv_silu"] = spec("conv_silu", K=K, dk=dk, dv=dv, nk=nk, nv=nv)
        specs["conv_silu_chunk"] = spec("conv_silu_chunk", K=K, dk=dk, dv=dv, nk=nk, nv=nv)
        specs["conv_state_update"] = spec("conv_state_update", K=K, C=cfg.linear_conv_dim)
        specs["gdn_recurrent"] = spec("gdn_recurrent", dk=dk, dv=dv, nk=nk, nv=nv)
        if dv % 128 == 0:           # (a warp a head: four columns a lane a step)
            specs["gated_rmsnorm4"] = spec("gated_rmsnorm4", dv=dv)
        specs.update(gdn_chunk_specs(dk, dv, nk, nv, tc=gc.tc_ok(dk, dv)))
    if cfg.attention_layer_ids:
        specs["qk_norm_rope_kv"] = spec("qk_norm_rope_kv", hd=hd, rot=cfg.rotary_dim, nh=nh,
                                        nkv=nkv, sec_t=sec[0], sec_h=sec[1], sec_w=sec[2],
                                        interleaved=bool(cfg.mrope_interleaved))
        G = nh // nkv
        GS = paged_attention_group(G, hd)
        specs["paged_attention"] = spec("paged_attention", hd=hd, G=G, nkv=nkv,
                                        **({"GS": GS} if GS != G else {}))
        specs["attn_combine"] = spec("attn_combine", hd=hd, nh=nh)
        GM = attention_mma_group(G, hd)
        if GM:
            specs["paged_attention_mma"] = spec("paged_attention_mma", hd=hd, G=G, nkv=nkv,
                                                **({"GS": GM} if GM != G else {}))
        specs["kv_gather"] = spec("kv_gather", hd=hd, nkv=nkv)
        specs["q_to_bf16"] = spec("q_to_bf16", hd=hd, G=G, nkv=nkv)
        specs["causal_softmax"] = spec("causal_softmax", G=G)
        specs["causal_softmax_reg"] = spec("causal_softmax_reg", G=G)
        specs["attn_gate_tc"] = spec("attn_gate_tc", hd=hd, G=G, nkv=nkv)
    if cfg.is_moe:
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        H, inter = cfg.hidden_size, cfg.moe_intermediate_size
        specs["router_topk"] = spec("router_topk", E=E, K=k, norm=bool(cfg.norm_topk_prob))
        specs["expert_gate_up"] = spec("expert_gate_up", H=H, inter=inter)
        # ... with the router's top-k in its prologue (decode: StepRunner.router_fused)
        specs["expert_gate_up_routed"] = spec("expert_gate_up_routed", H=H, inter=inter, E=E,
                                              K=k, norm=bool(cfg.norm_topk_prob))
        specs["expert_down"] = spec("expert_down", H=H, inter=inter)
        specs["moe_combine"] = spec("moe_combine", H=H, K=k)
        if fused_moe_tail(cfg):
            specs["moe_down_combine"] = spec("moe_down_combine", H=H, inter=inter,
                                             shared=cfg.shared_expert_intermediate_size, K=k)
        specs["gather_rows"] = spec("gather_rows")
        # the prefill's routing on the device (cuda/moe_route.py)
        specs["moe_route_count"] = spec("moe_route_count", E=E)
        specs["moe_route_scan"] = spec("moe_route_scan", E=E)
        specs["moe_route_place"] = spec("moe_route_place", E=E, K=k)
        # our grouped GEMM (where cuBLASLt has none: moe_route.DeviceRoute.own), its work list
        specs["moe_route_tiles"] = spec("moe_route_tiles", E=E, BM=moe_route.GEMM_BM)
        specs["grouped_gemm"] = spec("grouped_gemm")
        # ... at k steps of 64 where k is whole steps of it (moe_route.gemm_kernel)
        specs["grouped_gemm64"] = spec("grouped_gemm", BK=moe_route.GEMM_BK_WIDE)
        specs["routed_silu_mul"] = spec("routed_silu_mul")
    return specs


def attention_mma_group(G: int, hd: int) -> int:
    """Query heads a paged_attention_mma block (its GS): the largest divisor of G of at most 8
    (the n8 of its PV mma) whose 4 warps' merge fits the static shared memory; 0 where the kernel
    does not serve the geometry (head_dim not whole 64-dim groups: a lane's 16-byte V words, 4 a
    row of 32 lanes). Every Qwen3.5 release has G <= 8 but 122B-A10B and 397B-A17B (G = 16:
    two blocks a kv head, each reading its K/V rows)."""
    if hd % 64:
        return 0
    for gs in range(min(G, 8), 0, -1):
        if G % gs == 0 and 4 * gs * hd * 4 + 2 * 4 * 8 * 4 <= STATIC_SMEM_BYTES:
            return gs
    return 0


def paged_attention_group(G: int, hd: int) -> int:
    """Query heads per paged-attention block (the kernel's GS): all G heads of a kv head when
    their 4 warps' merge fits the static shared memory (each K/V row read once: fastest), else
    the largest divisor of G that fits (122B-A10B and 397B-A17B: G = 16 at head_dim 256 -> 8;
    the kv head's K/V rows are then read G/GS times). 0: not even one head fits."""
    for gs in range(G, 0, -1):
        if G % gs == 0 and 4 * 4 * gs * (hd + 2) <= STATIC_SMEM_BYTES:
            return gs
    return 0


def _f32_specs(cfg: TextConfig) -> dict:
    specs = {}
    for name, sp in geometry_specs(cfg).items():
        if name in F32_VARIANTS:
            specs[name] = spec(name, True, **dict(sp.params))
        elif sp.module not in ("attention_tc", "attention_mma", "gdn_chunk_tc", "grouped_gemm") \
                and name not in ("moe_down_combine", "expert_gate_up_routed") \
                and sp.factory != "gemv_norm":                                  # (bf16 only)
            specs[name] = sp
    if cfg.linear_layer_ids:                       # the fp32 chunked delta rule instead
        specs.update(gdn_chunk_specs(cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                     cfg.linear_num_key_heads, cfg.linear_num_value_heads))
    specs["widen_bf16"] = spec("widen_bf16")
    return specs


def gdn_chunk_specs(dk, dv, nk, nv, tc: bool = False) -> dict:
    """The chunked delta rule's kernels (prefill); constants from cuda/gdn_chunk.py. `tc`:
    the tensor-core variants (a bf16 model whose geometry gc.tc_ok takes)."""
    if tc:
        geo = dict(dk=dk, dv=dv, nk=nk, nv=nv, Cn=gc.TC_CHUNK)
        return {"gdn_chunk_prep_tc": spec("gdn_chunk_prep_tc", **geo),
                **{name: spec(name, **geo, VB=gc.TC_VB)
                   for name in ("gdn_chunk_state_tc", "gdn_chunk_out_tc")}}
    cn = gc.chunk_size(dk)
    if cn is None:
        return {}                    # check_geometry refuses such a model
    return {"gdn_chunk_prep": spec("gdn_chunk_prep", dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn,
                                   NT=gc.PREP_THREADS, KT=gc.PREP_KT),
            "gdn_chunk_scan": spec("gdn_chunk_scan", dk=dk, dv=dv, nk=nk, nv=nv, Cn=cn,
                                   VB=gc.SCAN_VB, NC=gc.SCAN_NC, KS=gc.scan_ks(dk),
                                   IB=gc.SCAN_IB)}


# static shared memory a kernel may declare (without the opt-in to more, which numba's static
# arrays cannot use): a geometry past it would fail at module load with a bare driver error
STATIC_SMEM_BYTES = 48 * 1024


def check_geometry(cfg: TextConfig) -> None:
    """The kernels' layout assumptions; raise DeviceError naming the unsupported dimension."""
    rules = []
    if cfg.attention_layer_ids:
        rules += [(not cfg.attention_bias, "no attention projection biases (attention_bias)"),
                  # (paged attention then fits at least one query head per block in its static
                  # shared memory: paged_attention_group splits larger groups)
                  (cfg.head_dim % 2 == 0 and cfg.head_dim <= 1024, "an even head_dim <= 1024")]
    if cfg.linear_layer_ids:
        rules += [(cfg.linear_key_head_dim % 4 == 0 and cfg.linear_key_head_dim <= 1024,
                   "linear_key_head_dim a multiple of 4, <= 1024"),
                  (cfg.linear_conv_kernel_dim >= 2, "linear_conv_kernel_dim >= 2"),
                  (max(cfg.linear_key_head_dim, cfg.linear_value_head_dim) <= 1024,
                   "GDN head dims <= 1024"),
                  # gdn_chunk_scan stages a [chunk, dk] tile: even 8-token chunks must fit
                  (gc.chunk_size(cfg.linear_key_head_dim) is not None,
                   f"the chunked delta rule's shared memory (4 x 8 x (linear_key_head_dim + "
                   f"{gc.SCAN_VB + 8 + 2})) <= 48 KiB (got linear_key_head_dim "
                   f"{cfg.linear_key_head_dim})")]
    if cfg.is_moe:
        rules += [(cfg.hidden_size % 2 == 0 and cfg.moe_intermediate_size % 2 == 0,
                   "even hidden and moe_intermediate sizes"),
                  (cfg.num_experts <= 4096, "num_experts <= 4096"),
                  # router_topk: one warp a token, lane k keeps pick k
                  (1 <= cfg.num_experts_per_tok <= min(32, cfg.num_experts),
                   f"1 <= num_experts_per_tok <= 32 and <= num_experts (got "
                   f"{cfg.num_experts_per_tok} of {cfg.num_experts})")]
    for ok, rule in rules:
        if not ok:
            raise DeviceError(f"backend 'cuda': this model's geometry is not supported, needs {rule}")


class KernelSet:
    def __init__(self, cfg: TextConfig, cache: KernelCache, f32: bool = False,
                 quant=frozenset(), kv_dtype: str = None, vision_head_dim: int = 0,
                 mtp: bool = False, dflash=None):
        check_geometry(cfg)
        self.specs = geometry_specs(cfg, f32, quant, kv_dtype)
        if mtp:                     # the MTP drafter's step (runner.mtp) and the verify's
            self.specs.update(mtp_specs(f32))
        if dflash is not None:      # a DFlash drafter's (DFlashConfig): its steps
            self.specs.update(dflash_specs(dflash, f32, kv_dtype))
        if mtp or dflash is not None:
            self.specs.update(speculation_specs(cfg))
        if vision_head_dim:         # the device vision tower's (loaded with the rest)
            self.specs.update(vision_specs(f32, vision_head_dim))
        self._cache = cache
        self._k = {}

    def get(self, spec: KernelSpec):
        """The loaded kernel of a spec (the vision tower takes its kernels by spec)."""
        return self.__dict__["_cache"].get(spec)

    def __getattr__(self, name):
        k = self.__dict__["_k"].get(name)
        if k is None:
            specs = self.__dict__["specs"]
            if name not in specs:
                raise AttributeError(name)
            k = self.__dict__["_cache"].get(specs[name])
            self.__dict__["_k"][name] = k
        return k

    def close(self) -> None:
        self.__dict__["_k"].clear()
        self.__dict__["_cache"].close()

    def start_precompile(self, workers: int = None):
        """Compile this set's missing kernels in other processes (KernelCache.start_precompile)
        while the caller goes on; `wait()` on the result before `load_all`."""
        return self.__dict__["_cache"].start_precompile(self.specs.values(), workers)

    def load_all(self, threads: int = 1, bind_context=None) -> None:
        """Load every kernel's module now; `threads` > 1: side by side (each thread first calls
        `bind_context`, which makes the model's context current there)."""
        if threads <= 1:
            if bind_context is not None:
                bind_context()
            for name in self.specs:
                getattr(self, name)
            return
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(threads, initializer=bind_context,
                                thread_name_prefix="ninfer-kernels") as pool:
            list(pool.map(lambda name: getattr(self, name), list(self.specs)))

    def start_loading(self, bind_context, threads: int = 8) -> "KernelLoading":
        """Compile what is missing (other processes) and load every module (`threads` threads),
        in the background: the caller loads the weights meanwhile, then `wait()`s."""
        return KernelLoading(self, self.start_precompile(), bind_context, threads)


class KernelLoading:
    """A KernelSet's compile-then-load running in one background thread (start_loading)."""

    def __init__(self, kernels: KernelSet, precompile, bind_context, threads: int):
        import threading
        self._error, self.compiled = None, 0

        def run():
            try:
                self.compiled = precompile.wait()
                kernels.load_all(threads, bind_context)
            except BaseException as exc:   # noqa: BLE001 - re-raised by wait() on the caller
                self._error = exc
        self._thread = threading.Thread(target=run, name="ninfer-kernel-load", daemon=True)
        self._thread.start()

    def wait(self) -> int:
        """Block until every kernel is loaded; the number compiled. Raises what loading raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.compiled
