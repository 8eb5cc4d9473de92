"""What the CUDA model takes of the device: call capacities, the workspace bound and the memory
plan (memory_plan.py's pools plus the weights, the workspace and the sampler), checked against the
free device memory before the arena is allocated.

    call_capacities(options) -> (b_cap, n_cap, p_cap, lg_cap)
    workspace_bytes(cfg, ...) -> an upper bound of runner.Workspace + metadata + cuBLASLt scratch
    plan_cuda_memory(cfg, options, ...) -> MemoryPlan (raises DeviceError when it does not fit)
"""
from __future__ import annotations

from dataclasses import replace

from ....core.cuda.arena import _round_up
from ....core.cuda.cublaslt import PIN_M
from ....errors import DeviceError
from ....options import draft_tokens
from ..memory_plan import MemoryPlan, plan_device_pools
from . import attention_tc, gdn_chunk, moe_route
from .runner import grouped_rows

LT_WORKSPACE = 32 << 20         # cuBLASLt workspace bytes (also the fp32 load's widening scratch)
MEMORY_MARGIN = 512 << 20       # left free for graphs, the driver and modules
ARENA_ALIGN_SLACK = 64 << 10    # per pool array: the arena's alignment of each region

# embed_gather and moe_combine put a call's tokens on grid.y, which CUDA caps at 65535 blocks
MAX_TOKENS_PER_CALL = 65535


def check_capacity(n_cap: int) -> None:
    if n_cap > MAX_TOKENS_PER_CALL:
        raise DeviceError(f"backend 'cuda': prefill_chunk {n_cap} exceeds the {MAX_TOKENS_PER_CALL} "
                          "tokens one CUDA model call can take (kernel grid limit)")


def call_capacities(options, max_tokens: int = None, *, mixed: bool = False) -> tuple:
    """(b_cap rows of a decode graph, n_cap tokens of one call, p_cap pages of one row, lg_cap
    logits rows of one head pass) for `options`; `max_tokens` overrides prefill_chunk (bench).
    mixed: a cycle's decode rows ride on its prefill chunk in one call (Model.mixed_batches),
    so a call holds up to b_cap tokens more than a chunk."""
    b_cap = max(int(options.max_concurrency), 1)
    page_size, max_context = int(options.page_size), int(options.max_context)
    # a decode graph runs b_cap tokens through the same workspace: never fewer rows than that
    # (batch_invariant: GEMMs of fewer than PIN_M rows run as PIN_M rows, cuda/runner.py)
    chunk = (max_tokens or options.prefill_chunk) + (b_cap if mixed else 0)
    # speculative (either drafter): a verify unit runs every decode row's last token and up to
    # k drafts, all of them with logits (program/speculative.py), in one call
    verify = b_cap * (draft_tokens(options) + 1) \
        if getattr(options, "speculative", None) is not None else b_cap
    n_cap = int(max(chunk, verify, PIN_M if options.batch_invariant else 1))
    check_capacity(n_cap)
    p_cap = (max_context + page_size - 1) // page_size + 1
    return b_cap, n_cap, p_cap, max(verify, min(n_cap, 256))


def workspace_bytes(cfg, *, f32: bool, n_cap: int, lg_cap: int, part_rows: int, max_keys: int,
                    meta_bytes: int, mtp: bool = False, rows: int = 8) -> int:
    """A generous upper bound of runner.Workspace (every buffer at its widest), the call metadata
    (meta_bytes) and the cuBLASLt workspace; `mtp`: with the MTP head's buffers (its fc input
    2H wide, its input hidden states); `rows`: the most rows of one call (Workspace's
    rows_cap)."""
    H = cfg.hidden_size
    g = 4 if f32 else 2          # bytes of a GEMM input element (x, act, xg, gact, xf)
    widest = max(cfg.linear_conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads,
                 2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim,
                 2 * cfg.intermediate_size,
                 cfg.num_experts + 2 * cfg.shared_expert_intermediate_size + 1)
    per_tok = 4 * H + g * H + g * max(H, cfg.linear_value_dim, cfg.num_attention_heads * cfg.head_dim,
                                      cfg.intermediate_size, cfg.shared_expert_intermediate_size,
                                      2 * H if mtp else 0) + (g * H + 4 if mtp else 0) \
        + 4 * widest + 4 * max(cfg.linear_conv_dim, cfg.num_attention_heads * cfg.head_dim) \
        + 4 * cfg.linear_value_dim
    if cfg.is_moe:
        K = cfg.num_experts_per_tok
        I = cfg.moe_intermediate_size
        # ids, wts, mact, shared per token; the grouped rows (my, xg, gu, gact, route)
        per_tok += 8 * K + 4 * K * I + 4 * H + 4 * K
        grouped = grouped_rows(n_cap, K, cfg.num_experts) * (4 * H + g * H + 8 * I + g * I + 4)
        if not f32:             # the routing on the device (moe_route.DeviceRoute), 8 arrays
            grouped += moe_route.nbytes(n_cap, K, cfg.num_experts,
                                        cfg.num_hidden_layers + int(mtp)) + 8 * 256
    else:
        grouped = 0
    part = grouped + part_rows * cfg.num_attention_heads * (cfg.head_dim + 2) * 4
    if cfg.attention_layer_ids and not f32:
        part += attention_tc.nbytes(attention_tc.buffer_sizes(
            cfg.num_attention_heads, max(cfg.num_key_value_heads, 1), cfg.head_dim, n_cap,
            max_keys))
    head = lg_cap * (g * H + 4 * cfg.vocab_size + 4)
    if cfg.linear_layer_ids:       # the chunked delta rule's W, P and decay factors
        part += gdn_chunk.workspace_bytes(n_cap, cfg.linear_num_value_heads,
                                          cfg.linear_key_head_dim,
                                          0 if f32 else cfg.linear_value_head_dim,
                                          rows) + 4 * 256
    return _round_up(n_cap * per_tok + part + head + meta_bytes + LT_WORKSPACE) + 64 * 256


def plan_cuda_memory(cfg, options, *, f32: bool, weights_bytes: int, workspace_bytes: int,
                     free_bytes: int, total_bytes: int, device: str,
                     margin_bytes: int = MEMORY_MARGIN, kv_dtype: str = None,
                     extra_kv: tuple = ()) -> MemoryPlan:
    """The whole plan: weights + workspace (with the sampler) + pools; the KV pages from what the
    free memory holds (memory_plan.plan_device_pools; kv_dtype "fp8" / "int8": quantized pages,
    codes and scales; extra_kv: a drafter's KV layers, (kv heads, head_dim) each). Raises
    DeviceError when the plan and the margin exceed the free memory."""
    fixed = weights_bytes + workspace_bytes
    pools = plan_device_pools(cfg, options, fixed_bytes=fixed, free_bytes=free_bytes,
                              kv_itemsize=4 if f32 else 2, margin_bytes=margin_bytes,
                              region_slack_bytes=ARENA_ALIGN_SLACK, kv_dtype=kv_dtype,
                              extra_kv=extra_kv)
    plan = replace(pools, weights_bytes=weights_bytes, workspace_bytes=workspace_bytes,
                   device=device)
    if plan.total_bytes + margin_bytes > free_bytes:
        raise DeviceError(
            f"backend 'cuda': too little device memory for the plan: needs "
            f"{(plan.total_bytes + margin_bytes) / 2**30:.2f} GiB (weights, KV/state pools, "
            f"workspace{', all in float32' if f32 else ''}), "
            f"{free_bytes / 2**30:.2f} GiB free of {total_bytes / 2**30:.2f} GiB on {device}")
    return plan
