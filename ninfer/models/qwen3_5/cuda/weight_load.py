"""The CUDA model's weights into its arena: from an artifact (cuda/upload.py streams them; the
float32 model widens bf16 on the device) or random (tests, benches: filled on the device).

    load_weights(cfg, loader) -> {"embed", "lm_head", "norm", ..., "layers": [per-layer dict]}
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ....core.cuda import driver as _d
from ..load import text_param_shapes
from . import weights as wplan
from .upload import UploadJob, upload_all


@dataclass(frozen=True)
class WeightLoader:
    """What loading needs: the arena the weights live in, the kernels (widen, random fills),
    the stream, a device scratch of scratch_bytes (the cuBLASLt workspace, idle at load), and
    what makes the model's context current in a loader thread."""
    arena: object
    kernels: object
    stream: object
    f32: bool
    scratch: object
    scratch_bytes: int
    bind_context: object = None


def load_weights(cfg, loader: WeightLoader, *, artifact=None, seed: int = None,
                 tied: bool = False) -> dict:
    plans = [("", wplan.model_plan(cfg))] + \
        [(i, wplan.layer_plan(cfg, i)) for i in range(cfg.num_hidden_layers)]
    out = {"layers": []}
    jobs = []           # artifact weights, in arena order: read in parallel, uploaded in order
    for idx, plan in plans:
        arrs = {}
        for name, (shape, dt, sources) in plan.items():
            if tied and name == "lm_head":
                arrs[name] = arrs["embed"]       # tied: one device copy
                continue
            widen = loader.f32 and dt == wplan.BF16
            dtype = np.uint16 if dt == wplan.BF16 and not widen else np.float32
            a = loader.arena.take(shape, dtype, f"weight {name}")
            if artifact is not None:
                jobs.append(UploadJob(a, tuple(shape), dt, tuple(sources), widen))
            else:
                random_fill(loader, a, name, dt,
                            seed + 7919 * len(out["layers"]) + zlib.crc32(name.encode()))
            arrs[name] = a
        if idx == "":
            out.update(arrs)
        else:
            out["layers"].append(arrs)
    if jobs:
        staging = []            # the fp32 model's pinned buffer for widening, made on first use

        def widen_one(job, host):
            if not staging:
                staging.append(_d.PinnedBuffer(loader.scratch_bytes))
            upload_widened(loader, job.dst, host, staging[0])
        try:
            upload_all(artifact, jobs, loader.stream, text_param_shapes(cfg), widen_one,
                       bind_context=loader.bind_context)
        finally:
            for buf in staging:
                buf.free()
    return out


def upload_widened(loader: WeightLoader, a, bits, staging) -> None:
    """fp32 weight `a` = bf16 `bits` (host uint16), widened on the device (exact): pieces of the
    scratch's size go up as bf16 and are widened into place (half the PCIe traffic and host
    memory of widening on the host)."""
    flat = bits.reshape(-1)
    step = loader.scratch_bytes // 2
    for i in range(0, flat.size, step):
        piece = flat[i: i + step]
        # upload synchronises: the previous widening has read the scratch before it is reused
        _d.upload(loader.scratch.ptr, piece, loader.stream, staging)
        loader.kernels.widen_bf16.launch(loader.stream, (min((piece.size + 255) // 256, 65535),),
                                         (256,), (a.ptr + 4 * i, loader.scratch, piece.size))


def random_fill(loader: WeightLoader, a, name, dt, seed) -> None:
    scale, offset = wplan.random_spec(name, a.shape)
    n = int(np.prod(a.shape))
    k = loader.kernels.random_bf16 if dt == wplan.BF16 else loader.kernels.random_f32
    k.launch(loader.stream, (min((n + 255) // 256, 65535),), (256,),
             (a, n, seed & 0xFFFFFFFF, scale, offset))
