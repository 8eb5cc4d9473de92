"""Write tests/fixtures_compat/default_rope: a Qwen3.5 text checkpoint saved by transformers from its
default text config (rope_parameters without mrope_section, so transformers' [11, 11, 10] applies,
and a head_dim of 16: rotary_dim/2 = 2, far below the sections' sum), plus transformers' float32
logits for one random sequence. tests/test_config_compat.py converts it and compares (CI has no
torch; this maintainer tool does).

    python tools/make_compat_fixture.py            # needs torch + transformers
"""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures_compat" / "default_rope"
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512)


def build():
    """(model, ids) with the same seed every time."""
    import torch
    import transformers
    cfg = transformers.Qwen3_5TextConfig(**SMALL)
    assert "mrope_section" not in (cfg.rope_parameters or {})
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:               # non-trivial norms and gates (init leaves them 0 / 1)
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(30.0)              # sharp attention: positions (RoPE) change the logits
    ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], size=29).astype(np.int32)
    return model, ids


def logits_of(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0].float().numpy()


def main() -> int:
    import transformers
    model, ids = build()
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT)
    np.savez(OUT / "logits.npz", ids=ids, logits=logits_of(model, ids),
             versions=np.array(f"transformers {transformers.__version__}"))
    hf = json.loads((OUT / "config.json").read_text())
    print(f"wrote {OUT}: rope_parameters {hf.get('rope_parameters')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
