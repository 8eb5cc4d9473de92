"""The public Engine facade. It wires owners together and delegates; it holds no logic of its own.

    Engine ─┬─ Artifact (read-only file, mapped)
            ├─ Frontend (tokenizer, chat template, OutputSession factory)     models/qwen3_5/frontend/
            ├─ Model (config, bound read-only parameters)                      models/qwen3_5/
            └─ purpose "generation": EngineCore (worker thread, Scheduler, Program)   runtime/
               purpose "scoring":    CausalScoreCore (serial, temporary State/KV)     runtime/scoring.py
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence

import numpy as np

from .api import GenerationResult, Prompt, SamplingParams, ScoreResult
from .artifact import Artifact
from .errors import EngineClosedError, RequestError
from .options import EngineOptions


class Engine:
    def __init__(self, path, backend: str = "numpy", purpose: str = "generation", *,
                 chat_template: Optional[str] = None, **options):
        """`chat_template`: a Jinja chat template source replacing the artifact's."""
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
            # Scoring token ids needs no tokenizer; generation always does.
            if self.options.purpose == "scoring" and self.artifact.resource("tokenizer.json") is None:
                self.frontend = None
            else:
                self.frontend = Frontend.from_artifact(self.artifact, chat_template=chat_template)
            self.model = load_model(self.artifact, self.options)
            self._core = None
            self._scorer = None
            if self.options.purpose == "scoring":
                from .runtime.scoring import CausalScoreCore
                self._scorer = CausalScoreCore(self.model, self.options)
            else:
                from .models.qwen3_5.program import Program
                from .runtime.engine_core import EngineCore
                program = Program(self.model, self.options, drafter=self._drafter())
                if self.options.warmup:     # graphs captured, first step run: then "ready"
                    program.warm_up()
                self._core = EngineCore(program, self.frontend, self.options)
        except BaseException:
            if self.model is not None:      # a Program that cannot start must not leak the model
                self.model.close()
            self.artifact.close()
            raise

    def _drafter(self):
        """The MTP drafter when speculative='mtp' (its weights are bound only then), else None."""
        if self.options.speculative is None:
            return None
        from .errors import ArtifactError
        from .models.qwen3_5.mtp import MtpDrafter
        try:
            return MtpDrafter.from_artifact(self.artifact, self.model)
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

    # ---- scoring ----------------------------------------------------------------------------------
    def score(self, token_ids, return_logits: bool = False) -> ScoreResult:
        if self._scorer is None:
            raise RequestError("Engine.score needs an Engine started with purpose='scoring'")
        if self._is_closed:
            raise EngineClosedError()
        return self._scorer.score(token_ids, return_logits=return_logits)

    # ---- generation -------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               tools: Optional[Sequence[dict]] = None, enable_thinking: Optional[bool] = None,
               request_id: Optional[str] = None, timeout_s: Optional[float] = None,
               session: Optional[str] = None):
        """Queue one request; returns a GenerationHandle (iterate events, .result(), .cancel()).
        No params: the checkpoint's defaults (`default_sampling_params()`). `session`: a hint
        (a string of at most 256 characters) that requests giving the same one continue one
        conversation; the context cache then finds its newest checkpoint first."""
        if self._is_closed:
            raise EngineClosedError()
        if self.frontend is not None:       # lone surrogates, provably over-long text: refused early
            from .models.qwen3_5.frontend.prompt import max_token_bytes, precheck_prompt
            precheck_prompt(prompt, self.options.max_context,
                            max_token_bytes(self.frontend.tokenizer))
        params = params if params is not None else self.default_sampling_params()
        return self._generation().submit(prompt, params, tools=tools,
                                         enable_thinking=enable_thinking, request_id=request_id,
                                         timeout_s=timeout_s, session=session)

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                 **kwargs) -> GenerationResult:
        """Blocking: submit and wait for the result."""
        return self.submit(prompt, params, **kwargs).result()

    def stats(self) -> dict:
        return self._generation().stats() if self._core is not None else {}

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
