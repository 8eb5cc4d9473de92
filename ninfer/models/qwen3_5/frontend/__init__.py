"""Frontend owner: tokenizer, chat template, PreparedPrompt, OutputSession (see docs/internals.md).

Pure Python + numpy + tokenizers + Jinja2; nothing here imports the runtime, a backend or the Engine.
"""
from .chat_template import ChatTemplate, builtin_template_source
from .frontend import Frontend
from .output_session import OutputPreview, OutputSession
from .prompt import PreparedPrompt
from .tokenizer import Tokenizer

__all__ = ["ChatTemplate", "Frontend", "OutputPreview", "OutputSession", "PreparedPrompt",
           "Tokenizer", "builtin_template_source"]
