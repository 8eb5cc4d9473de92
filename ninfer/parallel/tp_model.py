"""The numpy Qwen3.5 model run as N simulated tensor / expert parallel ranks (the CPU proof of
the sharding math before any multi-GPU code).

TensorParallelModel is a NumpyModel whose decoder layers are N rank shards each: every rank runs
the numpy model's own layer classes (GatedAttention, GatedDeltaNet, DenseMLP, SparseMoE) on its
shard of the parameters (shard.py) with a rank-local config (its head counts), and a
communicator sums the ranks' partial outputs where the math needs it:

    h = embed(ids)                                        replicated (one copy here)
    per layer:  x = input_norm(h)                         replicated
                h += all_reduce_sum(mixer_r(x))           after o_proj / out_proj (row-parallel)
                h += all_reduce_sum(mlp_r(post_norm(h)))  after down_proj / the MoE combine
    logits = lm_head(final_norm(h))                       replicated

Two all-reduces of [N_tokens, hidden] per layer, nothing else crosses ranks: routing is
computed from the replicated router on every rank and each rank runs only its own experts;
attention and the delta rule never mix heads. The forward contract (ForwardBatch in, float32
logits out, KV and State pools updated) is NumpyModel's, inherited unchanged: only the layers
and the pools differ. The pools are one per rank (ShardedKVPool, ShardedStatePool), each
holding that rank's heads (a replicated KV head is stored on every rank that reads it).

What the simulation shares between ranks: the replicated work (embedding, norms, lm_head, the
router) is done once, since every rank would compute identical values from identical inputs.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..contracts import ReadyRead
from ..models.qwen3_5.config import FULL_ATTENTION
from ..models.qwen3_5.layers import DenseMLP, GatedAttention, GatedDeltaNet, SparseMoE
from ..models.qwen3_5.model import NumpyModel
from ..models.qwen3_5.state import KVPool, StatePool
from .comm import LocalComm
from .shard import EXPERT_IDS, check_geometry, rank_config, shard_layer


class ExpertShardMoE(SparseMoE):
    """One rank's MoE: the replicated router picks every token's experts as in SparseMoE; this
    rank runs only the (token, expert) pairs whose expert it owns (its EXPERT_IDS, held at local
    indices 0..), plus its shard of the shared expert. Its output is a partial sum: the sum over
    ranks is SparseMoE's output."""

    def __init__(self, p: dict, cfg):
        super().__init__(p, cfg)
        self.local_index = np.full(cfg.num_experts, -1, np.int64)     # global id -> local, -1
        self.local_index[p[EXPERT_IDS]] = np.arange(len(p[EXPERT_IDS]))

    def routed(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        local = self.local_index[ids]                                   # [N, top_k]
        tok, slot = np.nonzero(local >= 0)
        out = np.zeros(x.shape, np.float32)
        if tok.size == 0:
            return out
        # pairs expert-major, tokens ascending within an expert: each expert then multiplies
        # the same rows in the same order as SparseMoE does, and each token's contributions
        # are added in ascending expert order, as there (world size 1 is bit-identical)
        order = np.argsort(local[tok, slot], kind="stable")
        tok, slot = tok[order], slot[order]
        part = ops.moe_experts(x[tok], local[tok, slot][:, None], weights[tok, slot][:, None],
                               self.p["experts_gate_up"], self.p["experts_down"])
        np.add.at(out, tok, part)
        return out


class RankSum:
    """One layer's mixer or MLP as N rank shards whose partial outputs are summed by `comm`.
    A mixer (reads_kv set) is handed a sharded pool and gives rank r its pool.ranks[r]."""

    def __init__(self, shards: list, comm, reads_kv: bool | None = None):
        self.shards, self.comm = shards, comm
        if reads_kv is not None:
            self.reads_kv = reads_kv

    def __call__(self, x: np.ndarray, *mixer_args) -> np.ndarray:
        if mixer_args:
            plan, pool = mixer_args
            return self.comm.all_reduce_sum([layer(x, plan, pool.ranks[r])
                                             for r, layer in enumerate(self.shards)])
        return self.comm.all_reduce_sum([layer(x) for layer in self.shards])


class ShardedKVPool:
    """The N ranks' KV pools (rank r: its KV heads of every attention layer); pages and the
    page size are common, so a block table means the same pages on every rank."""
    reads_async = False

    def __init__(self, ranks: list):
        self.ranks = list(ranks)
        self.page_size = self.ranks[0].page_size

    @property
    def num_pages(self) -> int:
        return self.ranks[0].num_pages

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.ranks)

    def read_pages(self, pages) -> tuple:
        """(per rank: that pool's read_pages) - opaque to anyone but write_pages."""
        return tuple(p.read_pages(pages) for p in self.ranks)

    def start_read_pages(self, pages) -> ReadyRead:
        return ReadyRead(self.read_pages(pages))

    def write_pages(self, pages, data: tuple) -> None:
        for p, d in zip(self.ranks, data, strict=True):
            p.write_pages(pages, d)

    def copy_pages(self, src_pages, dst_pages) -> None:
        for p in self.ranks:
            p.copy_pages(src_pages, dst_pages)


class ShardedStatePool:
    """The N ranks' Gated DeltaNet State pools (rank r: its heads' conv channels and S)."""
    reads_async = False

    def __init__(self, ranks: list):
        self.ranks = list(ranks)

    @property
    def num_slots(self) -> int:
        return self.ranks[0].num_slots

    def zero(self, slot: int) -> None:
        for p in self.ranks:
            p.zero(slot)

    def read(self, slot: int) -> tuple:
        return tuple(p.read(slot) for p in self.ranks)

    def start_read(self, slot: int) -> ReadyRead:
        return ReadyRead(self.read(slot))

    def write(self, slot: int, image: tuple) -> None:
        for p, im in zip(self.ranks, image, strict=True):
            p.write(slot, im)

    def copy(self, src_slot: int, dst_slot: int) -> None:
        for p in self.ranks:
            p.copy(src_slot, dst_slot)


class TensorParallelModel(NumpyModel):
    """`model` (a NumpyModel) as `world_size` tensor / expert parallel ranks over `comm`
    (default: LocalComm(world_size), all ranks in this process). Same forward, final_hidden and
    verify_forward as NumpyModel; pools from new_kv_pool / new_state_pool (sharded). Shares
    the source model's replicated arrays and contiguous row blocks; column blocks and a Gated
    DeltaNet layer's gathered q/k/v rows are copies."""

    def __init__(self, model: NumpyModel, world_size: int, comm=None):
        cfg = model.text
        check_geometry(cfg, world_size)
        self.comm = LocalComm(world_size) if comm is None else comm
        if self.comm.world_size != world_size:
            raise ValueError(f"comm has world_size {self.comm.world_size}, not {world_size}")
        self.world_size = int(world_size)
        self.config, self.text = model.config, cfg
        self.rank_text = rank_config(cfg, world_size)
        self.vision, self.kv_dtype = model.vision, model.kv_dtype
        self._embed, self._lm_head, self._norm = model._embed, model._lm_head, model._norm
        self.layer_shards = []          # [layer][rank] parameter dicts (shard.shard_layer)
        self._layers = []
        n_attn = n_lin = 0
        local = self.rank_text
        for kind, (in_norm, mixer, post_norm, _) in zip(cfg.layer_types, model._layers):
            shards = [shard_layer(mixer.p, cfg, kind, r, world_size) for r in range(world_size)]
            if kind == FULL_ATTENTION:
                mixers, n_attn = [GatedAttention(s, local, n_attn) for s in shards], n_attn + 1
            else:
                mixers, n_lin = [GatedDeltaNet(s, local, n_lin) for s in shards], n_lin + 1
            mlps = [ExpertShardMoE(s, local) if cfg.is_moe else DenseMLP(s) for s in shards]
            self.layer_shards.append(shards)
            self._layers.append((in_norm, RankSum(mixers, self.comm, mixers[0].reads_kv),
                                 post_norm, RankSum(mlps, self.comm)))

    def new_kv_pool(self, num_pages: int, page_size: int) -> ShardedKVPool:
        return ShardedKVPool([KVPool.allocate(self.rank_text, num_pages, page_size,
                                              kv_dtype=self.kv_dtype)
                              for _ in range(self.world_size)])

    def new_state_pool(self, num_slots: int) -> ShardedStatePool:
        return ShardedStatePool([StatePool.allocate(self.rank_text, num_slots)
                                 for _ in range(self.world_size)])
