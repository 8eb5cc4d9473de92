"""A DFlash drafter's steps on the CUDA model (cuda/dflash.py: CudaDFlashDrafter over
CudaModel.dflash_feed / dflash_draft) against the numpy drafter (dflash.DFlashDrafter) of the same
artifact: the tiny random target with a random drafter of the target's KV geometry (bf16 values).
Two rows: row 0 fed 5 positions, row 1 fed 3 then 4 more (a feed that continues its context), then
one block pass over both; with `verify`, the target's verify with the drafter's hidden_layers
(its features and logits against the numpy model's). Run on the simulator by sim_dflash.py and
on the GPU by test_dflash_gpu.py."""
import dataclasses
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from ckpt_helpers import write_checkpoint
from ninfer.convert import convert_checkpoint
from ninfer.models import model_config
from ninfer.models.qwen3_5 import cuda_model as cm
from ninfer.models.qwen3_5.batch import ForwardBatch
from ninfer.models.qwen3_5.cuda.dflash import CudaDFlashDrafter
from ninfer.models.qwen3_5.dflash import DFlashDrafter
from ninfer.models.qwen3_5.model import NumpyModel
from ninfer.options import EngineOptions
from test_dflash import write_drafter_dir

PAGE = 4


def rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# a drafter's KV geometry: the target's (head_dim 16, 2 KV heads), or one of its own (its layers
# page with the target's, each array its own page shape: DeviceKVPool(extra=))
GEOMETRIES = {"target": {"head_dim": 16}, "own": {"head_dim": 8, "num_key_value_heads": 1}}


def artifact(tmp: pathlib.Path, geometry: str = "target") -> pathlib.Path:
    """The tiny target (head_dim 16, 2 KV heads) and a random drafter of the KV geometry
    GEOMETRIES[geometry]."""
    write_checkpoint(tmp / "ckpt", "Qwen3_5ForCausalLM", tied=True)
    write_drafter_dir(tmp / "drafter", GEOMETRIES[geometry], seed=3)
    # bf16 values, as a checkpoint's (the device holds its matrices as bf16, widened at load
    # by the float32 model: float32 weights would differ from the oracle's there)
    f = tmp / "drafter" / "model.safetensors"
    save_file({k: v.astype(ml_dtypes.bfloat16).astype(np.float32)
               for k, v in load_file(str(f)).items()}, str(f))
    convert_checkpoint(tmp / "ckpt", tmp / "tiny.ninfer", progress=False,
                       dflash_dir=tmp / "drafter")
    return tmp / "tiny.ninfer"


def run(art, part: str = "step", graphs: bool = False) -> dict:
    """{dtype: {"hidden": rel err of the drafts' hidden states, "ids_equal", "ids_agree", ...}}
    (part "verify": also the verify's "verify_logits" and "verify_features" rel errs; graphs
    (a GPU): the block pass again through its captured graph, "graph_equal" to the eager one
    bit for bit, and without its hidden states, "no_hidden")."""
    cpu = NumpyModel.from_artifact(art)
    d_cpu = DFlashDrafter.from_artifact(art, cpu)
    cfg = cpu.config.dflash
    F, H, V = len(cfg.target_layer_ids), cpu.text.hidden_size, cpu.text.vocab_size
    r = np.random.default_rng(7)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    # (row, first position, positions): row 1's second feed continues its context
    feeds = [(0, 0, 5), (1, 0, 3), (1, 3, 4)]
    features = [r.standard_normal((n, F * H)).astype(np.float32) for _, _, n in feeds]
    anchors = r.integers(0, V, 2).astype(np.int32)
    ctx = np.array([5, 7], np.int32)
    out = {}
    for dtype in ("float32", "bfloat16"):
        opts = EngineOptions(backend="cuda", dtype=dtype, max_concurrency=2, max_context=64,
                             prefill_chunk=16, page_size=PAGE, num_kv_pages=20, graphs=False,
                             speculative="dflash", num_draft_tokens=cfg.block_size - 1)
        gpu = cm.CudaModel(model_config(art), opts, artifact=art, dflash=cfg)
        d_gpu = CudaDFlashDrafter(gpu)
        kv_g = gpu.new_kv_pool(9, PAGE)
        kv_c = d_cpu.new_kv_pool(9, PAGE)
        d_gpu.join_kv_pool(kv_g)
        for (row, start, n), f in zip(feeds, features):
            if dtype == "bfloat16":          # what the device holds: the oracle takes the same
                f = f.astype(ml_dtypes.bfloat16).astype(np.float32)
            b = ForwardBatch.single(np.zeros(n, np.int32), start, tables[row], row)
            d_gpu.feed(b, f, kv_g)
            d_cpu.feed(b, f, kv_c)
        ids_g, g_g = d_gpu.draft(kv_g, anchors, ctx, tables)
        ids_c, g_c = d_cpu.draft(kv_c, anchors, ctx, tables)
        res = {"hidden": rel(g_g, g_c), "ids_equal": bool(np.array_equal(ids_g, ids_c)),
               "ids_agree": float(np.mean(ids_g == ids_c)), "shape": list(g_g.shape),
               "kv_layers": len(kv_g.k),
               "target_kv_layers": len(cpu.text.attention_layer_ids)}
        if graphs:
            gpu.options = dataclasses.replace(opts, graphs=True)
            captured = len(gpu.graphs)
            ids_2, g_2 = d_gpu.draft(kv_g, anchors, ctx, tables)
            ids_3, g_3 = d_gpu.draft(kv_g, anchors, ctx, tables, with_hidden=False)
            res["graph_equal"] = bool(np.array_equal(ids_2, ids_g) and np.array_equal(g_2, g_g)
                                      and len(gpu.graphs) == captured + 1)
            res["no_hidden"] = g_3 is None and bool(np.array_equal(ids_3, ids_g))
            gpu.options = opts
        if part == "verify":
            res.update(verify(gpu, cpu, r))
        kv_g.close()
        gpu.close()
        out[dtype] = res
    return out


def verify(gpu, cpu, r, k: int = 3) -> dict:
    """CudaModel.verify_forward with the drafter's hidden_layers over a row's last token and k
    drafts after a 3-token prefill: its logits and features against the numpy model's."""
    V = cpu.text.vocab_size
    layers = tuple(cpu.config.dflash.target_layer_ids)
    pages = np.arange(8, dtype=np.int32)
    kv_g, st_g = gpu.new_kv_pool(9, PAGE), gpu.new_state_pool(2 + k + 1)
    kv_c, st_c = cpu.new_kv_pool(9, PAGE), cpu.new_state_pool(1)
    prompt = r.integers(0, V, 3).astype(np.int32)
    for model, kv, st in ((gpu, kv_g, st_g), (cpu, kv_c, st_c)):
        model.forward(ForwardBatch.single(prompt, 0, pages, 0), kv, st)
    b = ForwardBatch.single(r.integers(0, V, k + 1).astype(np.int32), 3, pages, 0)
    lg, fg = gpu.verify_forward(b, kv_g, st_g, np.arange(k + 1), snap_base=[2],
                                hidden_layers=layers)
    lc, fc = cpu.verify_forward(b, kv_c, st_c, np.arange(k + 1), hidden_layers=layers)
    # then a plain decode step that keeps the drafter's feed (a k = 0 unit as a plain step:
    # launch_tokens(keep_hidden=True, hidden_layers=...)): its row's features
    one = ForwardBatch.single(r.integers(0, V, 1).astype(np.int32), 4 + k, pages, 0)
    step = gpu.launch_tokens(one, kv_g, st_g, keep_hidden=True, hidden_layers=layers)
    step.collect()
    sg = step.hidden()
    _, sc = cpu.verify_forward(one, kv_c, st_c, np.zeros(1, np.int32), hidden_layers=layers)
    kv_g.close()
    st_g.close()
    return {"verify_logits": rel(lg, lc), "verify_features": rel(fg, fc),
            "features_shape": list(fg.shape), "step_features": rel(sg, sc)}

