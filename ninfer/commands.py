"""Parsers and handlers of `run` and `serve` (owned by the Gateway/CLI; see ninfer/serve/)."""
from __future__ import annotations


def add_run_parser(sub) -> None:
    r = sub.add_parser("run", help="generate from a prompt, streaming the answer to stdout")
    r.add_argument("artifact", nargs="?", help="a .ninfer file (default: the built-in demo model)")
    r.set_defaults(handler=_not_yet("run"))


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI/Anthropic-compatible HTTP API (gunicorn)")
    s.add_argument("artifact")
    s.set_defaults(handler=_not_yet("serve"))


def _not_yet(name):
    def handler(args):
        from .errors import Error
        raise Error(f"`{name}` is not built yet")
    return handler
