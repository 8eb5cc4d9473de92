"""The MTP head's step on the CUDA backend (CudaModel.mtp_forward, StepRunner.mtp) on the CPU:
sim_model.py's machine (kernels on numba-cuda's simulator, cuBLASLt as numpy products, fake
device memory) against the numpy drafter (MtpDrafter.forward) of the same artifact, over a row
of 3 tokens and then 2 more that attend to their KV, and its chained drafts (CudaModel.mtp_chain,
step): against the step-by-step drafts; and the target's verify step
(CudaModel.verify_forward: logits of every token, the State after each token in snapshot slots)
against the numpy model. Prints JSON:
{"<dtype>": {"logits": [rel err per call], "hidden": [...], "argmax_equal": [...],
             "verify_logits": rel err, "verify_hidden": rel err, "verify_states": [rel err per snapshot], ...}}

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_mtp.py [dense|moe] [step|verify]

("verify" runs the whole target model on the simulator: minutes.)
"""
import json
import pathlib
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sim_model import Machine, install   # noqa: E402  (the simulator switched on first)

from ninfer.models import model_config   # noqa: E402
from ninfer.models.qwen3_5 import cuda_model as cm   # noqa: E402
from ninfer.models.qwen3_5.batch import ForwardBatch   # noqa: E402
from ninfer.models.qwen3_5.model import NumpyModel   # noqa: E402
from ninfer.models.qwen3_5.mtp import MtpDrafter   # noqa: E402
from ninfer.options import EngineOptions   # noqa: E402
from tiny_model import mtp_artifact   # noqa: E402


def rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run(kind: str = "dense", part: str = "step") -> dict:
    machine = Machine(96 << 20)
    install(machine)
    art = mtp_artifact(kind)
    cpu = NumpyModel.from_artifact(art)
    drafter = MtpDrafter.from_artifact(art, cpu)
    H = cpu.text.hidden_size
    r = np.random.default_rng(2)
    V = cpu.text.vocab_size
    pages = np.arange(16, dtype=np.int32)
    calls = [(r.integers(0, V, 3).astype(np.int32), 0), (r.integers(0, V, 2).astype(np.int32), 3)]
    hiddens = [r.standard_normal((len(t), H)).astype(np.float32) for t, _ in calls]
    out = {}
    for dtype in ("float32", "bfloat16"):
        opts = EngineOptions(backend="cuda", dtype=dtype, max_concurrency=2, max_context=64,
                             prefill_chunk=16, page_size=4, num_kv_pages=20, graphs=False,
                             num_draft_tokens=4)
        gpu = cm.CudaModel(model_config(art), opts, artifact=art, mtp=True)
        kv_g = gpu.new_kv_pool(17, 4)
        kv_c = drafter.new_kv_pool(17, 4)
        res = {"logits": [], "hidden": [], "argmax_equal": [],
               "kv_layers": len(kv_g.k), "model_kv_layers": len(cpu.text.attention_layer_ids)}
        for (tokens, start), h in zip(calls if part == "step" else (), hiddens):
            if dtype == "bfloat16":          # what the device holds: the oracle takes the same
                h = h.astype(ml_dtypes.bfloat16).astype(np.float32)
            b = ForwardBatch.single(tokens, start, pages, 0)
            lg, gg = gpu.mtp_forward(b, h, kv_g)
            lc, gc = drafter.forward(b, h, kv_c)
            res["logits"].append(rel(lg, lc))
            res["hidden"].append(rel(gg, gc))
            res["argmax_equal"].append(bool((lg.argmax(1) == lc.argmax(1)).all()))
        if part == "verify":
            res.update(verify(gpu, cpu, r))
        if part == "step":
            res.update(chain(gpu, drafter, r, dtype))
        kv_g.close()
        gpu.close()
        out[dtype] = res
    return out


def _arrays(image) -> list:
    """Every array of a pool's page image (nested tuples and lists), in order."""
    if isinstance(image, (tuple, list)):
        return [a for part in image for a in _arrays(part)]
    return [np.array(image)]


def chain(gpu, drafter, r, dtype: str, steps: int = 3) -> dict:
    """CudaModel.mtp_chain (the drafts after d_1 in one call, each step's argmaxes fed to the
    next on the device) against mtp.draft_greedy step by step over the same CUDA model (each
    step's ids and MTP hidden down to the host and up again: the same launches, so the same
    drafts bit for bit) and over the numpy drafter (float32: the same drafts), for 2 rows after
    feeds of 5 and 3 positions; the drafter KV the chain wrote equals the stepwise one's."""
    from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter
    from ninfer.models.qwen3_5.mtp import draft_greedy
    V, H = drafter.text.vocab_size, drafter.text.hidden_size
    tables = np.arange(16, dtype=np.int32).reshape(2, 8)
    kv_g, kv_c = gpu.new_kv_pool(17, 4), drafter.new_kv_pool(17, 4)
    lens = (5, 3)
    feed = ForwardBatch(r.integers(0, V, sum(lens)).astype(np.int32),
                        ForwardBatch.text_positions([0, 0], list(lens)),
                        np.array([0, 5, 8], np.int32), np.zeros(2, np.int32), tables,
                        np.arange(2, dtype=np.int32))
    h = r.standard_normal((sum(lens), H)).astype(np.float32)
    if dtype == "bfloat16":
        h = h.astype(ml_dtypes.bfloat16).astype(np.float32)
    _, g = gpu.mtp_forward(feed, h, kv_g, with_logits=False)
    drafter.forward(feed, h, kv_c, with_logits=False)
    g1 = g[[4, 7]]
    feed_last = None
    if dtype == "float32":
        # the feed's call (mtp_argmax last_only): the rows' last MTP hidden states alone, as
        # mtp_forward has them, and their drafts (the numpy head's argmax of them). One dtype:
        # a simulated MTP step is ~half a minute, and this test stays within pytest's timeout
        kv_l = gpu.new_kv_pool(17, 4)
        ids_l, g_l = gpu.mtp_argmax(feed, h, kv_l, last_only=True)
        kv_l.close()
        feed_last = bool(np.array_equal(g_l, g1)
                         and np.array_equal(ids_l, drafter.draft_argmax(g1)))
    first = r.integers(0, V, 2).astype(np.int32)
    ctx = np.array(lens, np.int32)
    got = gpu.mtp_chain(g1, first, ctx, tables, steps, kv_g)
    kv_chain = _arrays(kv_g.read_pages(np.arange(16)))
    step, _ = draft_greedy(CudaDrafter(gpu), kv_g, g1, first, ctx, tables, steps,
                           with_logits=False)
    host, _ = draft_greedy(drafter, kv_c, g1, first, ctx, tables, steps, with_logits=False)
    kv_step = _arrays(kv_g.read_pages(np.arange(16)))
    out = {"feed_last_rows": feed_last,
           "chain_shape": list(got.shape), "chain_equals_stepwise": bool(np.array_equal(got, step)),
           "chain_equals_numpy": bool(np.array_equal(got, host)),
           "chain_kv_stepwise": len(kv_chain) > 0 and all(
               np.array_equal(a, b) for a, b in zip(kv_chain, kv_step))}
    kv_g.close()
    return out


def verify(gpu, cpu, r, k: int = 3) -> dict:
    """CudaModel.verify_forward over a row's last token and k drafts after a 3-token prefill:
    its logits and every token's final-normed hidden (the drafter's feed) against the numpy
    model's, and each snapshot slot 1 + i against the numpy State
    after the first i + 1 of those tokens (the row's own slot 0: after all of them)."""
    V = cpu.text.vocab_size
    pages = np.arange(16, dtype=np.int32)
    kv_g, st_g = gpu.new_kv_pool(17, 4), gpu.new_state_pool(2 + k + 1)
    kv_c, st_c = cpu.new_kv_pool(17, 4), cpu.new_state_pool(1)
    prompt = r.integers(0, V, 3).astype(np.int32)
    for model, kv, st in ((gpu, kv_g, st_g), (cpu, kv_c, st_c)):
        model.forward(ForwardBatch.single(prompt, 0, pages, 0), kv, st)
    pre = st_c.read(0)
    tokens = r.integers(0, V, k + 1).astype(np.int32)
    b = ForwardBatch.single(tokens, 3, pages, 0)
    lg, hg = gpu.verify_forward(b, kv_g, st_g, np.arange(k + 1), snap_base=[2])
    lc, hc = cpu.verify_forward(b, kv_c, st_c, np.arange(k + 1))
    state_err = []
    for i in range(k + 1):
        st_c.write(0, pre)
        cpu.forward(ForwardBatch.single(tokens[:i + 1], 3, pages, 0), kv_c, st_c)
        want = st_c.read(0)
        got = st_g.read(2 + i)
        state_err.append(max(rel(g, w) for g, w in zip(got[0] + got[1], want[0] + want[1])))
    own = st_g.read(0)
    own_err = max(rel(g, w) for g, w in zip(own[0] + own[1], want[0] + want[1]))
    untouched = st_g.read(1)               # between the row's slot and its snapshots
    kv_g.close()
    st_g.close()
    return {"verify_logits": rel(lg, lc), "verify_hidden": rel(hg, hc), "verify_states": state_err, "verify_own": own_err,
            "verify_untouched": bool(all(not np.any(a) for a in untouched[0] + untouched[1]))}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(run(a[0] if a else "dense", a[1] if len(a) > 1 else "step")))
