"""`convert_checkpoint`: a Hugging Face Qwen3.5 checkpoint directory -> one `.ninfer` v3 file.

Two phases. `plan_conversion` maps and validates every source name and shape against the config
without reading a payload byte, so a bad checkpoint fails in seconds and writes nothing. `_write`
then streams each object (a tensor in row blocks, fused experts one expert at a time) through the
recipe into an ArtifactWriter, which renames its partial file into place only when all succeeded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import tempfile
from dataclasses import dataclass, field

import numpy as np

from ..artifact import ArtifactWriter
from ..errors import ConvertError
from ..models.qwen3_5.config import TextConfig
from . import names as N
from .calibrate import input_hessians
from .quantize import SCALE_SUFFIX, Quantize, QuantPlan, plan_release_fp8, write_quantized
from .recipe import Recipe, ValuePreserving
from .source import CheckpointSource, DrafterSource


@dataclass
class ObjectPlan:
    name: str                    # object name, also the logical name it carries
    shape: tuple
    source_dtype: np.dtype
    sources: list                # source tensor names, concatenated in this order (row-major)
    quant: QuantPlan | None = None   # stored quantized (an FP8 release, or recipe Quantize)


@dataclass
class ConversionPlan:
    objects: list = field(default_factory=list)
    views: dict = field(default_factory=dict)       # logical name -> (object, view dict)
    aliases: dict = field(default_factory=dict)     # logical name -> object (tied lm_head)
    tied_lm_head: bool = False
    expert_layout: str | None = None                # "per_expert" | "fused" | None (dense)
    ignored: list = field(default_factory=list)     # source names deliberately not imported
    scales: dict = field(default_factory=dict)      # FP8 release: weight source -> its scale_inv

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(o.shape)) * o.source_dtype.itemsize for o in self.objects)


def convert_checkpoint(src_dir, out_path, *, name: str | None = None, progress: bool = True,
                       recipe: Recipe | None = None, defaults: dict | None = None,
                       open_source=CheckpointSource, dflash_dir=None) -> str:
    """Convert `src_dir` into `out_path`. Raises ConvertError (bad source) or ArtifactError (cannot
    write); either way no file is left at `out_path` (an existing one is untouched). `defaults`:
    the model's run defaults stored as metadata.defaults (e.g. {"enable_thinking": False}).
    `open_source`: how `src_dir` is opened (a CheckpointSource subclass; bench_engine's random
    source makes tensors as they are read, so a 70 GB model needs no checkpoint on disk).
    `dflash_dir`: a DFlash drafter's directory for this model (config.json + safetensors,
    z-lab's layout), stored as the `dflash` component as it is (docs/artifact.md section 8)."""
    recipe = recipe or ValuePreserving()
    src_dir, out_path = _fspath(src_dir, "src"), _fspath(out_path, "out")
    with open_source(src_dir) as src:
        if src.quantization is None:        # (an FP8 release with a Quantize recipe is refused)
            recipe.prepare(functools.partial(hessians_for_checkpoint, src_dir))
        plan = plan_conversion(src, recipe)
        metadata = {"recipe": recipe.name, "tied_lm_head": plan.tied_lm_head,
                    "source": {"architecture": src.config.architecture,
                               "expert_layout": plan.expert_layout,
                               "files": sorted({t.file for t in src.tensors.values()})}}
        if src.quantization is not None:
            metadata["quantization"] = {"format": "fp8", "from": "checkpoint",
                                        "block": list(src.quantization["block"])}
        elif any(o.quant for o in plan.objects):
            metadata["quantization"] = recipe.describe()
        if defaults:
            metadata["defaults"] = dict(defaults)
        with contextlib.ExitStack() as stack:
            drafter = None if dflash_dir is None else \
                stack.enter_context(DrafterSource(_fspath(dflash_dir, "dflash_dir"), src.config.text))
            drafter_plan = None if drafter is None else _plan_drafter(drafter)
            config = src.config if drafter is None else \
                dataclasses.replace(src.config, dflash=drafter.dflash)
            with ArtifactWriter(out_path, config, name=name, metadata=metadata) as writer:
                _write(src, plan, recipe, writer, progress)
                if drafter is not None:
                    _write_drafter(drafter, drafter_plan, writer)
    return out_path


def _plan_drafter(drafter: DrafterSource) -> list:
    """[(logical name, source name)] of a DFlash drafter's tensors, every one the config implies
    with its shape, nothing else."""
    from ..models.qwen3_5.dflash import PREFIX, dflash_param_shapes
    expected = dflash_param_shapes(drafter.dflash)
    names = {PREFIX + s: s for s in drafter.tensors}
    for lg, shape in expected.items():
        if lg not in names:
            raise ConvertError(f"{drafter.dir}: missing drafter tensor {lg[len(PREFIX):]!r} "
                               f"(expected shape {list(shape)})")
        got = tuple(drafter.tensors[names[lg]].shape)
        if got != tuple(shape):
            raise ConvertError(f"{drafter.dir}: drafter tensor {names[lg]!r}: expected shape "
                               f"{list(shape)} from its config.json, got {list(got)}")
    extra = sorted(set(names) - set(expected), key=_natural_key)
    if extra:
        raise ConvertError(f"{drafter.dir}: unexpected drafter tensor {names[extra[0]]!r} (its "
                           "config.json implies no such parameter; DFlash2 is not supported)")
    return [(lg, names[lg]) for lg in sorted(expected, key=_natural_key)]


def _write_drafter(drafter: DrafterSource, plan: list, writer: ArtifactWriter) -> None:
    """The drafter's tensors as stored (value-preserving), one object and binding each."""
    for logical, source in plan:
        info = drafter.tensors[source]
        with writer.begin_object(logical, info.dtype, info.shape, "row_major") as sink:
            for piece in drafter.read_chunks(source):
                sink.write(piece)
        writer.bind(logical, logical)


def hessians_for_checkpoint(src_dir, text: str, max_tokens: int, quantize=None) -> dict:
    """Convert `src_dir` value-preserving into a temporary artifact and calibrate on it
    (calibrate.input_hessians)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "calibration.ninfer"
        convert_checkpoint(src_dir, path, progress=False)
        return input_hessians(path, text, max_tokens, quantize)


def _fspath(path, role: str) -> str:
    try:
        return os.fspath(path)
    except TypeError:
        raise ConvertError(f"{role} {path!r} is not a file path (str or os.PathLike)") from None


# ------------------------------------------------------------------------------------ planning

def _natural_key(s: str):
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", s)]


def plan_conversion(src: CheckpointSource, recipe: Recipe | None = None) -> ConversionPlan:
    """Map and validate every source tensor; read no payload."""
    t = src.config.text
    plan = ConversionPlan()
    whole, experts = _collect(src, plan)
    has_lm_head = "text.lm_head.weight" in whole
    plan.tied_lm_head = t.tie_word_embeddings or not has_lm_head
    if plan.tied_lm_head and has_lm_head:       # config ties: HF would overwrite it with the embedding
        plan.ignored.append(whole.pop("text.lm_head.weight"))
    expected = N.expected_text_shapes(t, with_lm_head=not plan.tied_lm_head)
    _check_text(src, whole, experts, expected)
    _check_expert_groups(src, t, experts, whole)
    plan.expert_layout = ("per_expert" if experts else "fused") if t.is_moe else None
    plan.objects = _object_plans(src, whole, experts)
    if plan.tied_lm_head:
        plan.aliases["text.lm_head.weight"] = "text.embed_tokens.weight"
    for o in plan.objects:                   # gate/up halves of every fused expert object
        if o.name.endswith(".mlp.experts." + N.FUSED_GATE_UP) and len(o.shape) == 3 \
                and o.shape[1] % 2 == 0 and o.shape[1] > 0:
            base, I = o.name.rsplit(".", 1)[0], o.shape[1] // 2
            plan.views[base + ".gate_proj"] = (o.name, {"kind": "slice", "axis": 1, "start": 0, "stop": I})
            plan.views[base + ".up_proj"] = (o.name, {"kind": "slice", "axis": 1, "start": I, "stop": 2 * I})
    _plan_quantization(src, plan, recipe or ValuePreserving())
    return plan


def _plan_quantization(src: CheckpointSource, plan: ConversionPlan, recipe: Recipe) -> None:
    """Which objects are stored quantized: those of an FP8 release as they are, or the recipe's
    choice from an unquantized checkpoint."""
    if src.quantization is not None:
        if isinstance(recipe, Quantize):
            raise ConvertError(f"{src.dir}: the checkpoint is already quantized (FP8); convert it "
                               "without --quantize (its FP8 weights are imported as they are)")
        plan_release_fp8(src, plan)
        return
    for o in plan.objects:          # float8 codes without a config have no known scales
        bad = next((s for s in o.sources if src.tensors[s].dtype.itemsize == 1
                    and src.tensors[s].dtype.kind == "V"), None)
        if bad is not None:
            raise ConvertError(f"tensor {bad!r} is {src.tensors[bad].dtype} but config.json has no "
                               "FP8 quantization_config (its scales cannot be interpreted)")
    for o in plan.objects:
        if N.component(o.name) != "text" or len(o.shape) < 2:
            continue
        tied_head = plan.tied_lm_head and o.name == "text.embed_tokens.weight"
        if recipe.selects("text.lm_head.weight" if tied_head else o.name):
            gate_up = o.name.endswith(".mlp.experts." + N.FUSED_GATE_UP)
            o.quant = recipe.quant_plan(o.name, o.shape, o.shape[-2] // 2 if gate_up else o.shape[-2])


def _collect(src: CheckpointSource, plan: ConversionPlan) -> tuple[dict, dict]:
    """({logical: source} of whole tensors, {experts base: {proj: {e: source}}} of per-expert ones)."""
    whole: dict[str, str] = {}
    experts: dict[str, dict] = {}
    for s in sorted(src.tensors, key=_natural_key):
        if src.quantization is not None and s.endswith(SCALE_SUFFIX):
            plan.scales[s[:-len(SCALE_SUFFIX)] + ".weight"] = s
            continue
        lg = N.logical_name(s)
        if lg is None:
            plan.ignored.append(s)
            continue
        m = N.PER_EXPERT.match(lg)
        if m:
            slot = experts.setdefault(m["base"], {}).setdefault(m["proj"], {})
            prev = slot.setdefault(int(m["e"]), s)
            if prev != s:
                raise ConvertError(f"tensors {prev!r} and {s!r} both map to expert {m['e']} "
                                   f"{m['proj']} of {m['base']}")
            continue
        if lg in whole:
            raise ConvertError(f"tensors {whole[lg]!r} and {s!r} both map to {lg}")
        whole[lg] = s
    return whole, experts


def _object_plans(src: CheckpointSource, whole: dict, experts: dict) -> list:
    """One object per whole tensor, two (gate_up, down) per per-expert group, in natural order."""
    names = set(whole) | {f"{b}.{leaf}" for b in experts for leaf in (N.FUSED_GATE_UP, N.FUSED_DOWN)}
    objects = []
    for lg in sorted(names, key=_natural_key):
        if lg in whole:
            info = src.tensors[whole[lg]]
            objects.append(ObjectPlan(lg, info.shape, info.dtype, [whole[lg]]))
            continue
        base, leaf = lg.rsplit(".", 1)
        group = experts[base]
        E = len(group["down_proj"])
        first = src.tensors[group["gate_proj"][0]]
        if leaf == N.FUSED_GATE_UP:             # expert e: its gate rows, then its up rows
            I, H = first.shape
            sources = [s for e in range(E) for s in (group["gate_proj"][e], group["up_proj"][e])]
            objects.append(ObjectPlan(lg, (E, 2 * I, H), first.dtype, sources))
        else:
            H, I = src.tensors[group["down_proj"][0]].shape
            objects.append(ObjectPlan(lg, (E, H, I), first.dtype,
                                      [group["down_proj"][e] for e in range(E)]))
    return objects


def _source_guess(src: CheckpointSource, logical: str) -> str:
    if logical == "text.lm_head.weight":
        return "lm_head.weight"
    prefix = "model.language_model." if any(s.startswith("model.language_model.") for s in src.tensors) \
        else "model."
    return prefix + logical[len("text."):]


def _check_text(src, whole: dict, experts: dict, expected: dict) -> None:
    for lg, shape in expected.items():
        base = lg.rsplit(".", 1)[0]
        if base in experts:
            if lg in whole:
                raise ConvertError(f"{base}: checkpoint holds both per-expert and fused expert "
                                   f"tensors ({whole[lg]!r})")
            continue                         # checked per expert in _check_expert_groups
        if lg not in whole:
            raise ConvertError(f"missing tensor {_source_guess(src, lg)!r} "
                               f"(logical {lg}, expected shape {list(shape)})")
        got = src.tensors[whole[lg]].shape
        if tuple(got) != tuple(shape):
            raise ConvertError(f"tensor {whole[lg]!r}: expected shape {list(shape)} from config.json, "
                               f"got {list(got)}")
    for lg, s in whole.items():
        if N.component(lg) == "text" and lg not in expected:
            raise ConvertError(f"unexpected tensor {s!r} (logical {lg}): config.json implies no "
                               "such text parameter")
    for base, group in experts.items():
        if N.component(base) == "text" and base + "." + N.FUSED_GATE_UP not in expected:
            some = next(iter(next(iter(group.values())).values()))
            raise ConvertError(f"unexpected tensor {some!r}: config.json implies no experts at {base}")


def _check_expert_groups(src, t: TextConfig, experts: dict, whole: dict) -> None:
    for base, group in experts.items():
        if not t.is_moe:
            raise ConvertError(f"{base}: per-expert tensors in a dense ({src.config.architecture}) "
                               "checkpoint")
        if base + "." + N.FUSED_GATE_UP in whole or base + "." + N.FUSED_DOWN in whole:
            raise ConvertError(f"{base}: checkpoint holds both per-expert and fused expert tensors")
        dtypes = set()
        for proj in N.EXPERT_PROJS:
            got = group.get(proj, {})
            extra = sorted(set(got) - set(range(t.num_experts)))
            if extra:
                raise ConvertError(f"unexpected tensor {got[extra[0]]!r}: config.json has "
                                   f"{t.num_experts} experts")
            for e in range(t.num_experts):
                if e not in got:
                    raise ConvertError(f"missing tensor for expert {e} {proj} of {base} "
                                       f"({t.num_experts} experts expected)")
                info = src.tensors[got[e]]
                want = N.expert_piece_shape(t, proj)
                if tuple(info.shape) != want:
                    raise ConvertError(f"tensor {got[e]!r}: expected shape {list(want)} from "
                                       f"config.json, got {list(info.shape)}")
                dtypes.add(info.dtype)
        if len(dtypes) > 1:
            raise ConvertError(f"{base}: experts mix dtypes {sorted(map(str, dtypes))}; one fused "
                               "object needs one dtype")


# ------------------------------------------------------------------------------------ writing

def _write(src: CheckpointSource, plan: ConversionPlan, recipe: Recipe, writer: ArtifactWriter,
           progress: bool) -> None:
    from tqdm import tqdm
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               desc=f"convert {src.dir.name}", leave=False)
    try:
        for o in plan.objects:
            if o.quant is not None:
                write_quantized(src, o, writer, bar.update)
                writer.bind(o.name, o.name)
                continue
            dtype, layout = recipe.stored(o.name, o.source_dtype, o.shape)
            with writer.begin_object(o.name, dtype, o.shape, layout) as sink:
                for s in o.sources:
                    for piece in src.read_chunks(s):
                        sink.write(recipe.encode(o.name, piece))
                        bar.update(piece.nbytes)
            writer.bind(o.name, o.name)
    finally:
        bar.close()
    for logical, obj in plan.aliases.items():
        writer.bind(logical, obj)
    for logical, (obj, view) in plan.views.items():
        writer.bind(logical, obj, view)
    fp8 = {o.name for o in plan.objects if o.quant and o.quant.layout == "fp8_block"}
    for logical in [o.name for o in plan.objects] + list(plan.aliases):
        if N.component(logical) == "text":
            site, position = N.use_site(logical)
            # FP8 weights may meet FP8 activations (per token-group of 128), as the release's
            # dynamic activation scheme does; int8 / int4 are weight-only
            act = "AllowA8" if plan.aliases.get(logical, logical) in fp8 else recipe.activation(logical)
            writer.add_use(site, logical, [position], act)
    for rname, data in src.resources().items():
        writer.add_resource(rname, data)
