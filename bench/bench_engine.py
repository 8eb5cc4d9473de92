"""The benchmark a user sees: the public `ninfer.Engine` on an artifact made by `ninfer convert`.

    PYTHONPATH=.:bench python bench/bench_engine.py --shapes 9b [--workdir /tmp/nb] [--out r.json]

Per shape (bench_decode.SHAPES, random bf16 weights written as a Hugging Face checkpoint, converted
with `python -m ninfer convert`, artifact read once into the page cache first):
  load    Engine(path, backend=...) seconds: weights (GB/s of the artifact) and start-up warm-up
  ttft    submit -> result of a max_tokens=1 request at prompts of --prefill tokens (greedy)
  decode  B = --batches requests of --gen tokens each (ignore_eos), greedy and sampled
          (temperature 0.8, top_p 0.95): steady tok/s from engine.stats()' token count, between
          the first 32 and the last 16 tokens of every row
and the model-step figure of the same thing in the same process (the Engine's own model and
pools, no Engine around it: `decode_greedy` / `sample` on a packed batch, the prefill chunks of
the prompt), so each line shows engine / model step. `--backend numpy --shapes tiny` runs the
same code on the CPU (a smoke test of the script, not a benchmark).

`--kv-dtype fp8|int8` stores the KV cache quantized (EngineOptions.kv_dtype); `--decode-context N`
decodes after prompts of N tokens instead of 32 (the quantized KV's case: long contexts, where
decode reads mostly KV), e.g. the issue's comparison at 9B, B = 8, 32K:

    PYTHONPATH=.:bench python bench/bench_engine.py --shapes 9b --batches 8 --prefill 512 \
        --modes greedy --decode-context 32768 --prefill-chunk 4096 [--kv-dtype fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import ninfer  # noqa: E402
from ninfer.api import SamplingParams  # noqa: E402
from ninfer.contracts import SampleRow, SamplingSpec  # noqa: E402
from ninfer.models.qwen3_5.batch import ForwardBatch  # noqa: E402

TINY = dict(vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                             "mrope_interleaved": True})
# top_k 20 as Qwen3.5's generation_config (and the bench artifact's), so the Engine's rows and
# the HTTP server's (which applies the checkpoint's defaults) sample alike
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=20)


# ---- the artifact ----------------------------------------------------------------------------------
def hf_text_config(shape: str) -> dict:
    """`shape`: a bench_decode.SHAPES name, "tiny", or NAME@L: that geometry with L layers (a
    shorter model to convert and measure quickly; per-layer figures scale)."""
    if shape == "tiny":
        return dict(TINY)
    from bench_decode import SHAPES
    name, _, layers = shape.partition("@")
    text = {k: v for k, v in SHAPES[name].items() if k != "is_moe"}
    if layers:
        text["num_hidden_layers"] = int(layers)
    return text


def checkpoint_plan(shape: str, mtp: bool = False) -> tuple:
    """(full HF text config, architecture, {tensor name: shape}) of `shape`'s random checkpoint;
    `mtp`: with the release's MTP head (one layer, mtp.*: bench_speculative.py --shapes)."""
    from ckpt_helpers import text_tensor_shapes
    from ninfer.models.qwen3_5.config import TextConfig
    text = hf_text_config(shape)
    arch = "Qwen3_5MoeForCausalLM" if "num_experts" in text else "Qwen3_5ForCausalLM"
    d = TextConfig()
    full = dict(vocab_size=d.vocab_size, head_dim=d.head_dim, linear_conv_kernel_dim=4,
                linear_key_head_dim=d.linear_key_head_dim,
                linear_value_head_dim=d.linear_value_head_dim, full_attention_interval=4,
                rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=262144,
                eos_token_id=95, tie_word_embeddings=False)
    full.update(text)
    full["model_type"] = "qwen3_5_moe_text" if "num_experts" in text else "qwen3_5_text"
    if mtp:
        full["mtp_num_hidden_layers"] = 1
    shapes = text_tensor_shapes(full, "model.")
    shapes["lm_head.weight"] = [full["vocab_size"], full["hidden_size"]]
    if mtp:
        shapes.update(text_tensor_shapes(full, "mtp."))
    return full, arch, shapes


FP8_ACT = {"auto": None, "on": True, "off": False}     # --fp8-activations -> the option
RANDOM_VALUES = 1 << 24           # the random block every weight tiles


def random_block():
    """bf16 N(0, 0.02) values; weights tile it (writing 50 GB does not wait on the generator)."""
    import ml_dtypes
    return (np.random.default_rng(0).standard_normal(RANDOM_VALUES) * 0.02) \
        .astype(ml_dtypes.bfloat16)


def write_frontend_only(path: pathlib.Path, shape: str, mtp: bool = False) -> None:
    """config.json and the tiny test tokenizer: a checkpoint folder without weights."""
    from ckpt_helpers import _write_frontend
    full, arch, _ = checkpoint_plan(shape, mtp)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(full, architectures=[arch])))
    _write_frontend(path, False)


def write_checkpoint(path: pathlib.Path, shape: str, shard_bytes: int = 4 << 30) -> None:
    """A random-weight HF checkpoint of `shape` (random_block tiled), the tiny test tokenizer."""
    from safetensors.numpy import save_file
    _, _, shapes = checkpoint_plan(shape)
    write_frontend_only(path, shape)
    block = random_block()
    shard, shard_bytes_now, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes_now
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(path / name))
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, shard_bytes_now = {}, 0
    for name, shp in shapes.items():
        n = int(np.prod(shp))
        shard[name] = np.resize(block, n).reshape(shp)
        shard_bytes_now += 2 * n
        if shard_bytes_now >= shard_bytes:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))


def random_source(shape: str, shapes: dict = None):
    """A CheckpointSource class whose tensors are write_checkpoint's, made as they are read:
    convert_checkpoint(folder of write_frontend_only, out, open_source=...) writes the same
    artifact with no checkpoint on disk (27B and 35B-A3B do not fit the device's disk twice).
    `shapes`: other tensors ({name: shape}) of the same random values instead."""
    import ml_dtypes
    from ninfer.convert.source import CheckpointSource, TensorInfo
    if shapes is None:
        _, _, shapes = checkpoint_plan(shape)

    class RandomSource(CheckpointSource):
        def _index_tensors(self) -> dict:
            self._block = np.concatenate([random_block()] * 2)
            return {n: TensorInfo(n, "random", np.dtype(ml_dtypes.bfloat16), shp)
                    for n, shp in shapes.items()}

        def _read_chunks(self, name: str, row_multiple: int = 1):
            shp = self.tensors[name].shape
            rows = shp[0] if shp else 1
            row = int(np.prod(shp[1:])) if len(shp) > 1 else 1
            step = max(row_multiple, (RANDOM_VALUES // max(row, 1)) // row_multiple * row_multiple)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                start, count = (r0 * row) % RANDOM_VALUES, (r1 - r0) * row
                flat = self._block[start: start + count] if count <= RANDOM_VALUES else \
                    np.resize(np.roll(self._block[:RANDOM_VALUES], -start), count)
                yield flat.reshape((r1 - r0,) + tuple(shp[1:])) if shp else flat.reshape(())
    return RandomSource


def write_drafter(path: pathlib.Path, shape: str, layers: int, block_size: int = 16) -> None:
    """A random DFlash drafter directory for `shape`'s target (config.json in z-lab's layout,
    bf16 weights tiling random_block): `layers` layers of the target's attention geometry (its
    KV joins the target's pool, so num_key_value_heads and head_dim are the target's) and MLP
    width, target_layer_ids spread over the target's layers (z-lab's Qwen3-8B drafter: 5 layers,
    block 16, features of layers 1, 9, 17, 25, 33 of 36)."""
    from safetensors.numpy import save_file
    from ninfer.models.qwen3_5.config import parse_dflash_config, parse_hf_config
    from ninfer.models.qwen3_5.dflash import PREFIX, dflash_param_shapes
    full, arch, _ = checkpoint_plan(shape)
    n = full["num_hidden_layers"]
    ids = sorted({int(i) for i in np.linspace(1, max(n - 3, 1), min(5, n)).round()})
    hf = dict(architectures=["DFlashDraftModel"], model_type="qwen3",
              hidden_size=full["hidden_size"], num_hidden_layers=layers,
              num_attention_heads=full["num_attention_heads"],
              num_key_value_heads=full["num_key_value_heads"], head_dim=full["head_dim"],
              intermediate_size=full.get("intermediate_size", 4 * full["hidden_size"]),
              rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=full["vocab_size"],
              hidden_act="silu", attention_bias=False,
              dflash_config=dict(target_layer_ids=ids, block_size=block_size,
                                 mask_token_id=full["vocab_size"] - 1))
    text = parse_hf_config(dict(full, architectures=[arch])).text
    cfg = parse_dflash_config(hf, text)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    block = random_block()
    save_file({name[len(PREFIX):]: np.resize(block, int(np.prod(shp))).reshape(shp)
               for name, shp in dflash_param_shapes(cfg).items()},
              str(path / "model.safetensors"))


def make_artifact(shape: str, workdir: pathlib.Path, direct: bool = False,
                  quantize: str = None, lm_head: str = None, mtp: bool = False,
                  dflash: int = 0) -> tuple:
    """(artifact path, seconds to write the checkpoint, seconds to convert it). `direct`: no
    checkpoint on disk (random_source); the artifact is the same. `quantize`: fp8 / int8 /
    int4, as `convert --quantize` (direct only); `lm_head`: lm_head too, in that format.
    `mtp`: with the MTP head (direct only); `dflash`: with a random DFlash drafter of that many
    layers (write_drafter; direct only)."""
    tag = (f"-{quantize}" if quantize else "") + (f"-head-{lm_head}" if lm_head else "") \
        + ("-mtp" if mtp else "") + (f"-dflash{dflash}" if dflash else "")
    out = workdir / f"{shape}{tag}.ninfer"
    if out.exists():
        return out, 0.0, 0.0
    ckpt = workdir / f"{shape}-hf"
    t0 = time.perf_counter()
    if direct:
        from ninfer.convert.convert import convert_checkpoint
        write_frontend_only(ckpt, shape, mtp)
        t1 = time.perf_counter()
        extra = {}
        if quantize:
            from ninfer.convert.quantize import Quantize
            extra["recipe"] = Quantize(quantize, quantize_lm_head=lm_head or False)
        if dflash:
            extra["dflash_dir"] = workdir / f"{shape}-dflash{dflash}"
            write_drafter(extra["dflash_dir"], shape, dflash)
        convert_checkpoint(ckpt, out, progress=False,
                           open_source=random_source(shape, checkpoint_plan(shape, mtp)[2]),
                           **extra)
    else:
        if quantize or mtp or dflash:
            raise SystemExit("--quantize, an MTP head, a DFlash drafter: with --direct only")
        write_checkpoint(ckpt, shape)
        t1 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ninfer", "convert", "--quiet", str(ckpt), str(out)],
                       check=True)
    t2 = time.perf_counter()
    subprocess.run(["rm", "-rf", str(ckpt), str(workdir / f"{shape}-dflash{dflash}")],
                   check=True)      # disk: keep only the artifact
    return out, t1 - t0, t2 - t1


def read_into_page_cache(path: pathlib.Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


# ---- through the Engine --------------------------------------------------------------------------
def prompt_ids(n: int, seed: int, vocab: int = 90) -> list:
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def engine_ttft(engine, n: int, reps: int = 2) -> float:
    times = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        engine.generate(prompt_ids(n, 100 + r), SamplingParams(max_tokens=1, temperature=0.0,
                                                               ignore_eos=True))
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def engine_decode(engine, B: int, gen: int, sampled: bool, prompt_len: int = 32) -> tuple:
    """Steady tok/s of B concurrent requests (prompts of prompt_len tokens): slope of
    tokens_generated over time, sampled every 2 ms, between B*32 and B*(gen-16) tokens; and the
    tok/s of that window's first and last thirds (flatness over the run)."""
    params = SamplingParams(max_tokens=gen, ignore_eos=True,
                            **(SAMPLED if sampled else dict(temperature=0.0)))
    base = engine.stats().get("tokens_generated", 0)
    handles = [engine.submit(prompt_ids(prompt_len, 7 + r), params) for r in range(B)]
    samples = []
    done = threading.Event()

    def wait_all():
        for h in handles:
            h.result()
        done.set()
    threading.Thread(target=wait_all, daemon=True).start()
    while not done.is_set():
        samples.append((time.perf_counter(), engine.stats()["tokens_generated"] - base))
        time.sleep(0.002)
    lo, hi = B * 32, B * (gen - 16)
    window = [(t, n) for t, n in samples if lo <= n <= hi]
    (t0, n0), (t1, n1) = window[0], window[-1]

    def rate_between(a, b):
        part = [(t, n) for t, n in window if n0 + a * (n1 - n0) <= n <= n0 + b * (n1 - n0)]
        return (part[-1][1] - part[0][1]) / (part[-1][0] - part[0][0])
    return (n1 - n0) / (t1 - t0), rate_between(0, 1 / 3), rate_between(2 / 3, 1)


def worker_profile(engine, B: int, gen: int, top: int = 25) -> dict:
    """Where the Engine worker's time goes during a greedy decode of B rows: its stack sampled
    every ~0.5 ms from another thread (sys._current_frames; no profiler hooks, little overhead).
    {'leaf': [(function, share)], 'inclusive': [(function, share)]} over the samples."""
    from collections import Counter
    worker = engine._core._thread.ident
    leaf, inclusive, samples = Counter(), Counter(), 0
    done = threading.Event()

    def sample():
        nonlocal samples
        while not done.is_set():
            frame = sys._current_frames().get(worker)
            seen = set()
            if frame is not None:
                samples += 1
                leaf[_where(frame)] += 1
                while frame is not None:
                    key = _where(frame)
                    if key not in seen:
                        inclusive[key] += 1
                        seen.add(key)
                    frame = frame.f_back
            time.sleep(0.0005)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0.0)
    for h in [engine.submit(prompt_ids(32, 50 + r), params) for r in range(B)]:
        h.result()
    done.set()
    thread.join()
    n = max(samples, 1)
    return dict(samples=samples, leaf=[(k, c / n) for k, c in leaf.most_common(top)],
                inclusive=[(k, c / n) for k, c in inclusive.most_common(top)])


def _where(frame) -> str:
    code = frame.f_code
    return f"{pathlib.Path(code.co_filename).name}:{code.co_name}"


# ---- the model step, same model and pools --------------------------------------------------------
def model_decode(model, program, B: int, prompt_len: int, steps: int, sampled: bool) -> float:
    """tok/s of `steps` decode steps of B rows on the Engine's model and pools, each row first
    prefilled with a real prompt and fed its own tokens back (the sampler sees the logits a
    real sequence has, as in the Engine)."""
    ps, kv, state = program.page_size, program.kv, program.state
    per_row = -(-(prompt_len + steps + 8) // ps)
    tables = np.arange(B * per_row, dtype=np.int32).reshape(B, per_row)
    slots = np.arange(B, dtype=np.int32)
    prompts = [np.array(prompt_ids(prompt_len, 7 + r), np.int32) for r in range(B)]
    chunk = getattr(model, "n_cap", None) or prompt_len    # the most tokens one call takes
    for r, ids in enumerate(prompts):                     # all but the last prompt token
        n = len(ids) - 1
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            model.decode_greedy(ForwardBatch(ids[a:b], np.broadcast_to(
                np.arange(a, b, dtype=np.int32), (3, b - a)).copy(), np.array([0, b - a], np.int32),
                np.full(1, a, np.int32), tables[r:r + 1].copy(), slots[r:r + 1].copy()), kv, state)
    tokens = np.array([ids[-1] for ids in prompts], np.int32)
    empty = np.zeros(0, np.int32)
    ctx = prompt_len - 1

    def step(tokens, ctx):
        batch = ForwardBatch(tokens, np.full((3, B), ctx, np.int32),
                             np.arange(B + 1, dtype=np.int32), np.full(B, ctx, np.int32),
                             tables, slots)
        if not sampled:
            return model.decode_greedy(batch, kv, state)
        rows = [SampleRow(SamplingSpec(seed=r, **SAMPLED), ctx + 1, prompts[r], empty)
                for r in range(B)]
        return model.sample(batch, kv, state, rows)
    for _ in range(3):
        tokens = step(tokens, ctx)
        ctx += 1
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = step(tokens, ctx)
        ctx += 1
    return B * steps / (time.perf_counter() - t0)


def model_prefill(model, program, n: int) -> float:
    """Seconds for the prefill chunks of an n-token prompt, as the Program runs them."""
    chunk, ps = program.prefill_chunk, program.page_size
    ids = np.array(prompt_ids(n, 3), np.int32)
    table = np.arange(-(-n // ps), dtype=np.int32)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            batch = ForwardBatch(ids[a:b], np.broadcast_to(np.arange(a, b, dtype=np.int32),
                                                           (3, b - a)).copy(),
                                 np.array([0, b - a], np.int32), np.array([a], np.int32),
                                 table[None, :-(-b // ps)].copy(), np.array([0], np.int32))
            model.decode_greedy(batch, program.kv, program.state) if model.greedy_on_device \
                else model.forward(batch, program.kv, program.state)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def kernel_profile(model, program, n: int = 512) -> dict:
    """{"prefill": ..., "decode": ...}: ms by kernel (CUDA events around each launch, eager: the
    gaps between launches are not in it) of an n-token prefill chunk and of one greedy B = 1
    decode step after it, on the Engine's own model and pools (its KV pages and State slot 0,
    the Engine idle)."""
    import dataclasses
    ps, kv, state = program.page_size, program.kv, program.state
    ids = np.array(prompt_ids(n + 1, 5), np.int32)
    table = np.arange(-(-(n + 2) // ps), dtype=np.int32)[None]

    def batch(a, b):
        return ForwardBatch(ids[a:b], np.broadcast_to(np.arange(a, b, dtype=np.int32),
                                                      (3, b - a)).copy(),
                            np.array([0, b - a], np.int32), np.array([a], np.int32), table.copy(),
                            np.array([0], np.int32))
    opts, out = model.options, {}
    model.options = dataclasses.replace(opts, graphs=False)      # eager: the same kernels
    try:
        for name, (a, b) in (("prefill", (0, n)), ("decode", (n, n + 1))):
            model.runner.profile = []
            model.decode_greedy(batch(a, b), kv, state)
            out[name] = model.runner.profile_summary()
    finally:
        model.options = opts
    return out


# ---- through the HTTP server -----------------------------------------------------------------------
class HttpServer:
    """`python -m ninfer serve` in a subprocess, ready when /health answers 200. Requests go
    through http.client with the SSE stream read as it arrives: a lean client, so the figures are
    the server's (the openai SDK itself spends ~40-80 ms building and validating a 4096-id
    prompt's request, measured on the CPU; `sdk_ttft` shows it beside)."""

    def __init__(self, path, args, max_context: int):
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "ninfer", "serve", str(path), "--backend", args.backend,
               "--port", str(self.port), "--max-concurrency", str(max(args.batch_list)),
               "--max-context", str(max_context), "--prefill-chunk", str(args.prefill_chunk),
               "--kv-dtype", args.kv_dtype] \
            + {"auto": [], "on": ["--fp8-activations"], "off": ["--no-fp8-activations"]}[
                args.fp8_activations]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()
        self.start_s = time.perf_counter() - t0

    def _wait_ready(self) -> None:
        import urllib.request
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            self.model = json.loads(r.read())["data"][0]["id"]

    def stream(self, prompt: list, max_tokens: int, sampling: dict) -> tuple:
        """(seconds to the first token's chunk, seconds to the end, completion tokens) of one
        streamed /v1/completions request."""
        import http.client
        body = json.dumps(dict(model=self.model, prompt=prompt, max_tokens=max_tokens,
                               stream=True, stream_options={"include_usage": True},
                               ignore_eos=True, **sampling)).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body,
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        first, usage, buf = None, None, b""
        while True:
            data = resp.read1(65536)
            if not data:
                break
            buf += data
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                payload = ev.removeprefix(b"data: ").strip()
                if not payload or payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if first is None and obj.get("choices"):
                    first = time.perf_counter() - t0
                usage = obj.get("usage") or usage
        end = time.perf_counter() - t0
        conn.close()
        return first, end, usage["completion_tokens"]

    def sdk_ttft(self, prompt: list) -> float:
        """Seconds to the first chunk through the openai SDK (None without it)."""
        try:
            from openai import OpenAI
        except ImportError:
            return None
        client = OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        t0 = time.perf_counter()
        for _ in client.completions.create(model=self.model, prompt=prompt, max_tokens=1,
                                           stream=True, temperature=0.0):
            return time.perf_counter() - t0

    def decode_rate(self, B: int, gen: int, sampling: dict) -> tuple:
        """(tok/s of B streamed requests of `gen` tokens, seconds to B rows' first token).
        decode = B rows' tokens after the first / (the last row's end - the time B such
        requests take to their first token, measured alone on fresh prompts). Not from the
        stream's chunks: a token whose text is empty (ids the bench artifact's small test
        tokenizer cannot spell, frequent when sampling) sends no chunk, so chunk times would
        credit a whole run of them to one instant."""
        def together(max_tokens, seed):
            results = [None] * B

            def one(r):
                results[r] = self.stream(prompt_ids(32, seed + r), max_tokens, sampling)
            threads = [threading.Thread(target=one, args=(r,)) for r in range(B)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return results
        first_token = max(end for _, end, _ in together(1, 500 + 8 * B))
        results = together(gen, 7)
        rate = sum(n - 1 for _, _, n in results) / \
            (max(end for _, end, _ in results) - first_token)
        return rate, first_token

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def http_figures(server, args, log) -> dict:
    out = dict(start_s=server.start_s, ttft={}, decode={})
    out["sdk_ttft"] = {}
    for n in [int(x) for x in args.http_prefill.split(",") if x]:
        # as engine_ttft: fresh prompts (no context-cache hit), one warm-up, best of two
        times = [server.stream(prompt_ids(n, 200 + r), 1, dict(temperature=0.0))[0]
                 for r in range(3)]
        best = min(times[1:])
        out["ttft"][n] = best * 1e3
        sdk = server.sdk_ttft(prompt_ids(n, 300))
        out["sdk_ttft"][n] = sdk * 1e3 if sdk else None
        log(f"  HTTP TTFT {n:6d}: {best * 1e3:8.1f} ms (openai SDK client: "
            f"{sdk * 1e3 if sdk else float('nan'):.1f} ms)")
    for mode in args.http_modes.split(","):
        sampling = SAMPLED if mode == "sampled" else dict(temperature=0.0)
        for B in [int(x) for x in args.http_batches.split(",") if x]:
            rate, first_token = server.decode_rate(B, args.gen, sampling)
            out["decode"][f"{mode} B={B}"] = rate
            log(f"  HTTP decode {mode:7s} B={B}: {rate:8.1f} tok/s (first token of {B} rows "
                f"{first_token * 1e3:.1f} ms)")
    return out


# ---- one shape -----------------------------------------------------------------------------------
def bench_shape(shape, args, log) -> dict:
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path, t_ckpt, t_convert = make_artifact(shape, workdir, args.direct, args.quantize,
                                            args.quantize_lm_head)
    size = path.stat().st_size
    t_cache = read_into_page_cache(path)
    log(f"{shape}: artifact {size / 1e9:.2f} GB (checkpoint {t_ckpt:.0f} s, convert "
        f"{t_convert:.0f} s, page-cache read {size / t_cache / 1e9:.1f} GB/s)")
    prefills = [int(x) for x in args.prefill.split(",") if x]
    max_context = max(prefills + [args.gen + 64, args.decode_context + args.gen + 64]) + 64
    t0 = time.perf_counter()
    engine = ninfer.Engine(str(path), backend=args.backend, max_concurrency=max(args.batch_list),
                           max_context=max_context, prefill_chunk=args.prefill_chunk,
                           kv_dtype=args.kv_dtype, fp8_activations=FP8_ACT[args.fp8_activations])
    t_start = time.perf_counter() - t0
    model, program = engine.model, engine._core.program
    if args.moe_dequant:
        model.runner.packed_grouped = False
    if args.moe_route != "default":
        model.runner.moe_device_route = args.moe_route == "device"
    if args.no_chain:           # (the Program asks the model before each step ahead)
        model.chains_token_steps = False
    load_s = getattr(model, "load_seconds", None)
    res = dict(shape=shape, backend=args.backend, kv_dtype=args.kv_dtype,
               w8a8=bool(getattr(model, "w8a8", False)),
               decode_context=args.decode_context or 32, artifact_gb=size / 1e9, start_s=t_start,
               load_s=load_s, load_gbps=size / load_s / 1e9 if load_s else None,
               warmup_s=getattr(program, "warmup_seconds", None),
               plan=getattr(model, "memory_plan", None), ttft={}, decode={})
    log(f"  Engine start {t_start:.1f} s (weights {load_s or float('nan'):.1f} s = "
        f"{res['load_gbps'] or float('nan'):.1f} GB/s, warm-up "
        f"{res['warmup_s'] or float('nan'):.2f} s); plan {res['plan']}")
    log("  set-up phases: " + ", ".join(f"{k} {v:.2f} s"
                                        for k, v in getattr(model, "setup_phases", {}).items()))
    try:
        for n in prefills:
            e = engine_ttft(engine, n)
            m = model_prefill(model, program, n)
            res["ttft"][n] = dict(engine_ms=e * 1e3, model_ms=m * 1e3, ratio=e / m)
            log(f"  TTFT {n:6d}: engine {e * 1e3:8.1f} ms  model step {m * 1e3:8.1f} ms  "
                f"ratio {e / m:.3f}")
        for mode in args.modes.split(","):
            sampled = mode == "sampled"
            if sampled and not model.samples_on_device:
                continue
            for B in args.batch_list:
                prompt = args.decode_context or 32
                e, e_first, e_last = engine_decode(engine, B, args.gen, sampled, prompt)
                # the same mean context as the Engine's rows (the prompt + half of gen)
                m = model_decode(model, program, B,
                                 max(33, prompt + args.gen // 2 - args.steps // 2), args.steps,
                                 sampled) \
                    if model.greedy_on_device else float("nan")
                host_us = (B / e - B / m) * 1e6 if m == m else float("nan")
                res["decode"][f"{mode} B={B}"] = dict(engine_tok_s=e, model_tok_s=m,
                                                      ratio=e / m, host_us_per_step=host_us,
                                                      first_third_tok_s=e_first,
                                                      last_third_tok_s=e_last)
                log(f"  decode {mode:7s} B={B}: engine {e:8.1f} tok/s  model step {m:8.1f} "
                    f"tok/s  ratio {e / m:.3f}  engine-only host {host_us:6.0f} us/step  "
                    f"first/last third {e_first:.0f}/{e_last:.0f} tok/s")
        if args.profile_kernels and model.greedy_on_device:
            res["kernel_profile"] = kernel_profile(model, program)
            for what, prof in res["kernel_profile"].items():
                top = sorted(prof.items(), key=lambda kv: -kv[1])
                log(f"  {what} time by kernel (ms, eager, {sum(prof.values()):.2f} in all): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in top[:14]))
        if args.profile_host:
            res["worker_profile"] = {B: worker_profile(engine, B, 256) for B in (1, 8)}
            for B, prof in res["worker_profile"].items():
                log(f"  worker stack samples, greedy B={B} ({prof['samples']} samples):")
                log("    leaf: " + ", ".join(f"{k} {v:.0%}" for k, v in prof["leaf"][:15]))
                log("    incl: " + ", ".join(f"{k} {v:.0%}" for k, v in prof["inclusive"][:25]))
    finally:
        engine.close()
    if args.http:
        try:
            server = HttpServer(path, args, max_context)
        except RuntimeError as exc:         # e.g. no [serve] extra: keep the Engine figures
            log(f"  HTTP: not measured ({exc})")
            return res
        try:
            res["http"] = http_figures(server, args, log)
        finally:
            server.close()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="9b")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--workdir", default="/tmp/ninfer-bench")
    ap.add_argument("--direct", action="store_true",
                    help="write the artifact with no checkpoint on disk (27B, 35B-A3B: use a "
                         "--workdir in /dev/shm when the disk is smaller than the artifact)")
    ap.add_argument("--quantize", default=None, choices=("fp8", "int8", "int4"),
                    help="convert the random weights with --quantize (needs --direct)")
    ap.add_argument("--quantize-lm-head", default=None, choices=("fp8", "int8", "int4"),
                    help="with --quantize: lm_head too, in this format (convert --lm-head-format)")
    ap.add_argument("--prefill", default="512,4096,32768")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--gen", type=int, default=576, help="tokens per request (>= 512 + warm-up)")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--steps", type=int, default=100, help="model-step decode steps timed")
    ap.add_argument("--http", action="store_true",
                    help="also through `ninfer serve` (streamed /v1/completions, a lean client)")
    ap.add_argument("--http-prefill", default="512,4096")
    ap.add_argument("--http-batches", default="1,8")
    ap.add_argument("--http-modes", default="greedy,sampled")
    ap.add_argument("--profile-host", action="store_true",
                    help="sample the Engine worker's stacks during greedy decodes at B=1 and 8")
    ap.add_argument("--profile-kernels", action="store_true",
                    help="ms by kernel of a 512-token prefill chunk and a B=1 decode step (eager)")
    ap.add_argument("--fp8-activations", default="auto", choices=tuple(FP8_ACT),
                    help="fp8 weights: prefill GEMMs on fp8 tensor cores (EngineOptions."
                         "fp8_activations; auto: where the GPU has them)")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "fp8", "int8"),
                    help="KV cache storage (EngineOptions.kv_dtype; bfloat16: unquantized)")
    ap.add_argument("--decode-context", type=int, default=0, metavar="N",
                    help="decode after prompts of N tokens (default: 32)")
    ap.add_argument("--moe-dequant", action="store_true",
                    help="packed experts' prefill dequantized for cuBLASLt instead of the grouped "
                         "tensor-core GEMV (the default): the path it replaced, for comparison")
    ap.add_argument("--moe-route", default="default", choices=("default", "host", "device"),
                    help="bf16 MoE prefill: experts laid out on the host (one sync a layer) or "
                         "on the device (StepRunner.moe_device_route; where the GPU's cuBLASLt "
                         "or our grouped GEMM takes the shapes); the Engine rows only")
    ap.add_argument("--no-chain", action="store_true",
                    help="greedy decode steps one by one, each collected before the next "
                         "launch, instead of the pipelined decode (CudaModel.chains_token_steps): "
                         "the path it replaced, for comparison")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.batch_list = [int(x) for x in args.batches.split(",")]

    def log(msg):
        print(msg, flush=True)
    results = [bench_shape(s, args, log) for s in args.shapes.split(",")]
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print_table(results)


def print_table(results):
    print("\n| shape | what | engine | model step | engine / model |   (KV "
          + ", ".join(f"{r['shape']}: {r['kv_dtype']}, decode after {r['decode_context']} tokens"
                      for r in results) + ")")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | load (weights) | {r['load_s'] or 0:.1f} s = "
              f"{r['load_gbps'] or 0:.1f} GB/s | | |")
        print(f"| {r['shape']} | Engine start (load + warm-up) | {r['start_s']:.1f} s | | |")
        for n, t in r["ttft"].items():
            print(f"| {r['shape']} | TTFT {n} | {t['engine_ms']:.1f} ms | {t['model_ms']:.1f} ms | "
                  f"{t['ratio']:.3f} |")
        for k, t in r["decode"].items():
            print(f"| {r['shape']} | decode {k} | {t['engine_tok_s']:.0f} tok/s | "
                  f"{t['model_tok_s']:.0f} tok/s | {t['ratio']:.3f} "
                  f"(host {t['host_us_per_step']:.0f} us/step; first/last third "
                  f"{t['first_third_tok_s']:.0f}/{t['last_third_tok_s']:.0f} tok/s) |")
        http = r.get("http")
        if http:
            print(f"| {r['shape']} | HTTP server start | {http['start_s']:.1f} s | | |")
    print("\n| shape | through HTTP | HTTP | Engine | Engine / HTTP (TTFT), HTTP / Engine "
          "(decode) |")
    print("|---|---|---|---|---|")
    for r in results:
        http = r.get("http")
        if not http:
            continue
        for n, ms in http["ttft"].items():
            eng = r["ttft"].get(n, {}).get("engine_ms", float("nan"))
            sdk = http.get("sdk_ttft", {}).get(n)
            print(f"| {r['shape']} | TTFT {n} | {ms:.1f} ms | {eng:.1f} ms | {eng / ms:.3f}"
                  + (f" (openai SDK client: {sdk:.1f} ms)" if sdk else "") + " |")
        for k, rate in http["decode"].items():
            eng = r["decode"].get(k, {}).get("engine_tok_s", float("nan"))
            print(f"| {r['shape']} | decode {k} | {rate:.0f} tok/s | {eng:.0f} tok/s | "
                  f"{rate / eng:.3f} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
