"""The checkpoint's multi-token-prediction head (`mtp.*`) as a drafter, numpy backend.

One MTP step reads the target's final-normed hidden state h_t of position t and the token
x_{t+1} that follows it, and predicts x_{t+2}:

    e = embed(x_{t+1})                                   (the target's embedding, shared)
    u = fc( concat( norm_e(e), norm_h(h_t) ) )           fc: [H, 2H]; embedding half first
    u = one full-attention decoder layer at position t   (its own KV pages; same MRoPE tables)
    g = norm(u)                                          (final-normed MTP hidden)
    logits = g @ lm_head^T                               (the target's lm_head, shared)

This is the order vLLM's Qwen3-Next / Qwen3.5 MTP module runs and the one the reference models were
trained with (tools/train_reference.py: MTP.forward, position t for the pair (h_t, x_{t+1})). Every
norm is zero-centred RMSNorm. Drafting k tokens feeds g back as the next step's hidden (as vLLM's
MTP proposer does): step i reads (g_{i-1}, drafted x) at position t + i.

The drafter's KV is one attention layer indexed like the target's: the KV of position t lives at
the same page/offset as the target's, so a row's block table serves both. Standalone (tests, the
acceptance bench) it has a pool of its own (`new_kv_pool`); inside a Program it joins the target's
pool as one more layer (`join_kv_pool`), so pages, Snapshots and prefix checkpoints carry it.
Its entries for positions whose hidden came from a draft (not from the target) are provisional:
they are rewritten when the target's hidden for those positions is known (program/speculative.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ... import ops
from ...errors import ArtifactError
from ...options import MAX_DRAFT_TOKENS
from .batch import ForwardBatch
from .config import FULL_ATTENTION, TextConfig
from .layers import DenseMLP, GatedAttention, SparseMoE, StepPlan
from .load import ParamReader, _attention, _dense_mlp, _moe, text_param_shapes
from .model import DraftHead
from .state import KVPool

PREFIX = "mtp."


def mtp_param_shapes(cfg: TextConfig) -> dict:
    """{logical name: shape} of the MTP head's own tensors (one decoder layer per
    mtp_num_hidden_layers; the embedding and lm_head are the target's)."""
    H = cfg.hidden_size
    shapes = {PREFIX + "fc.weight": (H, 2 * H), PREFIX + "pre_fc_norm_embedding.weight": (H,),
              PREFIX + "pre_fc_norm_hidden.weight": (H,), PREFIX + "norm.weight": (H,)}
    one = dataclasses.replace(cfg, layer_types=(FULL_ATTENTION,), num_hidden_layers=1)
    layer = {n: s for n, s in text_param_shapes(one).items() if n.startswith("text.layers.0.")}
    for i in range(cfg.mtp_num_hidden_layers):
        shapes.update({f"{PREFIX}layers.{i}." + n[len("text.layers.0."):]: s
                       for n, s in layer.items()})
    return shapes


def read_mtp_params(artifact, cfg: TextConfig) -> dict:
    """{"fc", "norm_embedding", "norm_hidden", "norm", "layer"} float32; ArtifactError when the
    artifact has no MTP head (mtp_num_hidden_layers == 0) or a tensor is missing / mis-shaped."""
    if cfg.mtp_num_hidden_layers < 1:
        raise ArtifactError(f"{getattr(artifact, 'path', 'artifact')}: the model has no MTP head "
                            "(mtp_num_hidden_layers is 0)")
    if cfg.mtp_num_hidden_layers != 1:     # Qwen3.5 ships one; more would need a step schedule
        raise ArtifactError(f"MTP head with {cfg.mtp_num_hidden_layers} layers is not supported "
                            "(Qwen3.5 checkpoints have 1)")
    reader, shapes = ParamReader(artifact), mtp_param_shapes(cfg)

    def read(name: str) -> np.ndarray:
        return reader(name, shapes[name])
    p = PREFIX + "layers.0."
    layer = {"input_norm": read(p + "input_layernorm.weight"),
             "post_norm": read(p + "post_attention_layernorm.weight")}
    layer.update(_attention(read, p + "self_attn.", cfg))
    layer.update(_moe(read, p + "mlp.") if cfg.is_moe else _dense_mlp(read, p + "mlp."))
    return {"fc": read(PREFIX + "fc.weight"),
            "norm_embedding": read(PREFIX + "pre_fc_norm_embedding.weight"),
            "norm_hidden": read(PREFIX + "pre_fc_norm_hidden.weight"),
            "norm": read(PREFIX + "norm.weight"), "layer": layer}


class MtpDrafter:
    """The MTP head over a target NumpyModel's embedding and lm_head (shared arrays, no copy)."""
    hidden_layers = None        # its feed reads the target's final-normed hidden
    max_draft_tokens = MAX_DRAFT_TOKENS["mtp"]
    pages_ahead = 0             # its draft steps write KV only where the verify will

    def __init__(self, cfg: TextConfig, params: dict, embed: np.ndarray, lm_head: np.ndarray,
                 draft_vocab: int = None, int8_head: bool = False):
        """draft_vocab: drafts are argmaxes over the first draft_vocab ids (options.
        draft_vocab_size; None: every id), of their int8 values with int8_head (options.
        draft_head "int8": model.DraftHead); `logits` covers every id."""
        self.text, self.p = cfg, params
        self._embed, self._lm_head = embed, lm_head
        layer = params["layer"]
        self._attn = GatedAttention(layer, cfg, 0)          # ordinal 0 of the drafter's pool
        self._mlp = SparseMoE(layer, cfg) if cfg.is_moe else DenseMLP(layer)
        self._head = DraftHead(lm_head, draft_vocab, int8_head)

    @classmethod
    def from_artifact(cls, artifact, target, draft_vocab: int = None,
                      int8_head: bool = False) -> "MtpDrafter":
        """target: the NumpyModel of the same artifact (its embedding and lm_head are shared)."""
        cfg = target.text
        return cls(cfg, read_mtp_params(artifact, cfg), target._embed, target._lm_head,
                   draft_vocab, int8_head)

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        """One attention layer's KV, paged like the target's."""
        shape = (num_pages, page_size, self.text.num_key_value_heads, self.text.head_dim)
        return KVPool(page_size, [np.zeros(shape, np.float32)], [np.zeros(shape, np.float32)])

    def join_kv_pool(self, kv: KVPool) -> None:
        """Add the drafter's attention layer to a target's KVPool as its last layer and use it from
        now on (one pool at a time): one page ledger, and every copy of a page (Snapshot,
        checkpoint) holds both."""
        num_target = len(self.text.attention_layer_ids)
        if not num_target or len(kv.k) != num_target:
            raise ValueError(f"MTP: join_kv_pool needs a target pool of its {num_target} "
                             f"attention layers, got {len(kv.k)}")
        kv.k.append(np.zeros_like(kv.k[0]))
        kv.v.append(np.zeros_like(kv.v[0]))
        self._attn = GatedAttention(self.p["layer"], self.text, num_target)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [N, V] = final-normed hidden [N, H] @ lm_head^T (the shared lm_head: the target's
        logits from its final_hidden, or a draft's from an MTP hidden)."""
        return self._head.logits(hidden)

    def draft_argmax(self, hidden: np.ndarray) -> np.ndarray:
        """int32 [N]: argmax of logits(hidden) over the first draft_vocab ids (lowest id on
        ties; of their int8 values with int8_head, up to 8 rows: DraftHead)."""
        return self._head.argmax(hidden)

    def forward_argmax(self, batch: ForwardBatch, hidden: np.ndarray, kv: KVPool) -> tuple:
        """forward without logits, and each row's next draft: (int32 [B] draft_argmax of the
        MTP hidden of its last token, that MTP hidden [B, H]). The feed's last position gives
        the row's first draft (and the g_1 the next draft step continues), a draft step each
        row's next (draft_greedy); the CUDA drafter takes the argmax inside the step, and only
        the rows' last hidden states come down (a feed of thousands of positions needs B)."""
        _, g = self.forward(batch, hidden, kv, with_logits=False)
        g = g[np.asarray(batch.query_start[1:], np.int64) - 1]
        return self.draft_argmax(g), g

    def forward(self, batch: ForwardBatch, hidden: np.ndarray, kv: KVPool, *,
                with_logits: bool = True) -> tuple:
        """One MTP step over every new token of the batch. batch.token_ids are the *next* tokens
        x_{t+1}; batch.positions / context_lens are those of the hidden states' positions t (a
        row continues its drafter KV from context_lens[r], like the target's). hidden [N, H]:
        final-normed hidden states (the target's, or the previous MTP step's).
        Returns (logits [N, V] float32, MTP hidden [N, H] final-normed); logits is None with
        with_logits=False (filling the drafter KV over a prompt needs no vocabulary product)."""
        cfg, p, eps = self.text, self.p, self.text.rms_norm_eps
        hidden = np.asarray(hidden, np.float32)
        if hidden.shape != (batch.num_tokens, cfg.hidden_size):
            raise ValueError(f"MTP: hidden shape {hidden.shape} != "
                             f"({batch.num_tokens}, {cfg.hidden_size})")
        batch.validate(kv.page_size)
        if int(np.max(batch.block_tables, initial=-1)) >= kv.num_pages:
            raise ValueError(f"MTP: block table names a page >= {kv.num_pages}")
        ids = np.asarray(batch.token_ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"MTP: token id out of range [0, {cfg.vocab_size})")
        e = ops.rmsnorm_zero_centred(self._embed[ids], p["norm_embedding"], eps)
        h = ops.rmsnorm_zero_centred(hidden, p["norm_hidden"], eps)
        u = ops.linear(np.concatenate([e, h], axis=1), p["fc"])
        u = u + self._attn(ops.rmsnorm_zero_centred(u, p["layer"]["input_norm"], eps),
                           self._plan(batch, kv), kv)
        u = u + self._mlp(ops.rmsnorm_zero_centred(u, p["layer"]["post_norm"], eps))
        g = ops.rmsnorm_zero_centred(u, p["norm"], eps)
        if not with_logits:
            return None, g
        return self.logits(g), g

    def _plan(self, batch: ForwardBatch, kv: KVPool) -> StepPlan:
        cfg = self.text
        cos, sin = ops.mrope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta,
                                     cfg.mrope_section, cfg.mrope_interleaved)
        pages, offsets = ops.kv_slot_mapping(batch.block_tables, batch.context_lens,
                                             batch.query_start, kv.page_size)
        return StepPlan(batch=batch, lengths=batch.row_lengths(), cos=cos, sin=sin,
                        kv_pages=pages, kv_offsets=offsets)

    def draft_greedy(self, kv: KVPool, hidden: np.ndarray, next_tokens, context_lens,
                     block_tables, k, *, with_logits: bool = True, pick=None) -> tuple:
        """draft_greedy(self, ...): the drafts of these rows (the function's contract)."""
        return draft_greedy(self, kv, hidden, next_tokens, context_lens, block_tables, k,
                            with_logits=with_logits, pick=pick)

    # the speculator drafts behind the verify (verify_and_draft) only where that saves round
    # trips: the CUDA drafter's one call. Here it is the reference the tests run it against.
    drafts_in_verify = False

    def verify_draft_fits(self, n: int, rows: int, steps: int) -> bool:
        return True

    def verify_and_draft(self, model, batch: ForwardBatch, kv, state, rows, *, snap_base,
                         steps: int) -> tuple:
        """verify_and_draft(self, model, ...): the function's contract."""
        return verify_and_draft(self, model, batch, kv, state, rows, snap_base=snap_base,
                                steps=steps)


def draft_greedy(drafter, kv, hidden: np.ndarray, next_tokens, context_lens, block_tables, k, *,
                 with_logits: bool = True, pick=None) -> tuple:
    """Greedy draft tokens of an MTP drafter (MtpDrafter, or the CUDA backend's: its `forward`,
    `forward_argmax` and `text`), autoregressively on the drafter's KV; k: one int for every row, or
    one per row (k[r] >= 1; a row leaves the batch once it has its k[r]).
    Row r: hidden[r] is the target's final-normed hidden at position t_r = context_lens[r]
    (the drafter KV holds positions < t_r), next_tokens[r] = x_{t_r + 1}. Step i (0-based)
    writes drafter KV at t_r + i and predicts x_{t_r + i + 2}.
    Returns (drafts [B, max k] int32, logits [B, max k, V] float32); entries past a row's own
    k are -1 / 0. with_logits=False: logits is None (drafts by `forward_argmax`, or by
    pick(step, live row indices, MTP hidden [n, H], their argmaxes [n]) -> int32 [n] where
    given)."""
    ctx = np.asarray(context_lens, np.int32).copy()
    B = len(ctx)
    ks = np.broadcast_to(np.asarray(k, np.int64), (B,)).copy()
    if B and ks.min() < 1:
        raise ValueError(f"MTP: draft k must be >= 1, got {ks.tolist()}")
    tokens = np.asarray(next_tokens, np.int32).copy()
    tables = np.asarray(block_tables, np.int32).reshape(B, -1)
    k_max = int(ks.max(initial=0))
    drafts = np.full((B, k_max), -1, np.int32)
    logits = np.zeros((B, k_max, drafter.text.vocab_size), np.float32) if with_logits else None
    h = np.asarray(hidden, np.float32)
    for i in range(k_max):
        live = np.flatnonzero(ks > i)                   # rows still drafting
        n = len(live)
        batch = ForwardBatch(token_ids=tokens[live],
                             positions=ForwardBatch.text_positions(ctx[live], np.ones(n, int)),
                             query_start=np.arange(n + 1, dtype=np.int32),
                             context_lens=ctx[live], block_tables=tables[live],
                             state_slots=np.arange(n, dtype=np.int32))
        if with_logits:
            step_logits, g = drafter.forward(batch, h[live], kv)
            logits[live, i] = step_logits
            tokens[live] = np.argmax(step_logits, axis=1).astype(np.int32)
        else:
            ids, g = drafter.forward_argmax(batch, h[live], kv)
            tokens[live] = ids if pick is None else pick(i, live, g, ids)
        drafts[live, i] = tokens[live]
        h = np.zeros_like(h)
        h[live] = g
        ctx[live] += 1
    return drafts, logits


def verify_and_draft(drafter, model, batch: ForwardBatch, kv, state, rows, *, snap_base,
                     steps: int) -> tuple:
    """A verify whose every row drafted (batch: rows [x_F, d_1 .. d_k] at F .. F+k), its
    positions' picks (model.verify_tokens with the SampleRows `rows`), and the next unit's drafts
    behind it: row r produced t_0 .. t_j (j: its first pick that differs from the next draft,
    or k); the drafter's feed over F .. F+j pairs the target's hidden at F + i with t_i (its KV
    there; the device's feed also writes F+j+1 .. F+k, provisional), giving the next first
    draft d_1 and MTP hidden g_1 at F + j; `steps` greedy steps from (g_1, d_1) at F+j+1 ..
    (draft_greedy) give the drafts after it. Returns (int32 [n] picks, int32 [B, 1 + steps]
    drafts, float32 [B, H] g_1): CudaModel.verify_and_draft's contract, in host calls."""
    picks, hidden = model.verify_tokens(batch, kv, state,
                                        np.arange(batch.num_tokens, dtype=np.int32), rows,
                                        snap_base=snap_base)
    qs = np.asarray(batch.query_start, np.int64)
    ids = np.asarray(batch.token_ids, np.int32)
    produced = []
    for r in range(batch.num_rows):
        q0, k, j = qs[r], qs[r + 1] - qs[r] - 1, 0
        while j < k and picks[q0 + j] == ids[q0 + j + 1]:
            j += 1
        produced.append(j + 1)
    produced = np.array(produced, np.int32)
    idx = np.concatenate([np.arange(qs[r], qs[r] + produced[r]) for r in range(batch.num_rows)])
    ctx = np.asarray(batch.context_lens, np.int32)
    feed = ForwardBatch(picks[idx].astype(np.int32), np.asarray(batch.positions)[:, idx],
                        np.concatenate([[0], np.cumsum(produced)]).astype(np.int32), ctx,
                        batch.block_tables, batch.state_slots)
    first, g1 = drafter.forward_argmax(feed, np.asarray(hidden, np.float32)[idx], kv)
    drafts = np.asarray(first, np.int32)[:, None]
    if steps:
        tail, _ = drafter.draft_greedy(kv, g1, first, ctx + produced, batch.block_tables, steps,
                                       with_logits=False)
        drafts = np.concatenate([drafts, tail], axis=1)
    return np.asarray(picks, np.int32), drafts.astype(np.int32), g1
