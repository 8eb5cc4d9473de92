"""/v1/messages/count_tokens of a message with an image counts what the request would send: the
image's expanded placeholder tokens (the same as /v1/messages' usage.input_tokens), not the one
placeholder the chat template writes."""
from __future__ import annotations

import base64
import io
import shutil

import numpy as np
import pytest

from fixture_utils import FIXTURES_DIR, fixture_dir

Image = pytest.importorskip("PIL.Image")


def test_count_tokens_counts_the_expanded_image(tmp_path):
    from falcon import testing

    import ninfer
    from ninfer.convert import convert_checkpoint
    from ninfer.serve.app import create_app
    vision = FIXTURES_DIR / "vision"
    shutil.copytree(fixture_dir("cond_gen"), tmp_path / "src")
    for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(vision / f, tmp_path / "src" / f)
    convert_checkpoint(tmp_path / "src", tmp_path / "a.ninfer", progress=False)
    with np.load(vision / "reference.npz") as z:
        buf = io.BytesIO()
        Image.fromarray(z["image_0"]).save(buf, format="PNG")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(buf.getvalue()).decode()}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]
    with ninfer.Engine(tmp_path / "a.ninfer", max_context=512) as engine:
        client = testing.TestClient(create_app(engine))
        counted = client.simulate_post("/v1/messages/count_tokens",
                                       json={"model": "m", "messages": msgs})
        sent = client.simulate_post("/v1/messages",
                                    json={"model": "m", "max_tokens": 1, "messages": msgs})
        text_only = client.simulate_post("/v1/messages/count_tokens", json={
            "model": "m", "messages": [{"role": "user", "content": "what is it"}]})
    assert counted.status_code == 200 and sent.status_code == 200, (counted.text, sent.text)
    assert counted.json["input_tokens"] == sent.json["usage"]["input_tokens"]
    assert counted.json["input_tokens"] > text_only.json["input_tokens"] + 4
