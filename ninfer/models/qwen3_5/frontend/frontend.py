"""Frontend: the request-side owner of text. Pure: no backend, runtime or Engine imports."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

from ....api import SamplingParams
from ....errors import ArtifactError, RequestError
from .chat_template import ChatTemplate, builtin_template_source, normalize_tools
from .grammar import GrammarCompiler
from .output_session import OutputSession
from .prompt import THINK_NONE, PreparedPrompt, make_prepared
from .tokenizer import Tokenizer
from .media import VisionPreprocessor, media_digest, media_parts, rope_positions
from .image_preprocess import (IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, MediaError,
                               expand_placeholders)

_DEFAULT_EOS = ("<|im_end|>", "<|endoftext|>")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")



def _check_media_placed(messages, text: str) -> None:
    """Every image and video part of the messages has its placeholder in the rendered prompt,
    and no other placeholder is there: a chat template that does not render a kind of part (one
    that knows only {"type": "image"}, given an OpenAI "image_url" part) would otherwise drop the
    medium silently and the model answer without it."""
    kinds = [k for k, _ in media_parts(messages)]
    sent = (kinds.count("image"), kinds.count("video"))
    placed = (text.count(VISION_START + IMAGE_PAD + VISION_END),
              text.count(VISION_START + VIDEO_PAD + VISION_END))
    if sent != placed:
        raise RequestError(f"the messages hold {sent[0]} image(s) and {sent[1]} video(s) but the "
                           f"chat template placed {placed[0]} image and {placed[1]} video "
                           "placeholder(s) (a part the template does not render would be "
                           "dropped; a placeholder typed in text is not a medium)")

class Frontend:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate,
                 eos_token_ids: Tuple[int, ...], *, tokenizer_json: Optional[bytes] = None,
                 sampling_defaults: Optional[Mapping[str, Any]] = None):
        self.tokenizer = tokenizer
        # the checkpoint's recommended sampling (generation_config.json), SamplingParams names
        self.sampling_defaults = dict(sampling_defaults or {})
        # compiled grammars are per vocabulary: one compiler (llguidance tokenizer + grammar
        # cache) per Frontend, built on the first structured request
        self.grammars = None if tokenizer_json is None else GrammarCompiler(
            tokenizer_json, tokenizer.vocab_size, eos_token_ids, tokenizer.token_id)
        self.template = template
        # ids a prompt may hold: the model's embedding rows (from_artifact), which may run past
        # the tokenizer's table; those padding rows are ids the model can also generate, and
        # they read as no text (Tokenizer.piece_bytes)
        self.id_limit = tokenizer.vocab_size
        self._eos = tuple(eos_token_ids)
        self._think_ids = (tokenizer.token_id("<think>"), tokenizer.token_id("</think>"))
        self._im_start_id = tokenizer.token_id("<|im_start|>")
        # what a spent thinking budget forces: </think> and the template's separator after it
        self._think_close = () if self._think_ids[1] is None else \
            (self._think_ids[1],) + tuple(int(t) for t in tokenizer.encode("\n\n"))
        self._media_ids = np.array([i for i in (tokenizer.token_id("<|image_pad|>"),
                                                tokenizer.token_id("<|video_pad|>"))
                                    if i is not None], dtype=np.int32)
        # the model's vision preprocessing (frontend/image_preprocess.py); None: media are refused
        self.vision = None

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_artifact(cls, artifact, *, chat_template: Optional[str] = None) -> "Frontend":
        """`chat_template`: a Jinja source that replaces the artifact's (CLI --chat-template)."""
        tokenizer_json = artifact.resource("tokenizer.json")
        if tokenizer_json is None:
            raise ArtifactError("artifact has no 'tokenizer.json' resource")
        template = artifact.resource("chat_template.jinja")
        if template is not None:
            try:
                template = template.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ArtifactError(f"resource 'chat_template.jinja' is not UTF-8: {exc}") from None
        frontend = cls.from_resources(
            tokenizer_json, chat_template if chat_template is not None else template,
            _json_resource(artifact, "generation_config.json"),
            tokenizer_config=_json_resource(artifact, "tokenizer_config.json"))
        frontend.vision = VisionPreprocessor.from_artifact(artifact, frontend.tokenizer)
        rows = (artifact.model_config_json.get("text") or {}).get("vocab_size")
        if isinstance(rows, int) and rows > frontend.id_limit:
            frontend.id_limit = rows
        return frontend

    @classmethod
    def from_resources(cls, tokenizer_json: bytes, chat_template: Optional[str] = None,
                       generation_config: Optional[Mapping] = None, *,
                       tokenizer_config: Optional[Mapping] = None) -> "Frontend":
        """Template precedence: `chat_template`, then tokenizer_config's, then the built-in Qwen3.5
        template. EOS ids: generation_config's `eos_token_id`, else `<|im_end|>`/`<|endoftext|>`."""
        tokenizer = Tokenizer(tokenizer_json)
        config = dict(tokenizer_config or {})
        source = chat_template or _config_template(config) or builtin_template_source()
        specials = {k: _token_text(config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        specials = {k: v for k, v in specials.items() if v is not None}
        specials.setdefault("eos_token", "<|im_end|>")
        eos = _eos_ids(tokenizer, generation_config or {})
        return cls(tokenizer, ChatTemplate(source, specials), eos, tokenizer_json=tokenizer_json,
                   sampling_defaults=sampling_defaults(generation_config or {}))

    # ---- text ------------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> Tuple[int, ...]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (the model's embedding may be padded beyond this)."""
        return self.tokenizer.vocab_size

    def token_id(self, token: str) -> Optional[int]:
        return self.tokenizer.token_id(token)

    def tokenize(self, text: str) -> np.ndarray:
        return self.tokenizer.encode(text)

    def detokenize(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ids in [0, id_limit); the model's padding rows past the tokenizer's table
        read as nothing, as in generated text."""
        ids = self.tokenizer.check_ids(ids, self.id_limit)
        return self.tokenizer.decode(ids[ids < self.vocab_size],
                                     skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, tools: Optional[list] = None,
                            add_generation_prompt: bool = True,
                            enable_thinking: Optional[bool] = True, **template_kwargs) -> str:
        thinking = True if enable_thinking is None else bool(enable_thinking)   # None: default
        return self.template.render(messages, tools, add_generation_prompt=add_generation_prompt,
                                    enable_thinking=thinking, **template_kwargs)

    # ---- requests ----------------------------------------------------------------------------------
    def allow_media_urls(self, policy) -> None:
        """Fetch http(s) image URLs under `policy` (media_fetch.MediaUrlPolicy: listed hosts,
        size and time limits; None: never, the default). `serve --allow-media-urls` sets it."""
        if self.vision is not None:
            self.vision = dataclasses.replace(self.vision, urls=policy)

    def limit_videos(self, *, max_frames: Optional[int] = None,
                     max_bytes: Optional[int] = None) -> None:
        """A decoded video's frame limit (the source's frames, before sampling) and a fetched
        video URL's byte limit (`serve --max-video-frames / --max-video-mb` set them); None
        keeps the current one."""
        changes = {name: int(v) for name, v in (("max_video_frames", max_frames),
                                                ("max_video_bytes", max_bytes)) if v is not None}
        if self.vision is not None:
            self.vision = dataclasses.replace(self.vision, **changes)

    def prepare(self, prompt, *, tools: Optional[list] = None,
                enable_thinking: Optional[bool] = True) -> PreparedPrompt:
        """str: raw text, tokenized as is; list of messages: rendered by the chat template with a
        generation prompt; int array or list of ints: token ids, checked against the vocabulary."""
        thinking = True if enable_thinking is None else bool(enable_thinking)
        normalize_tools(tools)          # every prompt form: tools also arm tool-call parsing
        text: Optional[str] = None
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(text)
        elif isinstance(prompt, np.ndarray) or (isinstance(prompt, (list, tuple)) and prompt and
                                                _all_ints(prompt)):
            ids = self.tokenizer.check_ids(prompt, self.id_limit)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping)
                                                                  for m in prompt):
            text = self.apply_chat_template(list(prompt), tools=tools, enable_thinking=thinking)
            _check_media_placed(prompt, text)
            ids = self.tokenizer.encode(text)
            if np.isin(ids, self._media_ids).any():
                # the template wrote image/video placeholders: preprocess the media, expand the
                # placeholders, lay out the MRoPE positions (frontend/image_preprocess.py)
                return self._prepare_media(list(prompt), text, thinking)
        elif isinstance(prompt, (list, tuple)) and not prompt:
            raise RequestError("prompt is empty")
        else:
            raise RequestError("prompt must be a str, a list of chat messages, or token ids "
                               f"(got {type(prompt).__name__})")
        if ids.shape[0] == 0:
            raise RequestError("prompt is empty (it has no tokens)")
        return make_prepared(ids, text=text, enable_thinking=thinking,
                             think_ids=self._think_ids, im_start_id=self._im_start_id)

    def _prepare_media(self, messages: list, text: str, thinking: bool) -> PreparedPrompt:
        if self.vision is None:
            raise RequestError("image and video content needs a model with a vision tower "
                               "(this one is text-only)")
        try:
            media = self.vision.process(messages)
            text = expand_placeholders(text, media)
        except MediaError as exc:
            raise RequestError(str(exc)) from None
        ids = self.tokenizer.encode(text)
        grids = [(1 if m.kind == "image" else 2, m.grid_thw) for m in media]
        try:
            positions, _ = rope_positions(self.vision.token_types(ids), grids, media[0].merge_size)
        except ValueError:          # the text itself spells placeholder tokens
            raise RequestError("the prompt text contains image/video placeholder tokens of its "
                               "own") from None
        prepared = make_prepared(ids, text=text, enable_thinking=thinking,
                                 think_ids=self._think_ids, im_start_id=self._im_start_id)
        return dataclasses.replace(prepared, media=tuple(media),
                                   mrope_positions=positions.astype(np.int32),
                                   media_digest=media_digest(media))

    def new_output_session(self, params: SamplingParams, prepared: PreparedPrompt,
                           tools: Optional[Sequence[Mapping[str, Any]]] = None, *,
                           request_id: Optional[str] = None) -> OutputSession:
        """Tool-call ids derive from (request_id, prompt digest) when a request id is given: a
        replayed request gets the same ids, a client reusing one id across turns does not."""
        seed = None if request_id is None else f"{request_id}/{prepared.digest}"
        bias = params.logit_bias or {}
        outside = [t for t in bias if not 0 <= t < self.vocab_size]
        if outside:
            raise RequestError(f"logit_bias: token id {outside[0]} is not in the vocabulary "
                               f"[0, {self.vocab_size})")
        matcher = None
        if params.structured is not None:
            # compiled here, on the submit thread: a bad schema is this request's RequestError
            if self.grammars is None:
                raise RequestError("structured output needs a Frontend built from tokenizer.json")
            matcher = self.grammars.matcher(params.structured, tools,
                                            think_open=prepared.starts_in_reasoning)
        return OutputSession(self.tokenizer, params, eos_token_ids=self._eos,
                             starts_in_reasoning=prepared.starts_in_reasoning,
                             think_allowed=prepared.think_state == THINK_NONE, tools=tools,
                             request_id=seed, matcher=matcher, think_close=self._think_close)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _all_ints(items) -> bool:
    """Every item an int or numpy integer (no bool), judged by the items' few distinct types: a
    per-item isinstance cost ~1 ms of a 4,096-id prompt's time to first token."""
    return all(issubclass(t, (int, np.integer)) and not issubclass(t, bool)
               for t in set(map(type, items)))


def _json_resource(artifact, name: str) -> Optional[dict]:
    data = artifact.resource(name)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"resource {name!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ArtifactError(f"resource {name!r} must be a JSON object")
    return value


def _config_template(config: Mapping) -> Optional[str]:
    """tokenizer_config's `chat_template`: a string, or a list of {name, template} (use 'default')."""
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default")
    return None


def _token_text(value) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


# generation_config.json keys -> SamplingParams fields (vLLM reads the same ones)
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                    "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(generation_config: Mapping) -> dict:
    """The checkpoint's recommended sampling as SamplingParams fields. `do_sample: false` means
    greedy decoding whatever its temperature says (transformers' rule); a value of the wrong type
    or out of range is left out (a checkpoint file, not the user's request)."""
    out = {}
    for key, name in _GENERATION_KEYS.items():
        value = generation_config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if generation_config.get("do_sample") is False:
        for name in ("temperature", "top_p", "top_k", "min_p"):
            out.pop(name, None)
    if out.get("top_k", 0) < 0:          # transformers' "off" spellings
        out["top_k"] = 0
    for name in list(out):              # a value SamplingParams refuses is left out, not fatal
        try:
            SamplingParams(**{name: out[name]}).validate()
        except RequestError:
            del out[name]
    return out


def _eos_ids(tokenizer: Tokenizer, generation_config: Mapping) -> Tuple[int, ...]:
    value = generation_config.get("eos_token_id")
    if value is None:
        ids = [tokenizer.token_id(t) for t in _DEFAULT_EOS]
        return tuple(i for i in ids if i is not None)
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(_is_int(v) and 0 <= v < tokenizer.vocab_size for v in values):
        raise ArtifactError(f"generation_config.json: eos_token_id {value!r} must be token ids "
                            f"in [0, {tokenizer.vocab_size})")
    return tuple(int(v) for v in values)
