"""Build the vision oracle fixtures: transformers' preprocessing and float32 logits for prompts with
images and a video, on the tiny multimodal checkpoints `cond_gen` and `moe_cond_gen` (issue 18).

Regenerate (maintainers only; CI reads the committed files) from the repository root with a Python
that has torch, transformers and Pillow (not the project's runtime):

    python tools/make_vision_fixtures.py              # into tests/fixtures/vision/

The checkpoints are the committed `tests/fixtures/{cond_gen,moe_cond_gen}` (made by
tools/make_fixtures.py; their tiny vision tower: patch 4, temporal patch 2, merge 2, depth 1,
16 learned position embeddings) with the tiny vocabulary's vision tokens `<|image_pad|>` 256,
`<|video_pad|>` 257, `<|vision_start|>` 258, `<|vision_end|>` 259 (the real strings; the real
vocabulary's ids would need a 248k-row embedding). This script adds, under tests/fixtures/vision/:

    preprocessor_config.json        the image processor config (sizes scaled to the tiny patch)
    video_preprocessor_config.json  the video processor config
    reference.npz                   per prompt p in {image, two_images, video}:
        {p}_text                str      the prompt text with one placeholder per medium
        {p}_ids                 int32 [T] transformers' processor output (placeholders expanded)
        {p}_mm_types            int32 [T] 0 text, 1 image, 2 video (processor's mm_token_type_ids)
        {p}_positions           int32 [3, T] get_rope_index
        {p}_pixels              float32 [N, C*2*P*P] pixel_values / pixel_values_videos
        {p}_grid                int32 [M, 3] image_grid_thw / video_grid_thw
        {p}_embeds              float32 [N/4, H] the vision tower's merged output (pooler_output)
        {cond_gen,moe_cond_gen}_{p}_logits float32 [T, V] one full forward, float32
      image_0 uint8 [37, 53, 3], image_1 uint8 [14, 9, 3]: the images (image uses image_0;
      two_images both); video uint8 [8, 16, 24, 3] and video_fps: the decoded video (8 frames at
      4 fps; the processor samples 4 of them at 2 fps).
      chat_ending str: the last user text of chat_messages(); chat_ids int32 [T]: that two-turn
      chat rendered by ninfer's built-in template (thinking off), expanded by the processor;
      chat_positions int32 [3, T]: get_rope_index; {model}_chat_greedy int32 [8],
      {model}_chat_margins float32 [8], {model}_chat_first_logits float32 [V]: greedy decoding by
      uncached forwards with the vision tokens biased by -100 (greedy_uncached says why).

A rerun reproduced every array bit for bit (torch 2.13.0+cpu, transformers 5.18.0, Pillow 13.0.0).

Images go through transformers' PIL backend (Qwen2VLImageProcessorPil: PIL bicubic resize, then
rescale / normalize / patchify in numpy) and Qwen3VLProcessor, which expands the placeholders.
The video goes through Qwen3VLVideoProcessor's frame sampling and its _preprocess with
do_resize=False: its resize needs torchvision, which has no wheel for this torch here, so the
video's frames are already of the size smart_resize picks (16x24, multiples of 8): the resize is
the identity and is not covered by this oracle. The video placeholders come from the processor's
replace_video_token (timestamps `<t seconds>` per temporal patch).
"""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration, \
    Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
OUT = FIXTURES / "vision"
MODELS = {"cond_gen": Qwen3_5ForConditionalGeneration,
          "moe_cond_gen": Qwen3_5MoeForConditionalGeneration}
MEAN = [0.48145466, 0.4578275, 0.40821073]     # per-channel values, so a channel swap shows
STD = [0.26862954, 0.26130258, 0.27577711]
IMAGE_CONFIG = dict(image_processor_type="Qwen2VLImageProcessorFast",
                    processor_class="Qwen3VLProcessor",
                    do_resize=True, resample=3, size=dict(shortest_edge=256, longest_edge=1536),
                    do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=MEAN,
                    image_std=STD, do_convert_rgb=True, patch_size=4, temporal_patch_size=2,
                    merge_size=2)
VIDEO_CONFIG = dict(video_processor_type="Qwen3VLVideoProcessor",
                    processor_class="Qwen3VLProcessor",
                    do_resize=True, resample=3, size=dict(shortest_edge=256, longest_edge=8192),
                    do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=MEAN,
                    image_std=STD, do_convert_rgb=True, patch_size=4, temporal_patch_size=2,
                    merge_size=2, fps=2, min_frames=4, max_frames=8, do_sample_frames=True)
VISION = "<|vision_start|>{}<|vision_end|>"
PROMPTS = {
    "image": "qwen delta" + VISION.format("<|image_pad|>") + "net gated ten, tion",
    "two_images": "num" + VISION.format("<|image_pad|>") + "py in fer" +
                  VISION.format("<|image_pad|>") + "ence page state",
    "video": "rou ter" + VISION.format("<|video_pad|>") + "lay er norm",
}
# a two-turn chat rendered by ninfer's built-in Qwen3.5 template (thinking off): image_0 in the
# first user turn; the video then image_1 in the second (tests/test_vision_engine.py sends the same)
# the last text is the first of CHAT_ENDINGS whose greedy continuation, for both models, has a
# top-1 / top-2 logit gap >= MIN_MARGIN at every step
CHAT_ENDINGS = ("ex pert", "rou ter lay", "norm ro pe", "ca che page", "state slot in",
                "fer ence num", "to ken mo", "gat ed at")
MIN_MARGIN = 0.002     # >= 30x the numpy backend's logit error here (<= 6e-5; |logits| <= 3.6)
PLACEHOLDERS = (256, 257, 258, 259)


def chat_messages(ending):
    return [{"role": "user", "content": [{"type": "text", "text": "qwen net"}, {"type": "image"}]},
            {"role": "assistant", "content": "ta del"},
            {"role": "user", "content": [{"type": "video"}, {"type": "image"},
                                         {"type": "text", "text": ending}]}]
GREEDY_NEW = 8


def make_media(rng):
    img0 = rng.integers(0, 256, size=(37, 53, 3), dtype=np.uint8)     # downscaled to 32x40
    img1 = rng.integers(0, 256, size=(14, 9, 3), dtype=np.uint8)      # upscaled to 24x16
    video = rng.integers(0, 256, size=(8, 16, 24, 3), dtype=np.uint8)
    return [img0, img1], video


def video_inputs(vproc, video, fps):
    meta = VideoMetadata(total_num_frames=len(video), fps=fps, width=video.shape[2],
                         height=video.shape[1])
    idx = vproc.sample_frames(meta, fps=VIDEO_CONFIG["fps"])
    meta.frames_indices = idx
    # torchvision's normalize, which is (x - mean) / std per channel in the image's dtype
    vproc.normalize = lambda image, mean, std, inplace=False: \
        (image - torch.tensor(mean, dtype=image.dtype).view(-1, 1, 1)) \
        / torch.tensor(std, dtype=image.dtype).view(-1, 1, 1)
    frames = torch.from_numpy(video[idx]).permute(0, 3, 1, 2).contiguous()   # [F, C, H, W]
    out = vproc._preprocess([frames], do_resize=False, size=None, resample=None,
                            do_rescale=True, rescale_factor=VIDEO_CONFIG["rescale_factor"],
                            do_normalize=True, image_mean=tuple(MEAN), image_std=tuple(STD),
                            patch_size=4,
                            temporal_patch_size=2, merge_size=2, cap_pixels_per_frame=False)
    return out["pixel_values_videos"], out["video_grid_thw"], meta


@torch.no_grad()
def greedy_uncached(model, ids, kw):
    """Greedy by uncached forwards over the growing text, transformers laying out every position
    itself (get_rope_index over prompt + generated text). Not generate(): its cached decoding
    drifts from its own uncached forward on these prompts (a 3rd-token logit gap of 0.05 flipped),
    so the uncached forward is the oracle. The vision tokens get a -100 logit bias (the test sends
    the same logit_bias): generated as text, transformers would take them for media."""
    seq, rows = ids, []
    for _ in range(GREEDY_NEW):
        t = torch.where(seq == 256, 1, torch.where(seq == 257, 2, 0)).int()
        last = model(input_ids=seq, mm_token_type_ids=t, use_cache=False, **kw).logits[0, -1]
        last[list(PLACEHOLDERS)] -= 100.0          # the test's logit_bias: no vision tokens
        rows.append(last.double().numpy())
        seq = torch.cat([seq, last.argmax().view(1, 1)], 1)
    return seq[0, ids.shape[1]:].numpy(), np.stack(rows)


def chat_reference(proc, vproc, images, video) -> dict:
    from ninfer.models.qwen3_5.frontend import Frontend
    fe = Frontend.from_resources((FIXTURES / "cond_gen" / "tokenizer.json").read_bytes())
    models = {name: cls.from_pretrained(FIXTURES / name, dtype=torch.float32,
                                        attn_implementation="eager",
                                        experts_implementation="eager").eval()
              for name, cls in MODELS.items()}
    pix_v, grid_v, meta = video_inputs(vproc, video, 4.0)
    for ending in CHAT_ENDINGS:
        text = fe.apply_chat_template(chat_messages(ending), enable_thinking=False)
        text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", proc.replace_video_token(
            {"video_grid_thw": grid_v, "video_metadata": [meta]}, 0))
        enc = proc(text=[text], images=images, return_tensors="pt")
        ids = enc["input_ids"]
        kw = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                  pixel_values_videos=pix_v, video_grid_thw=grid_v)
        out = {"chat_ending": np.asarray(ending), "chat_ids": ids[0].numpy().astype(np.int32)}
        for name, model in models.items():
            tokens, steps = greedy_uncached(model, ids, kw)
            top2 = np.sort(steps, -1)[:, -2:]
            margins = top2[:, 1] - top2[:, 0]
            print(f"{name} chat {ending!r}: T={ids.shape[1]} greedy={tokens.tolist()} "
                  f"min margin {margins.min():.3f}")
            if margins.min() < MIN_MARGIN:
                break
            out[f"{name}_chat_greedy"] = tokens.astype(np.int32)
            out[f"{name}_chat_margins"] = margins.astype(np.float32)
            out[f"{name}_chat_first_logits"] = steps[0].astype(np.float32)
        else:
            types = torch.where(ids == 256, 1, torch.where(ids == 257, 2, 0)).int()
            pos, _ = models["cond_gen"].model.get_rope_index(ids, types, kw["image_grid_thw"],
                                                             grid_v)
            out["chat_positions"] = pos[:, 0].numpy().astype(np.int32)
            return out
    raise SystemExit(f"no chat ending gives greedy margins >= {MIN_MARGIN}")


def main() -> int:
    torch.set_num_threads(2)
    OUT.mkdir(exist_ok=True)
    (OUT / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG, indent=2) + "\n")
    (OUT / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG, indent=2) + "\n")
    names = ("image_processor_type", "video_processor_type", "processor_class")
    cfg = {k: v for k, v in IMAGE_CONFIG.items() if k not in names}
    iproc = Qwen2VLImageProcessorPil(**cfg)
    vcfg = {k: v for k, v in VIDEO_CONFIG.items() if k not in names}
    vproc = Qwen3VLVideoProcessor(**vcfg)
    tok = AutoTokenizer.from_pretrained(FIXTURES / "cond_gen")
    # without torchvision transformers' class check takes the video processor for a dummy
    Qwen3VLProcessor.check_argument_for_proper_class = lambda self, name, arg: None
    proc = Qwen3VLProcessor(image_processor=iproc, tokenizer=tok, video_processor=vproc)
    rng = np.random.default_rng(1818)
    images, video = make_media(rng)
    ref: dict = {"image_0": images[0], "image_1": images[1], "video": video,
                 "video_fps": np.float32(4.0)}
    inputs = {}
    for p, text in PROMPTS.items():
        if p == "video":
            pix, grid, meta = video_inputs(vproc, video, 4.0)
            expanded = text.replace("<|vision_start|><|video_pad|><|vision_end|>",
                                    proc.replace_video_token(
                                        {"video_grid_thw": grid, "video_metadata": [meta]}, 0))
            ids = torch.tensor([tok(expanded)["input_ids"]])
            kw = dict(pixel_values_videos=pix, video_grid_thw=grid)
        else:
            imgs = images[:1] if p == "image" else images
            enc = proc(text=[text], images=imgs, return_tensors="pt")
            ids, pix, grid = enc["input_ids"], enc["pixel_values"], enc["image_grid_thw"]
            assert np.array_equal(enc["mm_token_type_ids"][0].numpy(),
                                  np.where(ids[0].numpy() == 256, 1, 0))
            kw = dict(pixel_values=pix, image_grid_thw=grid)
        types = torch.where(ids == 256, 1, torch.where(ids == 257, 2, 0)).int()
        inputs[p] = (ids, types, kw)
        ref[f"{p}_text"] = np.asarray(text)
        ref[f"{p}_ids"] = ids[0].numpy().astype(np.int32)
        ref[f"{p}_mm_types"] = types[0].numpy().astype(np.int32)
        ref[f"{p}_pixels"] = pix.numpy().astype(np.float32)
        ref[f"{p}_grid"] = grid.numpy().astype(np.int32)
    for name, cls in MODELS.items():
        model = cls.from_pretrained(FIXTURES / name, dtype=torch.float32,
                                    attn_implementation="eager",
                                    experts_implementation="eager").eval()
        for p, (ids, types, kw) in inputs.items():
            with torch.no_grad():
                grid = kw.get("image_grid_thw", kw.get("video_grid_thw"))
                pos, _ = model.model.get_rope_index(ids, types, kw.get("image_grid_thw"),
                                                    kw.get("video_grid_thw"))
                pix = kw.get("pixel_values", kw.get("pixel_values_videos"))
                embeds = model.model.visual(pix, grid_thw=grid).pooler_output
                logits = model(input_ids=ids, mm_token_type_ids=types, use_cache=False,
                               **kw).logits[0]
                plain = model(input_ids=ids, use_cache=False, position_ids=pos).logits[0]
            # the media must matter, or the test could pass with the tower left out
            assert (logits - plain).abs().max() > 1e-2 * logits.abs().max(), (name, p)
            if name == "cond_gen":
                ref[f"{p}_positions"] = pos[:, 0].numpy().astype(np.int32)
                ref[f"{p}_embeds"] = embeds.numpy().astype(np.float32)
            ref[f"{name}_{p}_logits"] = logits.numpy().astype(np.float32)
            print(f"{name} {p}: T={ids.shape[1]} grid={grid.tolist()}")
    ref.update(chat_reference(proc, vproc, images, video))
    ref["versions"] = np.asarray(f"torch {torch.__version__}; transformers "
                                 f"{transformers.__version__}; numpy {np.__version__}")
    np.savez_compressed(OUT / "reference.npz", **ref)
    print(f"reference.npz {(OUT / 'reference.npz').stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
