"""Quality of the quantized formats: perplexity of each `--quantize` format against the bf16
conversion of the same checkpoint, on the same tokens (issue 13's quality gates).

    python bench/quant_quality.py CKPT_DIR --text heldout.txt [--max-tokens 4096]
    python bench/quant_quality.py --reference dense        # a trained reference model (issue 14)
    python bench/quant_quality.py tests/fixtures/dense            # no text: the fixture's ids

    python bench/quant_quality.py --reference dense --formats bf16 --kv-dtype fp8,int8
    python bench/quant_quality.py --reference dense --formats bf16,int4-gptq --gptq REFIT=0

Prints one row per format: weight bytes (every stored object but the frontend resources), mean
NLL, perplexity, its increase over bf16 with the standard error of that increase (paired
per-token NLL differences: how much of it the text's length can resolve), and the mean
KL(bf16 || format) of the next-token distributions. Scores with CausalScoring on the numpy
backend unless --backend cuda (fp8 there twice: its prefill GEMMs on the fp8 tensor cores,
the activations quantized per token and 128 columns, and "-exact-act" with the weights
dequantized to bf16).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ninfer import Engine  # noqa: E402
from ninfer.artifact import Artifact  # noqa: E402
from ninfer.convert import Quantize, convert_checkpoint  # noqa: E402

# name -> recipe arguments (None: value-preserving); the first rows are the CLI's formats
FORMATS = {
    "bf16": None,
    "fp8": dict(format="fp8"),
    "int8": dict(format="int8"),
    "int4": dict(format="int4"),
    "int8-channel": dict(format="int8", group=None),
    "int4-sym": dict(format="int4", asymmetric=False),
    "int8+head": dict(format="int8", quantize_lm_head=True),
    "int4+head": dict(format="int4", quantize_lm_head=True),
    # calibrated (GPTQ, ninfer/convert/gptq.py) on --calibration, never the held-out text;
    # int4-gptq: the recipe's default group (quantize.CALIBRATED_INT4_GROUP)
    "int4-gptq": dict(format="int4", calibration=True),
    "int4-gptq-oneshot": dict(format="int4", group=128, calibration=True, sequential=False),
    "int4-gptq-sym": dict(format="int4", group=128, asymmetric=False, calibration=True),
    "int8-gptq": dict(format="int8", calibration=True),
    "fp8-gptq": dict(format="fp8", calibration=True),
    "int4-g64": dict(format="int4", group=64),
    "int4-g32": dict(format="int4", group=32),
    "int4-g128-gptq": dict(format="int4", group=128, calibration=True),
    "int4-g64-gptq": dict(format="int4", group=64, calibration=True),
    "int4-g32-gptq": dict(format="int4", group=32, calibration=True),
}
CALIBRATION_CHARS = 60_000          # ~ 16K tokens of Python source; the recipe uses the first 8192


def stdlib_calibration(heldout: pathlib.Path | None, chars: int = CALIBRATION_CHARS) -> str:
    """Calibration text for the reference models: standard-library files of their *training*
    split (tools/reference_corpus.py), every 24th, skipping any file the held-out text contains."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    import sysconfig

    from reference_corpus import HELD_OUT_EVERY, read_source, stdlib_files
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    held = set()
    if heldout is not None:
        held = {line[len("# file: "):] for line in heldout.read_text().splitlines()
                if line.startswith("# file: ")}
    parts, size = [], 0
    for k, p in enumerate(stdlib_files(root)):
        rel = p.relative_to(root).as_posix()
        if k % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 or rel in held or k % 24:
            continue
        src = read_source(p)
        if src:
            parts.append(f"# file: {rel}\n{src}")
            size += len(parts[-1])
        if size >= chars:
            break
    return "<|endoftext|>".join(parts)[:chars]


def set_gptq_knobs(spec: str) -> None:
    """NAME=VALUE,... -> the module constants of ninfer/convert/gptq.py (numbers only)."""
    from ninfer.convert import gptq
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if not name.isupper() or not isinstance(getattr(gptq, name, None), (bool, int, float)):
            raise SystemExit(f"--gptq {item!r}: no numeric knob {name!r} in gptq.py")
        setattr(gptq, name, type(getattr(gptq, name))(float(value)))


def fixture_ids(ckpt: pathlib.Path) -> np.ndarray:
    with np.load(ckpt / "reference.npz") as z:
        return np.concatenate([z[f"prefill_ids_{s}"] for s in range(len(z["prefill_lengths"]))])


def score(path, ids, backend: str, chunk: int, kl_tokens: int, kv_dtype: str = "bfloat16",
          fp8_activations=None):
    """(per-prediction NLL, log-softmax rows of the first kl_tokens positions): the logits of a
    real vocabulary are 1 MB per token, so the KL uses a prefix."""
    with Engine(path, backend=backend, purpose="scoring", prefill_chunk=chunk,
                kv_dtype=kv_dtype, fp8_activations=fp8_activations) as engine:
        res = engine.score(ids, return_logits=True)
    nll = -np.asarray(res.logprobs, np.float64)
    logits = np.array(res.logits[:kl_tokens], np.float64)
    del res
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return nll, logp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt", type=pathlib.Path, nargs="?", help="an unquantized HF checkpoint directory")
    ap.add_argument("--reference", help="a trained reference model (dense, moe), expanded here; "
                                        "default text: its held-out file")
    ap.add_argument("--text", type=pathlib.Path, help="held-out text (default: a fixture's ids)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--skip-tokens", type=int, default=0,
                    help="score the text from this token on (a second, disjoint slice)")
    ap.add_argument("--gptq", default="",
                    help="GPTQ ablations: comma-separated NAME=VALUE of ninfer/convert/gptq.py's "
                         "knobs, e.g. JOINT_CLIP=0,REFIT=0 (the GPTQ before issue 24 step 5), "
                         "ACT_ORDER=0, DAMP=0.1")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--calibration", type=pathlib.Path,
                    help="calibration text of the -gptq formats (default: standard-library files "
                         "of the reference models' training split)")
    ap.add_argument("--calibration-tokens", type=int, default=None,
                    help="tokens of the calibration text the -gptq formats use (default: the "
                         "recipe's, 8192)")
    ap.add_argument("--kv-dtype", default="",
                    help="also score the bf16 weights with these KV cache dtypes, e.g. fp8,int8 "
                         "(rows kv-fp8, kv-int8)")
    ap.add_argument("--kl-tokens", type=int, default=256, help="positions the KL averages over")
    args = ap.parse_args(argv)
    names = args.formats.split(",")
    set_gptq_knobs(args.gptq)
    with tempfile.TemporaryDirectory() as tmp:
        if args.reference:
            from ninfer import reference_models as rm
            args.ckpt = rm.expand_to_checkpoint(rm.model_path(args.reference),
                                                pathlib.Path(tmp) / args.reference)
            args.text = args.text or rm.MODELS_DIR / "heldout.txt"
        elif args.ckpt is None:
            ap.error("give a checkpoint directory or --reference")
        rows, base = [], None
        calibration = None
        if any("gptq" in n for n in names):
            calibration = args.calibration.read_text() if args.calibration else \
                stdlib_calibration(args.text if args.reference else None)
        for name in ["bf16"] + [n for n in names if n != "bf16"]:
            kw = FORMATS[name]
            if kw and kw.get("calibration"):
                kw = dict(kw, calibration=calibration)
                if args.calibration_tokens:
                    kw["calibration_tokens"] = args.calibration_tokens
            path = pathlib.Path(tmp) / f"{name}.ninfer"
            convert_checkpoint(args.ckpt, path, progress=False,
                               recipe=Quantize(**kw) if kw else None)
            if base is None:
                with Engine(path, purpose="scoring") as engine:
                    ids = engine.tokenize(args.text.read_text()) if args.text \
                        else fixture_ids(args.ckpt)
                ids = np.asarray(ids[args.skip_tokens:args.skip_tokens + args.max_tokens],
                                 np.int32)
            with Artifact(path) as art:        # weights: every object but the resources
                nbytes = sum(o["nbytes"] for o in art.manifest["objects"]
                             if not o["name"].startswith("resource/"))
            # fp8 on cuda: the scoring prefill with the activations on fp8 tensor cores (W8A8,
            # asked for: scoring's default is off), and again with the weights dequantized
            # ("-exact-act", scoring's default)
            w8 = (True, False) if name.startswith("fp8") and args.backend == "cuda" else (None,)
            for fp8_act in w8:
                nll, logp = score(path, ids, args.backend, args.chunk, args.kl_tokens,
                                  fp8_activations=fp8_act)
                if base is None:
                    base = (nll, logp)
                kl = float(np.mean(np.sum(np.exp(base[1]) * (base[1] - logp), axis=-1)))
                rows.append((name + ("-exact-act" if fp8_act is False else ""), nbytes,
                             nll - base[0], nll.mean(), kl))
            if name == "bf16":                 # quantized KV cache over the bf16 weights
                for kv in filter(None, args.kv_dtype.split(",")):
                    nll, logp = score(path, ids, args.backend, args.chunk, args.kl_tokens, kv)
                    kl = float(np.mean(np.sum(np.exp(base[1]) * (base[1] - logp), axis=-1)))
                    rows.append((f"kv-{kv}", nbytes, nll - base[0], nll.mean(), kl))
    print(f"{args.ckpt.name}: {len(ids)} tokens (KL over the first {min(len(ids) - 1, args.kl_tokens)})"
          f", backend {args.backend}")
    print(f"{'format':18s} {'weight MB':>9s} {'nll':>9s} {'ppl':>10s} {'ppl +%':>8s} {'+- se':>6s} "
          f"{'KL':>9s}")
    for name, size, diff, nll, kl in rows:
        inc = (np.exp(diff.mean()) - 1) * 100
        se = 100 * diff.std() / np.sqrt(len(diff))
        print(f"{name:18s} {size / 1e6:9.4f} {nll:9.5f} {np.exp(nll):10.4f} {inc:8.3f} {se:6.2f} "
              f"{kl:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
