"""The public Engine facade. It wires owners together and delegates; it holds no logic of its own.

    Engine ─┬─ Artifact (read-only file, mapped)
            ├─ Frontend (tokenizer, chat template, OutputSession factory)     models/qwen3_5/frontend/
            ├─ Model (config, bound read-only parameters)                      models/qwen3_5/
            └─ purpose "generation": EngineCore (worker thread, Scheduler, Program)   runtime/
               purpose "scoring":    CausalScoreCore (serial, temporary State/KV)     runtime/scoring.py
               (generation, numpy: a SideScorer beside the worker for score / embed)
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Optional, Sequence

import numpy as np

from .api import GenerationResult, Prompt, SamplingParams, ScoreResult, choice_params
from .artifact import Artifact
from .errors import EngineClosedError, RequestError

# OpenAI's limit on the inputs of one embeddings request
MAX_EMBEDDING_INPUTS = 2048
from .options import EngineOptions


class Engine:
    def __init__(self, path, backend: str = "numpy", purpose: str = "generation", *,
                 chat_template: Optional[str] = None, **options):
        """`chat_template`: a Jinja chat template source replacing the artifact's."""
        t_start = time.perf_counter()
        self.options = EngineOptions.from_kwargs(backend=backend, purpose=purpose, **options)
        self._is_closed = False
        self.model = None
        self.artifact = Artifact(path)
        try:
            if self.options.default_enable_thinking is None:    # the model's own default
                thinking = bool(self.artifact.defaults.get("enable_thinking", True))
                self.options = dataclasses.replace(self.options, default_enable_thinking=thinking)
            from .models import model_config
            from .models.qwen3_5 import load_model
            from .models.qwen3_5.frontend import Frontend

            self.config = model_config(self.artifact)
            self._resolve_draft_tokens()
            t_frontend = time.perf_counter()
            # Scoring token ids needs no tokenizer; generation always does.
            if self.options.purpose == "scoring" and self.artifact.resource("tokenizer.json") is None:
                self.frontend = None
            else:
                self.frontend = Frontend.from_artifact(self.artifact, chat_template=chat_template)
            t_model = time.perf_counter()
            self.model = load_model(self.artifact, self.options)
            t_pools = t_warm = time.perf_counter()      # scoring: no pools, no warm-up
            warmed = False
            self._core = None
            self._scorer = None
            if self.options.purpose == "scoring":
                from .runtime.scoring import CausalScoreCore
                self._scorer = CausalScoreCore(self.model, self.options)
            else:
                # score / embed beside generation (numpy only; else NotSupportedError at the call)
                from .runtime.scoring import SideScorer
                self._scorer = SideScorer(self.model, self.options)
                from .models.qwen3_5.program import Program
                from .runtime.engine_core import EngineCore
                t_pools = time.perf_counter()
                program = Program(self.model, self.options, drafter=self._drafter())
                t_warm = time.perf_counter()
                if self.options.warmup:     # graphs captured, first step run: then "ready"
                    program.warm_up()
                    warmed = True
                self._core = EngineCore(program, self.frontend, self.options)
            t_end = time.perf_counter()
            # what `run`, `chat` and `serve` print as the start-up line (startup_line)
            # (flat: model's phases within "model", warm-up's within "warm_up"; pools = the
            # Program's KV and state pools, made and zeroed)
            self.startup_seconds = {"total": t_end - t_start, "tokenizer": t_model - t_frontend,
                                    "model": t_pools - t_model, **self.model.load_phases,
                                    "pools": t_warm - t_pools, "warm_up": t_end - t_warm,
                                    **(self.model.warm_up_phases if warmed else {})}
            # stats() and the start-up line: the artifact's payload over the weights' phase
            weights_s = self.startup_seconds.get("weights", 0.0)
            self._start_stats = {"startup_seconds": self.startup_seconds["total"]}
            if weights_s > 0:
                self._start_stats["weights_load_gb_per_s"] = \
                    self.artifact.payload_bytes / weights_s / 1e9
        except BaseException:
            if self.model is not None:      # a Program that cannot start must not leak the model
                self.model.close()
            self.artifact.close()
            raise

    def _resolve_draft_tokens(self) -> None:
        """speculative='dflash': the artifact must carry a DFlash drafter; num_draft_tokens
        defaults to its block_size - 1 and may not exceed it."""
        if self.options.speculative != "dflash":
            return
        from .errors import ArtifactError
        dflash = self.config.dflash
        if dflash is None:
            raise ArtifactError(f"speculative='dflash': {self.artifact.path} carries no DFlash "
                                "drafter (convert with --dflash DRAFTER_DIR)")
        most = dflash.block_size - 1
        n = self.options.num_draft_tokens
        if n is not None and n > most:
            raise RequestError(f"Engine option num_draft_tokens={n}: the DFlash drafter's block "
                               f"of {dflash.block_size} drafts at most {most}")
        self.options = dataclasses.replace(self.options, num_draft_tokens=most if n is None else n)

    def _drafter(self):
        """The drafter of options.speculative (its weights are bound only then), else None."""
        if self.options.speculative is None:
            return None
        from .errors import ArtifactError
        if self.options.speculative == "dflash":
            if self.options.backend == "cuda":     # (the model loaded it: load_cuda_model)
                from .models.qwen3_5.cuda.dflash import CudaDFlashDrafter
                return CudaDFlashDrafter(self.model)
            from .models.qwen3_5.dflash import DFlashDrafter
            return DFlashDrafter.from_artifact(self.artifact, self.model)
        if self.options.backend == "cuda":     # (the model loaded the head: load_cuda_model)
            from .models.qwen3_5.cuda.drafter import CudaDrafter
            return CudaDrafter(self.model)
        from .models.qwen3_5.mtp import MtpDrafter
        from .options import draft_vocab_size
        try:
            return MtpDrafter.from_artifact(
                self.artifact, self.model,
                draft_vocab_size(self.options, self.model.text.vocab_size),
                int8_head=self.options.draft_head == "int8")
        except ArtifactError as exc:
            raise ArtifactError(f"speculative='mtp' needs the checkpoint's MTP head: {exc}") \
                from None

    # ---- identity -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.artifact.name

    # ---- frontend ---------------------------------------------------------------------------------
    def tokenize(self, text: str) -> np.ndarray:
        return self._frontend().tokenize(text)

    def detokenize(self, ids) -> str:
        return self._frontend().detokenize(ids)

    def apply_chat_template(self, messages: list, tools: Optional[list] = None,
                            add_generation_prompt: bool = True,
                            enable_thinking: Optional[bool] = None) -> str:
        """The prompt text; `enable_thinking` None: the Engine's default (as `submit`)."""
        return self._frontend().apply_chat_template(messages, tools=tools,
                                                 add_generation_prompt=add_generation_prompt,
                                                 enable_thinking=self._thinking(enable_thinking))

    def count_prompt_tokens(self, messages: list, *, tools: Optional[list] = None,
                            enable_thinking: Optional[bool] = None) -> int:
        """Tokens `messages` take as a request sends them (images expanded to their tokens)."""
        return len(self._frontend().prepare(messages, tools=tools,
                                            enable_thinking=self._thinking(enable_thinking))
                   .token_ids)

    def _thinking(self, enable_thinking: Optional[bool]) -> bool:
        """A request's enable_thinking, or the Engine's default (options, else the model's)."""
        if enable_thinking is not None:
            return bool(enable_thinking)
        return bool(self.options.default_enable_thinking)

    @property
    def vocab_size(self) -> Optional[int]:
        """The tokenizer's vocabulary size; None without a tokenizer (scoring from ids)."""
        return None if self.frontend is None else self.frontend.vocab_size

    @property
    def sampling_defaults(self) -> dict:
        """The checkpoint's recommended sampling (its generation_config.json), as SamplingParams
        fields; {} when it recommends nothing."""
        return {} if self.frontend is None else dict(self.frontend.sampling_defaults)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams from the checkpoint's defaults, then `overrides` (vLLM's
        `get_default_sampling_params`); `submit` uses it when given no params."""
        return SamplingParams(**{**self.sampling_defaults, **overrides}).validate()

    def _frontend(self):
        if self.frontend is None:
            raise RequestError(f"{self.name}: this artifact has no tokenizer; pass token ids")
        return self.frontend

    # ---- scoring and embeddings -------------------------------------------------------------------
    def score(self, token_ids, return_logits: bool = False, top_logprobs: int = 0) -> ScoreResult:
        """log p(token[i+1] | token[:i+1]) of a whole sequence (ScoreResult). `top_logprobs` k:
        also the k likeliest tokens at each position. A generation Engine scores beside its
        worker on the numpy backend; elsewhere NotSupportedError (use purpose='scoring')."""
        if self._is_closed:
            raise EngineClosedError()
        return self._scorer.score(token_ids, return_logits=return_logits,
                                  top_logprobs=top_logprobs)

    def embedding_input_ids(self, item) -> np.ndarray:
        """The token ids `embed` pools for one input: text is tokenized and `<|endoftext|>`
        appended (Qwen3-Embedding's input convention, where the last token is that end of text);
        token ids are taken as given (the caller owns them). RequestError for an empty input, a
        bad id or one longer than max_context."""
        if isinstance(item, str):
            if not item:
                raise RequestError("embed: an input text must not be empty")
            ids = [int(t) for t in self._frontend().tokenize(item)]
            eot = self._frontend().token_id("<|endoftext|>")
            if eot is not None:
                ids.append(int(eot))
        else:
            arr = np.asarray(item) if not isinstance(item, np.ndarray) else item
            if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
                raise RequestError("embed: an input must be a non-empty string or a non-empty "
                                   "list of token ids")
            ids = [int(t) for t in arr]
            vocab = int(self.config.text.vocab_size)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"embed: token id {bad[0]} is outside the vocabulary "
                                   f"[0, {vocab})")
        if len(ids) > self.options.max_context:
            raise RequestError(f"embed: an input of {len(ids)} tokens is longer than the context "
                               f"({self.options.max_context} tokens)")
        return np.asarray(ids, np.int32)

    def embed(self, inputs, *, dimensions: Optional[int] = None) -> np.ndarray:
        """Embeddings, float32 [len(inputs), H] (or [.., dimensions]), each row of unit L2 norm:
        the final-normed hidden state at each input's last token (last-token pooling, as
        Qwen3-Embedding pools; `embedding_input_ids` says which tokens). `inputs`: a string, a
        list of token ids, or a list of either. `dimensions` d: the first d components,
        renormalised (Matryoshka truncation). The numpy backend computes them; another backend
        raises NotSupportedError. Meaningful for an embedding checkpoint; a chat model's vectors
        are its hidden states all the same."""
        if self._is_closed:
            raise EngineClosedError()
        if isinstance(inputs, (str, np.ndarray)) or (
                isinstance(inputs, (list, tuple)) and inputs
                and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                        for t in inputs)):
            inputs = [inputs]
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise RequestError("embed: inputs must be a string, a list of token ids, or a "
                               "non-empty list of those")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise RequestError(f"embed: {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} "
                               "per call")
        hidden = int(self.config.text.hidden_size)
        if dimensions is not None and (isinstance(dimensions, bool)
                                       or not isinstance(dimensions, (int, np.integer))
                                       or not 1 <= dimensions <= hidden):
            raise RequestError(f"embed: dimensions={dimensions!r} must be an integer in "
                               f"[1, {hidden}] (the model's hidden size)")
        ids = [self.embedding_input_ids(item) for item in inputs]
        vectors = np.stack([self._scorer.embed(x) for x in ids])
        if dimensions is not None:
            vectors = vectors[:, :int(dimensions)]
        norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
        return (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)

    # ---- generation -------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               tools: Optional[Sequence[dict]] = None, enable_thinking: Optional[bool] = None,
               request_id: Optional[str] = None, timeout_s: Optional[float] = None,
               session: Optional[str] = None, share_prompt: bool = False):
        """Queue one request; returns a GenerationHandle (iterate events, .result(), .cancel()).
        No params: the checkpoint's defaults (`default_sampling_params()`), max_tokens cut to
        what the context leaves; params whose prompt + max_tokens exceed max_context raise
        ContextLengthError (unless `clamp_max_tokens`). `session`: a hint
        (a string of at most 256 characters) that requests giving the same one continue one
        conversation; the context cache then finds its newest checkpoint first. `share_prompt`:
        more requests with this exact prompt follow (`submit_n` sets it on the first): its
        prefill leaves the checkpoint they start from."""
        if self._is_closed:
            raise EngineClosedError()
        if self.frontend is not None:       # lone surrogates, provably over-long text: refused early
            from .models.qwen3_5.frontend.prompt import max_token_bytes, precheck_prompt
            precheck_prompt(prompt, self.options.max_context,
                            max_token_bytes(self.frontend.tokenizer))
        if params is None:      # nothing named: a default max_tokens is an upper bound only
            params = self.default_sampling_params(clamp_max_tokens=True)
        return self._generation().submit(prompt, params, tools=tools,
                                         enable_thinking=enable_thinking, request_id=request_id,
                                         timeout_s=timeout_s, session=session,
                                         share_prompt=share_prompt)

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                 **kwargs) -> GenerationResult:
        """Blocking: submit and wait for the result."""
        return self.submit(prompt, params, **kwargs).result()

    def submit_n(self, prompt: Prompt, params: Optional[SamplingParams] = None, n: int = 2,
                 **kwargs) -> list:
        """n choices of one prompt: n requests (GenerationHandles, choice i at index i), choice i
        seeded `params.seed + i` when a seed is given (`choice_params`). Submitted in order, so
        the context cache prefills the shared prompt once: the first leaves a checkpoint one
        token short of the prompt's end (`share_prompt`), and the others start from it, waiting
        for it while the first is still prefilling (prompts longer than a KV page;
        `result.num_cached_tokens` shows it; with the context cache off each prefills its own).
        A failed submit cancels the ones before it. `request_id` r names the choices r-0, r-1..."""
        params = params if params is not None else self.default_sampling_params()
        per_choice = choice_params(params, n)
        base_id = kwargs.pop("request_id", None)
        handles = []
        try:
            for i, p in enumerate(per_choice):
                rid = None if base_id is None else f"{base_id}-{i}"
                handles.append(self.submit(prompt, p, request_id=rid,
                                           share_prompt=i == 0 and n > 1, **kwargs))
        except BaseException:
            for h in handles:
                h.cancel()
                h.close()
            raise
        return handles

    def stats(self) -> dict:
        """The worker's counters and gauges (generation), and how the start went:
        `startup_seconds` (Engine.startup_seconds' total) and `weights_load_gb_per_s`."""
        out = self._generation().stats() if self._core is not None else {}
        out.update(self._start_stats)
        return out

    @property
    def health(self) -> str:
        """'ready', 'failed' (an internal invariant broke) or 'closed'."""
        if self._is_closed:
            return "closed"
        return self._core.health if self._core is not None else "ready"

    def _generation(self):
        if self._core is None:
            raise RequestError("this Engine was started with purpose='scoring'; "
                               "generation needs purpose='generation'")
        return self._core

    # ---- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker (pending requests finish as 'cancelled'), then release the model.
        Idempotent. A later submit or score raises EngineClosedError (a RequestError, HTTP 503)."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._core is not None and not self._core.shutdown():
            # The worker is still inside a unit: releasing the model under it would crash it.
            # Leave model and mapping to the garbage collector instead.
            warnings.warn("ninfer.Engine.close: the worker did not stop in time; "
                          "the model is left loaded", RuntimeWarning, stacklevel=2)
            return
        self.model.close()
        self.artifact.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
