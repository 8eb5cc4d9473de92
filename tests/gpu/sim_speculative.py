"""Speculative units of a Program on the CUDA model (issue 25: program/speculative.py through
cuda/drafter.py, CudaModel.verify_forward with State snapshots, DeviceStatePool.copy) on the CPU:
sim_model.py's machine (kernels on numba-cuda's simulator, cuBLASLt as numpy products, fake
device memory), float32, against the same Program on the numpy model (its recompute rollback).
Two rows (greedy and seeded) of the tiny model with a random MTP head (drafts mostly rejected,
so the snapshot rollback runs), k = 2, fixed: a prefill unit, then speculative units. Prints
JSON: {"tokens_cuda": [...], "tokens_numpy": [...], "stats_cuda": {...}, "stats_numpy": {...}}

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_speculative.py [units]

(the whole target model on the simulator: many minutes.)
"""
import dataclasses
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sim_model import Machine, install   # noqa: E402  (the simulator switched on first)
from sim_patches import fake_libdevice, fix_shared_array_race   # noqa: E402

from ninfer.models import model_config   # noqa: E402
from ninfer.models.qwen3_5 import cuda_model as cm   # noqa: E402
from ninfer.models.qwen3_5.cuda.drafter import CudaDrafter   # noqa: E402
from ninfer.models.qwen3_5.model import NumpyModel   # noqa: E402
from ninfer.models.qwen3_5.mtp import MtpDrafter   # noqa: E402
from ninfer.models.qwen3_5.program import Program, RowDecision, SamplingSpec   # noqa: E402
from ninfer.options import EngineOptions   # noqa: E402
from tiny_model import mtp_artifact   # noqa: E402

SPECS = [SamplingSpec(seed=0), SamplingSpec(seed=5, temperature=0.9, top_p=0.95)]
STAT_KEYS = ("spec_verify_rows", "spec_draft_tokens", "spec_accepted_tokens",
             "spec_recompute_rows", "spec_snapshot_selects", "spec_drafts_behind_verify")


def drive(model, drafter, opts, prompts, units: int) -> tuple:
    """Each row's tokens after `units` units (every produced token accepted), and the stats."""
    prog = Program(model, opts, drafter=drafter)
    sids = [prog.bind(p, spec) for p, spec in zip(prompts, SPECS)]
    out = {s: [] for s in sids}
    for _ in range(units):
        assert prog.reserve_units(sids) == [True] * len(sids)
        pending = prog.execute(sids)
        prog.commit(pending, [RowDecision(len(r.produced)) for r in pending.rows])
        for row in pending.rows:
            out[row.seq_id] += [int(t) for t in row.produced]
    stats = prog.stats()
    return [out[s] for s in sids], {k: stats[k] for k in STAT_KEYS}


def run(units: int = 4) -> dict:
    machine = Machine(96 << 20)
    install(machine)
    fix_shared_array_race()          # (the device sampler's kernels: shared arrays, libdevice)
    fake_libdevice()
    art = mtp_artifact("dense")
    cfg = model_config(art)
    opts = EngineOptions(backend="cuda", dtype="float32", max_concurrency=2, max_context=32,
                         prefill_chunk=16, page_size=4, num_kv_pages=16, graphs=False,
                         prefix_cache=False, speculative="mtp", num_draft_tokens=2,
                         draft_policy="fixed")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.text.vocab_size, n).astype(np.int32) for n in (5, 3)]
    cpu = NumpyModel.from_artifact(art)
    want, want_stats = drive(cpu, MtpDrafter.from_artifact(art, cpu),
                             dataclasses.replace(opts, backend="numpy"), prompts, units)
    gpu = cm.CudaModel(cfg, opts, artifact=art, mtp=True)
    try:
        got, got_stats = drive(gpu, CudaDrafter(gpu), opts, prompts, units)
    finally:
        gpu.close()
    return {"tokens_cuda": got, "tokens_numpy": want, "stats_cuda": got_stats,
            "stats_numpy": want_stats}


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 4)))
