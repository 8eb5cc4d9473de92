"""Model families, found by the architecture name an artifact's model config stores.

The container (ninfer/artifact) and the runtime (ninfer/runtime) know no family: they hand over
plain JSON (`Artifact.model_config_json`) and take what the composition root (ninfer/engine.py,
ninfer/commands.py) injects. This registry is where that root asks which family parses an
artifact's config.
"""
from __future__ import annotations

from ..errors import ArtifactError
from .qwen3_5 import config as _qwen3_5_config
from .qwen3_5 import load as _qwen3_5_load

# architecture name -> that family's parse of an artifact's model config (an ArtifactError names
# the file when the config breaks a rule of the family)
CONFIG_PARSERS = {arch: _qwen3_5_load.model_config for arch in _qwen3_5_config.ARCHITECTURES}


def model_config(artifact):
    """The artifact's model config, parsed by the family its architecture names."""
    arch = artifact.model_config_json.get("architecture")
    parse = CONFIG_PARSERS.get(arch) if isinstance(arch, str) else None
    if parse is None:
        raise ArtifactError(f"{artifact.path}: manifest model config: unsupported architecture "
                            f"{arch!r}; expected one of {sorted(CONFIG_PARSERS)}")
    return parse(artifact)


__all__ = ["CONFIG_PARSERS", "model_config"]
