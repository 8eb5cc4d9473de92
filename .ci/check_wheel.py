"""Run from a fresh virtual environment holding the built wheel, OUTSIDE the source tree: every
kernel source of the kernel set is found inside the installed package (`ninfer.kernels`) and
compiles to PTX (numba-cuda needs no GPU for that), and the wheel's kernel pack serves every
kernel of the release geometries for sm_90, sm_89 and sm_80 without compiling. Exits non-zero
with the first problem."""
import json
import pathlib
import sys
import tempfile
import time

import ninfer
from ninfer.core.cuda import kernels as K
from ninfer.models.qwen3_5.config import FULL_ATTENTION, LINEAR_ATTENTION, TextConfig
from ninfer.models.qwen3_5.cuda.kernel_set import (F32_VARIANTS, SIGS, geometry_specs, spec,
                                                   speculation_specs, vision_specs)

CC = (9, 0)


def main() -> int:
    installed = pathlib.Path(ninfer.__file__).resolve().parent
    if "site-packages" not in installed.parts:
        print(f"ninfer imported from {installed}: run this from outside the source tree, against "
              "the installed wheel")
        return 1
    # the default model runs from a plain install: its compact files and tokenizer ranks ship
    for data in ("demo_models/dense.npz", "demo_models/heldout.txt",
                 "models/qwen3_5/frontend/qwen3_5_bpe_ranks.xz"):
        if not (installed / data).is_file():
            print(f"{data} is not in the installed package")
            return 1
    package, folder = K._kernel_package()
    if package != "ninfer.kernels":
        print(f"the kernel sources are not the installed package ninfer.kernels ({folder})")
        return 1
    modules = sorted({module for module, _, _ in SIGS.values()})
    for module in modules:
        K.source_text(module)          # raises DeviceError naming the missing file
    types = tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(8))
    dense = TextConfig(num_hidden_layers=8, layer_types=types)
    moe = TextConfig(hidden_size=2048, num_hidden_layers=8, layer_types=types, is_moe=True,
                     num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, num_attention_heads=16,
                     num_key_value_heads=2)
    specs = set(geometry_specs(dense).values()) | set(geometry_specs(moe).values()) \
        | set(geometry_specs(dense, f32=True).values()) \
        | set(geometry_specs(dense, kv_dtype="fp8").values())    # the quantized-KV variants
    specs |= {spec("widen_bf16")} | {spec(n, f32=True) for n in F32_VARIANTS
                                     if n in ("rmsnorm", "embed_gather")}
    # packed-weight kernels (an artifact's formats pick them): one of each
    specs |= {spec("qgemv", layout="int4_block", bm=2, asym=True),
              spec("dequant", layout="fp8_block", asym=False),
              spec("qmma", layout="int4_block", asym=True), spec("act_quant_fp8")}
    specs |= set(vision_specs().values())         # the device vision tower's (cuda/vision.py)
    specs |= set(speculation_specs(dense).values())   # a speculative verify's (issue 25)
    compiled = {s.module for s in specs}
    if set(modules) - compiled:
        print(f"kernel modules never compiled by this check: {sorted(set(modules) - compiled)}")
        return 1
    t0 = time.time()
    for s in sorted(specs, key=repr):
        ptx = K.compile_spec(s, CC)
        K.entry_name(ptx)              # exactly one kernel entry
    print(f"wheel: {len(modules)} kernel sources found under {folder}; {len(specs)} kernels "
          f"compiled to PTX for sm_{CC[0]}{CC[1]} in {time.time() - t0:.0f} s")
    return check_pack()


def check_pack() -> int:
    from ninfer.models.qwen3_5.releases import release_specs
    index = K.pack_dir() / "index.json"
    if not index.is_file():
        print(f"the wheel has no kernel pack ({index} missing)")
        return 1
    archs = json.loads(index.read_text())["archs"]
    specs = release_specs()

    def no_compile(spec, cc):
        raise AssertionError(f"{spec.factory} for {cc} compiled: not served by the pack")
    K.compile_spec = no_compile
    for arch in ("sm_90", "sm_89", "sm_80"):
        if arch not in archs:
            print(f"the kernel pack lacks {arch} (has {archs})")
            return 1
        cc = (int(arch[3]), int(arch[4]))
        with tempfile.TemporaryDirectory() as empty:
            cache = K.KernelCache(cc, empty)
            if cache.missing(specs):
                print(f"the kernel pack lacks {len(cache.missing(specs))} release kernels "
                      f"for {arch}")
                return 1
            for sp in specs:
                if f".target {arch}" not in cache.ptx(sp):
                    print(f"the pack's {sp.factory} for {arch} is not {arch} PTX")
                    return 1
    print(f"wheel: the kernel pack serves all {len(specs)} release kernels for {archs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
