"""The Qwen3.5 text model on the CUDA backend: same contract as the numpy model (docs/internals.md
"Model"), pools on the device, one arena, decode through one CUDA graph per exact batch size.

    load_cuda_model(artifact, options) -> CudaModel
    CudaModel.forward(batch, kv, state, all_logits=False) -> float32 logits (host)
    CudaModel.decode_greedy(batch, kv, state) -> int32 token ids [B] (argmax on the device)
    CudaModel.sample(batch, kv, state, rows) -> int32 token ids [B] (cuda/sampler.py on the device)
    CudaModel.capture_graphs(kv, state)     # optional: capture B = 1..max_concurrency now

Decode fast path: a batch whose rows each bring one token, B <= max_concurrency, graphs on ->
pack metadata into pinned staging, one async H2D copy, one cuGraphLaunch, one D2H + sync.

options.dtype "float32": fp32 weights (the checkpoint's bf16 widened on the device at load),
activations, KV pools and GEMMs (strict fp32 compute), CUDA-core attention for every row: the
numpy backend's arithmetic, for exact comparisons. None / "bfloat16": bf16 storage, fp32 math.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import zlib

import numpy as np

from ...core.cuda import driver as _d
from ...core.cuda.arena import Arena
from ...core.cuda.cublaslt import PIN_M, CublasLt
from ...core.cuda.graph import Graph
from ...core.cuda.kernels import KernelCache
from ...errors import DeviceError, RequestError
from ...ops.attention import kv_slot_mapping
from .batch import ForwardBatch
from .config import ModelConfig
from .load import model_config, text_param_shapes
from .vision_tower import MediaEncoding
from .cuda.kernel_set import KernelSet
from .cuda.meta import DeviceMeta, MetaLayout
from .cuda.pools import DeviceKVPool, DeviceStatePool
from .cuda.runner import StepRunner, Workspace, grouped_rows, part_rows_needed
from .cuda.sampler import DeviceSampler
from .cuda.upload import UploadJob, upload_all
from .cuda import attention_tc
from .cuda import gdn_chunk
from .cuda import weights as wplan

log = logging.getLogger("ninfer.cuda")
LT_WORKSPACE = 32 << 20
MEMORY_MARGIN = 512 << 20
_SAME_KV_SLOT = "ForwardBatch: two new tokens would write the same KV page slot"
# (the numpy model lets a negative context through; here it indexes before the block table and
# writes K/V outside the pool)
_NEGATIVE_CONTEXT = "ForwardBatch: context_lens must be >= 0"


# embed_gather and moe_combine put a call's tokens on grid.y, which CUDA caps at 65535 blocks
MAX_TOKENS_PER_CALL = 65535


def check_capacity(n_cap: int) -> None:
    if n_cap > MAX_TOKENS_PER_CALL:
        raise DeviceError(f"backend 'cuda': prefill_chunk {n_cap} exceeds the {MAX_TOKENS_PER_CALL} "
                          "tokens one CUDA model call can take (kernel grid limit)")


def call_capacities(options, max_tokens: int = None) -> tuple:
    """(b_cap rows of a decode graph, n_cap tokens of one call, p_cap pages of one row, lg_cap
    logits rows of one head pass) for `options`; `max_tokens` overrides prefill_chunk (bench)."""
    b_cap = max(int(options.max_concurrency), 1)
    page_size, max_context = int(options.page_size), int(options.max_context)
    # a decode graph runs b_cap tokens through the same workspace: never fewer rows than that
    # (batch_invariant: GEMMs of fewer than PIN_M rows run as PIN_M rows, cuda/runner.py)
    n_cap = int(max(max_tokens or options.prefill_chunk, b_cap,
                    PIN_M if options.batch_invariant else 1))
    check_capacity(n_cap)
    p_cap = (max_context + page_size - 1) // page_size + 1
    return b_cap, n_cap, p_cap, max(b_cap, min(n_cap, 256))


def load_cuda_model(artifact, options) -> "CudaModel":
    model = CudaModel(model_config(artifact), options, artifact=artifact)
    model.load_vision(artifact)
    return model


class CudaModel(MediaEncoding):
    """The contracts.Model of the CUDA backend (argmax and the whole sampler on the device).
    Media: the numpy vision tower on the host (vision.MediaEncoding, the numpy backend's own
    code); forward(media=) copies its output over the placeholders' embedding rows."""
    backend = "cuda"
    greedy_on_device = samples_on_device = True
    checks_batches = True   # direct callers get checked; a Program turns it off (contracts)
    f32 = False             # dtype="float32": fp32 weights, activations, KV and GEMM inputs
    max_kv_pages = None     # the KV pages the memory plan holds (set at load)
    batch_invariant = False  # options.batch_invariant (set at load)

    def __init__(self, config: ModelConfig, options, *, artifact=None, random_seed: int = None,
                 max_tokens: int = None, kernel_cache_dir=None):
        if (artifact is None) == (random_seed is None):
            raise ValueError("CudaModel: give exactly one of artifact / random_seed")
        self.config, self.text = config, config.text
        self.options = options
        self._ctx_threads = threading.local()
        self.device = _d.Device(options.device_id)
        self.stream = self.device.stream
        self.arena = None
        try:
            self._setup(options, artifact, random_seed, max_tokens, kernel_cache_dir)
        except BaseException:
            try:
                self.close()
            except Exception:   # noqa: BLE001 - the load error is the one to report
                pass
            raise
        self.last_host_us = 0.0
        self.last_host_breakdown_us = (0.0, 0.0, 0.0, 0.0)
        self._graphs = {}

    def _current(self) -> None:
        """Driver contexts are per thread: bind ours in a thread that has not used it yet (the
        Engine worker calls forward from its own thread)."""
        if not getattr(self._ctx_threads, "bound", False):
            self.device.make_current()
            self._ctx_threads.bound = True

    # ---- set-up -------------------------------------------------------------------------------
    def _setup(self, options, artifact, random_seed, max_tokens, kernel_cache_dir):
        cfg = self.text
        dtype = options.dtype
        if dtype not in (None, "bfloat16", "float32"):
            raise RequestError(f"backend 'cuda': dtype={dtype!r} must be None, 'bfloat16' or 'float32'")
        self.f32 = dtype == "float32"
        # batch_invariant: a row's logits do not depend on B or its neighbours (decode GEMMs at
        # one shape, fixed decode attention splits; docs/architecture.md "Load invariance")
        self.batch_invariant = bool(options.batch_invariant)
        self.kernels = KernelSet(cfg, KernelCache(self.device.cc, kernel_cache_dir), self.f32)
        page_size = int(options.page_size)
        b_cap, n_cap, self.p_cap, self.lg_cap = call_capacities(options, max_tokens)
        self.b_cap, self.n_cap = b_cap, n_cap
        self.max_keys = self.p_cap * page_size
        # rows of at least this many new tokens take the tensor-core prefill attention
        # (cuda/attention_tc.py); settable (tests move it to cover both paths)
        # (bf16 only: a float32 model runs every row on the CUDA-core kernel)
        self.attn_tc_min_tokens = math.inf if self.f32 else attention_tc.TC_MIN_TOKENS
        self.eager_layout = MetaLayout(n_cap, max(b_cap, 8), self.p_cap)
        self.decode_layout = MetaLayout(b_cap, b_cap, self.p_cap)
        tied = artifact is not None and wplan.is_tied(artifact)
        nkv = max(cfg.num_key_value_heads, 1)
        part_rows = part_rows_needed(n_cap, nkv, self.device.num_sms,
                                     b_cap if self.batch_invariant else 0)
        ws_bytes = self._workspace_bytes(n_cap, part_rows)
        # the device sampler: parameters, penalty lists and mask bits of one step, fp64 rows
        sampler_rows = max(b_cap, 8)
        fixed = wplan.plan_bytes(cfg, tied, self.f32) + ws_bytes + \
            DeviceSampler.device_bytes(sampler_rows, cfg.vocab_size, options.max_context)
        free, total = self.device.mem_info()
        num_pages = self._plan_kv_pages(options, fixed, free, page_size, b_cap)
        need = fixed + self._pool_reserve(num_pages, page_size, b_cap)
        self.memory_plan = dict(weights=wplan.plan_bytes(cfg, tied, self.f32), workspace=ws_bytes,
                                kv_pages=num_pages, page_size=page_size,
                                kv=self._pool_reserve(num_pages, page_size, b_cap),
                                total=need, free=free, device=self.device.name)
        if need + MEMORY_MARGIN > free:
            raise DeviceError(
                f"backend 'cuda': too little device memory for the plan: needs "
                f"{(need + MEMORY_MARGIN) / 2**30:.2f} GiB (weights, KV/state pools, workspace"
                f"{', all in float32' if self.f32 else ''}), "
                f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB on {self.device.name}")
        self.arena = Arena(need)
        self.ws = Workspace(self.arena, cfg, n_cap, self.lg_cap, part_rows, self.max_keys,
                            f32=self.f32)
        meta = self.arena.take((self.eager_layout.count + self.decode_layout.count,), np.int32,
                               "metadata")
        self.eager_meta = DeviceMeta(self.eager_layout, meta.ptr)
        self.decode_meta = DeviceMeta(self.decode_layout, meta.ptr + self.eager_layout.nbytes)
        lt_ws = self.arena.take((LT_WORKSPACE,), np.uint8, "cuBLASLt workspace")
        self.lt = CublasLt(lt_ws.ptr, LT_WORKSPACE, f32=self.f32, invariant=self.batch_invariant)
        self.sampler = DeviceSampler(self.arena, self.kernels, sampler_rows, cfg.vocab_size,
                                     options.max_context)
        self._lt_ws = lt_ws         # idle during the load: the fp32 model's widening scratch
        self.staging = _d.PinnedBuffer(self.eager_layout.nbytes + self.decode_layout.nbytes)
        self.out_host = _d.PinnedBuffer(self.lg_cap * cfg.vocab_size * 4)
        K = max(cfg.num_experts_per_tok, 1)
        self.route_host = _d.PinnedBuffer(
            (grouped_rows(n_cap, K, cfg.num_experts) + 2 * n_cap * K) * 4 if cfg.is_moe else 4)
        t_load = time.perf_counter()
        self.weights = self._load_weights(artifact, random_seed, tied)
        self.stream.synchronize()
        self.load_seconds = time.perf_counter() - t_load
        self.kernels.load_all()
        self.runner = StepRunner(self)
        self.stream.synchronize()
        p = self.memory_plan
        log.info("cuda plan on %s: weights %.2f GiB (loaded in %.1f s), workspace %.2f GiB, KV %d "
                 "pages of %d tokens = %.2f GiB, %.2f GiB in all of %.2f GiB free", p["device"],
                 p["weights"] / 2**30, self.load_seconds, p["workspace"] / 2**30, p["kv_pages"],
                 p["page_size"], p["kv"] / 2**30, p["total"] / 2**30, p["free"] / 2**30)

    def _plan_kv_pages(self, options, fixed: int, free: int, page_size: int, b_cap: int) -> int:
        """KV pages of the pool: options.num_kv_pages when given; else every slot at max_context
        (more could never be used), or fewer when the device memory left after weights, workspace,
        sampler, State pool and the margin (graphs, driver) holds fewer, down to one sequence."""
        if options.num_kv_pages:
            self.max_kv_pages = int(options.num_kv_pages)
            return self.max_kv_pages
        per_seq = -(-int(options.max_context) // page_size)
        want = b_cap * per_seq
        page_bytes = self._pool_reserve(1, page_size, b_cap) - self._pool_reserve(0, page_size, b_cap)
        left = free - MEMORY_MARGIN - fixed - self._pool_reserve(0, page_size, b_cap)
        fit = want if page_bytes == 0 else max(int(left // page_bytes), 0)
        # fewer than one sequence: keep `want`, and the memory check below says what is short
        self.max_kv_pages = min(want, fit) if fit >= per_seq else want
        return self.max_kv_pages

    def _pool_reserve(self, pages, page_size, b_cap) -> int:
        cfg = self.text
        kv = 2 * len(cfg.attention_layer_ids) * pages * page_size * cfg.num_key_value_heads * \
            cfg.head_dim * (4 if self.f32 else 2)
        slots = 2 * b_cap + 2
        st = len(cfg.linear_layer_ids) * slots * 4 * (
            cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) +
            cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
        return kv + st + (64 << 10) * (2 * len(cfg.attention_layer_ids) + 2 * len(cfg.linear_layer_ids))

    def _workspace_bytes(self, n_cap, part_rows) -> int:
        from ...core.cuda.arena import _round_up
        cfg = self.text
        H = cfg.hidden_size
        g = 4 if self.f32 else 2          # bytes of a GEMM input element (x, act, xg, gact, xf)
        # generous upper bound of Workspace (every buffer at its widest)
        widest = max(cfg.linear_conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads,
                     2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim,
                     2 * cfg.intermediate_size,
                     cfg.num_experts + 2 * cfg.shared_expert_intermediate_size + 1)
        per_tok = 4 * H + g * H + g * max(H, cfg.linear_value_dim, cfg.num_attention_heads * cfg.head_dim,
                                          cfg.intermediate_size, cfg.shared_expert_intermediate_size) \
            + 4 * widest + 4 * max(cfg.linear_conv_dim, cfg.num_attention_heads * cfg.head_dim) \
            + 4 * cfg.linear_value_dim
        if cfg.is_moe:
            K = cfg.num_experts_per_tok
            I = cfg.moe_intermediate_size
            # ids, wts, mact, shared per token; the grouped rows (my, xg, gu, gact, route)
            per_tok += 8 * K + 4 * K * I + 4 * H + 4 * K
            grouped = grouped_rows(n_cap, K, cfg.num_experts) * (4 * H + g * H + 8 * I + g * I + 4)
        else:
            grouped = 0
        part = grouped + part_rows * cfg.num_attention_heads * (cfg.head_dim + 2) * 4
        if cfg.attention_layer_ids and not self.f32:
            part += attention_tc.nbytes(attention_tc.buffer_sizes(
                cfg.num_attention_heads, max(cfg.num_key_value_heads, 1), cfg.head_dim, n_cap,
                self.max_keys))
        head = self.lg_cap * (g * H + 4 * cfg.vocab_size + 4)
        if cfg.linear_layer_ids:       # the chunked delta rule's W, P and decay factors
            part += gdn_chunk.workspace_bytes(n_cap, cfg.linear_num_value_heads,
                                              cfg.linear_key_head_dim) + 3 * 256
        meta = self.eager_layout.nbytes + self.decode_layout.nbytes
        return _round_up(n_cap * per_tok + part + head + meta + LT_WORKSPACE) + 64 * 256

    def _load_weights(self, artifact, seed, tied) -> dict:
        cfg = self.text
        plans = [("", wplan.model_plan(cfg))] + \
            [(i, wplan.layer_plan(cfg, i)) for i in range(cfg.num_hidden_layers)]
        out = {"layers": []}
        jobs = []           # artifact weights, in arena order: read in parallel, uploaded in order
        for idx, plan in plans:
            arrs = {}
            for name, (shape, dt, sources) in plan.items():
                if tied and name == "lm_head":
                    arrs[name] = arrs["embed"]       # tied: one device copy
                    continue
                widen = self.f32 and dt == wplan.BF16
                dtype = np.uint16 if dt == wplan.BF16 and not widen else np.float32
                a = self.arena.take(shape, dtype, f"weight {name}")
                if artifact is not None:
                    jobs.append(UploadJob(a, tuple(shape), dt, tuple(sources), widen))
                else:
                    self._random_fill(a, name, dt, seed + 7919 * len(out["layers"]) + zlib.crc32(name.encode()))
                arrs[name] = a
            if idx == "":
                out.update(arrs)
            else:
                out["layers"].append(arrs)
        if jobs:
            upload_all(artifact, jobs, self.stream, text_param_shapes(cfg),
                       lambda job, host, staging: self._upload_widened(job.dst, host, staging))
        return out

    def _upload_widened(self, a, bits, staging) -> None:
        """fp32 weight `a` = bf16 `bits` (host uint16), widened on the device (exact): pieces of
        the cuBLASLt workspace's size go up as bf16 and are widened into place (half the PCIe
        traffic and host memory of widening on the host)."""
        flat = bits.reshape(-1)
        step = LT_WORKSPACE // 2
        for i in range(0, flat.size, step):
            piece = flat[i: i + step]
            # upload synchronises: the previous widening has read the scratch before it is reused
            _d.upload(self._lt_ws.ptr, piece, self.stream, staging)
            self.kernels.widen_bf16.launch(self.stream, (min((piece.size + 255) // 256, 65535),),
                                           (256,), (a.ptr + 4 * i, self._lt_ws, piece.size))

    def _random_fill(self, a, name, dt, seed):
        scale, offset = wplan.random_spec(name, a.shape)
        n = int(np.prod(a.shape))
        k = self.kernels.random_bf16 if dt == wplan.BF16 else self.kernels.random_f32
        k.launch(self.stream, (min((n + 255) // 256, 65535),), (256,),
                 (a, n, seed & 0xFFFFFFFF, scale, offset))

    # ---- pools --------------------------------------------------------------------------------
    def new_kv_pool(self, num_pages: int, page_size: int) -> DeviceKVPool:
        self._current()
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"new_kv_pool: num_pages={num_pages}, page_size={page_size} must be >= 1")
        pool = DeviceKVPool(self, self.text, num_pages, page_size)
        self.stream.synchronize()
        return pool

    def new_state_pool(self, num_slots: int) -> DeviceStatePool:
        self._current()
        if num_slots < 1:
            raise ValueError(f"new_state_pool: num_slots={num_slots} must be >= 1")
        pool = DeviceStatePool(self, self.text, num_slots)
        self.stream.synchronize()
        return pool

    # ---- compute ------------------------------------------------------------------------------
    @staticmethod
    def _validate_plan(batch: ForwardBatch, page_size: int) -> None:
        """ForwardBatch.validate's rules, vectorised (it runs on every decode step)."""
        B, N = batch.num_rows, batch.num_tokens
        qs = np.asarray(batch.query_start)
        if qs.shape != (B + 1,) or qs[0] != 0 or qs[-1] != N or np.any(qs[1:] < qs[:-1]):
            raise ValueError(f"ForwardBatch: bad query_start {qs} for {N} tokens")
        if batch.positions.shape != (3, N):
            raise ValueError(f"ForwardBatch: positions shape {batch.positions.shape} != (3, {N})")
        bt = np.asarray(batch.block_tables)
        if bt.ndim != 2 or bt.shape[0] != B or np.shape(batch.state_slots) != (B,):
            raise ValueError("ForwardBatch: block_tables / state_slots do not match the rows")
        need = (np.asarray(batch.context_lens) + (qs[1:] - qs[:-1]) + page_size - 1) // page_size
        width = int(need.max(initial=0))
        if width > bt.shape[1] or np.any((bt[:, :width] < 0) &
                                         (np.arange(width) < need[:, None])):
            r = int(np.argmax(need > bt.shape[1])) if width > bt.shape[1] else \
                int(np.nonzero(np.any((bt[:, :width] < 0) & (np.arange(width) < need[:, None]), 1))[0][0])
            raise ValueError(f"ForwardBatch: row {r} block table does not cover "
                             f"{int(batch.context_lens[r] + qs[r + 1] - qs[r])} tokens")

    def _check_decode(self, batch: ForwardBatch, kv, state) -> None:
        """_check for rows of one token each, in plain Python over B <= 8 values (it runs on every
        decode step; numpy calls on tiny arrays cost more than the work)."""
        cfg = self.text
        B = batch.num_rows
        if batch.query_start.tolist() != list(range(B + 1)) or batch.positions.shape != (3, B) or \
                np.shape(batch.state_slots) != (B,) or batch.block_tables.ndim != 2 or \
                batch.block_tables.shape[0] != B:
            raise ValueError("ForwardBatch: decode rows must bring one token each; query_start, "
                             "positions, state_slots and block_tables must match the rows")
        ids, ctxs = batch.token_ids.tolist(), batch.context_lens.tolist()
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:
            raise ValueError(f"ForwardBatch: token id out of range [0, {cfg.vocab_size})")
        if min(ctxs) < 0:
            raise ValueError(_NEGATIVE_CONTEXT)
        if cfg.linear_layer_ids:
            slots = batch.state_slots.tolist()
            if len(set(slots)) != B or min(slots) < 0 or max(slots) >= state.num_slots:
                raise ValueError(f"ForwardBatch: state slots {slots} must be distinct and "
                                 f"< {state.num_slots}")
        if cfg.attention_layer_ids:
            ps, bt = kv.page_size, batch.block_tables
            need = [c // ps + 1 for c in ctxs]
            width = max(need)
            if width > bt.shape[1] or width > self.p_cap:
                raise ValueError(f"ForwardBatch: a row needs {width} pages; its block table has "
                                 f"{bt.shape[1]} (max_context allows {self.p_cap})")
            used = bt[:, :width]
            if used.min() < 0 and np.any((used < 0) & (np.arange(width) < np.array(need)[:, None])):
                raise ValueError("ForwardBatch: a row's block table does not cover its tokens")
            if used.max() >= kv.num_pages:
                raise ValueError(f"ForwardBatch: block table names a page >= {kv.num_pages}")
            # the page each row writes its token into; rows sharing a page must not share a slot
            last = bt[range(B), [c // ps for c in ctxs]].tolist()
            if len({p * ps + c % ps for p, c in zip(last, ctxs)}) != B:
                raise ValueError(_SAME_KV_SLOT)

    def _check(self, batch: ForwardBatch, kv, state) -> None:
        """The numpy model's checks (same message for the same bad batch), plus this model's
        capacities."""
        cfg = self.text
        n, b = batch.num_tokens, batch.num_rows
        if b and int(np.min(batch.context_lens)) < 0:
            raise ValueError(_NEGATIVE_CONTEXT)
        if cfg.attention_layer_ids:
            self._validate_plan(batch, kv.page_size)
        elif batch.positions.shape != (3, n) or np.shape(batch.query_start) != (b + 1,) or \
                batch.query_start[0] != 0 or batch.query_start[-1] != n:
            raise ValueError("ForwardBatch: positions / query_start do not match the tokens")
        lengths = batch.row_lengths()
        if b < 1 or np.any(lengths < 1):
            raise ValueError(f"ForwardBatch: every row needs >= 1 new token, got {lengths.tolist()}")
        if n > self.n_cap or b > self.eager_layout.b_cap:
            raise ValueError(f"ForwardBatch: {n} tokens / {b} rows exceed the CUDA model's "
                             f"capacity ({self.n_cap} tokens, {self.eager_layout.b_cap} rows); "
                             "split the prefill into chunks")
        ids = np.asarray(batch.token_ids)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"ForwardBatch: token id out of range [0, {cfg.vocab_size})")
        if cfg.linear_layer_ids:
            slots = np.asarray(batch.state_slots)
            if len(set(slots.tolist())) != len(slots) or slots.min() < 0 or \
                    slots.max() >= state.num_slots:
                raise ValueError(f"ForwardBatch: state slots {slots.tolist()} must be distinct and "
                                 f"< {state.num_slots}")
        if cfg.attention_layer_ids:
            if int(np.max(batch.block_tables, initial=-1)) >= kv.num_pages:
                raise ValueError(f"ForwardBatch: block table names a page >= {kv.num_pages}")
            need = (np.asarray(batch.context_lens) + lengths + kv.page_size - 1) // kv.page_size
            if need.max() > self.p_cap:
                raise ValueError(f"ForwardBatch: a row needs {int(need.max())} pages, more than "
                                 f"max_context allows ({self.p_cap})")
            pages, offsets = kv_slot_mapping(batch.block_tables, batch.context_lens,
                                             batch.query_start, kv.page_size)
            if len(np.unique(pages * kv.page_size + offsets)) != n:
                raise ValueError(_SAME_KV_SLOT)

    def _upload_meta(self, layout: MetaLayout, meta: DeviceMeta, host_off: int, batch, out_rows):
        host = self.staging.view(np.int32, host_off, layout.count)
        layout.pack(host, batch, out_rows)
        _d.copy_htod_async(meta.base, self.staging.ptr + host_off, layout.used_bytes(batch.num_rows),
                           self.stream)

    def _is_decode(self, batch) -> bool:
        return self.options.graphs and 0 < batch.num_rows <= self.b_cap \
            and batch.num_tokens == batch.num_rows

    def forward(self, batch: ForwardBatch, kv, state, *, all_logits: bool = False,
                media=None) -> np.ndarray:
        """float32 logits [B, V] for the last new token of each row, or [N, V] with all_logits.
        media: (token indices [k], embeddings [k, H]) that replace those tokens' embeddings (the
        vision tower's output at the placeholders): always an eager call, never a graph."""
        self._t_entry = time.perf_counter()
        self._current()
        V = self.text.vocab_size
        if media is not None and len(media[0]) == 0:
            media = None
        if media is None and not all_logits and self._is_decode(batch):
            if self.checks_batches:
                self._check_decode(batch, kv, state)
            B = batch.num_rows
            self._decode_launch(batch, kv, state)
            _d.copy_dtoh_async(self.out_host.ptr, self.ws.logits.ptr, B * V * 4, self.stream)
            self.stream.synchronize()
            return self.out_host.view(np.float32, 0, B * V).reshape(B, V).copy()
        if self.checks_batches:
            self._check(batch, kv, state)
        out_rows = np.arange(batch.num_tokens, dtype=np.int32) if all_logits else \
            (np.asarray(batch.query_start[1:], np.int32) - 1)
        if media is not None:
            media = self._checked_media(batch, media)
        return self._eager(batch, kv, state, out_rows, media=media)

    def _checked_media(self, batch, media) -> tuple:
        rows, vectors = media
        rows = np.asarray(rows, np.int64)
        vectors = np.ascontiguousarray(vectors, np.float32)
        H = self.text.hidden_size
        if vectors.shape != (len(rows), H) or (len(rows) and (
                rows.min() < 0 or rows.max() >= batch.num_tokens or np.any(np.diff(rows) <= 0))):
            raise ValueError(f"forward: media rows must be ascending token indices < "
                             f"{batch.num_tokens} with one [H={H}] vector each, got rows "
                             f"{rows.shape} and vectors {vectors.shape}")
        return rows, vectors

    def write_media_rows(self, st, media) -> None:
        """Copy media embeddings over their tokens' rows of the hidden buffer (after the embedding
        gather, before the first layer; eager calls only): one async copy per run of adjacent
        rows from a pinned staging buffer. The caller synchronizes before the next call (forward
        does), so the staging is free again."""
        rows, vectors = media
        H = self.text.hidden_size
        if getattr(self, "_media_host", None) is None:
            self._media_host = _d.PinnedBuffer(self.n_cap * H * 4)
        self._media_host.view(np.float32, 0, vectors.size)[:] = vectors.ravel()
        cut = np.flatnonzero(np.diff(rows) != 1) + 1
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(rows)]):
            _d.copy_htod_async(self.ws.h.ptr + int(rows[a]) * H * 4,
                               self._media_host.ptr + a * H * 4, (b - a) * H * 4, st)

    def decode_greedy(self, batch: ForwardBatch, kv, state) -> np.ndarray:
        """Argmax token of each row (device-side), through the graph when the batch is a decode."""
        self._t_entry = time.perf_counter()
        return self._token_step(batch, kv, state, None)

    def sample(self, batch: ForwardBatch, kv, state, rows) -> np.ndarray:
        """The step of decode_greedy, then one token per row sampled on the device from the B
        output logits rows: rows[r] a program.sampling.SampleRow (the host sampler's sample_row
        without logprobs, same token within its decision margins) or None (argmax). int32 [B]."""
        self._t_entry = time.perf_counter()
        B = batch.num_rows
        if len(rows) != B:
            raise ValueError(f"sample: {len(rows)} sampling rows for a batch of {B}")
        cap = min(self.sampler.layout.rows_cap, self.lg_cap)
        if B > cap:
            raise ValueError(f"sample: {B} rows exceed the device sampler's {cap}")
        return self._token_step(batch, kv, state, rows)

    def _token_step(self, batch, kv, state, rows) -> np.ndarray:
        """One step (graph for a decode batch, eager otherwise) whose result is a token id per row:
        the head's argmax, or the device sampler's pick over the logits rows when `rows` is given."""
        self._current()
        B = batch.num_rows
        if self._is_decode(batch):
            if self.checks_batches:
                self._check_decode(batch, kv, state)
            self._decode_launch(batch, kv, state)
        else:
            if self.checks_batches:
                self._check(batch, kv, state)
            self._eager(batch, kv, state, np.asarray(batch.query_start[1:], np.int32) - 1,
                        want_logits=False)
        if rows is not None:
            self.sampler.launch(self.stream, self.ws.logits.ptr, self.ws.tokens.ptr, rows)
        _d.copy_dtoh_async(self.out_host.ptr, self.ws.tokens.ptr, B * 4, self.stream)
        self.stream.synchronize()
        return self.out_host.view(np.int32, 0, B).copy()

    def _eager(self, batch, kv, state, out_rows, want_logits: bool = True, media=None):
        lay, meta = self.eager_layout, self.eager_meta
        self._upload_meta(lay, meta, 0, batch, out_rows)
        n, b = batch.num_tokens, batch.num_rows
        first = min(len(out_rows), self.lg_cap)
        qs = np.asarray(batch.query_start).tolist()
        ctxs = np.asarray(batch.context_lens).tolist()
        rows = [(qs[i], qs[i + 1] - qs[i], int(c)) for i, c in enumerate(ctxs)]
        self.runner.run(self.stream, meta, n, b, first, kv, state, rows=rows, media=media)
        V = self.text.vocab_size
        if not want_logits:
            return None
        result = np.empty((len(out_rows), V), np.float32)
        start = 0
        while start < len(out_rows):
            rows = min(self.lg_cap, len(out_rows) - start)
            if start:
                self.runner.head(self.stream, meta, rows, out_start=start)
            _d.copy_dtoh_async(self.out_host.ptr, self.ws.logits.ptr, rows * V * 4, self.stream)
            self.stream.synchronize()
            result[start: start + rows] = self.out_host.view(np.float32, 0, rows * V).reshape(rows, V)
            start += rows
        return result

    # ---- graphs -------------------------------------------------------------------------------
    def _graph(self, B, kv, state) -> Graph:
        # keyed by pool identity; the entry holds the pools, so their ids cannot be reused
        key = (B, id(kv), id(state))
        entry = self._graphs.get(key)
        if entry is not None:
            return entry[0]
        run = lambda st: self.runner.run(st, self.decode_meta, B, B, B, kv, state)  # noqa: E731
        self.runner.dry = True
        try:
            run(self.stream)          # GEMM plans and modules resolved before capture
        finally:
            self.runner.dry = False
        g = Graph(self.stream, run)
        self._graphs[key] = (g, kv, state)
        return g

    def _forget_graphs_of(self, pool) -> None:
        """Destroy the graphs captured over `pool` (it is closing: its regions go back to the
        arena, and a replay would write into whatever takes them next)."""
        graphs = getattr(self, "_graphs", {})
        stale = [key for key, (_, kv, state) in graphs.items() if pool is kv or pool is state]
        if stale:
            self._current()
        for key in stale:
            graphs.pop(key)[0].destroy()

    def warm_up(self, kv, state) -> None:
        """Capture and replay the decode graph of every B = 1..b_cap, run the device sampler and
        one eager call of the widest prefill: nothing is built lazily while serving. Rows use
        pages 0..B-1 and slots 0..B-1 at context 0 (the pools hold nothing yet)."""
        from ...contracts import SampleRow, SamplingSpec
        self._current()
        b_max = min(self.b_cap, kv.num_pages, state.num_slots)
        for B in range(1, b_max + 1):
            rows = np.arange(B, dtype=np.int32)
            batch = ForwardBatch(np.zeros(B, np.int32), np.zeros((3, B), np.int32),
                                 np.arange(B + 1, dtype=np.int32), np.zeros(B, np.int32),
                                 rows.reshape(B, 1).copy(), rows)
            self.decode_greedy(batch, kv, state)
        empty = np.zeros(0, np.int32)
        self.sample(ForwardBatch.single([0], 0, [0]), kv, state,
                    [SampleRow(SamplingSpec(seed=0, temperature=1.0, top_p=0.9), 0, empty, empty)])
        n = min(self.n_cap, min(kv.num_pages, self.p_cap - 1) * kv.page_size)
        self.decode_greedy(ForwardBatch.single(np.zeros(n, np.int32), 0,
                                               np.arange(-(-n // kv.page_size), dtype=np.int32)),
                           kv, state)

    def capture_graphs(self, kv, state, sizes=None) -> int:
        self._current()
        for B in sizes or range(1, self.b_cap + 1):
            self._graph(B, kv, state)
        return len(self._graphs)

    def _decode_launch(self, batch, kv, state) -> None:
        t0 = time.perf_counter()
        B = batch.num_rows
        g = self._graph(B, kv, state)
        t1 = time.perf_counter()
        lay, off = self.decode_layout, self.eager_layout.nbytes
        nbytes = lay.pack_decode(self.staging.view(np.int32, off, lay.count), batch)
        _d.copy_htod_async(self.decode_meta.base, self.staging.ptr + off, nbytes, self.stream)
        t2 = time.perf_counter()
        g.launch()
        t3 = time.perf_counter()
        t_in = getattr(self, "_t_entry", t0)
        self.last_host_us = (t3 - t_in) * 1e6
        # (checks, graph lookup, metadata pack + async copy, cuGraphLaunch) in microseconds
        self.last_host_breakdown_us = ((t0 - t_in) * 1e6, (t1 - t0) * 1e6, (t2 - t1) * 1e6,
                                       (t3 - t2) * 1e6)

    def close(self) -> None:
        """Release what the model holds, users first: graphs, cuBLASLt, modules, pinned host
        memory, the arena, the context. Every step runs even when an earlier one fails (a kernel
        fault leaves the context failing every call; releasing it is what lets the process use
        the GPU again); the first error is raised at the end. Idempotent."""
        dev = getattr(self, "device", None)
        if dev is None:
            return
        errors = []

        def release(step):
            try:
                step()
            except Exception as exc:   # noqa: BLE001 - collected, the first is raised below
                errors.append(exc)
        release(self._current)
        release(self.stream.synchronize)
        for g, _, _ in getattr(self, "_graphs", {}).values():
            release(g.destroy)
        self._graphs = {}
        for part in ("lt", "kernels"):
            if getattr(self, part, None) is not None:
                release(getattr(self, part).close)
                setattr(self, part, None)
        if getattr(self, "sampler", None) is not None:
            release(self.sampler.close)
            self.sampler = None
        for buf in ("staging", "out_host", "route_host", "_media_host"):
            b = getattr(self, buf, None)
            if b is not None:
                release(b.free)
                setattr(self, buf, None)
        if self.arena is not None:
            release(self.arena.close)
            self.arena = None
        release(dev.close)
        self.device = None
        if errors:
            raise errors[0]
