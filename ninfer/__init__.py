"""NInfer-Py: a torch-free inference engine for the Qwen3.5 model family.

    import ninfer
    with ninfer.Engine("model.ninfer") as engine:
        print(engine.generate("Hello", ninfer.SamplingParams(max_tokens=32)).text)
"""
from .api import (Finished, GenerationResult, GenerationStart, SamplingParams, ScoreResult,
                  StructuredOutput, TextDelta, TokenLogprob, ToolCall, ToolCallEvent)
from .errors import (ArtifactError, ContextLengthError, ConvertError, DeviceError,
                     EngineClosedError, EngineFailedError, Error, NotSupportedError,
                     RequestError)
from .options import EngineOptions

__version__ = "0.1.0"


def __getattr__(name):
    # Engine pulls in the runtime; import it lazily so `import ninfer` stays cheap.
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "EngineOptions", "SamplingParams", "StructuredOutput", "ScoreResult", "GenerationResult",
           "GenerationStart", "TextDelta", "ToolCall", "ToolCallEvent", "TokenLogprob", "Finished",
           "Error", "ArtifactError", "ConvertError", "DeviceError", "RequestError",
           "EngineClosedError", "EngineFailedError", "NotSupportedError", "ContextLengthError"]
