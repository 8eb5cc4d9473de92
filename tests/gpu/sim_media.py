"""An image prompt through the CUDA model on numba-cuda's CPU simulator (sim_model.py's fake
device: kernels simulated, GEMMs as numpy products) against the numpy backend, float32.

The tiny text model of tiny_model.py gets a tiny random vision tower (out_hidden = its hidden
size); one random image is preprocessed by the Frontend's code, encoded by the numpy tower and laid
out with get_rope_index's MRoPE positions (frontend/media.py), exactly as the Program does for
either backend. The CUDA model takes the embeddings over the placeholders' rows (forward(media=))
and the 3-D positions in its rope kernel. Prints JSON: rel. errors of the logits of a one-piece
prefill, of a prefill cut inside the image, of one decode step after it, and how far the logits
move without the media (that they matter at all).

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_media.py
"""
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sim_patches import fix_shared_array_race, yield_while_polling   # noqa: E402
fix_shared_array_race()
yield_while_polling()
import sim_model   # noqa: E402  (simulator patches and the fake device)

from ninfer.models import model_config   # noqa: E402
from ninfer.models.qwen3_5 import cuda_model as cm   # noqa: E402
from ninfer.models.qwen3_5.batch import ForwardBatch   # noqa: E402
from ninfer.models.qwen3_5.frontend.media import rope_positions   # noqa: E402
from ninfer.models.qwen3_5.frontend.image_preprocess import VisionProcessing, process_image   # noqa: E402
from ninfer.models.qwen3_5.model import NumpyModel   # noqa: E402
from ninfer.models.qwen3_5.vision_tower import VisionConfig, VisionTower, prompt_media   # noqa: E402
from ninfer.options import EngineOptions   # noqa: E402
from tiny_model import TinyArtifact, tiny_config   # noqa: E402

PAD, START, END = 300, 301, 302          # the tiny vocabulary's image pad / vision start / end
PAGE = 4


def tiny_tower(hidden: int, seed: int = 5) -> VisionTower:
    cfg = VisionConfig(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, in_channels=3,
                       patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                       num_position_embeddings=16, out_hidden_size=hidden)
    r = np.random.default_rng(seed)
    params = {k: (r.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
              for k, s in cfg.param_shapes().items()}
    return VisionTower(cfg, params)


def image_prompt(tower):
    """(token ids, PromptMedia) of 'text <start> pad*4 <end> text' with one 19x13 image (resized
    to 16x16: a 2x2 grid of merged patches)."""
    r = np.random.default_rng(11)
    proc = VisionProcessing(patch_size=4, merge_size=2, min_pixels=256, max_pixels=256)
    m = process_image(r.integers(0, 256, (19, 13, 3), dtype=np.uint8), proc)
    assert m.grid_thw == (1, 4, 4)
    ids = np.array([5, 17, START] + [PAD] * m.num_tokens + [END, 99], np.int32)
    positions, _ = rope_positions(np.where(ids == PAD, 1, 0), [(1, m.grid_thw)], 2)
    return ids, prompt_media(tower, ids, [m], positions, (PAD, None))


_T0 = time.monotonic()


def log(what):
    print(f"sim_media: {what} done at {time.monotonic() - _T0:.0f} s", file=sys.stderr, flush=True)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def small_config():
    """tiny_config with one GatedDeltaNet and one attention layer (the simulator runs each
    thread of each block in Python: layers are what a run costs)."""
    cfg = tiny_config()
    text = dataclasses.replace(cfg.text, num_hidden_layers=2,
                               layer_types=("linear_attention", "full_attention"))
    return dataclasses.replace(cfg, text=text)


def run():
    machine = sim_model.Machine(96 << 20)
    sim_model.install(machine)
    art = TinyArtifact(small_config(), seed=3)
    cpu = NumpyModel.from_artifact(art)
    ids, enc = image_prompt(tiny_tower(model_config(art).text.hidden_size))
    T = len(ids)
    assert len(set(enc.positions[:, 4].tolist())) > 1        # a media token: distinct t, h, w
    opts = EngineOptions(backend="cuda", dtype="float32", max_concurrency=1, max_context=64,
                         prefill_chunk=16, page_size=PAGE, num_kv_pages=20, graphs=False)
    gpu = cm.CudaModel(model_config(art), opts, artifact=art)
    pages = np.arange(16, dtype=np.int32)
    out = {"tokens": T, "media_rows": enc.rows.tolist(),
           "positions": enc.positions.tolist()}

    def batch(start, count):
        return ForwardBatch(token_ids=ids[start:start + count] if start < T else
                            np.array([77], np.int32)[:count],
                            positions=enc.positions_for(start, count),
                            query_start=np.array([0, count], np.int32),
                            context_lens=np.array([start], np.int32),
                            block_tables=pages.reshape(1, -1), state_slots=np.array([1], np.int32))

    def pools():
        return (gpu.new_kv_pool(17, PAGE), gpu.new_state_pool(2),
                cpu.new_kv_pool(17, PAGE), cpu.new_state_pool(2))

    # one piece, every position's logits
    kg, sg, kc, sc = pools()
    lg = gpu.forward(batch(0, T), kg, sg, all_logits=True, media=enc.rows_in(0, T))
    lc = cpu.forward(batch(0, T), kc, sc, all_logits=True, media=enc.rows_in(0, T))
    out["prefill"] = _rel(lg, lc)
    log("prefill")
    # the media matter: without them (numpy) the logits move far
    _, _, kc2, sc2 = pools()
    out["without_media"] = _rel(cpu.forward(batch(0, T), kc2, sc2, all_logits=True), lc)
    # then one decode step after the prompt (text after an image: positions shifted by delta)
    dg = gpu.forward(batch(T, 1), kg, sg)
    dc = cpu.forward(batch(T, 1), kc, sc)
    out["decode"] = _rel(dg, dc)
    out["decode_position"] = enc.positions_for(T, 1)[:, 0].tolist()
    log("decode")
    # a prefill cut inside the image: each chunk gets the media rows that fall in it
    kg, sg, kc, sc = pools()
    parts = []
    for s, e in ((0, 5), (5, T)):
        parts.append((gpu.forward(batch(s, e - s), kg, sg, all_logits=True,
                                  media=enc.rows_in(s, e - s)),
                      cpu.forward(batch(s, e - s), kc, sc, all_logits=True,
                                  media=enc.rows_in(s, e - s))))
    out["chunked"] = max(_rel(a, b) for a, b in parts)
    log("chunked")
    gpu.close()
    return out


if __name__ == "__main__":
    print(json.dumps(run()))
