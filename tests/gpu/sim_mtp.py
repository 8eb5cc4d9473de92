"""The MTP head's step on the CUDA backend (CudaModel.mtp_forward, StepRunner.mtp) on the CPU:
sim_model.py's machine (kernels on numba-cuda's simulator, cuBLASLt as numpy products, fake
device memory) against the numpy drafter (MtpDrafter.forward) of the same artifact, over a row
of 5 tokens and then 2 more that attend to their KV. Prints JSON:
{"<dtype>": {"logits": [rel err per call], "hidden": [...], "argmax_equal": [...]}}

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_mtp.py [dense|moe]
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


def run(kind: str = "dense") -> dict:
    machine = Machine(96 << 20)
    install(machine)
    art = mtp_artifact(kind)
    cpu = NumpyModel.from_artifact(art)
    drafter = MtpDrafter.from_artifact(art, cpu)
    H = cpu.text.hidden_size
    r = np.random.default_rng(2)
    V = cpu.text.vocab_size
    pages = np.arange(16, dtype=np.int32)
    calls = [(r.integers(0, V, 5).astype(np.int32), 0), (r.integers(0, V, 2).astype(np.int32), 5)]
    hiddens = [r.standard_normal((len(t), H)).astype(np.float32) for t, _ in calls]
    out = {}
    for dtype in ("float32", "bfloat16"):
        opts = EngineOptions(backend="cuda", dtype=dtype, max_concurrency=1, max_context=64,
                             prefill_chunk=16, page_size=4, num_kv_pages=20, graphs=False)
        gpu = cm.CudaModel(model_config(art), opts, artifact=art, mtp=True)
        kv_g = gpu.new_kv_pool(17, 4)
        kv_c = drafter.new_kv_pool(17, 4)
        res = {"logits": [], "hidden": [], "argmax_equal": [],
               "kv_layers": len(kv_g.k), "model_kv_layers": len(cpu.text.attention_layer_ids)}
        for (tokens, start), h in zip(calls, hiddens):
            if dtype == "bfloat16":          # what the device holds: the oracle takes the same
                h = h.astype(ml_dtypes.bfloat16).astype(np.float32)
            b = ForwardBatch.single(tokens, start, pages, 0)
            lg, gg = gpu.mtp_forward(b, h, kv_g)
            lc, gc = drafter.forward(b, h, kv_c)
            res["logits"].append(rel(lg, lc))
            res["hidden"].append(rel(gg, gc))
            res["argmax_equal"].append(bool((lg.argmax(1) == lc.argmax(1)).all()))
        kv_g.close()
        gpu.close()
        out[dtype] = res
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "dense")))
