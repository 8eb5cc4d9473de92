"""The .ninfer reader: maps the file, checks every rule it consumes, hands out zero-copy views.

    with Artifact("m.ninfer") as art:
        w = art.tensor("text.layers.0.self_attn.q_proj.weight")   # read-only view of the mapping
        raw = art.model_config_json                                # plain JSON config

Arrays handed out keep the mapping alive on their own, so they stay valid after `close()`.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
import threading

import numpy as np

from ..errors import ArtifactError
from . import format as fmt

VERIFY_MODES = ("lazy", "eager", "none")


def _open_regular(path: str):
    """Open `path` for reading only if it is a regular file: a FIFO would block open() and read()
    forever and a device (/dev/zero) never ends. O_NONBLOCK makes opening a FIFO return at once."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a plain file")
        raise ArtifactError(f"{path}: cannot open: it is {kind}, not a regular .ninfer file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


class Artifact:
    def __init__(self, path, *, verify: str = "lazy"):
        if verify not in VERIFY_MODES:
            raise ArtifactError(f"verify={verify!r}: expected one of {VERIFY_MODES}")
        try:
            self.path = os.fspath(path)
        except TypeError:
            raise ArtifactError(f"{path!r} is not a file path (str or os.PathLike)") from None
        self._verify = verify
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        self._mm = None
        self._file = _open_regular(self.path)
        try:
            self._open()
        except OSError as exc:
            # a "regular" file the kernel will not read or map: /proc/self/mem (EIO),
            # /proc/self/pagemap (EINVAL), /sys attributes (ENODEV), a failing disk
            self.close()
            raise ArtifactError(f"{self.path}: cannot read it as a .ninfer file: "
                                f"{exc.strerror or exc}") from exc
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        size = os.fstat(self._file.fileno()).st_size
        if size < fmt.HEADER_NBYTES:    # mmap cannot map an empty file; these are all errors anyway
            fmt.unpack_header(self._file.read(), size, self.path)
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        header = fmt.unpack_header(self._mm, size, self.path)
        start, n = header["manifest_offset"], header["manifest_nbytes"]
        blob = self._mm[start:start + n]
        if fmt.crc32(blob) != header["manifest_crc"]:
            raise ArtifactError(f"{self.path}: manifest: checksum mismatch (corrupted manifest)")
        try:
            manifest = json.loads(blob.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ArtifactError(f"{self.path}: manifest: not valid UTF-8 JSON ({exc})") from exc
        self._objects = fmt.validate_manifest(
            manifest, alignment=header["alignment"], payload_offset=header["payload_offset"],
            manifest_offset=start, where=self.path)
        self._manifest = manifest
        self._bindings = manifest["bindings"]
        if not isinstance(manifest.get("config"), dict):
            raise ArtifactError(f"{self.path}: manifest model config: not an object")
        if self._verify == "eager":
            self.verify_all()

    # -- metadata ------------------------------------------------------------------------------

    @property
    def model_config_json(self) -> dict:
        """The stored model config as plain JSON: the model family parses it (ninfer.models
        .model_config finds the family by the config's architecture); the container does not
        know its fields."""
        return self._manifest["config"]

    @property
    def name(self) -> str:
        return self._manifest["metadata"]["name"]

    @property
    def defaults(self) -> dict:
        """metadata.defaults: the model's defaults for how it is run (e.g. `enable_thinking`);
        {} for an artifact that carries none (the engine's own defaults then apply)."""
        return {k: v for k, v in self._manifest["metadata"].get("defaults", {}).items()
                if k in fmt.DEFAULT_KEYS}

    @property
    def manifest(self) -> dict:
        return self._manifest

    @property
    def uses(self) -> list:
        return self._manifest["uses"]

    def binding_names(self) -> list:
        return list(self._bindings)

    def object_names(self) -> list:
        return list(self._objects)

    @property
    def payload_bytes(self) -> int:
        """Bytes of every stored object (weights, scales): what loading all of them reads."""
        return sum(o["nbytes"] for o in self._objects.values())

    def resource_names(self) -> list:
        return list(self._manifest["resources"])

    def has(self, name: str) -> bool:
        return name in self._bindings

    def binding_info(self, name: str) -> dict:
        """{'object', 'dtype', 'shape', 'view'} of a binding, without touching its payload."""
        b = self._binding(name)
        return {"object": b["object"], "dtype": self._objects[b["object"]]["dtype"],
                "shape": fmt.binding_shape(b, self._objects), "view": b.get("view")}

    # -- payload -------------------------------------------------------------------------------

    def tensor(self, name: str) -> np.ndarray:
        """Read-only, zero-copy view of a binding, in its logical shape. A quantized binding
        raises (its bytes are not its values): read it with `quantized()`."""
        b = self._binding(name)
        layout = self._objects[b["object"]]["layout"]
        if layout != "row_major":
            raise ArtifactError(f"{self.path}: binding {name!r} is quantized ({layout}): read it "
                                "with Artifact.quantized() and dequantize")
        arr = self._object_array(b["object"])
        view = b.get("view")
        if view is None:
            return arr
        if view["kind"] == "slice":
            index = [slice(None)] * arr.ndim
            index[view["axis"]] = slice(view["start"], view["stop"])
            return arr[tuple(index)]
        return arr.reshape(-1)[view["start"]:view["stop"]].reshape(view["shape"])

    def is_quantized(self, name: str) -> bool:
        return self._objects[self._binding(name)["object"]]["layout"] != "row_major"

    def quantized(self, name: str) -> fmt.QuantizedTensor:
        """The stored parts of a quantized binding (zero-copy views of the mapping)."""
        b = self._binding(name)
        o = self._objects[b["object"]]
        q = o.get("quant")
        if q is None:
            raise ArtifactError(f"{self.path}: binding {name!r} is not quantized")
        zero = self._object_array(q["zero"]) if q.get("zero") else None
        return fmt.QuantizedTensor(o["layout"], tuple(q["shape"]), tuple(q["block"]),
                                   self._object_array(b["object"]), self._object_array(q["scale"]),
                                   zero, b.get("view"))

    def resource(self, name: str) -> bytes | None:
        obj = self._manifest["resources"].get(name)
        if obj is None:
            return None
        return self._object_array(obj).tobytes()

    def verify_all(self) -> None:
        """Check every object's payload checksum now."""
        for name in self._objects:
            self._verify_object(name)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass        # arrays still view it; the mapping goes away with the last of them
        if getattr(self, "_file", None) is not None:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Artifact({self.path!r}, name={self.name!r}, bindings={len(self._bindings)})"

    # -- internals -----------------------------------------------------------------------------

    def _binding(self, name: str) -> dict:
        b = self._bindings.get(name)
        if b is None:
            raise ArtifactError(f"{self.path}: binding {name!r}: missing (no such logical "
                                f"parameter among the {len(self._bindings)} bindings)")
        return b

    def _object_array(self, obj_name: str) -> np.ndarray:
        if self._mm is None:
            raise ArtifactError(f"{self.path}: artifact is closed")
        if self._verify != "none":
            self._verify_object(obj_name)
        o = self._objects[obj_name]
        dtype = fmt.DTYPES[o["dtype"]]
        arr = np.frombuffer(self._mm, dtype=dtype, count=o["nbytes"] // dtype.itemsize,
                            offset=o["offset"])
        return arr.reshape(o["shape"])

    def _verify_object(self, obj_name: str) -> None:
        if obj_name in self._verified:
            return
        if self._mm is None:
            raise ArtifactError(f"{self.path}: artifact is closed")
        # outside the lock: loader threads check different objects at once (zlib releases the
        # GIL); two threads checking the same object only do the work twice
        o = self._objects[obj_name]
        with memoryview(self._mm) as mv, mv[o["offset"]:o["offset"] + o["nbytes"]] as part:
            got = fmt.format_checksum(fmt.crc32(part))
        if got != o["checksum"]:
            raise ArtifactError(f"{self.path}: object {obj_name!r}: payload checksum mismatch "
                                f"(manifest {o['checksum']}, data {got}): corrupted payload")
        with self._lock:
            self._verified.add(obj_name)
