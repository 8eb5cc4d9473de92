"""dflash_cases.py on the CPU: sim_model.py's machine (kernels on numba-cuda's simulator,
cuBLASLt as numpy products, fake device memory). Prints JSON:
{"<dtype>": {"hidden": rel err, "ids_equal": bool, "ids_agree": fraction, ...}}

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu/sim_dflash.py [step|verify] [target|own]

(the drafter's KV geometry: the target's, or its own: dflash_cases.GEOMETRIES)

("verify" runs the whole target model on the simulator: minutes.)
"""
import json
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from sim_model import Machine, install   # noqa: E402  (the simulator switched on first)
from sim_patches import fix_shared_array_race, yield_while_polling   # noqa: E402

import dflash_cases   # noqa: E402
from ninfer.artifact import Artifact   # noqa: E402


def run(part: str = "step", geometry: str = "target") -> dict:
    machine = Machine(96 << 20)
    install(machine)
    fix_shared_array_race()
    yield_while_polling()
    with tempfile.TemporaryDirectory() as tmp, \
            Artifact(dflash_cases.artifact(pathlib.Path(tmp), geometry)) as art:
        return dflash_cases.run(art, part)


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(run(a[0] if a else "step", a[1] if len(a) > 1 else "target")))
