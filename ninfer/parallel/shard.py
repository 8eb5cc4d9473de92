"""Split one decoder layer's parameters (as the numpy model holds them: load.read_text_params'
per-layer dict of float32 arrays) for rank r of N, and merge the N shards back.

Every rank owns whole heads (attention, Gated DeltaNet), a contiguous block of the MLP's
intermediate channels, and a contiguous block of experts; a layer's output is the sum over the
ranks of their partial outputs (one all-reduce after the mixer, one after the MLP / MoE):

    full attention   q_proj (+bias) rows of query heads [q0, q1) (each head's [query, gate]
                     rows together), k_proj / v_proj (+bias) rows of the KV heads those query
                     heads read, o_proj columns of [q0, q1) (row-parallel); o_proj's bias on
                     rank 0 only (it must be added once); q_norm, k_norm replicated
    Gated DeltaNet   value heads [v0, v1) and the key heads they read: in_proj_qkv and the conv
                     channels (q rows, k rows of those key heads, v rows of those value heads),
                     in_proj_z, in_proj_b, in_proj_a, dt_bias, A_log of [v0, v1); out_proj
                     columns of [v0, v1) (row-parallel); the gated norm weight (per head dim)
                     replicated
    dense MLP        gate_proj / up_proj rows [i0, i1) (column-parallel), down_proj columns
                     [i0, i1) (row-parallel)
    MoE              experts [e0, e1) = [r E/N, (r+1) E/N) (expert parallel, contiguous blocks);
                     router and shared_expert_gate replicated; the shared expert split like a
                     dense MLP
    norms            input_norm, post_norm replicated (embeddings, final norm, lm_head too:
                     the model keeps one copy, ninfer/parallel/tp_model.py)

Supported geometries (check_geometry raises ShardingError, naming the numbers, otherwise):
    num_attention_heads % N == 0, and KV heads either sharded (num_key_value_heads % N == 0)
    or replicated (N % num_key_value_heads == 0: each rank's query heads all read one KV head,
    which the rank holds a copy of; e.g. 32 query on 2 KV heads over 8 ranks);
    linear_num_value_heads % N == 0, and key heads sharded (linear_num_key_heads % N == 0) or
    replicated (N % linear_num_key_heads == 0), the same rule;
    intermediate_size % N == 0 (dense), num_experts % N == 0 and
    shared_expert_intermediate_size % N == 0 (MoE).
Replicated arrays are the same objects on every rank (no copy); split ones are contiguous.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ShardingError
from ..models.qwen3_5.config import FULL_ATTENTION, LINEAR_ATTENTION, TextConfig


_COMMON = ("input_norm", "post_norm")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
              "q_bias", "k_bias", "v_bias", "o_bias")
_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv_w", "dt_bias", "A_log",
           "gdn_norm", "out_proj")
_DENSE = ("gate_proj", "up_proj", "down_proj")
_MOE = ("router", "experts_gate_up", "experts_down", "shared_gate_proj", "shared_up_proj",
        "shared_down_proj", "shared_expert_gate")
EXPERT_IDS = "expert_ids"        # a MoE shard's owned global expert ids (int64, ascending)


# ---- geometry ------------------------------------------------------------------------------------

def _check_world(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) \
            or world_size < 1:
        raise ShardingError(f"world_size must be a positive integer, got {world_size!r}")
    return int(world_size)


def _check_rank(rank, world_size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
            or not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank!r} is not in [0, {world_size})")
    return int(rank)


def _grouped_heads(what: str, n_heads: int, n_groups: int, group_name: str, N: int) -> None:
    """The rule shared by attention (query heads over KV heads) and Gated DeltaNet (value heads
    over key heads): the heads divide among the ranks, and the groups either divide too or each
    rank's heads lie inside one group."""
    if n_heads % N:
        raise ShardingError(f"cannot shard {what}={n_heads} over world_size={N}: the heads "
                            f"must divide evenly among the ranks")
    if n_groups % N and N % n_groups:
        raise ShardingError(
            f"cannot shard {group_name}={n_groups} (with {what}={n_heads}) over world_size={N}: "
            f"they must either divide among the ranks (here {n_groups} % {N} != 0) or be "
            f"replicated with each rank's heads inside one group (here {N} % {n_groups} != 0)")


def check_geometry(cfg: TextConfig, world_size: int) -> None:
    """Raise ShardingError unless every layer of `cfg` splits over `world_size` ranks."""
    N = _check_world(world_size)
    if cfg.attention_layer_ids:
        _grouped_heads("num_attention_heads", cfg.num_attention_heads, cfg.num_key_value_heads,
                       "num_key_value_heads", N)
    if cfg.linear_layer_ids:
        _grouped_heads("linear_num_value_heads", cfg.linear_num_value_heads,
                       cfg.linear_num_key_heads, "linear_num_key_heads", N)
    if cfg.is_moe:
        if cfg.num_experts % N:
            raise ShardingError(f"cannot place num_experts={cfg.num_experts} over world_size={N}: "
                                f"expert parallel gives each rank a block of num_experts / N")
        if cfg.shared_expert_intermediate_size % N:
            raise ShardingError(f"cannot shard shared_expert_intermediate_size="
                                f"{cfg.shared_expert_intermediate_size} over world_size={N}")
    elif cfg.intermediate_size % N:
        raise ShardingError(f"cannot shard intermediate_size={cfg.intermediate_size} over "
                            f"world_size={N}")


def _group_range(heads: range, n_heads: int, n_groups: int) -> range:
    """The groups (KV heads / key heads) read by a contiguous range of heads."""
    per = n_heads // n_groups
    return range(heads.start // per, (heads.stop - 1) // per + 1)


def _block(cfg: TextConfig, count: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s contiguous block of `count` things (heads, experts) split over N ranks."""
    N = _check_world(world_size)
    check_geometry(cfg, N)
    r, per = _check_rank(rank, N), count // N
    return range(r * per, (r + 1) * per)


def attention_heads(cfg: TextConfig, rank: int, world_size: int) -> tuple:
    """(query heads, KV heads) of `rank` as ranges of global head indices."""
    q = _block(cfg, cfg.num_attention_heads, rank, world_size)
    return q, _group_range(q, cfg.num_attention_heads, cfg.num_key_value_heads)


def linear_heads(cfg: TextConfig, rank: int, world_size: int) -> tuple:
    """(value heads, key heads) of `rank` in a Gated DeltaNet layer, as ranges."""
    v = _block(cfg, cfg.linear_num_value_heads, rank, world_size)
    return v, _group_range(v, cfg.linear_num_value_heads, cfg.linear_num_key_heads)


def owned_experts(cfg: TextConfig, rank: int, world_size: int) -> range:
    """The experts rank `rank` owns: the contiguous block [r E/N, (r+1) E/N)."""
    return _block(cfg, cfg.num_experts, rank, world_size)


def rank_config(cfg: TextConfig, world_size: int) -> TextConfig:
    """The geometry one rank's layers and pools see (the same for every rank): its head counts
    and intermediate sizes. num_experts stays global: the router is replicated and routes over
    all experts; a rank's experts are owned_experts()."""
    N = _check_world(world_size)
    check_geometry(cfg, N)
    q, kv = attention_heads(cfg, 0, N) if cfg.attention_layer_ids else \
        (range(cfg.num_attention_heads), range(cfg.num_key_value_heads))
    v, k = linear_heads(cfg, 0, N) if cfg.linear_layer_ids else \
        (range(cfg.linear_num_value_heads), range(cfg.linear_num_key_heads))
    over = dict(num_attention_heads=len(q), num_key_value_heads=len(kv),
                linear_num_value_heads=len(v), linear_num_key_heads=len(k))
    if cfg.is_moe:
        over["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size // N
    else:
        over["intermediate_size"] = cfg.intermediate_size // N
    return dataclasses.replace(cfg, **over)


# ---- split ---------------------------------------------------------------------------------------

def _rows(a: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.ascontiguousarray(a[start:stop])


def _cols(a: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.ascontiguousarray(a[:, start:stop])


def _known(p: dict, names: tuple, kind: str) -> None:
    unknown = sorted(set(p) - set(names) - set(_COMMON))
    if unknown:
        raise ShardingError(f"no sharding rule for {kind} layer parameters {unknown}")


def shard_layer(p: dict, cfg: TextConfig, kind: str, rank: int, world_size: int) -> dict:
    """Rank `rank`'s parameters of one layer (`kind`: config.FULL_ATTENTION or
    LINEAR_ATTENTION; the MLP part follows cfg.is_moe), under the same keys as `p` (a MoE shard
    adds EXPERT_IDS), ready for the numpy layer classes built with rank_config(cfg, N)."""
    N = _check_world(world_size)
    check_geometry(cfg, N)
    r = _check_rank(rank, N)
    mlp_names = _MOE if cfg.is_moe else _DENSE
    out = {k: p[k] for k in _COMMON}
    if kind == FULL_ATTENTION:
        _known(p, _ATTENTION + mlp_names, kind)
        out.update(_shard_attention(p, cfg, r, N))
    elif kind == LINEAR_ATTENTION:
        _known(p, _LINEAR + mlp_names, kind)
        out.update(_shard_linear(p, cfg, r, N))
    else:
        raise ShardingError(f"unknown layer kind {kind!r}")
    out.update(_shard_moe(p, cfg, r, N) if cfg.is_moe else _shard_mlp(p, "", r, N))
    return out


def _shard_attention(p: dict, cfg: TextConfig, r: int, N: int) -> dict:
    hd = cfg.head_dim
    q, kv = attention_heads(cfg, r, N)
    out = {"q_proj": _rows(p["q_proj"], q.start * 2 * hd, q.stop * 2 * hd),
           "k_proj": _rows(p["k_proj"], kv.start * hd, kv.stop * hd),
           "v_proj": _rows(p["v_proj"], kv.start * hd, kv.stop * hd),
           "o_proj": _cols(p["o_proj"], q.start * hd, q.stop * hd),
           "q_norm": p["q_norm"], "k_norm": p["k_norm"]}
    if "q_bias" in p:
        out["q_bias"] = _rows(p["q_bias"], q.start * 2 * hd, q.stop * 2 * hd)
    for name in ("k_bias", "v_bias"):
        if name in p:
            out[name] = _rows(p[name], kv.start * hd, kv.stop * hd)
    if "o_bias" in p and r == 0:           # added once: the other ranks' partials carry none
        out["o_bias"] = p["o_bias"]
    return out


def _qkv_rows(cfg: TextConfig, v: range, k: range) -> np.ndarray:
    """Row indices of in_proj_qkv / the conv channels for value heads v and key heads k:
    [q of k | k of k | v of v] out of the layout [q (nk dk) | k (nk dk) | v (nv dv)]."""
    dk, dv, kd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_key_dim
    return np.concatenate([np.arange(k.start * dk, k.stop * dk),
                           kd + np.arange(k.start * dk, k.stop * dk),
                           2 * kd + np.arange(v.start * dv, v.stop * dv)])


def _shard_linear(p: dict, cfg: TextConfig, r: int, N: int) -> dict:
    dv = cfg.linear_value_head_dim
    v, k = linear_heads(cfg, r, N)
    rows = _qkv_rows(cfg, v, k)
    return {"in_proj_qkv": p["in_proj_qkv"][rows], "conv_w": p["conv_w"][rows],
            "in_proj_z": _rows(p["in_proj_z"], v.start * dv, v.stop * dv),
            "in_proj_b": _rows(p["in_proj_b"], v.start, v.stop),
            "in_proj_a": _rows(p["in_proj_a"], v.start, v.stop),
            "dt_bias": _rows(p["dt_bias"], v.start, v.stop),
            "A_log": _rows(p["A_log"], v.start, v.stop),
            "gdn_norm": p["gdn_norm"],
            "out_proj": _cols(p["out_proj"], v.start * dv, v.stop * dv)}


def _shard_mlp(p: dict, prefix: str, r: int, N: int) -> dict:
    """gate / up column-parallel, down row-parallel (prefix "" dense, "shared_" the shared
    expert)."""
    inter = p[prefix + "gate_proj"].shape[0]
    i0, i1 = r * inter // N, (r + 1) * inter // N
    return {prefix + "gate_proj": _rows(p[prefix + "gate_proj"], i0, i1),
            prefix + "up_proj": _rows(p[prefix + "up_proj"], i0, i1),
            prefix + "down_proj": _cols(p[prefix + "down_proj"], i0, i1)}


def _shard_moe(p: dict, cfg: TextConfig, r: int, N: int) -> dict:
    e = owned_experts(cfg, r, N)
    out = {"router": p["router"], "shared_expert_gate": p["shared_expert_gate"],
           "experts_gate_up": _rows(p["experts_gate_up"], e.start, e.stop),
           "experts_down": _rows(p["experts_down"], e.start, e.stop),
           EXPERT_IDS: np.arange(e.start, e.stop, dtype=np.int64)}
    out.update(_shard_mlp(p, "shared_", r, N))
    return out


# ---- merge (the inverse) -------------------------------------------------------------------------

def _merge_groups(pieces: list, ranges: list, width: int, axis: int = 0) -> np.ndarray:
    """Concatenate per-rank pieces holding heads ranges[r] (`width` rows or columns per head)
    along `axis`, taking each head once (replicated heads from the first rank holding them)."""
    out, covered = [], 0
    for piece, heads in zip(pieces, ranges):
        if heads.stop <= covered:
            continue
        skip = (covered - heads.start) * width if covered > heads.start else 0
        out.append(np.take(piece, np.arange(skip, piece.shape[axis]), axis=axis))
        covered = heads.stop
    return np.concatenate(out, axis=axis)


def _replicated(shards: list, name: str) -> np.ndarray:
    first = shards[0][name]
    for r, s in enumerate(shards[1:], 1):
        if not np.array_equal(s[name], first):
            raise ShardingError(f"replicated parameter {name!r} differs on rank {r}")
    return first


def merge_layer(shards: list, cfg: TextConfig, kind: str) -> dict:
    """The inverse of shard_layer: the full layer dict from the N ranks' shards (in rank
    order). Replicated parameters come from rank 0 (checked equal on every rank)."""
    N = _check_world(len(shards))
    check_geometry(cfg, N)
    out = {k: _replicated(shards, k) for k in _COMMON}
    if kind == FULL_ATTENTION:
        hd = cfg.head_dim
        heads = [attention_heads(cfg, r, N) for r in range(N)]
        q_r, kv_r = [h[0] for h in heads], [h[1] for h in heads]
        for name, ranges, width, axis in (("q_proj", q_r, 2 * hd, 0), ("q_bias", q_r, 2 * hd, 0),
                                          ("k_proj", kv_r, hd, 0), ("k_bias", kv_r, hd, 0),
                                          ("v_proj", kv_r, hd, 0), ("v_bias", kv_r, hd, 0),
                                          ("o_proj", q_r, hd, 1)):
            if name in shards[0]:
                out[name] = _merge_groups([s[name] for s in shards], ranges, width, axis)
        out.update({k: _replicated(shards, k) for k in ("q_norm", "k_norm")})
        if "o_bias" in shards[0]:
            out["o_bias"] = shards[0]["o_bias"]
    elif kind == LINEAR_ATTENTION:
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        heads = [linear_heads(cfg, r, N) for r in range(N)]
        v_r, k_r = [h[0] for h in heads], [h[1] for h in heads]
        for name in ("in_proj_qkv", "conv_w"):
            parts = []
            for s, v, k in zip(shards, v_r, k_r):
                a = s[name]
                parts.append((a[:len(k) * dk], a[len(k) * dk:2 * len(k) * dk],
                              a[2 * len(k) * dk:]))
            out[name] = np.concatenate([_merge_groups([p[0] for p in parts], k_r, dk),
                                        _merge_groups([p[1] for p in parts], k_r, dk),
                                        _merge_groups([p[2] for p in parts], v_r, dv)])
        for name, width, axis in (("in_proj_z", dv, 0), ("in_proj_b", 1, 0), ("in_proj_a", 1, 0),
                                  ("dt_bias", 1, 0), ("A_log", 1, 0), ("out_proj", dv, 1)):
            out[name] = _merge_groups([s[name] for s in shards], v_r, width, axis)
        out["gdn_norm"] = _replicated(shards, "gdn_norm")
    else:
        raise ShardingError(f"unknown layer kind {kind!r}")
    if cfg.is_moe:
        out.update({k: _replicated(shards, k) for k in ("router", "shared_expert_gate")})
        for name in ("experts_gate_up", "experts_down"):
            out[name] = np.concatenate([s[name] for s in shards])
        prefix = "shared_"
    else:
        prefix = ""
    for name, axis in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        out[prefix + name] = np.concatenate([s[prefix + name] for s in shards], axis=axis)
    return out
