"""The Qwen3.5 text model on the numpy backend (float32 compute from the stored weights).

    embed -> [ input_norm -> mixer (GatedDeltaNet | GatedAttention) -> +residual
               post_norm  -> mlp (DenseMLP | SparseMoE)             -> +residual ] x layers
          -> final norm -> lm_head

A forward call runs one ForwardBatch: several independent rows, each continuing its own KV pages and
State slot from its frontier context_lens[r]. Rows never read one another's data, so a batched call
equals the per-row calls.
"""
from __future__ import annotations

import time

import numpy as np

from ... import ops
from ...contracts import BatchLimits, ForwardBatch
from .config import FULL_ATTENTION, ModelConfig
from .layers import DenseMLP, GatedAttention, GatedDeltaNet, SparseMoE, StepPlan
from .load import model_config, read_text_params
from .state import KVPool, StatePool
from .vision_tower import MediaEncoding


class NumpyModel(MediaEncoding):
    """The contracts.Model of the numpy backend: logits to the host, the host samples. Media:
    vision.MediaEncoding (the tower's output replaces the placeholders' embeddings)."""
    backend = "numpy"
    greedy_on_device = samples_on_device = False
    mixed_batches = True        # forward takes any rows (contracts.Model)
    chains_token_steps = False  # no device token path
    step_hidden = False         # (nor its hidden states: contracts.Model)
    one_off_seconds = 0.0       # (no graphs or plans made on first use)
    checks_batches = True       # direct callers get checked; a Program turns it off (contracts)
    max_kv_pages = None         # host memory: the Program's default pool size
    max_state_slots = None
    kv_dtype = None             # "fp8" / "int8": quantized KV pages (load_model sets it)
    load_phases: dict = {}      # from_artifact: {"weights": seconds} (never mutated: replaced)
    warm_up_phases: dict = {}   # nothing to capture on numpy

    def __init__(self, config: ModelConfig, params: dict):
        self.config = config
        cfg = self.text = config.text
        self._embed, self._lm_head, self._norm = params["embed"], params["lm_head"], params["norm"]
        self._layers = []
        n_attn = n_lin = 0
        for kind, p in zip(cfg.layer_types, params["layers"]):
            if kind == FULL_ATTENTION:
                mixer, n_attn = GatedAttention(p, cfg, n_attn), n_attn + 1
            else:
                mixer, n_lin = GatedDeltaNet(p, cfg, n_lin), n_lin + 1
            mlp = SparseMoE(p, cfg) if cfg.is_moe else DenseMLP(p)
            self._layers.append((p["input_norm"], mixer, p["post_norm"], mlp))

    @classmethod
    def from_artifact(cls, artifact) -> "NumpyModel":
        cfg = model_config(artifact)
        t0 = time.perf_counter()
        model = cls(cfg, read_text_params(artifact, cfg.text))
        model.load_vision(artifact)
        model.load_phases = {"weights": time.perf_counter() - t0}
        return model

    # ---- pools ------------------------------------------------------------------------------------
    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        return KVPool.allocate(self.text, num_pages, page_size, kv_dtype=self.kv_dtype)

    def new_state_pool(self, num_slots: int) -> StatePool:
        return StatePool.allocate(self.text, num_slots)

    # ---- compute ----------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool, *,
                all_logits: bool = False, media=None) -> np.ndarray:
        """float32 logits [B, V] for the last new token of each row, or [N, V] with all_logits.
        media: (token indices [k], embeddings [k, H]) that replace those tokens' embeddings (the
        vision tower's output at the image / video placeholders; vision.py)."""
        h = self._trunk(batch, kv, state, media)
        if not all_logits:
            h = h[np.asarray(batch.query_start[1:], np.int64) - 1]
        h = ops.rmsnorm_zero_centred(h, self._norm, self.text.rms_norm_eps)
        return ops.linear(h, self._lm_head).astype(np.float32, copy=False)

    def final_hidden(self, batch: ForwardBatch, kv: KVPool, state: StatePool, *,
                     media=None) -> np.ndarray:
        """Like forward(all_logits=True) but the final-normed hidden states [N, H] instead of
        logits: what the MTP drafter reads (mtp.py; logits = final_hidden @ lm_head^T)."""
        h = self._trunk(batch, kv, state, media)
        return ops.rmsnorm_zero_centred(h, self._norm, self.text.rms_norm_eps)

    # a speculative verify here keeps no per-token States (program/speculative.py: the rows
    # that rejected a draft run their accepted tokens again)
    verify_snapshots = False

    def verify_forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool, out_rows, *,
                       snap_base=None, media=None, hidden_layers=None) -> tuple:
        """A speculative unit's forward (program/speculative.py): (logits [len(out_rows), V]
        float32 of those tokens, the drafter's feed of every token: the final-normed hidden
        [N, H] (MTP), or with hidden_layers the outputs of those decoder layers side by side
        [N, len(hidden_layers) * H] (DFlash's features)). snap_base: the CUDA model's per-token
        State snapshots, which this model does not keep (verify_snapshots), so it must be None."""
        if snap_base is not None:
            raise ValueError("numpy verify_forward keeps no State snapshots (verify_snapshots)")
        h, kept = self._trunk(batch, kv, state, media, keep=hidden_layers or ())
        hidden = ops.rmsnorm_zero_centred(h, self._norm, self.text.rms_norm_eps)
        logits = head_product(hidden[np.asarray(out_rows, np.int64)], self._lm_head)
        return logits, (np.concatenate(kept, axis=1) if hidden_layers else hidden)

    def _trunk(self, batch, kv, state, media, keep=None):
        """The decoder layers over every new token: the residual stream [N, H] before the final
        norm; with `keep` (layer indices) also [the stream after each of those layers], in
        keep's order."""
        plan = self._plan(batch, kv, state)
        cfg = self.text
        h = self._embed[np.asarray(batch.token_ids, np.int64)]                  # [N, H]
        if media is not None:
            rows, vectors = media
            h[np.asarray(rows, np.int64)] = vectors
        after = {}
        for i, (in_norm, mixer, post_norm, mlp) in enumerate(self._layers):
            x = ops.rmsnorm_zero_centred(h, in_norm, cfg.rms_norm_eps)
            pool = kv if mixer.reads_kv else state
            h = h + mixer(x, plan, pool)
            h = h + mlp(ops.rmsnorm_zero_centred(h, post_norm, cfg.rms_norm_eps))
            if keep and i in keep:
                after[i] = h
        if keep is None:
            return h
        missing = [i for i in keep if i not in after]
        if missing:
            raise ValueError(f"hidden_layers {missing} are not layers of this model "
                             f"(0 .. {len(self._layers) - 1})")
        return h, [after[i] for i in keep]

    def batch_limits(self, kv: KVPool, state: StatePool) -> BatchLimits:
        """ForwardBatch.check's limits of a call over these pools."""
        cfg = self.text
        return BatchLimits(
            vocab_size=cfg.vocab_size,
            page_size=kv.page_size if cfg.attention_layer_ids else None,
            num_kv_pages=kv.num_pages if cfg.attention_layer_ids else None,
            num_state_slots=state.num_slots if cfg.linear_layer_ids else None)

    def _plan(self, batch: ForwardBatch, kv: KVPool, state: StatePool) -> StepPlan:
        cfg = self.text
        if self.checks_batches:
            batch.check(self.batch_limits(kv, state))
        lengths = batch.row_lengths()
        if not cfg.attention_layer_ids:           # a pure-GDN model has no KV and no rotary
            return StepPlan(batch=batch, lengths=lengths, cos=None, sin=None, kv_pages=None,
                            kv_offsets=None)
        cos, sin = ops.mrope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta,
                                     cfg.mrope_section, cfg.mrope_interleaved)
        pages, offsets = ops.kv_slot_mapping(batch.block_tables, batch.context_lens,
                                             batch.query_start, kv.page_size)
        return StepPlan(batch=batch, lengths=lengths, cos=cos, sin=sin, kv_pages=pages,
                        kv_offsets=offsets)

    def warm_up(self, kv, state) -> None:
        """Nothing is built lazily on this backend."""

    def close(self) -> None:
        self._layers = []
        self._embed = self._lm_head = self._norm = None

def head_product(hidden: np.ndarray, head: np.ndarray) -> np.ndarray:
    """hidden [N, H] @ head[V, H]^T as float32 [N, V]. A few rows go as head @ hidden^T: BLAS's
    GEMM with a transposed [V, H] operand packs all of it for each call, which costs 3-4x one
    matrix-vector pass when N is 2..5 (the verify rows); this form stays near one pass."""
    if 1 < len(hidden) <= 8:
        return np.ascontiguousarray((head @ hidden.T).T, dtype=np.float32)
    return ops.linear(hidden, head).astype(np.float32, copy=False)


# The MTP drafts' int8 head (EngineOptions.draft_head "int8"): the draft rows of the lm_head as
# int8 codes, one float32 scale per row and HEAD_GROUP columns (ops/kv_quant.py's int8 rule:
# scale = amax / 127, code = rint(value / scale)), which a draft's argmax reads in place of the
# bf16 rows: half the bytes of a draft step's largest product (the 9B's first 131072 rows: 1.07
# GB bf16). An argmax of more than INT8_HEAD_ROWS rows reads the bf16 rows: the GPU's int8
# product reads its codes once per 8 rows (cuda/qweights.py GEMV_BATCH), so past 8 it would read
# more than the bf16 product does. Drafts are only proposals: the output is the same either way.
HEAD_GROUP = 128
INT8_HEAD_ROWS = 8


def int8_head_ok(hidden_size: int) -> bool:
    """Whether a head of this width takes the int8 copy (whole HEAD_GROUP-column groups)."""
    return hidden_size % HEAD_GROUP == 0


def int8_head_values(head: np.ndarray) -> np.ndarray:
    """float32 [V, H]: the values the int8 codes of `head` [V, H] stand for (codes x scale)."""
    from ...ops.kv_quant import dequantize, quantize
    V, H = head.shape
    codes, scale = quantize(np.asarray(head, np.float32).reshape(V, H // HEAD_GROUP, HEAD_GROUP),
                            "int8")
    return dequantize(codes, scale).reshape(V, H)


class DraftHead:
    """A drafter's vocabulary product over the target's lm_head (shared array, no copy): `logits`
    (every id) and `argmax` (over the first `vocab` ids: EngineOptions.draft_vocab; None: every
    id; with `int8`, an argmax of up to INT8_HEAD_ROWS rows over those rows' int8 values:
    EngineOptions.draft_head). lm_head rows that are all zero give logit 0 for any hidden (the
    reference models' unseen ids): the argmax searches the others and compares with 0, exactly
    the argmax over every row at a fraction of the product (every row counts in real
    checkpoints)."""

    def __init__(self, lm_head: np.ndarray, vocab: int = None, int8: bool = False):
        self.lm_head = lm_head
        head = lm_head if vocab is None else lm_head[:max(1, int(vocab))]
        self._argmax_head = head
        live = np.flatnonzero(np.any(head != 0, axis=1))
        self._ids = live if 0 < len(live) < len(head) else None
        self._head = None if self._ids is None else np.ascontiguousarray(head[live])
        zero = np.flatnonzero(~np.any(head != 0, axis=1)) if self._ids is not None else ()
        self._first_zero_id = int(zero[0]) if len(zero) else -1
        # the int8 values of the rows the argmax reads (zero rows stay zero: scale 1, codes 0)
        self._int8 = None
        if int8 and int8_head_ok(head.shape[1]):
            self._int8 = int8_head_values(head if self._ids is None else self._head)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [N, V] = final-normed hidden [N, H] @ lm_head^T."""
        return head_product(np.asarray(hidden, np.float32), self.lm_head)

    def argmax(self, hidden: np.ndarray) -> np.ndarray:
        """int32 [N]: argmax of logits(hidden) over the head's first `vocab` ids (with `int8`
        and N <= INT8_HEAD_ROWS: of their int8 values), lowest id on ties."""
        hidden = np.asarray(hidden, np.float32)
        int8 = self._int8 is not None and len(hidden) <= INT8_HEAD_ROWS
        if self._ids is None:
            head = self._int8 if int8 else self._argmax_head
            return np.argmax(head_product(hidden, head), axis=1).astype(np.int32)
        live = head_product(hidden, self._int8 if int8 else self._head)      # [N, K]
        best = np.argmax(live, axis=1)
        value = live[np.arange(len(best)), best]
        out = self._ids[best].astype(np.int64)
        # the zero rows' logit is 0: they win over a negative best; at a best of exactly 0 the
        # lowest id among the live ones at 0 and the first zero row wins
        for i in np.flatnonzero(value <= 0):
            out[i] = self._first_zero_id if value[i] < 0 else \
                min(self._first_zero_id, int(self._ids[np.argmax(live[i] == 0)]))
        return out.astype(np.int32)
