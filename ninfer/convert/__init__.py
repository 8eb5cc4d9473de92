"""Hugging Face checkpoint -> `.ninfer` converter (`python -m ninfer convert SRC_DIR OUT.ninfer`).

Source mapping and validation live in `convert.py` / `names.py`, checkpoint reading in `source.py`,
the value-preserving import in `recipe.py`, quantized objects (FP8 releases, `--quantize`) in
`quantize.py`.
"""
from .convert import ConversionPlan, convert_checkpoint, plan_conversion
from .quantize import Quantize
from .recipe import Recipe, ValuePreserving

__all__ = ["convert_checkpoint", "plan_conversion", "ConversionPlan", "Recipe", "ValuePreserving",
           "Quantize"]
