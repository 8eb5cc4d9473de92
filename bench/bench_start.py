"""How long a user waits for `ninfer.Engine(path, backend="cuda")`, each start in a fresh process.

    PYTHONPATH=. python bench/bench_start.py ARTIFACT [--warm 2] [--out r.json]

First start: an empty kernel cache (a new temporary $NINFER_CACHE_DIR, NINFER_KERNEL_CACHE unset),
as on a fresh machine or container; then --warm starts that find the cache this one filled (a
second process). The artifact is read into the page cache before the first start. Each line is
Engine.startup_seconds (total, tokenizer, model: setup, weights and kernels; pools; warm-up:
graphs) with the weights' GB/s; the driver's JIT cache (~/.nv/ComputeCache) is pointed into the
same temporary folder, so "fresh" means fresh for it too.

`--cold-disk`: the artifact's pages are dropped from the page cache (posix_fadvise DONTNEED after
a sync) before every start instead, so the weights come from the disk; the disk's own rate is
measured beside with `dd iflag=direct` (O_DIRECT, no page cache).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_engine import read_into_page_cache  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import ninfer
t1 = time.perf_counter()
e = ninfer.Engine(sys.argv[1], backend="cuda", **json.loads(sys.argv[2]))
s = dict(e.startup_seconds, import_s=t1 - t0, kernels_compiled=e.model.kernels_compiled,
         setup_phases=getattr(e.model, "setup_phases", {}))
e.close()
print("STARTUP " + json.dumps(s))
"""


def one_start(path, cache_root, options) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NINFER_KERNEL_CACHE"}
    env.update(NINFER_CACHE_DIR=str(cache_root), CUDA_CACHE_PATH=str(cache_root / "nv"))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(options)], env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"start failed ({out.returncode}):\n{out.stderr[-4000:]}")
    line = [x for x in out.stdout.splitlines() if x.startswith("STARTUP ")][-1]
    return dict(json.loads(line[len("STARTUP "):]), process_s=wall)


def evict(path: pathlib.Path) -> None:
    """Drop the file's pages from the page cache (clean pages only: sync first)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_rate(path: pathlib.Path) -> float:
    """GB/s of `dd iflag=direct` over the whole file (the disk's rate, no page cache)."""
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True,
                   capture_output=True)
    return path.stat().st_size / (time.perf_counter() - t0) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--warm", type=int, default=2, help="starts after the cold one")
    ap.add_argument("--options", default='{"max_concurrency": 8, "max_context": 8192}')
    ap.add_argument("--cold-disk", action="store_true",
                    help="drop the artifact from the page cache before every start (module doc)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = pathlib.Path(args.artifact)
    size = path.stat().st_size
    if args.cold_disk:
        print(f"{path.name}: {size / 1e9:.2f} GB, disk (dd iflag=direct) "
              f"{disk_rate(path):.2f} GB/s", flush=True)
    else:
        rate = size / read_into_page_cache(path) / 1e9
        print(f"{path.name}: {size / 1e9:.2f} GB, page-cache read {rate:.1f} GB/s", flush=True)
    options = json.loads(args.options)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ninfer-start-") as tmp:
        for i in range(1 + args.warm):
            if args.cold_disk:
                evict(path)
            r = one_start(path, pathlib.Path(tmp), options)
            r["kind"] = ("empty cache" if i == 0 else "second process") + \
                (", cold disk" if args.cold_disk else "")
            r["weights_gbps"] = size / r["weights"] / 1e9
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("\n| start | Engine() | process | import | setup | weights | kernels (compiled) | "
          "pools | warm-up (graphs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['total']:.1f} s | {r['process_s']:.1f} s | "
              f"{r['import_s']:.1f} s | {r.get('setup', float('nan')):.1f} s | "
              f"{r['weights']:.1f} s = {r['weights_gbps']:.1f} GB/s | "
              f"{r.get('kernels', 0):.1f} s ({r['kernels_compiled']}) | "
              f"{r.get('pools', float('nan')):.1f} s | {r['warm_up']:.1f} s "
              f"({r.get('graphs', float('nan')):.1f} s) |")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
