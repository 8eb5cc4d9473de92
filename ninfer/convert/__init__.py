"""Hugging Face checkpoint -> `.ninfer` converter (`python -m ninfer convert SRC_DIR OUT.ninfer`).

Source mapping and validation live in `convert.py` / `names.py`, checkpoint reading in `source.py`,
the value-preserving import in `recipe.py`, quantized objects (FP8 releases, `--quantize`) in
`quantize.py`, calibration statistics (`--calibration`) in `calibrate.py` and the GPTQ maths in
`gptq.py`. Imports run downward only:

    convert.py -> calibrate.py (the numpy Engine over a calibration text)
               -> quantize.py  -> gptq.py -> artifact.format
"""
from .convert import ConversionPlan, convert_checkpoint, plan_conversion
from .quantize import Quantize
from .recipe import Recipe, ValuePreserving

__all__ = ["convert_checkpoint", "plan_conversion", "ConversionPlan", "Recipe", "ValuePreserving",
           "Quantize"]
