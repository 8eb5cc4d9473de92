"""The converter on the torch-built fixture checkpoints (tests/fixtures, real HF save layout): every
source tensor lands under its logical name byte for byte, and the config round-trips."""
import json
import pathlib

import pytest
from ckpt_helpers import check_artifact_matches, load_tensors

from ninfer.artifact import Artifact
from ninfer.convert import convert_checkpoint
from ninfer.models import model_config
from ninfer.models.qwen3_5.config import parse_hf_config

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
# skip a fixture maker's partial dir, and the FP8 releases (tests/test_quant_fixtures.py: their
# bytes are checked there, safetensors' numpy reader has no float8)
NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/config.json")
               if not p.parent.name.startswith((".", "fp8_")))


@pytest.mark.skipif(not NAMES, reason="no fixture checkpoints under tests/fixtures")
@pytest.mark.parametrize("fixture", NAMES)
def test_convert_fixture(tmp_path, fixture):
    src = FIXTURES / fixture
    hf = json.loads((src / "config.json").read_text())
    out = convert_checkpoint(src, tmp_path / f"{fixture}.ninfer", progress=False)
    tensors = load_tensors(src)
    with Artifact(out, verify="eager") as art:
        assert model_config(art) == parse_hf_config(hf)
        tied = model_config(art).text.tie_word_embeddings or "lm_head.weight" not in tensors
        check_artifact_matches(art, tensors, tied=tied)
        assert art.resource("config.json") == (src / "config.json").read_bytes()
        assert art.resource("generation_config.json") == (src / "generation_config.json").read_bytes()
        want = ["text"] + [c for c, prefix in (("vision", "model.visual."), ("mtp", "mtp."))
                           if any(n.startswith(prefix) for n in tensors)]
        assert art.manifest["components"] == want
