"""http(s) image URLs under `serve --allow-media-urls` (issue 18): fetched only from listed hosts,
redirects checked host by host, size and time limits, never file:// or other schemes; each
refusal a RequestError (HTTP 400) with the reason. A threaded http.server on 127.0.0.1 plays the
remote host; 'localhost' (the same server under a name not listed) plays an unlisted one."""
from __future__ import annotations

import http.server
import io
import threading
import time

import numpy as np
import pytest

from ninfer.errors import RequestError
from ninfer.models.qwen3_5.frontend.media_fetch import MediaUrlPolicy
from ninfer.models.qwen3_5.frontend.image_preprocess import MediaError
from test_vision_frontend import FakeArtifact, _user

Image = pytest.importorskip("PIL.Image")

LIMIT = 4096            # bytes, small so the oversized bodies stay small
TIMEOUT = 0.5           # seconds, small so the slow body's test stays short
IMG = np.random.default_rng(7).integers(0, 256, size=(14, 9, 3), dtype=np.uint8)


def _png(arr) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png(IMG)
assert len(PNG) < LIMIT


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hits: list = []

    def log_message(self, *a):          # quiet
        pass

    def _send(self, status, body=b"", headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        if not any(k == "Content-Length" for k, _ in headers):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        Handler.hits.append(self.path)
        port = self.server.server_address[1]
        if self.path == "/a.png":
            self._send(200, PNG, [("Content-Type", "image/png")])
        elif self.path == "/hop":           # same host: followed
            self._send(302, headers=[("Location", "/a.png")])
        elif self.path == "/out":           # to a host not listed: refused, never fetched
            self._send(302, headers=[("Location", f"http://localhost:{port}/a.png")])
        elif self.path == "/file":
            self._send(302, headers=[("Location", "file:///etc/passwd")])
        elif self.path == "/loop":
            self._send(302, headers=[("Location", "/loop")])
        elif self.path == "/big-declared":
            self._send(200, b"x" * (LIMIT + 1))
        elif self.path == "/big-undeclared":   # no Content-Length: read until the limit
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"x" * (4 * LIMIT))
            self.close_connection = True
        elif self.path == "/slow":          # a small body trickling in, past the time limit
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            try:
                for i in range(0, len(PNG), 16):
                    self.wfile.write(PNG[i:i + 16])
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        elif self.path == "/junk":
            self._send(200, b"not an image at all")
        else:
            self._send(404, b"no")


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def fe(server):
    from ninfer.models.qwen3_5.frontend import Frontend
    fe = Frontend.from_artifact(FakeArtifact())
    fe.allow_media_urls(MediaUrlPolicy(("127.0.0.1",), max_bytes=LIMIT, timeout_s=TIMEOUT))
    return fe


def _url_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_listed_host_is_fetched_and_equals_the_inline_image(fe, server):
    base, _ = server
    want = fe.prepare(_user({"type": "image", "image": IMG})).media[0]
    for part in (_url_part(base + "/a.png"), _url_part(base + "/hop"),
                 {"type": "image", "image": base + "/a.png"},
                 {"type": "image", "source": {"type": "url", "url": base + "/a.png"}}):
        got = fe.prepare(_user(part)).media[0]
        assert got.grid_thw == want.grid_thw
        np.testing.assert_array_equal(got.pixels, want.pixels)


@pytest.mark.parametrize("path, reason", [
    ("/out", r"host 'localhost' \(port \d+\) is not among the server's --allow-media-urls"),
    ("/file", "only http\\(s\\) URLs are fetched"),
    ("/loop", "more than 3 redirects"),
    ("/big-declared", f"{LIMIT + 1} bytes, over the {LIMIT}-byte limit"),
    ("/big-undeclared", f"over the {LIMIT}-byte limit"),
    ("/slow", f"no complete answer within {TIMEOUT:g} s"),
    ("/missing", "HTTP 404"),
    ("/junk", "image 1: image is not decodable"),
])
def test_refusals_are_400s_with_the_reason(fe, server, path, reason):
    base, _ = server
    Handler.hits.clear()
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=reason) as e:
        fe.prepare(_user(_url_part(base + path)))
    assert e.value.status == 400
    assert time.monotonic() - t0 < TIMEOUT + 1.0        # the time limit bounds the whole fetch
    if path == "/out":
        assert Handler.hits == ["/out"]                 # the unlisted target was never asked


def test_unlisted_host_and_other_schemes_are_never_opened(fe, server):
    _, port = server
    Handler.hits.clear()
    for url, reason in ((f"http://localhost:{port}/a.png", "not among"),
                        ("file:///etc/passwd", "only http\\(s\\)"),
                        ("ftp://127.0.0.1/a.png", "only http\\(s\\)")):
        with pytest.raises(RequestError, match=reason):
            fe.prepare(_user(_url_part(url)))
    assert Handler.hits == []


def test_without_the_option_urls_are_refused_naming_it(server):
    from ninfer.models.qwen3_5.frontend import Frontend
    base, _ = server
    Handler.hits.clear()
    plain = Frontend.from_artifact(FakeArtifact())
    with pytest.raises(RequestError, match="--allow-media-urls") as e:
        plain.prepare(_user(_url_part(base + "/a.png")))
    assert e.value.status == 400
    with pytest.raises(RequestError, match="only data: URLs"):
        plain.prepare(_user(_url_part("file:///etc/passwd")))
    assert Handler.hits == []


def test_policy_ports_and_parsing():
    p = MediaUrlPolicy.parse("Example.com, 127.0.0.1:8080")
    assert p.allows("example.com", 443) and p.allows("127.0.0.1", 8080)
    assert not p.allows("127.0.0.1", 8081) and not p.allows("evil.example.com", 80)
    for bad in ("", "a,,b", "http://x/y", "user@host", "host:notaport"):
        with pytest.raises(ValueError):
            MediaUrlPolicy.parse(bad)
    assert issubclass(MediaError, ValueError)
