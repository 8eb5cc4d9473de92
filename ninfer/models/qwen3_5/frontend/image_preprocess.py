"""Image and video preprocessing for the Qwen3.5 vision tower (the Frontend's half of Vision).

Numerically the same as transformers' Qwen3-VL processors (issue 18):
- images: Qwen2VLImageProcessor's PIL backend: `smart_resize` to multiples of patch x merge within
  [min_pixels, max_pixels], PIL's bicubic resample on uint8 (Pillow's own when installed, else
  its algorithm in numpy: see resize_bicubic), rescale in float64 -> float32, normalize in float32,
  patchify in merge-block order with the frame repeated to the temporal patch;
- videos: Qwen3VLVideoProcessor's frame sampling (fps / min / max frames, linspace rounding), its
  own `smart_resize` over (frames, h, w), fused rescale+normalize in float32, patchify with the last
  frame repeated to fill a temporal patch, one timestamp per temporal patch;
- placeholders: `<|vision_start|><|image_pad|>*n<|vision_end|>` per image; per temporal patch of a
  video `<{t:.1f} seconds><|vision_start|><|video_pad|>*n<|vision_end|>`, replacing the template's
  `<|vision_start|><|video_pad|><|vision_end|>` as Qwen's processor does.

(transformers 5.18's Qwen3VLProcessor replaces only the `<|video_pad|>`, nesting each frame's
start/end inside the template's; Qwen's original Qwen3-VL processor replaces the whole triple,
as here.)

Known difference: transformers' video resize runs torchvision's antialiased bicubic, not PIL's;
here videos use the PIL resample too (the fixtures' videos are already of the target size).
"""
from __future__ import annotations

import functools
import io
import itertools
import math
from dataclasses import dataclass

import numpy as np

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
MAX_ASPECT = 200                  # transformers refuses more extreme aspect ratios
PRECISION_BITS = 32 - 8 - 2       # PIL's fixed-point resample precision (Resample.c)


class MediaError(ValueError):
    """A client's image or video cannot be used (the API turns it into a 400 with this text)."""


# ---- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class VisionProcessing:
    """The parts of preprocessor_config.json / video_preprocessor_config.json that change pixels."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple = (0.48145466, 0.4578275, 0.40821073)
    std: tuple = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    # video only
    fps: float | None = 2
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_json(cls, d: dict, *, video: bool = False) -> "VisionProcessing":
        size = d.get("size") or {}
        base = cls() if not video else cls(min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                                           mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
        kw = dict(min_pixels=d.get("min_pixels", size.get("shortest_edge", base.min_pixels)),
                  max_pixels=d.get("max_pixels", size.get("longest_edge", base.max_pixels)))
        for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "do_resize",
                  "do_rescale", "do_normalize", "fps", "num_frames", "min_frames", "max_frames",
                  "do_sample_frames"):
            if k in d:
                kw[k] = d[k]
        if "image_mean" in d:
            kw["mean"] = tuple(_per_channel(d["image_mean"]))
        if "image_std" in d:
            kw["std"] = tuple(_per_channel(d["image_std"]))
        resample = d.get("resample", 3)
        if resample not in (3, None):
            raise ValueError(f"preprocessor resample={resample}: only bicubic (3) is implemented")
        return cls(**{**base.__dict__, **kw})


def _per_channel(v) -> list:
    return [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * 3


# ---- sizes ---------------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' image smart_resize (Python's round: half to even)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise MediaError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is "
                         f"over {MAX_ASPECT}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int,
                       factor: int, min_pixels: int, max_pixels: int):
    """Qwen3VLVideoProcessor's smart_resize: the pixel budget counts every frame."""
    if num_frames < temporal_factor:
        raise MediaError(f"a video needs at least {temporal_factor} frames, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise MediaError(f"video aspect ratio {max(height, width) / min(height, width):.0f} is "
                         f"over {MAX_ASPECT}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ---- PIL's bicubic resample on uint8, in numpy ---------------------------------------------------

def _bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1,
                    np.where(x < 2.0, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _coeffs(in_size: int, out_size: int):
    """PIL's precompute_coeffs + normalize_coeffs_8bpc: per output pixel a window start and the
    fixed-point weights (int64 [out, ksize], zero past the window)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    starts = np.zeros(out_size, np.int64)
    weights = np.zeros((out_size, ksize), np.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = _bicubic((np.arange(xmax) + xmin - center + 0.5) * (1.0 / filterscale))
        total = 0.0
        for v in w.tolist():                 # PIL's left-to-right sum, not numpy's pairwise one
            total += v
        weights[xx, :xmax] = w / total if total != 0.0 else w
        starts[xx] = xmin
    fixed = np.where(weights < 0, np.trunc(-0.5 + weights * (1 << PRECISION_BITS)),
                     np.trunc(0.5 + weights * (1 << PRECISION_BITS))).astype(np.int64)
    return starts, fixed


def _resample_axis0(img: np.ndarray, out_size: int) -> np.ndarray:
    """One PIL pass along axis 0 of a uint8 [n, m, C] array."""
    starts, k = _coeffs(img.shape[0], out_size)
    src = np.concatenate([img.astype(np.int64), np.zeros((k.shape[1],) + img.shape[1:], np.int64)])
    idx = starts[:, None] + np.arange(k.shape[1])                     # [out, ksize]
    acc = np.full((out_size,) + img.shape[1:], 1 << (PRECISION_BITS - 1), np.int64)
    acc += np.einsum("ok,okmc->omc", k, src[idx])
    return np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)


def resize_bicubic(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> [height, width, C] as transformers' PIL backend resizes: Pillow's
    Image.resize(BICUBIC) when Pillow is installed; otherwise its algorithm in numpy, a horizontal
    pass then a vertical one, each rounded to uint8. Each pass equals Pillow's bit for bit, and so
    does the whole for Pillow <= 12 (its Resample.c runs horizontal first); Pillow 13 runs some
    two-axis resizes vertical first, which moves a few pixels by rounding."""
    if img.shape[:2] == (height, width):
        return img.copy()
    try:
        from PIL import Image
    except ImportError:
        return resize_bicubic_numpy(img, height, width)
    return np.asarray(Image.fromarray(img).resize((width, height), Image.BICUBIC))


def resize_bicubic_numpy(img: np.ndarray, height: int, width: int) -> np.ndarray:
    out = img
    if img.shape[1] != width:
        out = _resample_axis0(out.transpose(1, 0, 2), width).transpose(1, 0, 2)
    if img.shape[0] != height:
        out = _resample_axis0(out, height)
    return np.ascontiguousarray(out)


# ---- decoding ------------------------------------------------------------------------------------

def to_rgb_array(image, *, max_pixels: int = 1 << 26) -> np.ndarray:
    """A client's image as uint8 [H, W, 3]: a numpy array (HxWx3 uint8), encoded bytes or a PIL
    image (Pillow, the `vision` extra, decodes and converts to RGB like transformers'
    convert_to_rgb)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            from PIL import Image
        except ImportError:
            raise MediaError("decoding image bytes needs Pillow: pip install 'ninfer[vision]' "
                             "(or pass a uint8 HxWx3 numpy array)") from None
        try:
            pil = Image.open(io.BytesIO(bytes(image)))
            if pil.width * pil.height > max_pixels:
                raise MediaError(f"image has {pil.width * pil.height} pixels, over {max_pixels}")
            pil.load()
        except MediaError:
            raise
        except Exception as e:                                  # Pillow raises many kinds
            raise MediaError(f"image is not decodable: {e}") from None
        image = pil
    if type(image).__module__.startswith("PIL."):
        image = np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    if not isinstance(image, np.ndarray):
        raise MediaError(f"an image must be bytes, a PIL image or a numpy array, "
                         f"got {type(image).__name__}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise MediaError(f"a numpy image must be uint8 [H, W, 3], got {image.dtype} "
                         f"{list(image.shape)}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise MediaError(f"image is empty ({image.shape[0]}x{image.shape[1]})")
    if image.shape[0] * image.shape[1] > max_pixels:
        raise MediaError(f"image has {image.shape[0] * image.shape[1]} pixels, over {max_pixels}")
    return image


# ---- preprocessing -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Media:
    """One preprocessed image or video: what the vision tower and the prompt need."""
    kind: str                   # "image" | "video"
    pixels: np.ndarray          # float32 [t*h*w, C * temporal_patch * patch^2], merge-block order
    grid_thw: tuple             # (t, h, w) in patches
    merge_size: int
    timestamps: tuple = ()      # video: seconds per temporal patch
    # what the pixels are a function of, given the processor (an image: its resized uint8
    # bytes, a quarter of the float32 pixels' and one copy for the temporal patch's two);
    # None: the pixels themselves are hashed
    source: np.ndarray = None

    @functools.cached_property
    def digest(self) -> str:
        """Content hash (grid, and the source or the pixels): equal media give equal
        embeddings (one Engine has one processor). Computed once."""
        import hashlib
        h = hashlib.blake2b(np.asarray(self.grid_thw, "<i8").tobytes(), digest_size=16)
        if self.source is not None:
            h.update(b"uint8 source")
            h.update(np.ascontiguousarray(self.source, np.uint8).data)
        else:
            h.update(np.ascontiguousarray(self.pixels, "<f4").data)
        return h.hexdigest()

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size ** 2

    def placeholder(self) -> str:
        """The text that replaces this medium's `<|vision_start|><|x_pad|><|vision_end|>`."""
        if self.kind == "image":
            return VISION_START + IMAGE_PAD * self.num_tokens + VISION_END
        per_frame = self.num_tokens // self.grid_thw[0]
        return "".join(f"<{t:.1f} seconds>" + VISION_START + VIDEO_PAD * per_frame + VISION_END
                       for t in self.timestamps)


def _patchify(frames: np.ndarray, p: VisionProcessing) -> tuple[np.ndarray, tuple]:
    """float32 [F, C, H, W] (F a multiple of the temporal patch) -> [t*h*w, C*T*P*P] in the
    processors' order (t, h-block, w-block, h-in-block, w-in-block | C, T, P, P)."""
    F, C, H, W = frames.shape
    T, P, M = p.temporal_patch_size, p.patch_size, p.merge_size
    gt, gh, gw = F // T, H // P, W // P
    x = frames.reshape(gt, T, C, gh // M, M, P, gw // M, M, P)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, C * T * P * P)), (gt, gh, gw)


def process_image(image, p: VisionProcessing) -> Media:
    """transformers' Qwen2VLImageProcessor (PIL backend) for one image. Rescale and normalize act
    on each uint8 value alone, so they are a table of 256 float32 values per channel (the same
    arithmetic, the same bits), looked up after the patches are cut from the uint8 image: the
    float32 image is never made, and the patchify moves bytes, not floats."""
    img = to_rgb_array(image)
    if p.do_resize:
        h, w = smart_resize(img.shape[0], img.shape[1], p.factor, p.min_pixels, p.max_pixels)
        img = resize_bicubic(img, h, w)
    if img.shape[0] % p.factor or img.shape[1] % p.factor:
        raise MediaError(f"image {img.shape[0]}x{img.shape[1]} is not a multiple of {p.factor} "
                         f"(the preprocessor config turns resizing off)")
    C, T, P, M = img.shape[2], p.temporal_patch_size, p.patch_size, p.merge_size
    gh, gw = img.shape[0] // P, img.shape[1] // P
    table = value_table(p, C)                                           # float32 [C, 256]
    u8 = img.reshape(gh // M, M, P, gw // M, M, P, C).transpose(0, 3, 1, 4, 6, 2, 5)
    index = u8.reshape(gh * gw, C, P * P).astype(np.intp)              # [patch, C, P*P]
    index += (np.arange(C) * 256)[None, :, None]
    values = np.take(table.reshape(-1), index)                        # [patch, C, P*P]
    pixels = np.empty((gh * gw, C, T, P * P), np.float32)
    pixels[:] = values[:, :, None]                # the image is each of the T frames
    return Media("image", pixels.reshape(gh * gw, C * T * P * P), (1, gh, gw), p.merge_size,
                 source=img)


def value_table(p: VisionProcessing, channels: int) -> np.ndarray:
    """float32 [channels, 256]: each uint8 value rescaled and normalized per channel, as the
    processor computes it on a whole image (rescale in float64 then float32; normalize in
    float32)."""
    v = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 256))[:, None, :]  # [C, 1, 256]
    x = (v.astype(np.float64) * p.rescale_factor).astype(np.float32) if p.do_rescale \
        else v.astype(np.float32)
    if p.do_normalize:
        mean, std = np.asarray(p.mean, np.float32), np.asarray(p.std, np.float32)
        x = (x - mean[:, None, None]) / std[:, None, None]
    return np.ascontiguousarray(x[:, 0])


def sample_frame_indices(total: int, video_fps: float | None, p: VisionProcessing) -> np.ndarray:
    """Qwen3VLVideoProcessor.sample_frames: `fps` frames per second of the source (24 when it is
    unknown), clamped to [min_frames, max_frames] and to the frames there are."""
    if p.num_frames is not None:
        n = p.num_frames
    elif p.fps is not None:
        src_fps = 24.0 if video_fps is None else video_fps
        n = int(total / src_fps * p.fps)
        n = min(max(n, p.min_frames), p.max_frames, total)
    else:
        n = min(max(total, p.min_frames), p.max_frames)
    return np.linspace(0, total - 1, n).round().astype(int)


def read_video(path, p: VisionProcessing, max_frames: int | None = None) -> tuple:
    """A video file (a path, or its bytes) -> (sampled frames uint8 [n, H, W, 3], their indices,
    the stream's fps or None), decoded by PyAV (the `vision` extra) as transformers'
    read_video_pyav does: the frame count and average rate from the stream, indices by
    sample_frame_indices, frames decoded up to the last index (a container that does not record
    its frame count is decoded twice: count, then keep). max_frames: a video with more frames is
    refused before anything is decoded (the count stops there)."""
    try:
        import av
    except ImportError:
        raise MediaError("decoding video files needs PyAV: pip install 'ninfer[vision]' (or pass "
                         "the frames as a list of uint8 HxWx3 arrays and 'fps')") from None
    def opened():
        return av.open(io.BytesIO(path) if isinstance(path, (bytes, bytearray)) else str(path))
    try:
        with opened() as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate
            fps = float(rate) if rate else None
            total = int(stream.frames or 0)
        counted = total <= 0            # no count in the header: count, up to one past the limit
        if counted:
            with opened() as container:
                frames = container.decode(video=0)
                stop = None if max_frames is None else max_frames + 1
                total = sum(1 for _ in itertools.islice(frames, stop))
        if total <= 0:
            raise MediaError("the video has no frames")
        if max_frames is not None and total > max_frames:
            n = f"more than {max_frames}" if counted else str(total)
            raise MediaError(f"the video has {n} frames, over the limit of {max_frames} "
                             "(serve --max-video-frames)")
        idx = sample_frame_indices(total, fps, p) if p.do_sample_frames else np.arange(total)
        want, frames = set(int(i) for i in idx), {}
        with opened() as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i > idx[-1]:
                    break
                if i in want:
                    frames[i] = to_rgb_array(frame.to_ndarray(format="rgb24"))
    except MediaError:
        raise
    except FileNotFoundError as e:
        raise MediaError(f"video path {str(path)[:200]!r}: {e.strerror}") from None
    except Exception as e:                                   # PyAV / FFmpeg raise many kinds
        raise MediaError(f"video is not decodable: {e}") from None
    if len(frames) != len(want):
        raise MediaError(f"the video has fewer frames than its header says ({total})")
    return np.stack([frames[int(i)] for i in idx]), idx, fps


def process_video_file(path, p: VisionProcessing, max_frames: int | None = None) -> Media:
    """A video file named explicitly by the caller, or its bytes -> Media (read_video, then as
    process_video)."""
    video, idx, fps = read_video(path, p, max_frames)
    return _process_sampled(video, idx, p, fps)


def process_video(frames, p: VisionProcessing, fps: float | None = None) -> Media:
    """A decoded video (uint8 [F, H, W, 3] or a list of such frames) at `fps` frames per second ->
    Media: frames sampled, resized, normalized and patchified as Qwen3VLVideoProcessor does."""
    frames = [to_rgb_array(f) for f in frames]
    if not frames:
        raise MediaError("video has no frames")
    if len({f.shape for f in frames}) != 1:
        raise MediaError("video frames differ in size")
    video = np.stack(frames)
    idx = sample_frame_indices(len(video), fps, p) if p.do_sample_frames \
        else np.arange(len(video))
    return _process_sampled(video[idx], idx, p, fps)


def _process_sampled(video: np.ndarray, idx, p: VisionProcessing, fps) -> Media:
    """The sampled frames uint8 [n, H, W, 3] (source indices `idx`) -> Media."""
    F, H, W, _ = video.shape
    if p.do_resize:
        h, w = video_smart_resize(F, H, W, p.temporal_patch_size, p.factor, p.min_pixels,
                                  p.max_pixels)
        video = np.stack([resize_bicubic(f, h, w) for f in video])
    x = video.transpose(0, 3, 1, 2).astype(np.float32)                   # [F, C, H, W]
    if p.do_rescale and p.do_normalize:       # the video processor fuses the two, in float32
        scale = np.float32(1.0 / p.rescale_factor)
        mean = np.asarray(p.mean, np.float32) * scale
        std = np.asarray(p.std, np.float32) * scale
        x = (x - mean[:, None, None]) / std[:, None, None]
    elif p.do_rescale:
        x = x * np.float32(p.rescale_factor)
    elif p.do_normalize:
        x = (x - np.asarray(p.mean, np.float32)[:, None, None]) / \
            np.asarray(p.std, np.float32)[:, None, None]
    if pad := -len(x) % p.temporal_patch_size:                        # repeat the last frame
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    pixels, grid = _patchify(x, p)
    # one timestamp per temporal patch: the mean of its first and last frame's time
    src_fps = 24.0 if fps is None else fps
    ids = list(idx) + [idx[-1]] * (-len(idx) % p.temporal_patch_size)
    T = p.temporal_patch_size
    stamps = tuple((ids[i] / src_fps + ids[i + T - 1] / src_fps) / 2 for i in range(0, len(ids), T))
    return Media("video", pixels, grid, p.merge_size, stamps)


def expand_placeholders(text: str, media: list) -> str:
    """Replace each `<|vision_start|><|image_pad|><|vision_end|>` / `...<|video_pad|>...` of the
    rendered prompt, in order, by its medium's placeholder; the counts must agree."""
    out, pos = [], 0
    marks = {"image": VISION_START + IMAGE_PAD + VISION_END,
             "video": VISION_START + VIDEO_PAD + VISION_END}
    for m in media:
        at = text.find(marks[m.kind], pos)
        other = [text.find(v, pos) for k, v in marks.items() if k != m.kind]
        if at < 0 or any(0 <= o < at for o in other):
            raise MediaError(f"the prompt has no {m.kind} placeholder for {m.kind} "
                             f"#{len(out) // 2 + 1}")
        out += [text[pos:at], m.placeholder()]
        pos = at + len(marks[m.kind])
    rest = text[pos:]
    if any(v in rest for v in marks.values()):
        raise MediaError("the prompt has more media placeholders than media")
    return "".join(out) + rest
