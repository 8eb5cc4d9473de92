"""Streaming .ninfer writer: objects go to disk as they arrive; the manifest and header come last.

    with ArtifactWriter("m.ninfer", config, name="tiny") as w:
        w.add_object("text.norm.weight", norm)            # one whole array
        with w.begin_object("text.layers.0.mlp.experts.down_proj", "bfloat16", (E, H, I)) as sink:
            for e in range(E):
                sink.write(expert_down[e])                # row-major pieces, bounded memory
        w.bind("text.norm.weight", "text.norm.weight")
    # leaving the block finishes (atomic rename); an exception aborts (the partial file is deleted)
"""
from __future__ import annotations

import json
import math
import os
from typing import Protocol, runtime_checkable

import numpy as np

from .. import __version__
from ..errors import ArtifactError
from . import format as fmt


@runtime_checkable
class StoredModelConfig(Protocol):
    """What the container needs of a model family's config (e.g. the Qwen3.5 ModelConfig): the
    architecture name (the artifact's default name; ninfer.models finds the family by it when
    reading) and the plain JSON stored as the manifest's "config"."""

    architecture: str

    def to_json(self) -> dict: ...


class ObjectSink:
    """Receives one object's bytes in row-major order; `close()` checks the byte count."""

    def __init__(self, writer: "ArtifactWriter", entry: dict):
        self._writer = writer
        self._entry = entry
        self._dtype = fmt.DTYPES[entry["dtype"]]
        self._written = 0
        self._crc = 0
        self.closed = False

    def write(self, piece) -> None:
        if self.closed:
            raise ArtifactError(f"object {self._entry['name']!r}: write after close")
        if isinstance(piece, np.ndarray):
            if piece.dtype != self._dtype:
                raise ArtifactError(f"object {self._entry['name']!r}: piece dtype {piece.dtype} "
                                    f"!= object dtype {self._entry['dtype']} (no silent conversion)")
            raw = memoryview(np.ascontiguousarray(piece).reshape(-1).view(np.uint8))
        else:
            raw = memoryview(piece).cast("B")
        if self._written + len(raw) > self._entry["nbytes"]:
            raise ArtifactError(f"object {self._entry['name']!r}: pieces exceed its "
                                f"{self._entry['nbytes']} bytes")
        self._writer._io(lambda: self._writer._write_raw(raw))
        self._crc = fmt.crc32(raw, self._crc)
        self._written += len(raw)

    def close(self) -> None:
        if self.closed:
            return
        if self._written != self._entry["nbytes"]:
            raise ArtifactError(f"object {self._entry['name']!r}: got {self._written} bytes, "
                                f"shape {self._entry['shape']} needs {self._entry['nbytes']}")
        self._entry["checksum"] = fmt.format_checksum(self._crc)
        self.closed = True
        self._writer._object_closed(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()


class ArtifactWriter:
    """Writes `<path>.partial` in the destination directory and renames it to `path` at `finish()`."""

    def __init__(self, path, config: StoredModelConfig, *, name: str | None = None,
                 alignment: int = fmt.DEFAULT_ALIGNMENT, metadata: dict | None = None):
        if not isinstance(config, StoredModelConfig):
            raise ArtifactError("ArtifactWriter needs a model config (architecture, to_json()), "
                                f"got {type(config).__name__}")
        if not fmt.is_valid_alignment(alignment):
            raise ArtifactError(f"alignment {alignment} is not a power of two >= {fmt.MIN_ALIGNMENT}")
        self.path = os.fspath(path)
        self.partial_path = self.path + ".partial"
        self._config = config
        self._alignment = alignment
        self._metadata = {"name": name or config.architecture, "producer": f"ninfer {__version__}",
                          **(metadata or {})}
        if name:
            self._metadata["name"] = name
        self._objects: dict[str, dict] = {}
        self._bindings: dict[str, dict] = {}
        self._uses: list[dict] = []
        self._resources: dict[str, str] = {}
        self._sink: ObjectSink | None = None
        self._payload_offset = fmt.align_up(fmt.HEADER_NBYTES, alignment)
        self._done = False
        try:
            self._file = open(self.partial_path, "wb")
        except OSError as exc:
            raise ArtifactError(f"cannot create {self.partial_path}: {exc.strerror or exc}") from exc
        self._pos = 0
        self._io(lambda: self._write_raw(bytes(self._payload_offset)))   # header placeholder

    # -- objects -------------------------------------------------------------------------------

    def begin_object(self, name: str, dtype, shape, layout: str = "row_major",
                     quant: dict | None = None) -> ObjectSink:
        """`quant`: the quantized-layout fields (docs/artifact.md 3.2.1), checked at finish()
        once the scale / zero objects it names exist."""
        self._check_open()
        if self._sink is not None:
            raise ArtifactError(f"object {name!r}: object {self._sink._entry['name']!r} is still open")
        if not isinstance(name, str) or not name:
            raise ArtifactError(f"object name {name!r} must be a non-empty string")
        if name in self._objects:
            raise ArtifactError(f"object {name!r}: duplicate object name")
        if layout not in fmt.LAYOUTS:
            raise ArtifactError(f"object {name!r}: unknown layout {layout!r}")
        dtype_name = dtype if isinstance(dtype, str) and dtype in fmt.DTYPES else fmt.dtype_name(dtype)
        shape = [int(d) for d in shape]
        if any(d < 0 for d in shape):
            raise ArtifactError(f"object {name!r}: negative dimension in shape {shape}")
        offset = fmt.align_up(self._pos, self._alignment)
        self._io(lambda: self._write_raw(bytes(offset - self._pos)))
        entry = {"name": name, "dtype": dtype_name, "shape": shape, "layout": layout,
                 "offset": offset,
                 "nbytes": math.prod(shape) * fmt.DTYPES[dtype_name].itemsize, "checksum": None}
        if quant is not None:
            entry["quant"] = dict(quant)
        self._sink = ObjectSink(self, entry)
        return self._sink

    def add_object(self, name: str, array, layout: str = "row_major") -> None:
        array = np.asarray(array)
        with self.begin_object(name, array.dtype, array.shape, layout) as sink:
            sink.write(array)

    def add_resource(self, name: str, data: bytes) -> None:
        if name in self._resources:
            raise ArtifactError(f"resource {name!r}: added twice")
        obj = f"resource/{name}"
        self.add_object(obj, np.frombuffer(bytes(data), dtype=np.uint8))
        self._resources[name] = obj

    # -- logical layer -------------------------------------------------------------------------

    def bind(self, logical: str, object_name: str, view: dict | None = None) -> None:
        self._check_open()
        if logical in self._bindings:
            raise ArtifactError(f"binding {logical!r}: bound twice")
        b = {"object": object_name} if view is None else {"object": object_name, "view": dict(view)}
        fmt.validate_binding(logical, b, self._objects, "writer")
        self._bindings[logical] = b

    def add_use(self, site: str, binding: str, inputs=(0,), activation: str = "A16Only") -> None:
        self._check_open()
        if binding not in self._bindings:
            raise ArtifactError(f"use at site {site!r}: binding {binding!r} does not exist")
        if activation not in fmt.ACTIVATIONS:
            raise ArtifactError(f"use at site {site!r}: activation {activation!r} is not one of "
                                f"{fmt.ACTIVATIONS}")
        self._uses.append({"site": site, "binding": binding, "inputs": [int(p) for p in inputs],
                           "activation": activation})

    def has_object(self, name: str) -> bool:
        return name in self._objects

    # -- end -----------------------------------------------------------------------------------

    def finish(self) -> str:
        """Write manifest and header, fsync, rename onto the final path. Returns the path."""
        self._check_open()
        if self._sink is not None:
            raise ArtifactError(f"finish: object {self._sink._entry['name']!r} is still open")
        manifest_offset = fmt.align_up(self._pos, self._alignment)
        manifest = self._manifest()
        fmt.validate_manifest(manifest, alignment=self._alignment,
                              payload_offset=self._payload_offset,
                              manifest_offset=manifest_offset, where=self.path)
        blob = json.dumps(manifest, separators=(",", ":"), sort_keys=False).encode("utf-8")

        def write_tail():
            self._write_raw(bytes(manifest_offset - self._pos))
            self._write_raw(blob)
            self._file.seek(0)
            self._file.write(fmt.pack_header(
                manifest_offset=manifest_offset, manifest_nbytes=len(blob),
                manifest_crc=fmt.crc32(blob), alignment=self._alignment,
                payload_offset=self._payload_offset, file_nbytes=manifest_offset + len(blob)))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.partial_path, self.path)

        self._io(write_tail)
        self._done = True
        return self.path

    def abort(self) -> None:
        """Drop everything written; never leaves a file behind. Safe to call more than once."""
        if self._done:
            return
        self._done = True
        try:
            self._file.close()
        finally:
            try:
                os.unlink(self.partial_path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        elif not self._done:
            try:
                self.finish()
            except BaseException:
                self.abort()
                raise

    # -- internals -----------------------------------------------------------------------------

    def _manifest(self) -> dict:
        present = {b.split(".", 1)[0] for b in self._bindings}
        components = [c for c in ("text", "vision", "mtp", "dflash") if c in present]
        return {
            "format": "ninfer", "format_version": fmt.FORMAT_VERSION, "alignment": self._alignment,
            "metadata": self._metadata, "config": self._config.to_json(), "components": components,
            "objects": list(self._objects.values()), "bindings": self._bindings, "uses": self._uses,
            "resources": self._resources,
        }

    def _write_raw(self, raw) -> None:
        self._file.write(raw)
        self._pos += len(raw)

    def _object_closed(self, sink: ObjectSink) -> None:
        self._objects[sink._entry["name"]] = sink._entry
        self._sink = None

    def _check_open(self) -> None:
        if self._done:
            raise ArtifactError(f"{self.path}: writer already finished or aborted")

    def _io(self, fn) -> None:
        # Disk errors end the writer: a partial file with a hole in it is useless.
        try:
            fn()
        except OSError as exc:
            self.abort()
            raise ArtifactError(f"writing {self.partial_path}: {exc.strerror or exc}") from exc
