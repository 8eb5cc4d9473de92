"""The CUDA model's weights into its arena: from an artifact (cuda/upload.py streams them; the
float32 model widens bf16 on the device) or random (tests, benches: filled on the device).

    load_weights(cfg, loader) -> {"embed", "lm_head", "norm", ..., "layers": [per-layer dict]}
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ....core.cuda import driver as _d
from ....errors import DeviceError
from ..load import text_param_shapes
from . import qweights as qw
from . import weights as wplan
from .upload import RAW, UploadJob, upload_all


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


def quant_plans(cfg, artifact) -> dict:
    """{(layer index or "", name): segments} of every weight-plan matrix with a quantized
    source (qweights.py); empty for an unquantized artifact or random weights."""
    out = {}
    if artifact is None:
        return out
    plans = [("", wplan.model_plan(cfg))] + \
        [(i, wplan.layer_plan(cfg, i)) for i in range(cfg.num_hidden_layers)]
    for idx, plan in plans:
        for name, (shape, dt, sources) in plan.items():
            if dt != wplan.BF16 or name == "embed":
                continue        # vectors; the embedding is gathered (dequantized at load)
            segs = qw.matrix_plan(artifact, shape, sources)
            if segs is not None:
                out[(idx, name)] = segs
        if ((idx, "experts_gu") in out) != ((idx, "experts_down") in out):
            raise DeviceError(f"backend 'cuda': layer {idx}'s experts are packed in one projection "
                              "only (gate_up or down); the kernels need both or neither")
    return out


def load_weights(cfg, loader: WeightLoader, *, artifact=None, seed: int = None,
                 tied: bool = False, qplans: dict = None, mtp: bool = False,
                 dflash=None) -> dict:
    """mtp: the MTP head's arrays too, as out["mtp"] (weights.mtp_plan; never quantized);
    dflash (a DFlashConfig): that drafter's, as out["dflash"] = {fc, hidden_norm, norm,
    "layers": [...]} (weights.dflash_plans; never quantized)."""
    plans = [("", wplan.model_plan(cfg))] + \
        [(i, wplan.layer_plan(cfg, i)) for i in range(cfg.num_hidden_layers)]
    if mtp:
        plans.append(("mtp", wplan.mtp_plan(cfg)))
    expected = text_param_shapes(cfg)
    if dflash is not None:
        from ..dflash import dflash_param_shapes
        plans += wplan.dflash_plans(dflash)
        expected = {**expected, **dflash_param_shapes(dflash)}
    qplans = qplans or {}
    out = {"layers": []}
    jobs = []           # artifact weights, in arena order: read in parallel, uploaded in order
    for idx, plan in plans:
        arrs = {}
        for name, (shape, dt, sources) in plan.items():
            if tied and name == "lm_head" and (idx, name) not in qplans:
                arrs[name] = arrs["embed"]       # tied: one device copy
                continue
            if (idx, name) in qplans:
                arrs[name] = _quantized_matrix(loader, shape, qplans[(idx, name)], artifact, jobs)
                continue
            widen = loader.f32 and dt == wplan.BF16
            dtype = np.uint16 if dt == wplan.BF16 and not widen else np.float32
            a = loader.arena.take(shape, dtype, f"weight {name}")
            if artifact is not None:
                if widen and any(artifact.has(n) and artifact.is_quantized(n) for n, _ in sources):
                    # decoded at load (an embedding sharing a quantized lm_head's object): the
                    # float32 model takes the decoded float32 values as they are, not via bf16
                    dt, widen = wplan.F32, False
                jobs.append(UploadJob(a, tuple(shape), dt, tuple(sources), widen))
            else:
                if isinstance(idx, tuple):        # a DFlash drafter's (random_spec's norms)
                    random_fill(loader, a, "dflash." + name, dt,
                                seed + zlib.crc32(f"dflash.{idx[1]}.{name}".encode()))
                else:
                    random_fill(loader, a, name, dt,
                                seed + 7919 * len(out["layers"]) + zlib.crc32(name.encode()))
            arrs[name] = a
        if idx == "":
            out.update(arrs)
        elif idx == "mtp":
            out["mtp"] = arrs
        elif isinstance(idx, tuple):          # ("dflash", None | layer)
            d = out.setdefault("dflash", {"layers": []})
            if idx[1] is None:
                d.update(arrs)
            else:
                d["layers"].append(arrs)
        else:
            out["layers"].append(arrs)
    if jobs:
        staging = []            # the fp32 model's pinned buffer for widening, made on first use

        def widen_one(job, host):
            if not staging:
                staging.append(_d.PinnedBuffer(loader.scratch_bytes))
            upload_widened(loader, job.dst, host, staging[0])
        try:
            upload_all(artifact, jobs, loader.stream, expected, widen_one,
                       bind_context=loader.bind_context)
        finally:
            for buf in staging:
                buf.free()
    return out


class _At:
    """An upload destination inside an arena array (a source's rows within a segment)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)


def _quantized_matrix(loader: WeightLoader, shape, segs, artifact, jobs) -> qw.QMatrix:
    """Arena regions of a QMatrix's segments, and the jobs that fill them: bf16 segments
    through read_host (widened for a float32 model), codes / scales / zeros as stored."""
    out = []
    for seg in segs:
        if seg.layout == qw.BF16:
            widen = loader.f32
            w = loader.arena.take((seg.experts, seg.rows, seg.k),
                                  np.float32 if widen else np.uint16, "weight segment")
            esize = 4 if widen else 2
            for part in seg.parts:
                jobs.append(UploadJob(_At(w.ptr + esize * part.row0 * seg.k), (part.rows, seg.k),
                                      wplan.BF16, ((part.name, part.rows),), widen))
            out.append(qw.QSegment(seg, w))
            continue
        sshape = seg.scale_shape
        w = loader.arena.take((seg.experts * seg.rows * seg.row_bytes,), np.uint8, "weight codes")
        scale = loader.arena.take(sshape, np.float32, "weight scales")
        zero = loader.arena.take(sshape, np.uint8, "weight zero points") if seg.asym else None
        br, sc_cols = seg.block[0], sshape[-1]
        for part in seg.parts:
            s0 = part.row0 // br * sc_cols          # merged parts start on whole row blocks
            ns = -(-part.rows // br) * sc_cols * seg.experts
            jobs.append(UploadJob(_At(w.ptr + part.row0 * seg.row_bytes),
                                  (seg.experts * part.rows * seg.row_bytes,), RAW, (),
                                  host=lambda p=part, lay=seg.layout:
                                  qw.codes_host(artifact, p, lay)))
            jobs.append(UploadJob(_At(scale.ptr + 4 * s0), (4 * ns,), RAW, (),
                                  host=lambda p=part: qw.scale_host(artifact, p, sc_cols)))
            if zero is not None:
                jobs.append(UploadJob(_At(zero.ptr + s0), (ns,), RAW, (),
                                      host=lambda p=part: qw.zero_host(artifact, p)))
        out.append(qw.QSegment(seg, w, scale, zero))
    return qw.QMatrix(tuple(shape), tuple(out))


def int8_head(loader: WeightLoader, lm_head, rows: int, k: int) -> qw.QMatrix:
    """The MTP drafts' int8 head (qweights.int8_head_plan) of the loaded lm_head's first `rows`
    rows, quantized on the device (kernels/act_quant.py head_quant_int8; queued on the loader's
    stream)."""
    plan = qw.int8_head_plan(rows, k)
    codes = loader.arena.take((rows * k,), np.uint8, "draft head codes")
    scale = loader.arena.take(plan.scale_shape, np.float32, "draft head scales")
    loader.kernels.head_quant_int8.launch(
        loader.stream, (rows, -(-k // (plan.block[1] * qw.ACT_QUANT_WARPS))),
        (32 * qw.ACT_QUANT_WARPS,),
        (lm_head, codes, scale, rows, k))
    return qw.QMatrix((rows, k), (qw.QSegment(plan, codes, scale),))


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
