"""The Qwen3.5 model family: config, binder and the text model (numpy here, CUDA in cuda_model)."""
from __future__ import annotations

from ...errors import DeviceError, RequestError


def load_model(artifact, options):
    """Bind the artifact's text parameters on the backend named by `options.backend`
    (`options`: EngineOptions; its backend, dtype and kv_dtype are read)."""
    backend = options.backend
    if backend == "cuda":
        try:
            from .cuda_model import load_cuda_model
        except ImportError as exc:
            raise DeviceError(f"backend 'cuda' is not available here: {exc}") from exc
        return load_cuda_model(artifact, options)
    if backend != "numpy":
        raise DeviceError(f"unknown backend {backend!r}; expected 'numpy' or 'cuda'")
    if options.dtype not in (None, "float32"):
        # (EngineOptions.validate says the same; this covers options made without it)
        raise RequestError(f"dtype={options.dtype!r}: the numpy backend computes in float32 only "
                           "(from the stored weights); use None or 'float32'")
    from .model import NumpyModel
    model = NumpyModel.from_artifact(artifact)
    model.kv_dtype = _quantized_kv(options)
    return model


def _quantized_kv(options):
    """None for the backend's unquantized KV, else "fp8" / "int8"."""
    return None if options.kv_dtype == "bfloat16" else options.kv_dtype


__all__ = ["load_model"]
