"""Images over HTTP with the official SDKs (issue 18): a real `python -m ninfer serve` of the tiny
multimodal checkpoint (numpy backend); an OpenAI `image_url` data: URL and an Anthropic base64
image block give the same greedy tokens as the Engine given the decoded array, and a bad image is
a 400 naming the reason."""
from __future__ import annotations

import base64
import io
import shutil
import sys

import numpy as np
import pytest

from fixture_utils import FIXTURES_DIR, fixture_dir
from test_serve_support import ServerProcess

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
Image = pytest.importorskip("PIL.Image")

VISION_DIR = FIXTURES_DIR / "vision"
KEY = "k"
BAN = {str(t): -100 for t in (256, 257, 258, 259)}      # vision tokens never come out as text


@pytest.fixture(scope="module")
def image():
    with np.load(VISION_DIR / "reference.npz") as z:
        return z["image_0"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from ninfer.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("vision_http")
    shutil.copytree(fixture_dir("cond_gen"), root / "src")
    for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(VISION_DIR / f, root / "src" / f)
    convert_checkpoint(root / "src", root / "cond_gen.ninfer", progress=False)
    return root / "cond_gen.ninfer"


@pytest.fixture(scope="module")
def server(artifact):
    srv = ServerProcess([sys.executable, "-m", "ninfer", "serve", artifact, "--api-key", KEY,
                         "--max-context", "512", "--no-thinking", "--allow-media-urls",
                         "127.0.0.1"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def want(artifact, image):
    from ninfer import Engine, SamplingParams

    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                         {"type": "image", "image": image}]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            logit_bias={int(k): v for k, v in BAN.items()})
    with Engine(artifact) as engine:
        return engine.generate(msgs, params, enable_thinking=False).text


def _png_b64(arr) -> str:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _openai_answer(server, url: str, kind: str = "image_url") -> str:
    """The greedy answer of the server to 'what is it' and the image (or, kind "video_url", the
    video) at `url` (OpenAI SDK)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.chat.completions.create(
        model="m", max_tokens=6, temperature=0, logit_bias=BAN,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is it"}, {"type": kind, kind: {"url": url}}]}])
    return r.choices[0].message.content


def test_openai_image_url(server, image, want):
    assert _openai_answer(server, "data:image/png;base64," + _png_b64(image)) == want


def test_anthropic_base64_image(server, image, want):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    r = client.messages.create(
        model="m", max_tokens=6,
        extra_body={"temperature": 0, "ignore_eos": True, "logit_bias": BAN},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is it"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": _png_b64(image)}}]}])
    assert "".join(b.text for b in r.content if b.type == "text") == want


@pytest.fixture(scope="module")
def image_host(image):
    """A local http server with the image at /a.png (the host the server lists is 127.0.0.1)."""
    import http.server
    import threading
    png = base64.b64decode(_png_b64(image))

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/a.png" else 404)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_image_urls_from_listed_hosts_only(server, image_host, want):
    """serve --allow-media-urls 127.0.0.1: the image at an http URL there gives the inline
    image's tokens; the same server named 'localhost' is not listed: a 400 naming the option."""
    assert _openai_answer(server, f"http://127.0.0.1:{image_host}/a.png") == want
    with pytest.raises(openai.BadRequestError, match="--allow-media-urls"):
        _openai_answer(server, f"http://localhost:{image_host}/a.png")
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match="--allow-media-urls"):
        claude.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": f"http://localhost:{image_host}/a.png"}}]}])


def test_bad_image_is_a_400_with_the_reason(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    bad = base64.b64encode(b"not a picture").decode()
    with pytest.raises(openai.BadRequestError, match="not decodable"):
        client.chat.completions.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + bad}}]}])


def test_openai_video_url(server, artifact, tmp_path):
    """An OpenAI `video_url` part with a data: URL (a lossless AVI of the fixture's frames)
    gives the greedy tokens of the Engine given the same file by path; an http URL on a host
    the server does not list is a 400 naming the option."""
    pytest.importorskip("av", reason="video files need PyAV (the vision extra)")
    from ninfer import Engine, SamplingParams
    from test_vision_video import write_video
    with np.load(VISION_DIR / "reference.npz") as z:
        frames, fps = z["video"], int(z["video_fps"])
    path = tmp_path / "clip.avi"
    write_video(path, frames, fps)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            logit_bias={int(k): v for k, v in BAN.items()})
    with Engine(artifact) as engine:
        want = engine.generate([{"role": "user", "content": [
            {"type": "text", "text": "what is it"}, {"type": "video", "path": str(path)}]}],
            params, enable_thinking=False).text
    data = base64.b64encode(path.read_bytes()).decode()
    assert _openai_answer(server, "data:video/x-msvideo;base64," + data, "video_url") == want
    with pytest.raises(openai.BadRequestError, match="--allow-media-urls"):
        _openai_answer(server, "http://localhost:9/clip.avi", "video_url")
