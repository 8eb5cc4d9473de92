"""The HTTP server's own cost, without a GPU: `ninfer serve` and the Engine over a model whose
step is a fixed sleep (GIL released, as a GPU step is), so HTTP / Engine decode shows only what
the serving path adds (threads, rendering, the GIL it takes from the Engine's worker).

    python bench/bench_serve_host.py --step-ms 6.5 --batches 1,8 --gen 256

The model samples token `--token` on its "device" every step (NullModel); the artifact is the
compact demo (real frontend, tokenizer and templates). Decode is measured as bench_engine does:
Engine = tokens_generated slope; HTTP = tokens after the first / (last end - B first tokens).
"""
from __future__ import annotations

import argparse
import pathlib
import socket
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_engine  # noqa: E402


def sleep_engine(step_s: float, token: int, **options):
    """An Engine over the demo artifact whose model is a NullModel sleeping `step_s` a step."""
    import numpy as np
    import ninfer.models.qwen3_5 as family
    from ninfer import Engine
    from ninfer.demo import ensure_demo_artifact
    from ninfer.models.qwen3_5.fakes import NullModel

    class SleepModel(NullModel):
        def decode_greedy(self, batch, kv, state):
            time.sleep(step_s)
            return super().decode_greedy(batch, kv, state)

        def forward(self, batch, kv, state, *, all_logits: bool = False):
            time.sleep(step_s)
            self.num_calls += 1
            n = int(batch.query_start[-1]) if all_logits else batch.num_rows
            logits = np.full((n, self.config.text.vocab_size), -30.0, np.float32)
            logits[:, token] = 30.0
            return logits

    path = ensure_demo_artifact()

    def load_model(artifact, opts):
        from ninfer.models import model_config
        return SleepModel(model_config(artifact).text.vocab_size, token)
    family.load_model = load_model
    return Engine(path, backend="numpy", **options)


def serve_main(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--step-ms", type=float)
    ap.add_argument("--token", type=int)
    ap.add_argument("--concurrency", type=int)
    a = ap.parse_args(argv)
    from ninfer.serve.config import ServeConfig
    from ninfer.serve.launcher import serve
    serve(lambda: sleep_engine(a.step_ms / 1e3, a.token, max_concurrency=a.concurrency,
                               max_context=1024, prefix_cache_bytes=0),
          ServeConfig(), port=a.port)


class Server(bench_engine.HttpServer):
    def __init__(self, args):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(self.port),
                                      "--step-ms", str(args.step_ms), "--token", str(args.token),
                                      "--concurrency", str(max(args.batch_list))])
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve_main(argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=6.5)
    ap.add_argument("--token", type=int, default=300)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--gen", type=int, default=256)
    args = ap.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    engine = sleep_engine(args.step_ms / 1e3, args.token, max_concurrency=max(args.batch_list),
                          max_context=1024, prefix_cache_bytes=0)
    rows = {}
    ttft = [bench_engine.engine_ttft(engine, 512, reps=4)]
    for B in args.batch_list:
        rate, _, _ = bench_engine.engine_decode(engine, B, args.gen, sampled=False)
        rows[B] = [rate]
    engine.close()
    server = Server(args)
    try:
        ttft.append(min(server.stream(bench_engine.prompt_ids(512, 200 + r), 1,
                                      dict(temperature=0.0))[0] for r in range(5)))
        for B in args.batch_list:
            rows[B].append(server.decode_rate(B, args.gen, dict(temperature=0.0))[0])
    finally:
        server.close()
    print(f"step {args.step_ms} ms, {args.gen} tokens a row")
    print(f"  TTFT 512: engine {ttft[0] * 1e3:6.2f} ms  HTTP {ttft[1] * 1e3:6.2f} ms  "
          f"engine/HTTP {ttft[0] / ttft[1]:.3f}")
    for B, (eng, http) in rows.items():
        print(f"  B={B}: engine {eng:8.1f} tok/s  HTTP {http:8.1f} tok/s  HTTP/engine "
              f"{http / eng:.3f}")


if __name__ == "__main__":
    main()
