"""Chat messages -> media for the Frontend (issue 18): which content parts are images and videos,
their payloads (arrays, bytes, PIL images, explicit paths, data: URLs, Anthropic base64 sources,
decoded video frames), the checkpoint's processor configs (VisionPreprocessor) and the MRoPE
positions of a prompt with media (transformers' get_rope_index). The pixel math is image_preprocess.py's."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .media_fetch import OPTION, MediaUrlPolicy
from .image_preprocess import (IMAGE_PAD, VIDEO_PAD, MediaError, VisionProcessing, process_image,
                     process_video, process_video_file)


# ---- MRoPE positions -----------------------------------------------------------------------------

def rope_positions(mm_types: np.ndarray, grids: list, merge: int, start: int = 0) -> tuple:
    """transformers' get_rope_index for one sequence: (positions int64 [3, T], next position).

    mm_types: per token 0 text, 1 image, 2 video; grids: the (t, h, w) patch grid of each medium in
    order (a video's temporal patches are separate frames, each between its own vision start/end).
    Text runs count up on all three axes; a frame's tokens sit at (base, base + row, base + col),
    and the text after it resumes at base + max(h, w) / merge. `start` continues a sequence (a later
    turn): pass the previous call's next position."""
    mm_types = np.asarray(mm_types)
    frames = []
    for kind, (t, h, w) in grids:
        frames += [(kind, h, w)] * (t if kind == 2 else 1)
    out = np.zeros((3, len(mm_types)), np.int64)
    pos, i, f = start, 0, 0
    while i < len(mm_types):
        j = i
        while j < len(mm_types) and mm_types[j] == mm_types[i]:
            j += 1
        kind = int(mm_types[i])
        if kind == 0:
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
        else:
            # one run may hold several media back to back: take frames until it is covered
            k = i
            while k < j:
                if f >= len(frames) or frames[f][0] != kind:
                    raise ValueError("media placeholders do not match the media given")
                _, h, w = frames[f]
                gh, gw = h // merge, w // merge
                rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
                n = gh * gw
                if k + n > j:
                    raise ValueError("media placeholders do not match the media given")
                out[0, k:k + n] = pos
                out[1, k:k + n] = pos + rows.ravel()
                out[2, k:k + n] = pos + cols.ravel()
                pos += max(gh, gw)
                k += n
                f += 1
        i = j
    if f != len(frames):
        raise ValueError("media placeholders do not match the media given")
    return out, pos


def media_digest(media) -> bytes:
    """blake2b-128 over each medium's kind and content digest (grid and pixels), in order."""
    import hashlib
    h = hashlib.blake2b(digest_size=16)
    for m in media:
        h.update(m.kind.encode() + bytes.fromhex(m.digest))
    return h.digest()


# ---- chat messages -> media ----------------------------------------------------------------------

def _kind_of_part(part) -> str | None:
    """'image' / 'video' / None for one content part, with the chat template's own tests (a part
    counts as an image if its type is 'image' or it has an 'image' or 'image_url' key)."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image" or "image" in part or "image_url" in part:
        return "image"
    if part.get("type") == "video" or "video" in part or "video_url" in part:
        return "video"
    return None


def media_parts(messages) -> list:
    """The image and video content parts of chat messages, in the order the template renders
    their placeholders."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, (list, tuple)):
            out += [(k, p) for p in content if (k := _kind_of_part(p)) is not None]
    return out


def _data_url(url: str) -> bytes:
    import base64
    import binascii
    head, sep, data = url.partition(",")
    if not sep or ";base64" not in head:
        raise MediaError("a data: URL must be base64 (data:image/...;base64,... or "
                         "data:video/...;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL's base64 payload is not valid base64") from None


def image_payload(part: dict, urls=None):
    """The image of one part: `image` (bytes, numpy uint8 HxWx3, PIL image or a data: URL),
    `path` (a file the caller names explicitly), OpenAI `image_url` ({"url": "data:..."}) or an
    Anthropic `source` ({"type": "base64", "data": ...} or {"type": "url", "url": ...}). http(s)
    URLs are fetched only under a MediaUrlPolicy (`urls`, media_fetch.py)."""
    if "path" in part and "image" not in part:
        try:
            with open(part["path"], "rb") as f:
                return f.read()
        except OSError as e:
            raise MediaError(f"image path {part['path']!r}: {e.strerror}") from None
    if "source" in part and "image" not in part:
        src = part["source"] or {}
        if src.get("type") == "url" and isinstance(src.get("url"), str):
            return _url_media(src["url"], urls)
        if src.get("type") != "base64" or not isinstance(src.get("data"), str):
            raise MediaError("an image block's source must be {'type': 'base64', 'data': ...} "
                             "or {'type': 'url', 'url': ...}")
        return _data_url(f"data:{src.get('media_type', 'image')};base64,{src['data']}")
    value = part.get("image", part.get("image_url"))
    if isinstance(value, dict):
        value = value.get("url")
    if isinstance(value, str):
        if value.startswith("data:"):
            return _data_url(value)
        if "://" in value[:16]:
            return _url_media(value, urls)
        raise MediaError("an image string must be a data: URL; pass a file as "
                         "{'type': 'image', 'path': ...}")
    if value is None:
        raise MediaError("an image part has no image")
    return value


def _url_media(url: str, urls, what: str = "image", max_bytes: int = None) -> bytes:
    """The body at an http(s) URL, fetched under the policy `urls` (at most max_bytes, else the
    policy's own limit); without a policy a MediaError naming the serve option."""
    if urls is None:
        scheme = url.partition("://")[0].lower()
        if scheme not in ("http", "https"):
            raise MediaError(f"{what} URL scheme {scheme!r}: only data: URLs (and http(s) URLs "
                             f"on a server started with {OPTION}) are accepted")
        raise MediaError(f"{what} URLs are not fetched unless the server is started with "
                         f"{OPTION} HOST,...; send the {what} inline as a data: URL (base64)")
    if max_bytes is not None:
        urls = replace(urls, max_bytes=max_bytes)
    return urls.fetch(url, what)


@dataclass(frozen=True)
class VisionPreprocessor:
    """The Frontend's vision step: the checkpoint's processor configs and placeholder ids."""
    image: VisionProcessing
    video: VisionProcessing
    image_token_id: int
    video_token_id: int
    max_media: int = 64
    urls: "MediaUrlPolicy | None" = None       # http(s) media URLs fetched under this policy
    # a decoded video's frames (the source's, before sampling: decoding is the cost) and a
    # fetched video URL's bytes (an image URL's are the policy's max_bytes)
    max_video_frames: int = 7200
    max_video_bytes: int = 64 << 20

    @classmethod
    def from_artifact(cls, artifact, tokenizer) -> "VisionPreprocessor | None":
        """None unless the model has a vision tower and the vocabulary its placeholder tokens."""
        import json
        vision = artifact.model_config_json.get("vision")     # the tower's config, or None
        if not vision:
            return None
        image_id, video_id = tokenizer.token_id(IMAGE_PAD), tokenizer.token_id(VIDEO_PAD)
        if image_id is None or video_id is None:
            return None

        def load(name):
            data = artifact.resource(name)
            return json.loads(data) if data else {}
        image_cfg = load("preprocessor_config.json")
        video_cfg = load("video_preprocessor_config.json") or image_cfg
        merge = vision.get("spatial_merge_size", 2)
        patch = vision.get("patch_size", 16)
        image_cfg = {"patch_size": patch, "merge_size": merge, **image_cfg}
        video_cfg = {"patch_size": patch, "merge_size": merge, **video_cfg}
        return cls(VisionProcessing.from_json(image_cfg),
                   VisionProcessing.from_json(video_cfg, video=True), image_id, video_id)

    def process(self, messages) -> list:
        parts = media_parts(messages)
        if len(parts) > self.max_media:
            raise MediaError(f"{len(parts)} images/videos in one request, over {self.max_media}")
        out = []
        for n, (kind, part) in enumerate(parts, 1):
            try:
                if kind == "image":
                    out.append(process_image(image_payload(part, self.urls), self.image))
                elif "path" in part and "video" not in part:     # a file the caller names
                    out.append(process_video_file(part["path"], self.video,
                                                  self.max_video_frames))
                elif "video_url" in part:                       # OpenAI-style: a data: URL
                    out.append(process_video_file(self._video_bytes(part["video_url"]),
                                                  self.video, self.max_video_frames))
                else:
                    frames = part.get("video")
                    if isinstance(frames, (str, bytes)):
                        raise MediaError("a video must be a list of frames (uint8 HxWx3 arrays "
                                         "or PIL images) with 'fps'; pass a file as "
                                         "{'type': 'video', 'path': ...}")
                    if frames is None or len(frames) == 0:
                        raise MediaError("a video part has no frames")
                    out.append(process_video(list(frames), self.video, part.get("fps")))
            except MediaError as e:
                raise MediaError(f"{kind} {n}: {e}") from None
        return out

    def _video_bytes(self, value) -> bytes:
        """A `video_url` value ({"url": ...} or the URL): a data: URL's payload, or an http(s)
        URL's body fetched under the policy, at most max_video_bytes."""
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise MediaError("a video_url part needs a URL string")
        if url.startswith("data:"):
            return _data_url(url)
        return _url_media(url, self.urls, "video", self.max_video_bytes)

    def token_types(self, ids: np.ndarray) -> np.ndarray:
        return np.where(ids == self.image_token_id, 1, np.where(ids == self.video_token_id, 2, 0))
