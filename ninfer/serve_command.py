"""`python -m ninfer serve`: the OpenAI / Anthropic HTTP server over one Engine (ninfer/serve/),
or over N replicas behind a router (--data-parallel N).

Bad input ends with one `ninfer: error: ...` line and exit status 2 (cli.main prints it).
"""
from __future__ import annotations

import math
import os
import sys

from .commands import (_artifact_or_demo, _engine_flags, check_engine_flags, engine_kwargs,
                       read_chat_template, resolved_engine_kwargs, sampling_flags,
                       sampling_overrides, say_backend, settle_backend, startup_line,
                       thinking_flags)
from .errors import Error


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI/Anthropic-compatible HTTP API (gunicorn)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/messages, "
                                   "/v1/models, /health and /metrics (see docs/serving.md).")
    s.add_argument("artifact", nargs="?",
                   help="a .ninfer file (default: the built-in demo model, trained on Python)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="bind port (default 8000)")
    _engine_flags(s, concurrency_default=4)
    s.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(default: $NINFER_API_KEY; unset = no auth)")
    s.add_argument("--model-id", help="model name in responses and /v1/models "
                                      "(default: the artifact's name)")
    sampling_flags(s)       # request defaults: a request's own field wins
    s.add_argument("--max-tokens", type=int, default=None,
                   help="default max_tokens (default: the checkpoint's, else whatever fits in "
                        "the context)")
    s.add_argument("--max-tokens-cap", type=int, default=None, metavar="N",
                   help="most tokens one request may ask for: a larger max_tokens is a 400 "
                        "naming N, a request naming none gets at most N (default: no cap but "
                        "the context)")
    thinking_flags(s, what="requests that do not say (chat_template_kwargs.enable_thinking) get")
    s.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template replacing the artifact's")
    s.add_argument("--lenient", action="store_true",
                   help="ignore request fields this server does not implement (default: 400 "
                        "naming the field)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="cancel a generation still running this long after it was submitted "
                        "(default: no limit)")
    s.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                   help="CORS: let browser pages from ORIGIN (https://host:port, or '*') call "
                        "the API (repeatable; default: none)")
    s.add_argument("--allow-media-urls", metavar="HOST,...", default=None,
                   help="fetch http(s) image and video URLs from these hosts (HOST or "
                        "HOST:PORT, comma-separated; 20 MiB per image, --max-video-mb per "
                        "video, 10 s each, redirects only to listed hosts; default: none, media "
                        "come inline as data: URLs)")
    s.add_argument("--max-video-frames", type=int, default=7200, metavar="N",
                   help="refuse (400) a video of more than N frames before decoding it "
                        "(default 7200: 4 minutes at 30 fps)")
    s.add_argument("--max-video-mb", type=float, default=64.0, metavar="MB",
                   help="largest video fetched from a URL, MiB (default 64; an inline data: "
                        "URL is bounded by --max-body-mb)")
    s.add_argument("--threads", type=int, default=None,
                   help="HTTP worker threads (default max-concurrency + max-queue + 4)")
    s.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body, MiB (default 8)")
    s.add_argument("--drain-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, in-flight requests get this long before they are "
                        "cancelled (default 30)")
    s.add_argument("--access-log", action="store_true", help="log each request to stderr")
    s.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="the server's (gunicorn and uvicorn) log lines on stderr at this level "
                        "and above (default info)")
    s.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="serve with N replicas, each a whole server with its own Engine on its "
                        "own GPU, behind a router on --host/--port that keeps each "
                        "conversation on one replica (docs/serving.md; default 1: one Engine, "
                        "no router)")
    s.add_argument("--replica-devices", metavar="LIST", default=None,
                   help="with --data-parallel N: the N CUDA_VISIBLE_DEVICES values of the "
                        "replicas, comma-separated (default: the first N entries of "
                        "$CUDA_VISIBLE_DEVICES when it lists enough, else 0,1,...,N-1)")
    # the parser itself, so that --data-parallel can give its replicas the flags this one got
    s.set_defaults(handler=serve_command, serve_parser=s)


def serve_command(args) -> int:
    from .options import EngineOptions
    from .serve.config import ServeConfig, transport_overrides   # plain data: no falcon yet

    check_engine_flags(engine_kwargs(args, concurrency_default=4))   # one line, before any fork
    if not 1 <= args.port <= 65535:
        raise Error(f"--port {args.port}: must be in 1..65535")
    if args.threads is not None and args.threads < 1:
        raise Error(f"--threads {args.threads}: must be >= 1")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise Error(f"--max-body-mb {args.max_body_mb}: must be a finite number > 0")
    if args.max_video_frames < 1:
        raise Error(f"--max-video-frames {args.max_video_frames}: must be >= 1")
    if not (math.isfinite(args.max_video_mb) and args.max_video_mb > 0):
        raise Error(f"--max-video-mb {args.max_video_mb}: must be a finite number > 0")
    config = ServeConfig(model_id=args.model_id, api_key=args.api_key or None,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)),
                         max_tokens=args.max_tokens, max_tokens_cap=args.max_tokens_cap,
                         enable_thinking=args.thinking,
                         drain_grace_s=args.drain_grace, lenient=args.lenient,
                         request_timeout_s=args.request_timeout,
                         allowed_origins=tuple(args.allowed_origins),
                         **sampling_overrides(args), **transport_overrides(args)).validate()
    media_urls = None
    if args.allow_media_urls is not None:
        from .models.qwen3_5.frontend.media_fetch import MediaUrlPolicy
        try:
            media_urls = MediaUrlPolicy.parse(args.allow_media_urls)
        except ValueError as exc:
            raise Error(str(exc)) from None
    template = read_chat_template(args.chat_template)
    devices = _replica_devices(args)
    _check_can_listen(args.host, args.port)
    note = settle_backend(args, concurrency_default=4)
    path, _ = _artifact_or_demo(args.artifact)
    say_backend(note)
    if devices is not None:
        return _serve_replicated(args, path, config, devices)
    kwargs = dict(resolved_engine_kwargs(args, path, concurrency_default=4),
                  default_enable_thinking=args.thinking)     # None: the model's default
    options = EngineOptions.from_kwargs(**kwargs)
    threads = args.threads or min(options.max_concurrency + options.max_queue + 4, 512)

    def engine_factory():
        from .engine import Engine
        engine = Engine(path, chat_template=template, **kwargs)
        # one write: this runs in the loading thread while the access log writes /health lines
        # to the same stream, and print() writes the text and its newline separately
        sys.stderr.write(startup_line(engine) + "\n")
        sys.stderr.flush()
        if engine.frontend is not None:
            if media_urls is not None:
                engine.frontend.allow_media_urls(media_urls)
            engine.frontend.limit_videos(max_frames=args.max_video_frames,
                                         max_bytes=int(args.max_video_mb * (1 << 20)))
        return engine

    try:
        from .serve.launcher import serve
    except ImportError as exc:
        raise Error(f"serve needs the [serve] extra ({exc}); pip install 'ninfer[serve]'") from None
    print(f"ninfer: serving {path} on http://{args.host}:{args.port} "
          f"(OpenAI /v1/chat/completions, Anthropic /v1/messages)", file=sys.stderr)
    serve(engine_factory, config, host=args.host, port=args.port, threads=threads,
          access_log=args.access_log, log_level=args.log_level)
    return 0


def _check_can_listen(host: str, port: int) -> None:
    """Bind once (as gunicorn will, SO_REUSEADDR) so that a taken port or an unknown host is one
    error line before the model loads, not gunicorn's retries. A port taken in between still
    fails in gunicorn."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        raise Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


# ---- --data-parallel N: replicas behind a router (serve/dp_launcher.py, replicas.py, router.py) --

# flags a replica does not get from the router's command line: the router owns them, or sets
# them per replica (the API key travels in the environment, not on a command line `ps` shows;
# the access log is the router's, which sees every request, not the replicas' /health probes)
_ROUTER_ONLY = frozenset(("artifact", "host", "port", "data_parallel", "replica_devices",
                          "api_key", "access_log", "serve_parser", "handler", "command"))


def _replica_devices(args) -> list | None:
    """The replicas' CUDA_VISIBLE_DEVICES values, or None for one Engine without a router."""
    n = args.data_parallel
    if n < 1:
        raise Error(f"--data-parallel {n}: must be >= 1")
    if n == 1:
        if args.replica_devices is not None:
            raise Error("--replica-devices needs --data-parallel N with N >= 2")
        return None
    if args.device_id is not None:
        raise Error("--device-id: with --data-parallel each replica sees only its own GPU "
                    "(device 0); name the GPUs with --replica-devices")
    if args.replica_devices is None:
        # the GPUs this process may use: the first N of its own CUDA_VISIBLE_DEVICES, if set
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                   if d.strip()]
        return visible[:n] if len(visible) >= n else [str(i) for i in range(n)]
    devices = [d.strip() for d in args.replica_devices.split(",")]
    if len(devices) != n or not all(devices):
        raise Error(f"--replica-devices {args.replica_devices!r}: must list {n} devices "
                    f"(--data-parallel {n}), comma-separated")
    return devices


def replica_flags(parser, args) -> list:
    """The command-line flags that give a replica the options `args` holds, but those in
    _ROUTER_ONLY: each flag whose value differs from the parser's default, written back as the
    parser reads it (tests/test_serve_replicas.py parses the result again)."""
    import argparse
    defaults = vars(parser.parse_args([]))
    out, done = [], set()
    for action in parser._actions:      # argparse lists them nowhere public
        dest = action.dest
        if not action.option_strings or dest in _ROUTER_ONLY or dest in done \
                or dest not in defaults:
            continue
        value = getattr(args, dest, None)
        if value == defaults[dest]:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            negative = [o for o in action.option_strings if o.startswith("--no-")]
            out.append(action.option_strings[0] if value else negative[0])
        elif action.nargs == 0:         # store_true / store_false / store_const
            if value != action.const:
                continue                # another action of this dest writes it
            out.append(action.option_strings[0])
        elif isinstance(value, list):   # append
            for item in value:
                out += [action.option_strings[0], str(item)]
        else:
            out += [action.option_strings[0], str(value)]
        done.add(dest)
    return out


def _serve_replicated(args, path, config, devices: list) -> int:
    from .commands import engine_kwargs
    try:
        from .serve.dp_launcher import serve_replicas
    except ImportError as exc:
        raise Error(f"serve needs the [serve] extra ({exc}); pip install 'ninfer[serve]'") from None
    if args.backend == "cuda" and args.replica_devices is None:
        from .backend_auto import cuda_device_count
        count, why = cuda_device_count()
        if count < len(devices):
            raise Error(f"--data-parallel {len(devices)}: {count} CUDA devices found"
                        f"{f' ({why})' if why else ''}; name the devices with --replica-devices")
    flags = replica_flags(args.serve_parser, args)
    env = dict(os.environ)
    if args.api_key:
        env["NINFER_API_KEY"] = args.api_key

    def argv_for(port: int) -> list:
        return [sys.executable, "-m", "ninfer", "serve", str(path), *flags,
                "--host", "127.0.0.1", "--port", str(port)]
    print(f"ninfer: serving {path} on http://{args.host}:{args.port} with {len(devices)} "
          f"replicas (CUDA_VISIBLE_DEVICES {', '.join(devices)}) behind a router",
          file=sys.stderr)
    # the load bound: a replica with a full batch of requests more than the least-loaded one
    # waits for them rather than take more of its keys
    slack = engine_kwargs(args, concurrency_default=4)["max_concurrency"]
    serve_replicas(argv_for, devices, config, host=args.host, port=args.port, slack=slack,
                   env=env, access_log=args.access_log, log_level=args.log_level)
    return 0
