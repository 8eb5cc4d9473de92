"""The Gateway: an OpenAI- and Anthropic-compatible HTTP API over one resident Engine.

    from ninfer.serve import create_app, create_asgi_app
    app = create_app(engine)          # WSGI (gunicorn, waitress, ...)
    app = create_asgi_app(engine)     # ASGI (uvicorn, ...)

`python -m ninfer serve ARTIFACT` runs the WSGI app under gunicorn (ninfer/serve/launcher.py).
See docs/serving.md for every endpoint, option and error.
"""
from .config import ServeConfig
from .errors import ApiError


def __getattr__(name):
    # falcon and prometheus-client (the [serve] extra) load only when an app is built
    if name in ("create_app", "create_asgi_app"):
        from . import app
        return getattr(app, name)
    if name == "Gateway":
        from .gateway import Gateway
        return Gateway
    raise AttributeError(name)


__all__ = ["create_app", "create_asgi_app", "ServeConfig", "Gateway", "ApiError"]
