"""Figures recorded with the numpy backend when the reference models were committed
(docs/models.md); tests/test_reference_models.py and tests/gpu/test_reference_models_gpu.py hold
the models to them."""

NAMES = ("dense", "moe")
PROMPT = "def fibonacci(n):"
GREEDY = {   # 24 greedy tokens: the chat template with PROMPT as the user message, no thinking
    "dense": [727, 1007, 1153, 11, 1007, 11, 2182, 1590, 198, 262, 413, 2182, 606, 220, 16, 25,
              198, 285, 460, 21264, 15985, 13, 1936, 198],
    "moe": [727, 369, 648, 1153, 1590, 198, 262, 4071, 5423, 279, 1103, 314, 279, 1428, 1500,
            314, 279, 5024, 5639, 71483, 198, 262, 460, 638],
}
GREEDY_RAW = {   # raw text PROMPT + "\n", up to 24 tokens
    "dense": [262, 460, 2912, 248046],
    "moe": [262, 413, 272, 606, 292, 6, 1170, 198, 285, 460, 292, 4456, 198, 262, 745, 25, 198,
            285, 460, 292, 4456, 198, 262, 413],
}
# the held-out text's first HELDOUT_TOKENS tokens, in two windows of 512 (eval's default context)
HELDOUT_TOKENS = 1022
HELDOUT_BYTES = 3984
HELDOUT_PPL = {"dense": 39.15474337249513, "moe": 48.742330075497925}
