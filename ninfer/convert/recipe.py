"""Import recipes: how each logical parameter's source values become stored bytes.

The converter asks the recipe, per logical parameter, which dtype it stores, hands it the source
values piece by piece (row blocks, or one expert at a time), and records the activation permission the
recipe grants each use. `ValuePreserving` keeps the source bytes exactly. The quantizing recipe
(`quantize.Quantize`) also `selects` the weights it stores quantized and gives each a `quant_plan`;
those objects bypass `stored` / `encode` (quantize.write_quantized encodes whole blocks).
"""
from __future__ import annotations

import numpy as np


class Recipe:
    name = "abstract"

    def stored(self, logical: str, source_dtype: np.dtype, shape: tuple) -> tuple[np.dtype, str]:
        """(stored dtype, layout) of the object holding `logical`."""
        raise NotImplementedError

    def encode(self, logical: str, piece: np.ndarray) -> np.ndarray:
        """One row-major piece of the source tensor -> the bytes to store for it."""
        raise NotImplementedError

    def activation(self, logical: str) -> str:
        """Activation permission of the uses of `logical`: A16Only, AllowA8 or AllowA4."""
        raise NotImplementedError

    def selects(self, logical: str) -> bool:
        """Whether the text weight `logical` is stored quantized (`quant_plan` says how)."""
        return False

    def quant_plan(self, logical: str, shape: tuple, segment_rows: int):
        raise NotImplementedError

    def prepare(self, measure) -> None:
        """Called once before planning an unquantized checkpoint. `measure(text, max_tokens,
        quantize=None) -> {logical: H}` gives the input statistics of its projections over a
        calibration text (convert.hessians_for_checkpoint bound to the checkpoint)."""


class ValuePreserving(Recipe):
    """Store every tensor in its source dtype, byte for byte (bf16 stays bf16, f32 stays f32)."""
    name = "value-preserving"

    def stored(self, logical, source_dtype, shape):
        return np.dtype(source_dtype), "row_major"

    def encode(self, logical, piece):
        return piece

    def activation(self, logical):
        return "A16Only"
