"""Hugging Face checkpoint -> `.ninfer` converter (`python -m ninfer convert SRC_DIR OUT.ninfer`).

Source mapping and validation live in `convert.py` / `names.py`, checkpoint reading in `source.py`,
and the value-preserving (later: quantizing) import in `recipe.py`.
"""
from .convert import ConversionPlan, convert_checkpoint, plan_conversion
from .recipe import Recipe, ValuePreserving

__all__ = ["convert_checkpoint", "plan_conversion", "ConversionPlan", "Recipe", "ValuePreserving"]
