"""Engine start-up options: fixed for the Engine's life (docs/python-api.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, Optional

import numpy as np

from .errors import RequestError

Backend = Literal["numpy", "cuda"]
Purpose = Literal["generation", "scoring"]


@dataclass(frozen=True, slots=True)
class EngineOptions:
    backend: Backend = "numpy"
    purpose: Purpose = "generation"
    max_concurrency: int = 4            # resident requests, 1..8
    max_context: int = 4096             # prompt + generated tokens per request
    max_queue: int = 64                 # bounded FIFO wait queue; beyond it submit() -> 429
    prefill_chunk: int = 512            # tokens per prefill / Replay / scoring window
    page_size: int = 16                 # tokens per KV page
    num_kv_pages: Optional[int] = None  # None -> enough for max_concurrency * max_context
    host_snapshot_bytes: int = 256 << 20   # host budget for Snapshot pauses (0 -> Replay only)
    # context cache (docs/architecture.md "Context cache"): checkpoints of prompts, finished turns
    # and long-prompt intervals kept on the device (KV pages shared by reference, State images in
    # extra State slots) within prefix_cache_device_fraction of the KV pages and State slots, cold
    # ones demoted to a host tier of prefix_cache_host_bytes (None: 256 MiB). False: no reuse;
    # None: on, except with batch_invariant (a hit moves prefill chunk boundaries with the load)
    prefix_cache: Optional[bool] = None
    prefix_cache_device_fraction: float = 0.5
    prefix_cache_host_bytes: Optional[int] = None
    prefix_cache_bytes: Optional[int] = None     # the older name of prefix_cache_host_bytes
    checkpoint_interval: int = 2048     # tokens between checkpoints inside a long prompt
    queue_timeout_s: Optional[float] = None
    # the chat template's enable_thinking for a request that does not say: None -> the model's
    # default (the artifact's metadata.defaults.enable_thinking; True for an artifact without it)
    default_enable_thinking: Optional[bool] = None
    device_id: int = 0
    graphs: bool = True                 # cuda: replay CUDA graphs for decode
    # compute dtype (like vLLM's --dtype). cuda: None / "bfloat16" -> bf16 weights, activations and
    # KV with fp32 accumulation; "float32" -> fp32 throughout (exact agreement with the numpy
    # backend, about 2x the memory). numpy: always float32 (None or "float32")
    dtype: Optional[str] = None
    # KV cache storage: "bfloat16" = the backend's unquantized KV (numpy: float32 pages; cuda: its
    # compute dtype); "fp8" (e4m3) / "int8": one-byte codes with a scale per token and kv head
    # (ops/kv_quant.py; both backends store the same bytes), about half the bytes of bf16 pages
    kv_dtype: str = "bfloat16"
    # fp8 weights (FP8 releases, --quantize fp8), cuda bf16: prefill GEMMs on the fp8 tensor cores
    # with the activations quantized to e4m3 per token and 128 columns (the releases'
    # activation_scheme "dynamic", as vLLM and SGLang run them; the error it adds:
    # docs/performance.md). None: on where cuBLASLt has block-scaled fp8 (Hopper), except for
    # purpose="scoring" (every logit there comes from prefill); False: the weights dequantized
    # to bf16 (exact weights, slower prefill). Decode is the same either way
    fp8_activations: Optional[bool] = None
    # cuda: capture every decode graph (B = 1..max_concurrency) and run a warm-up step before the
    # Engine reports ready (False: capture lazily, on the first decode of each batch size)
    warmup: bool = True
    # re-check every batch inside the backend too (the Program validates each batch once, where
    # it builds it; backends trust those batches unless this is on)
    debug_checks: bool = False
    # a request's tokens independent of load: every row's logits bitwise the same whatever B and
    # the other rows are (cuda: one GEMM shape for all decode batches, fixed attention splits),
    # and Replay re-runs history the way it first ran (docs/architecture.md "Load invariance";
    # its cost: docs/performance.md)
    batch_invariant: bool = False
    # speculative decoding: None; "mtp": the checkpoint's MTP head drafts up to num_draft_tokens
    # (1..4, default 3) tokens per decode step, one at a time; "dflash": the artifact's DFlash
    # drafter drafts them in one pass (1 .. its block_size - 1, the default); one target forward
    # verifies them and the output is the same as without it (docs/architecture.md "Speculative
    # decoding")
    speculative: Optional[Literal["mtp", "dflash"]] = None
    num_draft_tokens: Optional[int] = None     # None: the drafter's default (Engine resolves it)
    # "adaptive": each step drafts the k in 0..num_draft_tokens with the most tokens per second
    # by the measured acceptance and step costs (0: plain decoding, where drafts do not pay);
    # "fixed": always num_draft_tokens
    draft_policy: Literal["adaptive", "fixed"] = "adaptive"
    # MTP drafts are the argmax over the first draft_vocab ids only (None: DEFAULT_DRAFT_VOCAB,
    # 131072 of the Qwen3.5 vocabulary's 248,320; any value >= the vocabulary: all of it). A
    # draft step's lm_head product reads those rows alone (the 9B's lm_head is 2 GB, 0.11 of a
    # decode step), and the Qwen vocabulary's ids below 131072 are 99.8-99.9% of English and
    # Python text and 99.1% of Chinese (docs/performance.md). A token past them is never
    # drafted: that draft is rejected, and the output is the same either way
    draft_vocab: Optional[int] = None
    # "int8": an MTP draft's argmax reads an int8 copy of those lm_head rows (one scale per row
    # and 128 columns), made at load: half the bytes of a draft step's largest product, for the
    # memory of the copy (the 9B: 0.54 GB); "bf16": the lm_head's own rows. Drafts of up to 8
    # rows at once take the copy (more read the bf16 rows: the GPU's int8 product reads its
    # codes once per 8 rows). The output is the same either way: drafts are only proposals
    draft_head: Literal["int8", "bf16"] = "int8"
    # cuda, a checkpoint with a vision tower: the tower runs on the GPU with buffers for one
    # image (or video frame group) of up to this many 16x16 patches (16384: 2048 x 2048 pixels;
    # its device memory at the 27B geometry: 1.8 GiB, taken from the KV pages); a larger image
    # is encoded by the numpy tower on the host (seconds). 0: the host tower only
    vision_max_patches: int = 16384

    @property
    def uses_prefix_cache(self) -> bool:
        """The context cache is on: as asked, else on unless batch_invariant."""
        if self.prefix_cache is not None:
            return bool(self.prefix_cache)
        return not self.batch_invariant

    @property
    def prefix_cache_budget_bytes(self) -> int:
        """The context cache's host-tier budget in bytes (0 with the cache off)."""
        if not self.uses_prefix_cache:
            return 0
        host = self.prefix_cache_host_bytes if self.prefix_cache_host_bytes is not None \
            else self.prefix_cache_bytes
        return 256 << 20 if host is None else int(host)

    @property
    def prefix_cache_device_share(self) -> float:
        """The share of the KV pages (and of extra State slots) the cache may hold on the device
        (0 with the cache off)."""
        return float(self.prefix_cache_device_fraction) if self.uses_prefix_cache else 0.0

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Engine: unknown option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**kwargs)
        opts.validate()
        return opts

    def validate(self) -> None:
        def bad(name, rule):
            raise RequestError(f"Engine option {name}={getattr(self, name)!r}: {rule}")
        if self.backend not in ("numpy", "cuda"):
            bad("backend", "must be 'numpy' or 'cuda'")
        if self.purpose not in ("generation", "scoring"):
            bad("purpose", "must be 'generation' or 'scoring'")
        if not _is_int(self.max_concurrency) or not 1 <= self.max_concurrency <= 8:
            bad("max_concurrency", "must be in 1..8")
        for name, least in _INT_MINIMA:
            if not _is_int(getattr(self, name)) or getattr(self, name) < least:
                bad(name, f"must be an integer >= {least}")
        if self.num_kv_pages is not None and (not _is_int(self.num_kv_pages)
                                              or self.num_kv_pages < 1):
            bad("num_kv_pages", "must be an integer >= 1 (or None: sized for max_context)")
        for name in ("prefix_cache_host_bytes", "prefix_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                bad(name, "must be an integer >= 0 (or None: 256 MiB)")
        if None not in (self.prefix_cache_host_bytes, self.prefix_cache_bytes) \
                and self.prefix_cache_host_bytes != self.prefix_cache_bytes:
            bad("prefix_cache_bytes", "is the older name of prefix_cache_host_bytes; give one")
        if self.prefix_cache is not None and not isinstance(self.prefix_cache, (bool, np.bool_)):
            bad("prefix_cache", "must be true or false (or None: on unless batch_invariant)")
        if self.prefix_cache and self.batch_invariant:
            # a hit prefills the rest of a prompt in other chunks than a cold run, and whether a
            # request hits depends on the others: its logits would depend on load after all
            bad("prefix_cache", "cannot be on with batch_invariant=True (a cache hit changes "
                                "where prefill chunks split, so tokens would depend on load); "
                                "leave it unset or False")
        fraction = self.prefix_cache_device_fraction
        if not (_is_real(fraction) and 0.0 <= fraction <= 1.0):
            bad("prefix_cache_device_fraction", "must be a number in [0, 1]")
        if self.default_enable_thinking is not None \
                and not isinstance(self.default_enable_thinking, (bool, np.bool_)):
            bad("default_enable_thinking", "must be true or false (or None: the model's default)")
        if self.dtype not in (None, "bfloat16", "float32"):
            bad("dtype", "must be None, 'bfloat16' or 'float32'")
        if self.backend == "numpy" and self.dtype == "bfloat16":
            bad("dtype", "the numpy backend computes in float32 only (from the stored weights); "
                         "use None or 'float32', or backend='cuda' for bfloat16")
        if self.kv_dtype not in ("bfloat16", "fp8", "int8"):
            bad("kv_dtype", "must be 'bfloat16', 'fp8' or 'int8'")
        if self.fp8_activations is not None \
                and not isinstance(self.fp8_activations, (bool, np.bool_)):
            bad("fp8_activations", "must be true or false (or None: on where the GPU has it)")
        if self.speculative not in (None, "mtp", "dflash"):
            bad("speculative", "must be None, 'mtp' (the checkpoint's multi-token-prediction "
                               "head) or 'dflash' (the artifact's DFlash drafter)")
        most = MAX_DRAFT_TOKENS[self.speculative or "mtp"]
        if self.num_draft_tokens is not None and (not _is_int(self.num_draft_tokens)
                                                  or not 1 <= self.num_draft_tokens <= most):
            bad("num_draft_tokens", f"must be an integer in 1..{most}")
        if self.draft_policy not in ("adaptive", "fixed"):
            bad("draft_policy", "must be 'adaptive' or 'fixed'")
        if self.draft_vocab is not None and (not _is_int(self.draft_vocab)
                                             or self.draft_vocab < 1):
            bad("draft_vocab", "must be an integer >= 1 (or None: the default, "
                               f"{DEFAULT_DRAFT_VOCAB})")
        if self.draft_head not in ("int8", "bf16"):
            bad("draft_head", "must be 'int8' or 'bf16'")
        timeout = self.queue_timeout_s
        if timeout is not None and not (_is_real(timeout) and math.isfinite(timeout)
                                        and timeout > 0):
            bad("queue_timeout_s", "must be a finite number of seconds > 0 (or None: no limit)")


# the most drafts per unit: MTP drafts one token per drafter step (the verify grows with k);
# DFlash drafts a block in one pass (the published drafters' blocks are 16 tokens: 15 drafts)
MAX_DRAFT_TOKENS = {"mtp": 4, "dflash": 15}
# the default k where num_draft_tokens is None (DFlash: its block_size - 1)
DEFAULT_MTP_DRAFT_TOKENS = 3


# MTP drafts come from the first this many ids where EngineOptions.draft_vocab is None
DEFAULT_DRAFT_VOCAB = 131072


def draft_vocab_size(options, vocab_size: int) -> int:
    """How many of the vocabulary's first ids an MTP draft may be (EngineOptions.draft_vocab,
    bounded by the vocabulary)."""
    n = getattr(options, "draft_vocab", None)
    return min(int(vocab_size), DEFAULT_DRAFT_VOCAB if n is None else int(n))


def draft_tokens(options) -> int:
    """The most drafts a speculative unit verifies: num_draft_tokens, or where None the MTP
    default (the Engine resolves a DFlash drafter's default, its block_size - 1, at start)."""
    n = getattr(options, "num_draft_tokens", None)
    return DEFAULT_MTP_DRAFT_TOKENS if n is None else int(n)


# integer options and their least value (max_concurrency has its own range)
_INT_MINIMA = (("max_context", 2), ("max_queue", 0), ("prefill_chunk", 1), ("page_size", 1),
               ("host_snapshot_bytes", 0), ("device_id", 0),
               ("checkpoint_interval", 1), ("vision_max_patches", 0))


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
