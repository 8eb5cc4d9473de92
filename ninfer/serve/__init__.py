"""The Gateway: an OpenAI- and Anthropic-compatible HTTP API over one resident Engine.

    from ninfer.serve import create_app, create_asgi_app
    app = create_app(engine)          # WSGI (gunicorn, waitress, ...)
    app = create_asgi_app(engine)     # ASGI (uvicorn, ...)

`python -m ninfer serve ARTIFACT` runs the WSGI app under gunicorn (ninfer/serve/launcher.py).
See docs/serving.md for every endpoint, option and error.
"""
from .app import create_app, create_asgi_app
from .config import ServeConfig
from .errors import ApiError
from .gateway import Gateway

__all__ = ["create_app", "create_asgi_app", "ServeConfig", "Gateway", "ApiError"]
