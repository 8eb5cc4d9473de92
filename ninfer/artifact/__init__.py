"""The .ninfer v3 container: `Artifact` (validating, zero-copy reader) and `ArtifactWriter` (streaming).

docs/artifact.md is the format specification.
"""
from .format import ACTIVATIONS, DTYPES, FORMAT_VERSION, MAGIC
from .reader import Artifact
from .writer import ArtifactWriter, ObjectSink

__all__ = ["Artifact", "ArtifactWriter", "ObjectSink", "ACTIVATIONS", "DTYPES", "FORMAT_VERSION",
           "MAGIC"]
