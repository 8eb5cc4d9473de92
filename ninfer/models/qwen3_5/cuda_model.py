"""The Qwen3.5 text model on the CUDA backend: same contract as the numpy model (docs/internals.md
"Model"), pools on the device, one arena, decode through one CUDA graph per exact batch size.

    load_cuda_model(artifact, options) -> CudaModel
    CudaModel.forward(batch, kv, state, all_logits=False) -> float32 logits (host)
    CudaModel.launch_tokens(batch, kv, state, rows=None) -> TokenStep (cuda/token_step.py)
    CudaModel.decode_greedy(batch, kv, state) -> int32 token ids [B] (argmax on the device)
    CudaModel.sample(batch, kv, state, rows) -> int32 token ids [B] (cuda/sampler.py on the device)
    CudaModel.capture_graphs(kv, state)     # optional: capture B = 1..max_concurrency now

Decode fast path: a batch whose rows each bring one token, B <= max_concurrency, graphs on ->
pack metadata into pinned staging, one async H2D copy, one cuGraphLaunch, one async D2H copy of
the B ids and an event after it; collect() waits on that event.

The pieces, each given what it uses: cuda/device_memory.py (the memory plan), cuda/weight_load.py,
cuda/device_pools.py, cuda/decode_graphs.py, cuda/token_step.py, cuda/runner.py (the layers),
cuda/media_rows.py (media embeddings over their rows).

options.dtype "float32": fp32 weights (the checkpoint's bf16 widened on the device at load),
activations, KV pools and GEMMs (strict fp32 compute), CUDA-core attention for every row: the
numpy backend's arithmetic, for exact comparisons. None / "bfloat16": bf16 storage, fp32 math.
options.kv_dtype "fp8" / "int8": KV pages of one-byte codes and a float32 scale per token and kv
head (the numpy backend's ops/kv_quant.py, the same bytes), in either dtype.
"""
from __future__ import annotations

import contextlib

import logging
import math
import time

import numpy as np

from ...contracts import BatchLimits, ForwardBatch
from ...core.cuda import driver as _d
from ...core.cuda.arena import Arena
from ...core.cuda.cublaslt import CublasLt, shared_algo_rows
from ...core.cuda.kernels import KernelCache
from ...errors import ArtifactError, DeviceError, RequestError
from ...options import draft_tokens, draft_vocab_size
from .config import ModelConfig
from .load import model_config
from .memory_plan import state_slot_bytes
from .model import int8_head_ok
from .vision_tower import MediaEncoding, VisionConfig, read_vision_params
from .cuda.decode_graphs import DecodeGraphs
from .cuda.device_memory import (LT_WORKSPACE, MAX_TOKENS_PER_CALL, MEMORY_MARGIN,  # noqa: F401
                                 call_capacities, check_capacity, plan_cuda_memory,
                                 workspace_bytes)
from .cuda.device_pools import DeviceKVPool, DeviceStatePool, HostStaging, PinnedPool, PoolDevice
from .cuda.drafter import BF16, host_rows
from .cuda.host_tier import CHUNK_BYTES, PinnedReserve
from .cuda.kernel_set import KernelSet
from .cuda.meta import DeviceMeta, MetaLayout
from .cuda.media_rows import MediaRows, checked_media
from .cuda.runner import (StepResources, StepRunner, Workspace, grouped_rows, part_rows_needed,
                          w8a8_bytes)
from .cuda.sampler import DeviceSampler
from .cuda.thread_context import ThreadContext
from .cuda.token_step import TokenStep
from .cuda.weight_load import WeightLoader, int8_head, load_weights, quant_plans
from .cuda import qweights as qw
from .cuda import attention_tc
from .cuda import dflash as device_dflash
from .cuda import vision as device_vision
from .cuda import weights as wplan

log = logging.getLogger("ninfer.cuda")
VISION_SM_SHARE = 0.3   # the vision tower's share of the SMs while steps run (vision_sm_count)
VISION_BUSY_S = 0.02    # steps "run" when one is in flight or was launched this recently


def load_cuda_model(artifact, options) -> "CudaModel":
    # speculative='mtp' / 'dflash': the drafter's weights, kernels and KV layers, and the
    # verify's State snapshot slots in the memory plan (memory_plan.snapshot_slots)
    config = model_config(artifact)
    model = CudaModel(config, options, artifact=artifact, mtp=options.speculative == "mtp",
                      dflash=config.dflash if options.speculative == "dflash" else None)
    model.load_vision(artifact)
    return model



def _chainable(rows) -> bool:
    """A chained step's sampling rows: argmax (None) or draws from the logits, seed and position
    alone (no penalty, bias or mask: nothing packed past the sampler's fixed parameters)."""
    return rows is None or all(r is None or (r.spec.samples_from_logits_alone and r.mask is None)
                               for r in rows)

class CudaModel(MediaEncoding):
    """The contracts.Model of the CUDA backend (argmax and the whole sampler on the device).
    Media: the vision tower on the device (cuda/vision.py; the numpy tower past
    options.vision_max_patches, or with it 0), run from the media encoder's thread on a stream
    of its own; forward(media=) copies its output over the placeholders' embedding rows."""
    backend = "cuda"
    greedy_on_device = samples_on_device = True
    # decode rows beside a prefill chunk in one eager call: the eager path takes such rows, but
    # the mix has not been measured against a decode graph + the chunk on a GPU yet
    # (tests/gpu/test_engine_gpu.py::test_mixed_batches_give_the_same_tokens)
    mixed_batches = False
    # launch_tokens(after=step) takes a decode batch's token ids from the step in flight (a
    # device-to-device copy into the graph's token field), so the Program launches decode step
    # k+1 (greedy, or sampled from the logits alone) before step k is collected (H200, 9B
    # greedy: Engine / model step 0.95 -> 1.03 at B=1, 0.86 -> 0.94 at B=8; bench_engine
    # --no-chain runs the steps one by one)
    chains_token_steps = True
    # the pools' host copies without waits: reads for the context cache's demotions on a copy
    # stream beside the steps (start_read_pages / start_read), writes (installs from the host
    # tier, resumes) queued on the model's stream, their host memory given back by events.
    # Its GPU test passes (test_context_cache_gpu.py::test_async_host_copies_equal_the_
    # synchronous_ones); off since no measured chat gained from it yet (docs/performance.md)
    async_host_copies = False
    copy_stream = None               # (made at load when async_host_copies)
    host_reserve = None              # the context cache's host tier, pinned ahead (made at load)
    # while steps run, the vision tower on this many SMs (None: VISION_SM_SHARE of the device's;
    # 0: every SM always), the rest left to the steps: on the H200 (9B decode B=1 beside
    # back-to-back 1024 x 1024 images) 0.92 of decode's speed alone on 40 SMs, 0.62 on all
    # (bench_vision.py --engine 9b --tower-sms; docs/performance.md). Layers encoded while no
    # step runs (_steps_running) get every SM: a lone image chat's TTFT is the whole device's.
    vision_sm_count = None
    pool_pinned = None
    hidden_host = None               # pinned: every token's hidden (or features) of a verify
    dflash = None                    # cuda/dflash.DFlashRunner (loaded with dflash=)
    step_hidden_host = None          # pinned: two token steps' hidden states (mtp; at load)
    step_hidden = False              # launch_tokens(keep_hidden=True) (contracts.Model; mtp)
    checks_batches = True   # direct callers get checked; a Program turns it off (contracts)
    f32 = False             # dtype="float32": fp32 weights, activations, KV and GEMM inputs
    kv_dtype = None         # "fp8" / "int8": quantized KV pages (options.kv_dtype)
    max_kv_pages = None     # the KV pages the memory plan holds (set at load)
    max_state_slots = None  # and the State slots (sequences' + the context cache's)
    batch_invariant = False  # options.batch_invariant (set at load)
    load_phases: dict = {}   # {"setup", "weights", "kernels"} seconds (set at load; contracts.Model)
    # {"graphs": seconds capturing the decode graphs, "speculative_graphs": the verify graphs,
    # MTP chains and DFlash block passes} (warm_up)
    warm_up_phases: dict = {}
    # the numpy model's final_hidden (embeddings, MTP): this model's hidden states stay on the
    # device, so it offers none (Engine.embed answers NotSupportedError)
    final_hidden = None

    def __init__(self, config: ModelConfig, options, *, artifact=None, random_seed: int = None,
                 max_tokens: int = None, kernel_cache_dir=None, mtp: bool = False,
                 dflash=None):
        """mtp: also hold the checkpoint's MTP head (its weights, kernels, and one more attention
        layer in every KV pool, last) for `mtp_forward` and `verify_forward` (issue 25: the
        speculative units, program/speculative.py, through cuda/drafter.py). dflash (a
        DFlashConfig): hold that DFlash drafter instead (its weights, kernels, buffers and its
        layers last in every KV pool) for `dflash_feed`, `dflash_draft` and `verify_forward`
        with its `hidden_layers` (issue 30, through cuda/dflash.py)."""
        if (artifact is None) == (random_seed is None):
            raise ValueError("CudaModel: give exactly one of artifact / random_seed")
        if mtp and config.text.mtp_num_hidden_layers != 1:
            raise ArtifactError(f"speculative='mtp' needs the checkpoint's MTP head (one layer; "
                                f"this model has {config.text.mtp_num_hidden_layers})")
        if mtp and dflash is not None:
            raise ValueError("CudaModel: one drafter at a time (mtp or dflash)")
        if dflash is not None:
            dflash.validate(config.text)
        self.mtp = bool(mtp)
        self.dflash_cfg = dflash
        # a speculative verify's buffers and kernels (either drafter)
        self.speculative = self.mtp or dflash is not None
        # the drafter's KV layers, last in every pool: (kv heads, head_dim) each (the MTP
        # head's is the target's attention; a DFlash drafter's may have its own geometry)
        t = config.text
        self.drafter_kv = ((t.num_key_value_heads, t.head_dim),) * int(self.mtp) + (
            ((dflash.num_key_value_heads, dflash.head_dim),) * dflash.num_hidden_layers
            if dflash else ())
        self.config, self.text = config, config.text
        self.options = options
        # MTP drafts: argmaxes over the first draft_vocab ids (EngineOptions.draft_vocab)
        self.draft_vocab = draft_vocab_size(options, t.vocab_size)
        # what close() releases: None until made (a failed load closes what it got to)
        self.arena = self.lt = self.kernels = self.sampler = self.graphs = None
        self.staging = self.out_host = self.ids_host = self.route_host = self.media_rows = None
        self.pool_staging = HostStaging()         # the pools' host copies (device_pools.py)
        self.pool_pinned = PinnedPool()  # the pinned buffers of reads on the copy stream
        self.step_events = ()            # the events recorded after token steps' D2H copies
        self._in_flight = []             # launched TokenSteps not yet collected (at most 2)
        self._turn = 0                   # which of two id buffers / events / decode stagings
        self.last_host_us = 0.0
        self.last_host_breakdown_us = (0.0, 0.0, 0.0, 0.0)
        self._t_entry = 0.0
        self._t_begin = time.perf_counter()
        self.setup_phases = {}           # what "setup" spent, by part (bench/bench_start.py)
        self.device = _d.Device(options.device_id)
        self._lap("context")
        self.stream = self.device.stream
        if self.async_host_copies:
            self.copy_stream = _d.Stream()
        self._bind_context = ThreadContext(self.device)   # shared with the pools
        try:
            self._setup(options, artifact, random_seed, max_tokens, kernel_cache_dir)
        except BaseException:
            try:
                self.close()
            except Exception:   # noqa: BLE001 - the load error is the one to report
                pass
            raise

    @property
    def attn_tc_min_tokens(self):
        """Rows of at least this many new tokens take the tensor-core prefill attention
        (cuda/attention_tc.py); the runner's, settable here (tests and the benchmark move it
        to cover both paths)."""
        return self.runner.attn_tc_min_tokens

    @attn_tc_min_tokens.setter
    def attn_tc_min_tokens(self, tokens) -> None:
        self.runner.attn_tc_min_tokens = tokens

    def load_vision(self, artifact) -> None:
        """The numpy tower, unless the device one was built at set-up (vision_max_patches)."""
        if self.vision is None:
            super().load_vision(artifact)

    def _current(self) -> None:
        """Bind the driver context in this thread if it has not used it yet (the Engine worker
        calls forward from its own thread)."""
        self._bind_context()

    # ---- set-up -------------------------------------------------------------------------------
    def _lap(self, name: str) -> None:
        now = time.perf_counter()
        self.setup_phases[name] = now - self._t_begin - sum(self.setup_phases.values())

    def _setup(self, options, artifact, random_seed, max_tokens, kernel_cache_dir):
        cfg = self.text
        dtype = options.dtype
        if dtype not in (None, "bfloat16", "float32"):
            raise RequestError(f"backend 'cuda': dtype={dtype!r} must be None, 'bfloat16' or 'float32'")
        self.f32 = dtype == "float32"
        kv_dtype = options.kv_dtype
        if kv_dtype not in ("bfloat16", "fp8", "int8"):
            raise RequestError(f"backend 'cuda': kv_dtype={kv_dtype!r} must be 'bfloat16', "
                               "'fp8' or 'int8'")
        self.kv_dtype = None if kv_dtype == "bfloat16" else kv_dtype
        # batch_invariant: a row's logits do not depend on B or its neighbours (decode GEMMs at
        # one shape, fixed decode attention splits; docs/architecture.md "Load invariance")
        self.batch_invariant = bool(options.batch_invariant)
        # matrices held as packed codes (cuda/qweights.py): their formats pick kernels
        self.qplans = quant_plans(cfg, artifact)
        # the MTP drafts' int8 head (EngineOptions.draft_head; model.DraftHead's rule): rows of
        # a bf16 (or the float32 model's) lm_head; a packed lm_head is read as it is
        self.int8_head_rows = self.draft_vocab if (
            self.mtp and options.draft_head == "int8" and int8_head_ok(cfg.hidden_size)
            and ("", "lm_head") not in self.qplans) else 0
        # the vision tower on the device (cuda/vision.py): a share of the arena, its kernels
        # loaded with the rest; vision_max_patches 0: the numpy tower (load_vision)
        vcfg = VisionConfig.from_dict(self.config.vision) \
            if artifact is not None and self.config.vision else None
        m2 = vcfg.spatial_merge_size ** 2 if vcfg else 1
        vis_patches = options.vision_max_patches // m2 * m2 if vcfg else 0
        vis_bytes = device_vision.plan_bytes(vcfg, vis_patches, self.f32) if vis_patches else 0
        # programmatic dependent launch: each kernel of ours resident and waiting when the one
        # before ends. A bf16 MoE decode step is mostly small kernels of ours (35B-A3B, H100:
        # 3.55 -> 3.37 ms at B = 1, 9.6 -> 9.2 at B = 8); dense bf16 steps moved within the
        # noise and a 9B fp8 one lost 5% at B = 8 (H200), so those keep it off (NINFER_PDL=1/0;
        # kernels.pdl_supported)
        pdl = cfg.is_moe and not self.f32 and not self.qplans
        self.kernels = KernelSet(cfg, KernelCache(self.device.cc, kernel_cache_dir,
                                                  pdl_default=pdl), self.f32,
                                 qw.formats(self.qplans.values()), self.kv_dtype,
                                 vision_head_dim=vcfg.head_dim if vis_patches else 0,
                                 mtp=self.mtp, dflash=self.dflash_cfg)
        # kernels compile (other processes: numba holds the GIL) and load (the driver JIT-compiles
        # each module's PTX, in threads) while the weights load
        kernel_loading = self.kernels.start_loading(self._bind_context)
        self._lap("kernel lookup")
        page_size = int(options.page_size)
        # (the Program merges no units in batch_invariant mode: program.py)
        b_cap, n_cap, self.p_cap, self.lg_cap = call_capacities(
            options, max_tokens, mixed=self.mixed_batches and not options.batch_invariant)
        self.b_cap, self.n_cap = b_cap, n_cap
        self.max_keys = self.p_cap * page_size
        self.eager_layout = MetaLayout(n_cap, max(b_cap, 8), self.p_cap)
        self.decode_layout = MetaLayout(b_cap, b_cap, self.p_cap)
        # the MTP drafter's chained steps (mtp_chain): a decode-shaped metadata region per step
        # after the first draft, and each step's argmaxes
        self.chain_steps = max(draft_tokens(options) - 1, 0) if self.mtp else 0
        chain_words = self.chain_steps * (self.decode_layout.count + b_cap)
        tied = artifact is not None and wplan.is_tied(artifact)
        nkv = max(cfg.num_key_value_heads, 1)
        part_rows = part_rows_needed(n_cap, nkv, self.device.num_sms,
                                     b_cap if self.batch_invariant else 0)
        wq = qw.slab_elements(self.qplans.values(), n_cap)      # the prefill dequant tile
        # fp8 weights' prefill on the fp8 tensor cores (W8A8): the quantized input's width
        fp8_act = options.fp8_activations
        if fp8_act is None and options.purpose == "scoring":
            # scoring reads every position's logits straight from the prefill, where the
            # activations' rounding shows in full (docs/performance.md "W8A8's error"); a
            # generation's logits come from decode, which never quantizes them
            fp8_act = False
        if fp8_act and self.f32:
            raise RequestError("backend 'cuda': fp8_activations=True needs dtype bfloat16 (the "
                               "float32 model multiplies exact weights and inputs)")
        w8k = qw.w8a8_k(self.qplans.values()) \
            if fp8_act is not False and not self.f32 and n_cap > qw.GEMV_MAX_ROWS else 0
        ws_bytes = workspace_bytes(cfg, f32=self.f32, n_cap=n_cap, lg_cap=self.lg_cap,
                                   part_rows=part_rows, max_keys=self.max_keys,
                                   meta_bytes=self.eager_layout.nbytes + self.decode_layout.nbytes
                                   + 4 * chain_words,
                                   mtp=self.speculative, rows=max(b_cap, 8)) \
            + wq * (4 if self.f32 else 2) + w8a8_bytes(n_cap, w8k) + (1024 if w8k else 0)
        if self.dflash_cfg is not None:
            ws_bytes += device_dflash.buffer_bytes(self.dflash_cfg, n_cap, self.device.num_sms,
                                                   self.f32)
        # the device sampler: parameters, penalty lists and mask bits of one step, fp64 rows
        # (speculative: every verify position of every row is a sampler row)
        sampler_rows = max(b_cap * (draft_tokens(options) + 1 if self.speculative else 1), 8)
        free, total = self.device.mem_info()
        self.memory_plan = plan = plan_cuda_memory(
            # (with a drafter: its KV layers paged with the model's, in every page's bytes)
            cfg, options, f32=self.f32,
            weights_bytes=wplan.plan_bytes(cfg, tied, self.f32, self.qplans, mtp=self.mtp,
                                           dflash=self.dflash_cfg,
                                           int8_head_rows=self.int8_head_rows),
            workspace_bytes=ws_bytes + vis_bytes + DeviceSampler.device_bytes(
                sampler_rows, cfg.vocab_size, options.max_context),
            free_bytes=free, total_bytes=total, device=self.device.name, margin_bytes=MEMORY_MARGIN,
            kv_dtype=self.kv_dtype, extra_kv=self.drafter_kv)
        self.max_kv_pages = plan.num_kv_pages
        self.max_state_slots = plan.num_state_slots
        self._lap("plan")
        self.arena = Arena(plan.total_bytes)
        self._lap("arena")
        self.ws = Workspace(self.arena, cfg, n_cap, self.lg_cap, part_rows, self.max_keys,
                            f32=self.f32, wq_elements=wq, w8a8_k=w8k, mtp=self.mtp,
                            verify=self.speculative, rows_cap=max(b_cap, 8))
        if self.dflash_cfg is not None:
            self.dflash_bufs = device_dflash.DFlashBuffers(self.arena, self.dflash_cfg, n_cap,
                                                           self.device.num_sms, self.f32)
        meta = self.arena.take((self.eager_layout.count + self.decode_layout.count
                                + chain_words,), np.int32, "metadata")
        self.eager_meta = DeviceMeta(self.eager_layout, meta.ptr)
        self.decode_meta = DeviceMeta(self.decode_layout, meta.ptr + self.eager_layout.nbytes)
        chain = meta.ptr + self.eager_layout.nbytes + self.decode_layout.nbytes
        self.chain_metas = [DeviceMeta(self.decode_layout, chain + i * self.decode_layout.nbytes)
                            for i in range(self.chain_steps)]
        self.chain_ids = chain + self.chain_steps * self.decode_layout.nbytes
        lt_ws = self.arena.take((LT_WORKSPACE,), np.uint8, "cuBLASLt workspace")
        self.lt = CublasLt(lt_ws.ptr, LT_WORKSPACE, f32=self.f32, invariant=self.batch_invariant)
        self.w8a8 = bool(w8k) and self.lt.fp8_supported()
        if fp8_act and w8k and not self.w8a8:
            raise DeviceError(f"backend 'cuda': fp8_activations=True, but cuBLASLt on "
                              f"{self.device.name} has no block-scaled fp8 GEMM (Hopper and "
                              "cuBLAS 12.9 or later)")
        self._lap("cublaslt")
        self.sampler = DeviceSampler(self.arena, self.kernels, sampler_rows, cfg.vocab_size,
                                     options.max_context)
        self._lap("sampler")
        # two decode stagings, id buffers and events, used in turn: with a step launched ahead
        # (launch_tokens(after=)) two are in flight, and a staging or id buffer is written
        # again only after the step that used it was collected
        # (and after them the MTP chain's step regions)
        self.staging = _d.PinnedBuffer(self.eager_layout.nbytes + (2 + self.chain_steps)
                                       * self.decode_layout.nbytes)
        self.out_host = _d.PinnedBuffer(self.lg_cap * cfg.vocab_size * 4)
        # the final-normed hidden of every token of an eager call (verify_forward; mtp), or its
        # features (dflash: the outputs of the drafter's target layers side by side)
        self.hidden_width = cfg.hidden_size * (len(self.dflash_cfg.target_layer_ids)
                                               if self.dflash_cfg is not None else 1)
        self.hidden_host = _d.PinnedBuffer(n_cap * self.hidden_width * self.ws.gin_bytes) \
            if self.speculative else None
        # and of a token step's rows (keep_hidden: a speculative Program's plain steps, two in
        # flight as their ids)
        if self.speculative:
            self.step_hidden_host = _d.PinnedBuffer(2 * self.lg_cap * self.hidden_width
                                                    * self.ws.gin_bytes)
            self.step_hidden = True
        # token steps' ids in their own buffer (a forward may run before collect)
        self.ids_host = _d.PinnedBuffer(2 * self.lg_cap * 4)
        self.step_events = (_d.Event(timing=False), _d.Event(timing=False))
        K = max(cfg.num_experts_per_tok, 1)
        self.route_host = _d.PinnedBuffer(
            (grouped_rows(n_cap, K, cfg.num_experts) + 2 * n_cap * K) * 4 if cfg.is_moe else 4)
        self.media_rows = MediaRows(self.ws.h, cfg.hidden_size, n_cap)
        # the context cache's host tier, pinned beside the weight load (host_tier.py): its
        # budget and a quarter over it, for the rows one tier frees and the other cannot use
        # (measured on the H200: at the budget + one KV chunk and one State image, a 9B chat
        # with every checkpoint on the host still pinned 35 ms at one turn), + one KV chunk and
        # one State image (each tier rounds up to its rows)
        host_budget = options.prefix_cache_budget_bytes
        if host_budget:
            self.host_reserve = PinnedReserve(
                host_budget + host_budget // 4 + CHUNK_BYTES + state_slot_bytes(cfg),
                self._bind_context)
        self._lap("pinned buffers")
        t_load = time.perf_counter()
        # the cuBLASLt workspace is idle during the load: the fp32 model's widening scratch
        loader = WeightLoader(self.arena, self.kernels, self.stream, self.f32, lt_ws, LT_WORKSPACE,
                              self._bind_context)
        try:
            self.weights = load_weights(cfg, loader, artifact=artifact, seed=random_seed,
                                        tied=tied, qplans=self.qplans, mtp=self.mtp,
                                        dflash=self.dflash_cfg)
            self.stream.synchronize()
        except BaseException:
            # the kernels' thread finishes before close() unloads what it loads
            with contextlib.suppress(BaseException):
                kernel_loading.wait()
            raise
        self.load_seconds = time.perf_counter() - t_load
        t_kernels = time.perf_counter()
        self.kernels_compiled = kernel_loading.wait()
        self.kernel_seconds = time.perf_counter() - t_kernels      # beyond the weights' time
        if self.int8_head_rows:
            self.weights["draft_head"] = int8_head(loader, self.weights["lm_head"],
                                                   self.int8_head_rows, cfg.hidden_size)
            self.stream.synchronize()
        if vis_patches:
            t_vision = time.perf_counter()
            self.vision = device_vision.load_device_vision(
                vcfg, read_vision_params(artifact, vcfg), arena=self.arena, kernels=self.kernels,
                bind=self._bind_context, f32=self.f32, max_patches=vis_patches,
                sm_count=self._vision_sms(), device=self.device, busy=self._steps_running)
            self.load_seconds += time.perf_counter() - t_vision
        self.load_phases = {"setup": t_load - self._t_begin, "weights": self.load_seconds,
                            "kernels": self.kernel_seconds}
        self.runner = StepRunner(
            StepResources(cfg=cfg, ws=self.ws, weights=self.weights, lt=self.lt,
                          kernels=self.kernels, num_sms=self.device.num_sms, b_cap=b_cap,
                          # a verify of every row's k + 1 tokens stays on the decode's expert
                          # GEMVs: the grouped path syncs with the host at every MoE layer
                          # (a 35B-A3B verify of 4 tokens: 7.4x a decode step that way)
                          moe_gemv_tokens=b_cap * (draft_tokens(options) + 1
                                                   if self.speculative else 1),
                          n_cap=n_cap, route_host=self.route_host, media=self.media_rows),
            invariant=self.batch_invariant,
            # (bf16 only: a float32 model runs every row on the CUDA-core kernel)
            attn_tc_min_tokens=math.inf if self.f32 else attention_tc.TC_MIN_TOKENS,
            w8a8=self.w8a8, fuse_moe_tail="moe_down_combine" in self.kernels.specs)
        if self.ws.route_dev is not None:
            # the MoE prefill's routing on the device where cuBLASLt has the grouped GEMM
            # (cuda/moe_route.py): every MoE layer's expert addresses, the MTP head's too
            self.ws.route_dev.bind(self.stream, self.lt, self.ws,
                                   list(self.weights["layers"])
                                   + ([self.weights["mtp"]] if self.mtp else []))
        if self.dflash_cfg is not None:
            self.dflash = device_dflash.DFlashRunner(
                self.runner, self.dflash_cfg, self.weights["dflash"], self.dflash_bufs,
                first_layer=len(cfg.attention_layer_ids))
        self.graphs = DecodeGraphs(self.stream, self.runner, self.decode_meta)
        if self.dflash is not None:     # every decode step hands the drafter's features too
            self.graphs.capture = self.dflash.capture
        self.stream.synchronize()
        log.info("cuda plan on %s: weights %.2f GiB (loaded in %.1f s), workspace and sampler "
                 "%.2f GiB, KV (%s) %d pages of %d tokens + State %d slots = %.2f GiB, %.2f GiB in "
                 "all of %.2f GiB free", plan.device, plan.weights_bytes / 2**30, self.load_seconds,
                 plan.workspace_bytes / 2**30, self.kv_dtype or ("float32" if self.f32 else
                                                                 "bfloat16"),
                 plan.num_kv_pages, plan.page_size,
                 plan.num_state_slots, plan.pool_bytes / 2**30, plan.total_bytes / 2**30,
                 plan.free_bytes / 2**30)

    # ---- pools --------------------------------------------------------------------------------
    def _pool_device(self) -> PoolDevice:
        # a closing pool destroys the graphs captured over it (they would write into its regions)
        return PoolDevice(self.arena, self.stream, self._bind_context, self.graphs.forget,
                          self.pool_staging, self.f32, self.kv_dtype,
                          copy_stream=self.copy_stream,
                          pinned=self.pool_pinned if self.copy_stream is not None else None,
                          host_reserve=self.host_reserve)

    def _vision_sms(self) -> int:
        if self.vision_sm_count is None:
            return max(1, round(VISION_SM_SHARE * self.device.num_sms))
        return int(self.vision_sm_count)

    @property
    def one_off_seconds(self) -> float:
        """contracts.Model.one_off_seconds: what capturing graphs and making cuBLASLt plans took
        so far (a drafter's catch-up feed of a new length plans its GEMMs; a graph captured
        lazily takes seconds: neither is the unit's cost)."""
        return (self.graphs.capture_seconds if self.graphs is not None else 0.0) + \
            (self.lt.plan_seconds if self.lt is not None else 0.0)

    def _steps_running(self) -> bool:
        """A step is in flight or one was launched in the last VISION_BUSY_S (the vision
        tower's lane, chosen again before each of its layers)."""
        return bool(self._in_flight) or time.perf_counter() - self._t_entry < VISION_BUSY_S

    def new_kv_pool(self, num_pages: int, page_size: int) -> DeviceKVPool:
        self._current()
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"new_kv_pool: num_pages={num_pages}, page_size={page_size} must be >= 1")
        pool = DeviceKVPool(self._pool_device(), self.text, num_pages, page_size,
                            extra=self.drafter_kv)
        self.stream.synchronize()
        return pool

    def new_state_pool(self, num_slots: int) -> DeviceStatePool:
        self._current()
        if num_slots < 1:
            raise ValueError(f"new_state_pool: num_slots={num_slots} must be >= 1")
        pool = DeviceStatePool(self._pool_device(), self.text, num_slots)
        self.stream.synchronize()
        return pool

    # ---- compute ------------------------------------------------------------------------------
    def batch_limits(self, kv, state) -> BatchLimits:
        """ForwardBatch.check's limits of a call over these pools: the numpy model's, plus this
        model's capacities (a decode graph's B <= b_cap is within them)."""
        cfg = self.text
        return BatchLimits(
            vocab_size=cfg.vocab_size,
            page_size=kv.page_size if cfg.attention_layer_ids else None,
            num_kv_pages=kv.num_pages if cfg.attention_layer_ids else None,
            num_state_slots=state.num_slots if cfg.linear_layer_ids else None,
            max_rows=self.eager_layout.b_cap, max_tokens=self.n_cap,
            max_pages_per_row=self.p_cap)

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
        if self.checks_batches:
            batch.check(self.batch_limits(kv, state))
        media = self._media(batch, media)
        if media is None and not all_logits and self._is_decode(batch):
            self._decode_launch(batch, kv, state)
            return self._logits_out(batch.num_rows).copy()
        out_rows = np.arange(batch.num_tokens, dtype=np.int32) if all_logits else \
            (np.asarray(batch.query_start[1:], np.int32) - 1)
        return self._eager(batch, kv, state, out_rows, media=media)

    def _media(self, batch, media):
        """forward's media argument checked against the batch; None when it replaces nothing."""
        if media is None or len(media[0]) == 0:
            return None
        return checked_media(batch, media, self.text.hidden_size)

    def launch_tokens(self, batch: ForwardBatch, kv, state, rows=None, *,
                      after: TokenStep = None, keep_hidden: bool = False,
                      hidden_layers=None) -> TokenStep:
        """Launch one step whose result is a token id per row (graph for a decode batch, eager
        otherwise): the head's argmax, or with `rows` (a program.sampling.SampleRow or None per
        row) the device sampler's pick over the logits rows; then the async copy of the ids to
        pinned memory and an event after it. Returns at once; TokenStep.collect() waits on that
        event. One step in flight: collect the previous one before the next launch, except
        after=that step: a decode batch of the same rows whose token ids are that step's ids,
        copied on the device (contracts.Model.chains_token_steps), its sampling rows (if any)
        each None or of a spec that samples_from_logits_alone. keep_hidden (step_hidden: a
        model with a drafter): every row's final-normed hidden state (the head's, of the row's
        last token) comes down too, TokenStep.hidden(); with hidden_layers (the loaded DFlash
        drafter's; a decode batch) every row's features instead (the decode graph captures
        them)."""
        self._t_entry = time.perf_counter()
        B = batch.num_rows
        capture = feat = None
        if keep_hidden:
            capture, feat = self._feed_source(hidden_layers)
            if capture is not None and batch.num_tokens != B:
                raise ValueError("launch_tokens(keep_hidden=True, hidden_layers=...): a decode "
                                 "batch (one token a row)")
        if after is None and self._in_flight:
            raise RuntimeError("launch_tokens: the previous TokenStep is not collected yet")
        if after is not None and (self._in_flight != [after] or not self._is_decode(batch)
                                  or after.num_rows != B or not _chainable(rows)):
            raise RuntimeError("launch_tokens(after=): a decode batch of the rows of the one "
                               "step in flight, sampled from their logits alone")
        if rows is not None:
            if len(rows) != B:
                raise ValueError(f"sample: {len(rows)} sampling rows for a batch of {B}")
            cap = min(self.sampler.layout.rows_cap, self.lg_cap)
            if B > cap:
                raise ValueError(f"sample: {B} rows exceed the device sampler's {cap}")
        self._current()
        if self.checks_batches:
            batch.check(self.batch_limits(kv, state))
        turn, self._turn = self._turn, self._turn ^ 1
        if self._is_decode(batch):
            self._decode_launch(batch, kv, state, turn, chained=after is not None)
        else:
            self._eager(batch, kv, state, np.asarray(batch.query_start[1:], np.int32) - 1,
                        want_logits=False,
                        capture=self.dflash.capture if self.dflash is not None else None)
        if rows is not None:
            # a chained step's parameters go through a staging of their own (the step in flight
            # may not have copied its own yet); a serial one's through the sampler's main one
            self.sampler.launch(self.stream, self.ws.logits.ptr, self.ws.tokens.ptr, rows,
                                ahead_turn=turn if after is not None else None)
        off = turn * self.lg_cap * 4
        _d.copy_dtoh_async(self.ids_host.ptr + off, self.ws.tokens.ptr, B * 4, self.stream)
        read_hidden = self._queue_step_hidden(turn, B, feat if capture else self.ws.xf,
                                              self._feed_width(capture)) \
            if keep_hidden else None
        event = self.step_events[turn]
        event.record(self.stream)
        step = TokenStep(self.ids_host.view(np.int32, off, B), event, self._step_collected,
                         read_hidden)
        self._in_flight.append(step)
        return step

    def _queue_step_hidden(self, turn: int, B: int, src, H: int):
        """Queue the copy of a token step's B rows of `src`, H wide (ws.xf: the head normed each
        row's last token there, graph or eager; or the DFlash features) into pinned turn `turn`;
        returns the reader TokenStep.collect calls once the step's event passed."""
        if not self.step_hidden:
            raise RuntimeError("launch_tokens(keep_hidden=True): the model was loaded without "
                               "a drafter (mtp=True or dflash=)")
        row_bytes = H * self.ws.gin_bytes
        off = turn * self.lg_cap * row_bytes
        _d.copy_dtoh_async(self.step_hidden_host.ptr + off, src.ptr, B * row_bytes, self.stream)
        if self.f32:
            return lambda: self.step_hidden_host.view(np.float32, off, B * H).reshape(B, H).copy()
        # (bf16 as stored: a plain step's rows wait in the drafter's queue and go up again as
        # they are, drafter.host_rows)
        return lambda: self.step_hidden_host.view(np.uint16, off, B * H).reshape(B, H).copy() \
            .view(BF16)

    def _step_collected(self, step: TokenStep) -> None:
        if step in self._in_flight:
            self._in_flight.remove(step)

    def decode_greedy(self, batch: ForwardBatch, kv, state) -> np.ndarray:
        """Argmax token of each row (device-side), through the graph when the batch is a decode."""
        return self.launch_tokens(batch, kv, state).collect()

    def sample(self, batch: ForwardBatch, kv, state, rows) -> np.ndarray:
        """The step of decode_greedy, then one token per row sampled on the device from the B
        output logits rows: rows[r] a program.sampling.SampleRow (the host sampler's sample_row
        without logprobs, same token within its decision margins) or None (argmax). int32 [B]."""
        return self.launch_tokens(batch, kv, state, rows).collect()

    def _eager(self, batch, kv, state, out_rows, want_logits: bool = True, media=None,
               snap=None, capture=None):
        lay, meta = self.eager_layout, self.eager_meta
        self._upload_meta(lay, meta, 0, batch, out_rows)
        n, b = batch.num_tokens, batch.num_rows
        first = min(len(out_rows), self.lg_cap)
        qs = np.asarray(batch.query_start).tolist()
        ctxs = np.asarray(batch.context_lens).tolist()
        rows = [(qs[i], qs[i + 1] - qs[i], int(c)) for i, c in enumerate(ctxs)]
        self.runner.run(self.stream, meta, n, b, first, kv, state, rows=rows, media=media,
                        snap=snap, capture=capture)
        V = self.text.vocab_size
        if not want_logits:
            return None
        result = np.empty((len(out_rows), V), np.float32)
        start = 0
        while start < len(out_rows):
            rows = min(self.lg_cap, len(out_rows) - start)
            if start:
                self.runner.head(self.stream, meta, rows, out_start=start)
            result[start: start + rows] = self._logits_out(rows)
            start += rows
        return result

    # ---- speculative units (issue 25; program/speculative.py through cuda/drafter.py) --------
    # Host arrays in and out for now: the drafter's hidden states and the verify's logits cross
    # to the host and back each unit. (The device path keeps them in the workspace.)
    verify_snapshots = True     # verify_forward writes each verify row's per-token States

    def _put_hidden(self, dst, hidden: np.ndarray) -> None:
        """float32 [n, width] host rows, or a bf16 model's own (drafter.host_rows: bfloat16, as
        stored), into a workspace buffer of the GEMM inputs' type (bf16, or fp32 with dtype
        float32)."""
        if self.f32:
            stored = np.ascontiguousarray(hidden, np.float32)
        elif hidden.dtype == BF16:
            stored = np.ascontiguousarray(hidden).view(np.uint16)
        else:
            stored = np.asarray(hidden, np.float32).astype(BF16).view(np.uint16)
        self.hidden_host.view(stored.dtype, 0, stored.size)[:] = stored.reshape(-1)
        _d.copy_htod_async(dst.ptr, self.hidden_host.ptr, stored.nbytes, self.stream)

    def _get_hidden(self, src, n: int, width: int = None) -> np.ndarray:
        """float32 [n, width] (default H) of a workspace buffer of the GEMM inputs' type (waits
        for the stream)."""
        self._queue_hidden(src, n, width)
        self.stream.synchronize()
        return self._read_hidden(n, width)

    def _queue_hidden(self, src, n: int, width: int = None) -> None:
        nbytes = n * (width or self.text.hidden_size) * self.ws.gin_bytes
        _d.copy_dtoh_async(self.hidden_host.ptr, src.ptr, nbytes, self.stream)

    def _queue_hidden_rows(self, src, rows) -> None:
        """Rows `rows` (ascending) of a workspace buffer of H-wide rows into the pinned buffer,
        packed: one copy per run of consecutive rows."""
        row_bytes = self.text.hidden_size * self.ws.gin_bytes
        rows = np.asarray(rows, np.int64)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        at = 0
        for run in np.split(rows, breaks):
            _d.copy_dtoh_async(self.hidden_host.ptr + at * row_bytes,
                               src.ptr + int(run[0]) * row_bytes, len(run) * row_bytes,
                               self.stream)
            at += len(run)

    def _read_hidden(self, n: int, width: int = None) -> np.ndarray:
        """What _queue_hidden copied, once the stream has passed it."""
        H = width or self.text.hidden_size
        if self.f32:
            return self.hidden_host.view(np.float32, 0, n * H).reshape(n, H).copy()
        bits = self.hidden_host.view(np.uint16, 0, n * H).reshape(n, H)
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def _logits_out(self, n: int) -> np.ndarray:
        """The first n logits rows, copied down (waits for the stream): a view of the pinned
        buffer, valid until its next use."""
        V = self.text.vocab_size
        _d.copy_dtoh_async(self.out_host.ptr, self.ws.logits.ptr, n * V * 4, self.stream)
        self.stream.synchronize()
        return self.out_host.view(np.float32, 0, n * V).reshape(n, V)

    def _need_mtp(self, what: str) -> None:
        if not self.mtp:
            raise RuntimeError(f"{what}: the model was loaded without its MTP head (mtp=True)")
        self._current()

    def _need_speculative(self, what: str) -> None:
        if not self.speculative:
            raise RuntimeError(f"{what}: the model was loaded without a drafter (mtp=True or "
                               "dflash=)")
        self._current()

    def mtp_forward(self, batch: ForwardBatch, hidden: np.ndarray, kv, *,
                    with_logits: bool = True) -> tuple:
        """One MTP head step on the device, MtpDrafter.forward's contract (models/qwen3_5/mtp.py):
        batch.token_ids are the next tokens x_{t+1}, positions / context_lens those of the hidden
        states' positions t, hidden [N, H] the final-normed hidden states it continues (stored
        as the GEMM inputs are: bf16, or fp32 with dtype float32). Its KV is the pool's last
        layer. Returns (logits [N, V] float32, or None without with_logits; final-normed MTP
        hidden [N, H] float32), eager; N <= the tokens of one call, and with logits <= its
        logits rows (cuda/drafter.py splits longer feeds)."""
        n = batch.num_tokens
        self._mtp_run("mtp_forward", batch, hidden, kv, np.arange(n, dtype=np.int32)
                      if with_logits else self._row_ends(batch))
        logits = self._logits_out(n).copy() if with_logits else None
        return logits, self._get_hidden(self.ws.x, n)

    def mtp_argmax(self, batch: ForwardBatch, hidden: np.ndarray, kv, *,
                   last_only: bool = False) -> tuple:
        """mtp_forward without logits, and the device's argmax of each row's last token's
        logits (the drafter's next draft of that row): (int32 [B], MTP hidden [N, H] float32,
        or with last_only [B, H]: each row's last token's alone), B ids down instead of B x V
        logits; one wait. last_only is the feed's: of a catch-up over thousands of queued
        positions only the rows' last MTP hidden states are used, and bringing down and
        widening all of them cost more host time than the feed's whole device work."""
        n, B = batch.num_tokens, batch.num_rows
        ends = self._row_ends(batch)
        self._mtp_run("mtp_argmax", batch, hidden, kv, ends, vocab=self.draft_vocab)
        _d.copy_dtoh_async(self.ids_host.ptr, self.ws.tokens.ptr, 4 * B, self.stream)
        if last_only:
            self._queue_hidden_rows(self.ws.x, ends)
        else:
            self._queue_hidden(self.ws.x, n)
        self.stream.synchronize()
        return self.ids_host.view(np.int32, 0, B).copy(), self._read_hidden(B if last_only
                                                                             else n)

    def mtp_chain_fits(self, rows: int, steps: int) -> bool:
        """Whether mtp_chain takes `steps` steps of `rows` rows (its step regions, the decode
        graphs' rows)."""
        return self.mtp and 1 <= steps <= self.chain_steps and 0 < rows <= self.b_cap

    def mtp_chain(self, hidden: np.ndarray, first, context_lens, block_tables, steps: int,
                  kv) -> np.ndarray:
        """`steps` greedy MTP steps of B rows in one call, each step's argmaxes fed to the next
        on the device: mtp.draft_greedy's loop without logits (the speculative units' drafts
        after d_1), one wait instead of one per step. Row r's step i runs at position
        context_lens[r] + i from (the MTP hidden g, token x): g = hidden[r] (final-normed, as
        mtp_forward's) and x = first[r] at i = 0, else the previous step's final-normed MTP
        hidden and argmax. Returns int32 [B, steps], the argmaxes. Through a captured graph
        per (B, steps) where graphs are on (warm_up captures them all), else the same launches
        eagerly."""
        self._need_mtp("mtp_chain")
        first = np.asarray(first, np.int32)
        B, H = len(first), self.text.hidden_size
        if not self.mtp_chain_fits(B, steps):
            raise ValueError(f"mtp_chain: {steps} steps of {B} rows; it takes 1..{self.chain_steps}"
                             f" steps of 1..{self.b_cap} rows")
        hidden = np.asarray(hidden, np.float32)
        if hidden.shape != (B, H):
            raise ValueError(f"mtp_chain: hidden shape {hidden.shape} != ({B}, {H})")
        graph = self._stage_chain("mtp_chain", first, context_lens, block_tables, steps, kv)
        self._put_hidden(self.ws.mtp_h, hidden)
        self._run_chain(graph, B, steps, kv, 0)
        self.stream.synchronize()
        return self.ids_host.view(np.int32, 0, steps * B).reshape(steps, B).T.copy()

    def _stage_chain(self, what: str, first, context_lens, block_tables, steps: int, kv):
        """The chain's graph (None with graphs off) and its steps' metadata staged and copied
        up: row r's step i at position context_lens[r] + i, token first[r] at i = 0. The graph
        comes first: its capture's dry run must come before this call's uploads."""
        first = np.asarray(first, np.int32)
        B = len(first)
        ctx = np.asarray(context_lens, np.int32)
        tables = np.asarray(block_tables, np.int32).reshape(B, -1)
        rows = np.arange(B, dtype=np.int32)
        lay = self.decode_layout
        steps_meta = [ForwardBatch(first, ForwardBatch.text_positions(ctx + i, np.ones(B, int)),
                                   np.arange(B + 1, dtype=np.int32), ctx + i, tables, rows)
                      for i in range(steps)]
        for b in (steps_meta[0], steps_meta[-1]):     # (positions only grow between them)
            self._drafter_call(what, b, kv, B)
        graph = self.graphs.chain(B, steps, kv, self._chain_launches) \
            if self.options.graphs else None
        off = self.eager_layout.nbytes + 2 * lay.nbytes
        for i, b in enumerate(steps_meta):
            lay.pack_decode(self.staging.view(np.int32, off + i * lay.nbytes, lay.count), b)
        _d.copy_htod_async(self.chain_metas[0].base, self.staging.ptr + off, steps * lay.nbytes,
                           self.stream)
        return graph

    def _run_chain(self, graph, B: int, steps: int, kv, ids_at: int) -> None:
        """The staged chain through its graph (or eagerly), its argmaxes [steps, B] copied down
        into the ids' pinned buffer from int32 index ids_at."""
        if graph is not None:
            graph.launch()
        else:
            self._chain_launches(self.stream, B, steps, kv)
        _d.copy_dtoh_async(self.ids_host.ptr + 4 * ids_at, self.chain_ids, 4 * steps * B,
                           self.stream)

    def _chain_launches(self, st, B: int, steps: int, kv) -> None:
        """mtp_chain's launches over its step regions (graph or eager): step i's argmaxes into
        chain_ids row i and, for the next step, over its token ids; its final-normed MTP
        hidden (ws.x) over the next step's input (ws.mtp_h). A dry run (the graph's planning
        pass) copies nothing."""
        ws, runner = self.ws, self.runner
        for i in range(steps):
            runner.mtp(st, self.chain_metas[i], B, B, B, kv, vocab=self.draft_vocab)
            if runner.dry:
                continue
            _d.copy_dtod_async(self.chain_ids + 4 * i * B, ws.tokens.ptr, 4 * B, st)
            if i + 1 < steps:
                _d.copy_dtod_async(self.chain_metas[i + 1].token_ids, ws.tokens.ptr, 4 * B, st)
                _d.copy_dtod_async(ws.mtp_h.ptr, ws.x.ptr,
                                   B * self.text.hidden_size * ws.gin_bytes, st)

    @staticmethod
    def _row_ends(batch) -> np.ndarray:
        return np.asarray(batch.query_start[1:], np.int32) - 1

    def _mtp_run(self, what: str, batch, hidden, kv, out_rows, vocab: int = None) -> None:
        """The checks, uploads and launches of an MTP step whose head covers out_rows (logits
        and argmax into the workspace, over the first `vocab` ids where given; MTP hidden of
        every token in ws.x)."""
        self._need_mtp(what)
        n, H = batch.num_tokens, self.text.hidden_size
        hidden = host_rows(hidden)
        if hidden.shape != (n, H):
            raise ValueError(f"{what}: hidden shape {hidden.shape} != ({n}, {H})")
        self._drafter_call(what, batch, kv, len(out_rows))
        self._put_hidden(self.ws.mtp_h, hidden)
        self._upload_meta(self.eager_layout, self.eager_meta, 0, batch, out_rows)
        self.runner.mtp(self.stream, self.eager_meta, n, batch.num_rows, len(out_rows), kv,
                        vocab=vocab)

    def head_logits(self, hidden: np.ndarray) -> np.ndarray:
        """float32 [N, V] = final-normed hidden [N, H] @ lm_head^T on the device (a draft's MTP
        or DFlash hidden within a grammar: its masked argmax is the draft)."""
        self._need_speculative("head_logits")
        hidden = np.asarray(hidden, np.float32)
        out = np.empty((len(hidden), self.text.vocab_size), np.float32)
        for start in range(0, len(hidden), self.lg_cap):
            rows = hidden[start:start + self.lg_cap]
            self._put_hidden(self.ws.xf, rows)
            self.runner.head_of(self.stream, len(rows))
            out[start:start + len(rows)] = self._logits_out(len(rows))
        return out

    # ---- the DFlash drafter's steps (cuda/dflash.py; program/speculative.py _BlockProposer) ---
    def _need_dflash(self, what: str) -> None:
        if self.dflash is None:
            raise RuntimeError(f"{what}: the model was loaded without a DFlash drafter "
                               "(dflash=)")
        self._current()

    def _drafter_call(self, what: str, batch: ForwardBatch, kv, n_out: int) -> None:
        """The checks of a drafter's eager call (MTP or DFlash) of n_out output rows."""
        if not 0 < batch.num_tokens <= self.n_cap or n_out > self.lg_cap \
                or batch.num_rows > self.eager_layout.b_cap:
            raise ValueError(f"{what}: {batch.num_tokens} tokens of {batch.num_rows} rows with "
                             f"{n_out} output rows; one call takes 1..{self.n_cap} tokens, "
                             f"{self.eager_layout.b_cap} rows and {self.lg_cap} logits rows")
        if self.checks_batches:
            batch.check(BatchLimits(vocab_size=self.text.vocab_size, page_size=kv.page_size,
                                    num_kv_pages=kv.num_pages, num_state_slots=None,
                                    max_rows=self.eager_layout.b_cap, max_tokens=self.n_cap,
                                    max_pages_per_row=self.p_cap))

    def dflash_feed(self, batch: ForwardBatch, features: np.ndarray, kv) -> None:
        """DFlashDrafter.feed on the device for one call: every drafter layer's context K/V of
        the batch's positions (context_lens + index in row) from the target's features
        [N, len(target_layer_ids) * H] (stored as the GEMM inputs are); the token ids are not
        read. N <= the tokens of one call (cuda/dflash.py splits longer feeds). Waits."""
        self._need_dflash("dflash_feed")
        n = batch.num_tokens
        features = host_rows(features)
        if features.shape != (n, self.hidden_width):
            raise ValueError(f"dflash_feed: features shape {features.shape} != ({n}, "
                             f"{self.hidden_width})")
        self._drafter_call("dflash_feed", batch, kv, 0)
        self._put_hidden(self.dflash_bufs.feat, features)
        self._upload_meta(self.eager_layout, self.eager_meta, 0, batch, np.zeros(0, np.int32))
        self.dflash.feed(self.stream, self.eager_meta, n, kv)
        self.stream.synchronize()          # (the staging buffers are written again next call)

    def dflash_draft(self, kv, anchors, context_lens, block_tables, *,
                     with_hidden: bool = True) -> tuple:
        """The block pass of B rows on the device (DFlashDrafter.draft's contract for rows that
        fit one call: B * block_size tokens, B * (block_size - 1) output rows): each row's
        [anchor, mask, ...] at positions F .. F + bs - 1 (F = context_lens[r]) over its
        drafter context, whose K/V the block writes at those positions (its pages must cover
        them). Returns (int32 [B, bs - 1] argmax drafts, float32 [B, bs - 1, H] final-normed
        hidden states, or None without with_hidden). Through a captured graph per B where
        graphs are on (warm_up captures them: `_block_graphable`), else eager. Waits."""
        self._need_dflash("dflash_draft")
        cfg, bs, H = self.dflash.cfg, self.dflash.cfg.block_size, self.text.hidden_size
        anchors = np.asarray(anchors, np.int32)
        ctx = np.asarray(context_lens, np.int32)
        B = len(ctx)
        tables = np.asarray(block_tables, np.int32).reshape(B, -1)
        if anchors.shape != (B,) or B == 0:
            raise ValueError(f"dflash_draft: {anchors.shape} anchors for {B} rows")
        last_page = (ctx + bs - 1) // kv.page_size
        if np.any(last_page >= tables.shape[1]) or \
                np.any(tables[np.arange(B), np.minimum(last_page, tables.shape[1] - 1)] < 0):
            raise ValueError(f"dflash_draft: the rows' pages must cover their block, positions "
                             f"context_lens .. context_lens + {bs - 1}")
        tokens = np.full((B, bs), cfg.mask_token_id, np.int32)
        tokens[:, 0] = anchors
        pos = (ctx[:, None] + np.arange(bs, dtype=np.int32)).reshape(-1)
        batch = ForwardBatch(tokens.reshape(-1), np.stack([pos, pos, pos]),
                             (np.arange(B + 1) * bs).astype(np.int32), ctx, tables,
                             np.zeros(B, np.int32))
        out_rows = (np.arange(B)[:, None] * bs + np.arange(1, bs)).reshape(-1).astype(np.int32)
        m = len(out_rows)
        self._drafter_call("dflash_draft", batch, kv, m)
        # the graph first: its capture's dry run must come before this call's upload
        graph = self._block_graph(B, kv) if self._block_graphable(B) else None
        self._upload_meta(self.eager_layout, self.eager_meta, 0, batch, out_rows)
        if graph is not None:
            graph.launch()
        else:
            self.dflash.block(self.stream, self.eager_meta, B * bs, m, kv)
        _d.copy_dtoh_async(self.ids_host.ptr, self.ws.tokens.ptr, 4 * m, self.stream)
        if with_hidden:
            self._queue_hidden(self.ws.xf, m)
        self.stream.synchronize()
        ids = self.ids_host.view(np.int32, 0, m).copy().reshape(B, bs - 1)
        return ids, self._read_hidden(m).reshape(B, bs - 1, H) if with_hidden else None

    def _block_graphable(self, B: int) -> bool:
        """Whether the DFlash block pass of B rows runs as a graph (graphs on, the decode
        graphs' rows, one call's tokens and logits rows)."""
        bs = self.dflash.cfg.block_size
        return bool(self.options.graphs) and B <= self.b_cap and B * bs <= self.n_cap \
            and B * (bs - 1) <= self.lg_cap

    def _block_graph(self, B: int, kv):
        """The block pass of B rows over the eager metadata (rows of block_size tokens, output
        rows 1 .. bs - 1 of each), captured on first use (warm_up captures every B)."""
        bs = self.dflash.cfg.block_size
        return self.graphs.block(B, kv, lambda st: self.dflash.block(
            st, self.eager_meta, B * bs, B * (bs - 1), kv))

    def verify_forward(self, batch: ForwardBatch, kv, state, out_rows, *, snap_base=None,
                       media=None, hidden_layers=None) -> tuple:
        """A speculative unit's target forward (program/speculative.py), eager: (logits
        [len(out_rows), V] float32 of those tokens, final-normed hidden [N, H] float32 of every
        token: the drafter's feed). snap_base: per row, -1 or its first snapshot slot: its
        State after each of its tokens i also goes to State slot snap_base[r] + i (the
        recurrent delta rule over the row's few tokens), so rejecting the drafts after token j
        is one slot copy (DeviceStatePool.copy) instead of a recompute. media: as forward's.
        hidden_layers: the loaded DFlash drafter's target layers, whose outputs side by side
        ([N, len * H], its features) replace the final-normed hidden. Needs a drafter loaded
        (mtp=True or dflash=: the verify's kernels and buffers)."""
        capture, feat = self._feed_source(hidden_layers)
        media, snap = self._verify_run(batch, kv, state, snap_base, media)
        out_rows = np.asarray(out_rows, np.int32)
        if self._verify_graph_launch(batch, kv, state, out_rows, snap, media, capture):
            logits = self._logits_out(len(out_rows)).copy()
        else:
            logits = self._eager(batch, kv, state, out_rows, media=media, snap=snap,
                                 capture=capture)
            if capture is None:
                self.runner.final_hidden(self.stream, batch.num_tokens)
        return logits, self._get_hidden(feat, batch.num_tokens, self._feed_width(capture))

    def _feed_source(self, hidden_layers) -> tuple:
        """(the runner's capture hook or None, the buffer the drafter's feed is read from):
        ws.mtp_h (final-normed hidden) or, with hidden_layers, the DFlash features."""
        if hidden_layers is None:
            return None, self.ws.mtp_h if self.ws is not None else None
        if self.dflash is None or tuple(hidden_layers) != tuple(self.dflash.cfg.target_layer_ids):
            raise ValueError(f"verify: hidden_layers {tuple(hidden_layers)} are not the loaded "
                             "DFlash drafter's target layers")
        return self.dflash.capture, self.dflash_bufs.feat

    def _feed_width(self, capture) -> int:
        return self.text.hidden_size if capture is None else self.hidden_width

    def verify_tokens(self, batch: ForwardBatch, kv, state, out_rows, rows, *, snap_base=None,
                      media=None, hidden_layers=None) -> tuple:
        """verify_forward with the tokens sampled on the device instead of the logits: rows[i]
        a program.sampling.SampleRow (or None: argmax) for out_rows[i] (`sample`'s contract:
        the host sampler's sample_row without logprobs, the same token within its decision
        margins). Returns (int32 [len(out_rows)], hidden [N, H] float32); one wait, after both
        copies. len(out_rows) <= the logits rows of one call (call_capacities: a verify of
        every row's k + 1 positions fits). A decode batch without snapshots (no row drafted)
        runs as plain decoding does, through its captured graph (MTP; a DFlash feed needs the
        layers' outputs, which the verify path captures). hidden_layers: as verify_forward's."""
        capture, feat = self._feed_source(hidden_layers)
        out_rows = np.asarray(out_rows, np.int32)
        m, cap = len(out_rows), min(self.lg_cap, self.sampler.layout.rows_cap)
        if len(rows) != m or not 0 < m <= cap:
            raise ValueError(f"verify_tokens: {len(rows)} sampling rows for {m} output rows, "
                             f"one call samples 1..{cap}")
        media, snap = self._verify_run(batch, kv, state, snap_base, media)
        ws, n = self.ws, batch.num_tokens
        if snap is None and media is None and self._is_decode(batch) \
                and np.array_equal(out_rows, np.arange(n)):
            # a unit without drafts (the draft policy's k = 0): plain decoding's graph, whose
            # head normed every row's hidden into ws.xf (and which captures the DFlash features)
            turn, self._turn = self._turn, self._turn ^ 1
            self._decode_launch(batch, kv, state, turn)
            hidden = ws.xf if capture is None else feat
        else:
            if not self._verify_graph_launch(batch, kv, state, out_rows, snap, media, capture):
                self._eager(batch, kv, state, out_rows, want_logits=False, media=media,
                            snap=snap, capture=capture)
                if capture is None:
                    self.runner.final_hidden(self.stream, n)
            hidden = feat
        width = self._feed_width(capture)
        self.sampler.launch(self.stream, ws.logits.ptr, ws.tokens.ptr, list(rows))
        _d.copy_dtoh_async(self.ids_host.ptr, ws.tokens.ptr, 4 * m, self.stream)
        self._queue_hidden(hidden, n, width)
        self.stream.synchronize()
        return self.ids_host.view(np.int32, 0, m).copy(), self._read_hidden(n, width)

    def verify_and_draft(self, batch: ForwardBatch, kv, state, rows, *, snap_base,
                         steps: int) -> tuple:
        """verify_tokens of a unit whose every row drafted the same k (MTP, no media, every
        position's token picked), then on the device, with no host round trip: each row's
        produced count j + 1 (its first pick t_j that differs from the next draft, or j = k),
        the drafter's feed over the row's k + 1 positions F .. F+k with the picks as the tokens
        after them (its KV there: past F + j provisional, rewritten by the next unit's feed),
        the next first draft d_1 and MTP hidden g_1 at F + j, and `steps` chained drafts after
        d_1 from F + j + 1 (mtp_chain's launches: its graph where graphs are on). One wait.
        The rows' pages must cover F + k + steps (the chain's last KV write). Returns (int32
        [n] picks, int32 [B, 1 + steps] the next drafts, float32 [B, H] g_1). speculative.py
        keeps the drafts when the Engine takes every produced token (else the row's feed
        covers what it took and its next draft is made again)."""
        self._need_mtp("verify_and_draft")
        n, B, H = batch.num_tokens, batch.num_rows, self.text.hidden_size
        lens = np.diff(np.asarray(batch.query_start, np.int64))
        if not self.verify_draft_fits(n, B, steps) or np.any(lens != lens[0]) or lens[0] < 2:
            raise ValueError(f"verify_and_draft: {n} tokens over {B} rows, {steps} chain steps; "
                             f"it takes rows of one length >= 2 and verify_draft_fits's shapes")
        if len(rows) != n:
            raise ValueError(f"verify_and_draft: {len(rows)} sampling rows for {n} positions")
        # the chain steps' metadata as for a row that produced nothing (spec_feed adds the
        # produced count on the device): step i at F + i, the rows' pages as the verify's; its
        # token ids are d_1, copied in on the device
        graph = self._stage_chain("verify_and_draft", np.zeros(B, np.int32), batch.context_lens,
                                  batch.block_tables, steps, kv) if steps else None
        lay = self.decode_layout
        _, snap = self._verify_run(batch, kv, state, snap_base, None)
        if snap is None:
            raise ValueError("verify_and_draft: every row drafts (snap_base >= 0 each)")
        ws, meta, out_rows = self.ws, self.eager_meta, np.arange(n, dtype=np.int32)
        if not self._verify_graph_launch(batch, kv, state, out_rows, snap, None):
            self._eager(batch, kv, state, out_rows, want_logits=False, snap=snap)
            self.runner.final_hidden(self.stream, n)
        self.sampler.launch(self.stream, ws.logits.ptr, ws.tokens.ptr, list(rows))
        _d.copy_dtoh_async(self.ids_host.ptr, ws.tokens.ptr, 4 * n, self.stream)
        first_chain = self.chain_metas[0] if steps else meta
        self.runner.launch(self.stream, self.kernels.spec_feed, (-(-B // 32),), (32,),
                           (meta.out_rows, meta.token_ids, first_chain.context_lens,
                            first_chain.positions, ws.tokens, meta.query_start, B, steps,
                            lay.count, lay.n_cap))
        # the feed: the verify's final-normed hidden (ws.mtp_h) and its picks, every position;
        # the head over each row's last produced position: g_1 in ws.xf, d_1 in ws.tokens
        self.runner.mtp(self.stream, meta, n, B, B, kv, vocab=self.draft_vocab)
        _d.copy_dtoh_async(self.ids_host.ptr + 4 * n, ws.tokens.ptr, 4 * B, self.stream)
        self._queue_hidden(ws.xf, B)
        if steps:
            _d.copy_dtod_async(self.chain_metas[0].token_ids, ws.tokens.ptr, 4 * B, self.stream)
            _d.copy_dtod_async(ws.mtp_h.ptr, ws.xf.ptr, B * H * ws.gin_bytes, self.stream)
            self._run_chain(graph, B, steps, kv, n + B)
        self.stream.synchronize()
        ids = self.ids_host.view(np.int32, 0, n + B + steps * B)
        picks = ids[:n].copy()
        drafts = np.concatenate([ids[n:n + B, None],
                                 ids[n + B:].reshape(steps, B).T], axis=1).astype(np.int32)
        return picks, drafts, self._read_hidden(B)

    def verify_draft_fits(self, n: int, B: int, steps: int) -> bool:
        """Whether verify_and_draft takes a verify of n tokens over B rows and `steps` chained
        drafts behind it (the verify's sampler rows, the chain's step regions and rows, the
        ids' pinned buffer)."""
        return self.mtp and 0 < B <= min(self.b_cap, self.eager_layout.b_cap) \
            and 0 < n <= min(self.lg_cap, self.sampler.layout.rows_cap, self.n_cap) \
            and 0 <= steps <= self.chain_steps and n + B * (1 + steps) <= 2 * self.lg_cap

    def _verify_graph_launch(self, batch, kv, state, out_rows, snap, media,
                             capture=None) -> bool:
        """Launch the verify through its captured graph (cuda/decode_graphs.py; captured on
        first use) where it has one: graphs on, every row drafting the same number of tokens
        (at most num_draft_tokens x max_concurrency graphs), fewer than the tensor-core
        attention's minimum each, snapshots, no media, every token's logits wanted and within
        one call's logits rows. `capture`: the DFlash features' hook (its own graphs). False:
        nothing launched (the caller runs it eager)."""
        n, b = batch.num_tokens, batch.num_rows
        lens = np.diff(np.asarray(batch.query_start, np.int64))
        if snap is None or media is not None or np.any(lens != lens[0]) \
                or not self._verify_graphable(n, b) or not np.array_equal(out_rows, np.arange(n)):
            return False
        graph = self.graphs.verify(n, b, kv, state, self.eager_meta, snap, capture)
        self._upload_meta(self.eager_layout, self.eager_meta, 0, batch, out_rows)
        graph.launch()
        return True

    def _verify_graphable(self, n: int, b: int) -> bool:
        """Whether a verify of b rows of n / b tokens each may run as a graph: graphs on, every
        token's logits within one call's logits rows, its MoE on the expert GEMVs, and its rows
        shorter than the tensor-core attention's minimum (the graph's kernels are the
        CUDA-core ones)."""
        return bool(self.options.graphs) and n <= self.lg_cap \
            and n <= self.runner.res.moe_gemv_tokens and n // b < self.runner.attn_tc_min_tokens

    def verify_shapes(self, b_max: int) -> list:
        """(tokens, rows) of the verify graphs a speculative unit of up to b_max rows, each
        drafting the same 1 .. num_draft_tokens tokens, launches: warm_up captures them all, so
        no unit pays a capture (issue 25; the draft policy's first unit at each k would)."""
        if not self.speculative:
            return []
        k_max = draft_tokens(self.options)
        return [(b * (k + 1), b) for b in range(1, b_max + 1) for k in range(1, k_max + 1)
                if self._verify_graphable(b * (k + 1), b)]

    def _verify_run(self, batch, kv, state, snap_base, media) -> tuple:
        """The checks and uploads of a verify call: (the checked media or None, the device
        pointer of the rows' snapshot bases or None)."""
        self._need_speculative("verify")
        if self._in_flight:
            raise RuntimeError("verify: a launched TokenStep is not collected yet")
        if self.checks_batches:
            batch.check(self.batch_limits(kv, state))
        b, n = batch.num_rows, batch.num_tokens
        snap_ptr = None
        if snap_base is not None:
            snap = np.asarray(snap_base, np.int32)
            # a row's snapshots: one slot per token, from its snap_base
            ends = snap + np.diff(np.asarray(batch.query_start, np.int64)) if snap.shape == (b,) \
                else None
            if ends is None or int(ends[snap >= 0].max(initial=0)) > state.num_slots:
                raise ValueError(f"verify: snap_base {snap.tolist()} for {b} rows of {n} "
                                 f"tokens over {state.num_slots} State slots")
            # (staged in the logits' pinned buffer: the stream copies it up before the logits
            # come down into it)
            self.out_host.view(np.int32, 0, b)[:] = snap
            _d.copy_htod_async(self.ws.snap.ptr, self.out_host.ptr, 4 * b, self.stream)
            snap_ptr = self.ws.snap.ptr
        return self._media(batch, media), snap_ptr

    # ---- graphs -------------------------------------------------------------------------------
    def warm_up(self, kv, state) -> None:
        """Capture and replay the decode graph of every B = 1..b_cap, capture the speculative
        verify graphs (verify_shapes), the MTP drafter's chains (mtp_chain) and the DFlash
        drafter's block passes (dflash_draft), run the device sampler, one eager call of the
        widest prefill and one of each row count that loads the GEMM algorithms longer calls
        share (shared_algo_rows: prefill chunks, the drafters' catch-up feeds): nothing is built
        or loaded lazily while serving. Rows use pages 0..B-1 and slots 0..B-1 at context 0
        (the pools hold nothing yet)."""
        from ...contracts import SampleRow, SamplingSpec
        self._current()
        b_max = min(self.b_cap, kv.num_pages, state.num_slots)
        t0 = time.perf_counter()
        self.capture_graphs(kv, state, range(1, b_max + 1))
        t1 = time.perf_counter()
        capture = self.dflash.capture if self.dflash is not None else None
        for n, B in self.verify_shapes(b_max):
            self.graphs.verify(n, B, kv, state, self.eager_meta, self.ws.snap.ptr, capture)
        for B in range(1, b_max + 1) if self.options.graphs else ():
            for steps in range(1, self.chain_steps + 1):
                self.graphs.chain(B, steps, kv, self._chain_launches)
            if self.dflash is not None and self._block_graphable(B):
                self._block_graph(B, kv)
        self.warm_up_phases = {"graphs": t1 - t0, "speculative_graphs": time.perf_counter() - t1}
        for B in range(1, b_max + 1):
            rows = np.arange(B, dtype=np.int32)
            batch = ForwardBatch(np.zeros(B, np.int32), np.zeros((3, B), np.int32),
                                 np.arange(B + 1, dtype=np.int32), np.zeros(B, np.int32),
                                 rows.reshape(B, 1).copy(), rows)
            self.decode_greedy(batch, kv, state)
        empty = np.zeros(0, np.int32)
        self.sample(ForwardBatch.single([0], 0, [0]), kv, state,
                    [SampleRow(SamplingSpec(seed=0, temperature=1.0, top_p=0.9), 0, empty, empty)])
        # a call of n tokens over as many rows as it takes (a row holds p_cap - 1 pages here):
        # a catch-up feed of B rows is as long as a call, longer than one row may be
        per_row = (self.p_cap - 1) * kv.page_size
        n = min(self.n_cap, b_max * per_row, kv.num_pages * kv.page_size)
        self.decode_greedy(self._filler(n, per_row, kv), kv, state)
        # a GEMM kernel's first launch costs milliseconds, and a product of more than 8 rows
        # runs the algorithm of its power of two's (cublaslt.SHARED_ALGO_FROM): one call of each
        # such row count loads them all, for the prefill chunks (up to prefill_chunk tokens) and
        # the drafter's catch-up feeds (up to a call's tokens: 9B on an H100, an MTP feed of 337
        # positions took 19.5 ms the first time, 3.3 ms warm)
        for rows in shared_algo_rows(n):
            batch = self._filler(rows, per_row, kv)
            if rows <= self.options.prefill_chunk and rows != n:
                self.decode_greedy(batch, kv, state)
            if self.mtp:
                self.mtp_argmax(batch, np.zeros((rows, self.text.hidden_size), np.float32),
                                kv, last_only=True)
            if self.dflash is not None:
                self.dflash_feed(batch, np.zeros((rows, self.hidden_width), np.float32), kv)

    @staticmethod
    def _filler(n: int, per_row: int, kv) -> ForwardBatch:
        """n tokens at context 0 in rows of at most per_row, each on its own pages and state
        slot from 0 (warm_up's: the pools hold nothing yet)."""
        lengths = [min(per_row, n - q) for q in range(0, n, per_row)]
        pages = [-(-ln // kv.page_size) for ln in lengths]
        first = np.cumsum([0] + pages)
        tables = np.zeros((len(lengths), max(pages)), np.int32)
        for r, p in enumerate(pages):
            tables[r, :p] = np.arange(first[r], first[r] + p)
        B = len(lengths)
        return ForwardBatch(np.zeros(n, np.int32), ForwardBatch.text_positions([0] * B, lengths),
                            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                            np.zeros(B, np.int32), tables, np.arange(B, dtype=np.int32))

    def capture_graphs(self, kv, state, sizes=None) -> int:
        self._current()
        for B in sizes or range(1, self.b_cap + 1):
            self.graphs.get(B, kv, state)
        return len(self.graphs)

    def _decode_launch(self, batch, kv, state, turn: int = 0, chained: bool = False) -> None:
        """The decode graph of B rows over metadata staged in decode staging `turn`; chained:
        the token ids are the previous step's, still in the workspace's token buffer (a
        device-to-device copy over the staged placeholders, in stream order after that step)."""
        t0 = time.perf_counter()
        B = batch.num_rows
        g = self.graphs.get(B, kv, state)
        t1 = time.perf_counter()
        lay = self.decode_layout
        off = self.eager_layout.nbytes + turn * lay.nbytes
        nbytes = lay.pack_decode(self.staging.view(np.int32, off, lay.count), batch)
        _d.copy_htod_async(self.decode_meta.base, self.staging.ptr + off, nbytes, self.stream)
        if chained:
            _d.copy_dtod_async(self.decode_meta.token_ids, self.ws.tokens.ptr, B * 4, self.stream)
        t2 = time.perf_counter()
        g.launch()
        t3 = time.perf_counter()
        t_in = self._t_entry or t0
        self.last_host_us = (t3 - t_in) * 1e6
        # (checks, graph lookup, metadata pack + async copy, cuGraphLaunch) in microseconds
        self.last_host_breakdown_us = ((t0 - t_in) * 1e6, (t1 - t0) * 1e6, (t2 - t1) * 1e6,
                                       (t3 - t2) * 1e6)

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the model holds, users first: graphs, cuBLASLt, modules, the sampler,
        the step event, pinned host memory, the arena, the context. Every step runs even when an
        earlier one fails (a kernel fault leaves the context failing every call; releasing it is
        what lets the process use the GPU again); the first error is raised at the end.
        Idempotent."""
        dev = self.device
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
        self._in_flight = []
        if self.graphs is not None:
            for g in self.graphs.take_all():
                release(g.destroy)
        if isinstance(self.vision, device_vision.DeviceVisionTower):
            release(self.vision.close)
            self.vision = None
        for part in (self.lt, self.kernels, self.sampler):
            if part is not None:
                release(part.close)
        for event in self.step_events:
            release(event.destroy)
        self.lt = self.kernels = self.sampler = None
        self.step_events = ()
        for buf in (self.staging, self.out_host, self.ids_host, self.route_host, self.media_rows,
                    self.hidden_host, self.step_hidden_host):
            if buf is not None:
                release(buf.free)
        self.staging = self.out_host = self.ids_host = self.route_host = self.media_rows = None
        self.hidden_host = self.step_hidden_host = None
        release(self.pool_staging.free)
        if self.copy_stream is not None:
            release(self.copy_stream.synchronize)
            release(self.copy_stream.destroy)
            self.copy_stream = None
        if self.pool_pinned is not None:
            release(self.pool_pinned.free)
        if self.host_reserve is not None:
            release(self.host_reserve.free)
            self.host_reserve = None
        if self.arena is not None:
            release(self.arena.close)
            self.arena = None
        release(dev.close)
        self.device = None
        if errors:
            raise errors[0]
