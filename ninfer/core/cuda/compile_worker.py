"""One kernel-compiling process of KernelCache.start_precompile (kernels.Precompile). Reads
{"cc": [9, 0], "dir": CACHE_DIR, "specs": [[module, factory, sig, params], ...]} on stdin,
compiles each spec into the cache, and prints {"errors": [[index, text], ...]} as its last line."""
from __future__ import annotations

import json
import sys

from .kernels import KernelSpec, _compile_entry


def main() -> int:
    job = json.load(sys.stdin)
    cc = tuple(job["cc"])
    errors = []
    for i, (module, factory, sig, params) in enumerate(job["specs"]):
        spec = KernelSpec(module, factory, tuple(sig), tuple((k, v) for k, v in params))
        text = _compile_entry(spec, cc, job["dir"])
        if text is not None:
            errors.append([i, text])
    print(json.dumps({"errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
