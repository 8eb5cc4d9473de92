"""numpy reference ops (the numpy backend and the oracle the CUDA kernels are checked against).

Every op computes in float32 (the model's compute dtype) unless its docstring says otherwise, takes
plain arrays, and allocates its outputs; none keeps state between calls. Families:

    elementwise   silu, sigmoid, softplus, swiglu, linear
    norm          rmsnorm, rmsnorm_zero_centred, rmsnorm_gated, l2norm
    conv          causal_conv1d (prefill and single-step update share one code path)
    delta_rule    gated_delta_chunked (prefill), gated_delta_recurrent (decode)
    rotary        mrope_cos_sin, apply_rotary (partial rotary, rotate-half style)
    attention     kv_slot_mapping, write_paged_kv, paged_attention (causal GQA over paged KV)
    moe           route_topk, moe_experts
"""
from .attention import kv_slot_mapping, paged_attention, write_paged_kv
from .conv import causal_conv1d
from .delta_rule import gated_delta_chunked, gated_delta_recurrent
from .elementwise import linear, sigmoid, silu, softplus, swiglu
from .moe import moe_experts, route_topk
from .norm import l2norm, rmsnorm, rmsnorm_gated, rmsnorm_zero_centred
from .rotary import apply_rotary, mrope_cos_sin

__all__ = ["kv_slot_mapping", "paged_attention", "write_paged_kv", "causal_conv1d", "gated_delta_chunked",
           "gated_delta_recurrent", "linear", "sigmoid", "silu", "softplus", "swiglu",
           "moe_experts", "route_topk", "l2norm", "rmsnorm", "rmsnorm_gated", "rmsnorm_zero_centred",
           "apply_rotary", "mrope_cos_sin"]
