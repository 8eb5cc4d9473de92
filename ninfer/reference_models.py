"""The trained reference models' compact form (committed under ninfer/demo_models/) and its
expansion into a normal Hugging Face checkpoint directory, which `ninfer.convert` then turns into a
`.ninfer` artifact like any release.

Compact form: one `.npz` per model (numpy only, no pickle):

    __config__            uint8   config.json bytes (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM)
    __meta__              uint8   JSON: recipe, data, steps, recorded perplexities
    __vocab__             int32   [K] sorted token ids whose embedding rows are stored ("kept")
    <name>.__q / .__s     int8 [..., n] values and float32 [...] per-row scales: w = q * s
    <name>                float32 small tensors (norms, A_log, dt_bias) as trained

`model.embed_tokens.weight.__q` holds only the K kept rows. Expansion fills every other row with
zeros, which is exactly the model that was trained: the training loss counted the 248,320 - K
unseen ids as logits fixed at 0 (tied embeddings: logit = h . e = 0), so the recorded figures hold
for the expanded model, and an unseen input id embeds to the zero vector. The expanded weights are
stored as bfloat16 (w = q * s rounded once).

A DFlash drafter for a reference model (`<name>-dflash.npz`, tools/train_dflash.py) uses the same
form without `__vocab__` (it has no embedding: it reads its target's); `expand_drafter` writes it
as a drafter directory (config.json with `dflash_config`, model.safetensors in bfloat16).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

MODELS_DIR = pathlib.Path(__file__).with_name("demo_models")
DRAFTER_SUFFIX = "-dflash"
EMBED = "model.embed_tokens.weight"
_Q, _S = ".__q", ".__s"
# tensors quantized per row (last axis); the rest (norms, A_log, dt_bias: 1-D) stay float32
QUANTIZED_MIN_NDIM = 2


def model_path(name: str) -> pathlib.Path:
    """ninfer/demo_models/<name>.npz; ValueError naming the models shipped when it is not one."""
    path = MODELS_DIR / f"{name}.npz"
    shipped = sorted(p.stem for p in MODELS_DIR.glob("*.npz")
                     if not p.stem.endswith(DRAFTER_SUFFIX))
    if name not in shipped or not path.is_file():
        raise ValueError(f"no reference model {name!r} (shipped: {', '.join(shipped) or 'none'})")
    return path


def drafter_path(name: str) -> pathlib.Path:
    """ninfer/demo_models/<name>-dflash.npz, the DFlash drafter of reference model <name>;
    ValueError naming the drafters shipped when there is none."""
    path = MODELS_DIR / f"{name}{DRAFTER_SUFFIX}.npz"
    if not path.is_file():
        shipped = sorted(p.stem[:-len(DRAFTER_SUFFIX)] for p in MODELS_DIR.glob("*.npz")
                         if p.stem.endswith(DRAFTER_SUFFIX))
        raise ValueError(f"no DFlash drafter for {name!r} "
                         f"(shipped for: {', '.join(shipped) or 'none'})")
    return path


def quantize_rows(w: np.ndarray) -> tuple:
    """Symmetric int8 per row of the last axis: (q int8, scale float32 [...]); a zero row gets
    scale 1."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -127, 127).astype(np.int8)
    return q, scale


def save_compact(path, hf_config: dict, meta: dict, kept_ids: np.ndarray, tensors: dict) -> None:
    """tensors: {HF name: float32 array}; the embedding holds the kept rows only [K, H]."""
    kept_ids = np.asarray(kept_ids, np.int32)
    if np.any(np.diff(kept_ids) <= 0):
        raise ValueError("kept ids must be sorted and unique")
    if tensors[EMBED].shape[0] != kept_ids.size:
        raise ValueError(f"embedding has {tensors[EMBED].shape[0]} rows, {kept_ids.size} kept ids")
    arrays = {"__config__": _json_bytes(hf_config), "__meta__": _json_bytes(meta),
              "__vocab__": kept_ids}
    _write(path, arrays, tensors)


def save_compact_drafter(path, hf_config: dict, meta: dict, tensors: dict) -> None:
    """A DFlash drafter: tensors {name: float32 array} (no embedding, no __vocab__)."""
    _write(path, {"__config__": _json_bytes(hf_config), "__meta__": _json_bytes(meta)}, tensors)


def _write(path, arrays: dict, tensors: dict) -> None:
    for name in sorted(tensors):
        w = np.asarray(tensors[name], np.float32)
        if w.ndim >= QUANTIZED_MIN_NDIM:
            arrays[name + _Q], arrays[name + _S] = quantize_rows(w)
        else:
            arrays[name] = w
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


class CompactModel:
    """A loaded compact file: `config` (HF dict), `meta`, `kept_ids` (None for a drafter),
    `tensor(name)` (float32, dequantized; the embedding expanded to the full vocabulary)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        with np.load(self.path, allow_pickle=False) as z:
            self._arrays = {k: z[k] for k in z.files}
        self.config = json.loads(self._arrays.pop("__config__").tobytes())
        self.meta = json.loads(self._arrays.pop("__meta__").tobytes())
        self.kept_ids = self._arrays.pop("__vocab__", None)

    @property
    def names(self) -> list:
        return sorted({k[:-len(_Q)] if k.endswith(_Q) else k
                       for k in self._arrays if not k.endswith(_S)})

    def tensor(self, name: str) -> np.ndarray:
        if name + _Q in self._arrays:
            w = self._arrays[name + _Q].astype(np.float32) * self._arrays[name + _S][..., None]
        else:
            w = self._arrays[name].astype(np.float32)
        if name == EMBED and self.kept_ids is not None:
            full = np.zeros((int(self.config["vocab_size"]), w.shape[1]), np.float32)
            full[self.kept_ids] = w
            return full
        return w


def expand_to_checkpoint(compact_path, out_dir) -> pathlib.Path:
    """Write a Hugging Face checkpoint directory (config.json, model.safetensors in bfloat16,
    tokenizer.json, tokenizer_config.json with the chat template, generation_config.json)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from .models.qwen3_5.frontend import builtin_template_source
    from .models.qwen3_5.frontend.vocab import cached_qwen3_5_tokenizer_json

    model = CompactModel(compact_path)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: model.tensor(n).astype(ml_dtypes.bfloat16) for n in model.names}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_bytes(_json_bytes(model.config, indent=1).tobytes())
    (out / "tokenizer.json").write_bytes(cached_qwen3_5_tokenizer_json())
    tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>", "model_max_length": 32768,
                        "chat_template": builtin_template_source()}
    (out / "tokenizer_config.json").write_bytes(_json_bytes(tokenizer_config, indent=1).tobytes())
    generation = {"eos_token_id": model.config["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_bytes(_json_bytes(generation, indent=1).tobytes())
    return out


CompactDrafter = CompactModel            # a drafter file is a compact file without __vocab__


def expand_drafter(compact_path, out_dir) -> pathlib.Path:
    """Write a DFlash drafter directory: config.json (with `dflash_config`) and model.safetensors
    (every tensor in bfloat16, w = q * s rounded once)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    drafter = CompactDrafter(compact_path)
    if drafter.kept_ids is not None or "dflash_config" not in drafter.config:
        raise ValueError(f"{compact_path} is not a compact DFlash drafter")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: drafter.tensor(n).astype(ml_dtypes.bfloat16) for n in drafter.names}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_bytes(_json_bytes(drafter.config, indent=1).tobytes())
    return out


def _json_bytes(obj, indent=None) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, indent=indent, sort_keys=True).encode("utf-8"), np.uint8)
