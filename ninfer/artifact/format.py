"""The .ninfer v3 framing: header layout, dtypes, and the manifest rules shared by reader and writer.

docs/artifact.md is the specification; every check here is one of its numbered rules, and every
failure is an ArtifactError naming the thing that broke the rule.
"""
from __future__ import annotations

import dataclasses
import math
import struct
import zlib

import ml_dtypes
import numpy as np

from ..errors import ArtifactError

MAGIC = b"\x89NINFER\n"
FORMAT_VERSION = 3
HEADER_NBYTES = 64
DEFAULT_ALIGNMENT = 4096
MIN_ALIGNMENT = 64

# magic, version, header_nbytes, manifest_offset, manifest_nbytes, manifest_crc32, alignment,
# payload_offset, file_nbytes, reserved, header_crc32
_HEADER = struct.Struct("<8sIIQQIIQQII")
assert _HEADER.size == HEADER_NBYTES

LAYOUTS = ("row_major", "fp8_block", "int8_block", "int4_block")
# Quantized layouts (docs/artifact.md 3.2.1): the stored element dtype each one requires.
QUANT_LAYOUTS = {"fp8_block": "float8_e4m3fn", "int8_block": "int8", "int4_block": "uint8"}
SCALE_DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("A16Only", "AllowA8", "AllowA4")
VIEW_KINDS = ("slice", "elements")

DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16), "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32), "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64), "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# zlib.crc32 takes a length that may be a C int on some builds; feed it bounded pieces.
_CRC_PIECE = 1 << 30


def dtype_name(dtype) -> str:
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise ArtifactError(f"dtype {dt}: big-endian arrays are not storable (the format is little-endian)")
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        raise ArtifactError(f"dtype {dt} is not a .ninfer dtype (known: {', '.join(DTYPES)})")
    return name


def crc32(data, value: int = 0) -> int:
    mv = memoryview(data).cast("B")
    for start in range(0, len(mv), _CRC_PIECE):
        value = zlib.crc32(mv[start:start + _CRC_PIECE], value)
    return value


def format_checksum(value: int) -> str:
    return f"crc32:{value & 0xFFFFFFFF:08x}"


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def is_valid_alignment(alignment) -> bool:
    return (isinstance(alignment, int) and alignment >= MIN_ALIGNMENT
            and alignment & (alignment - 1) == 0)


def pack_header(*, manifest_offset: int, manifest_nbytes: int, manifest_crc: int, alignment: int,
                payload_offset: int, file_nbytes: int) -> bytes:
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_NBYTES, manifest_offset, manifest_nbytes,
                        manifest_crc & 0xFFFFFFFF, alignment, payload_offset, file_nbytes, 0, 0)
    return body[:60] + struct.pack("<I", zlib.crc32(body[:60]))


def unpack_header(buf, file_nbytes: int, where: str) -> dict:
    """Check the header rules of docs/artifact.md section 2 in the order it gives; return the fields."""
    def bad(rule):
        raise ArtifactError(f"{where}: header: {rule}")

    if file_nbytes < 12:
        bad(f"file is {file_nbytes} bytes, too short to hold the magic and version (truncated?)")
    magic = bytes(buf[0:8])
    if magic != MAGIC:
        bad(f"bad magic {magic!r}, expected {MAGIC!r} (not a .ninfer file)")
    version = struct.unpack_from("<I", buf, 8)[0]
    if version != FORMAT_VERSION:
        bad(f"unsupported format version {version} (this reader reads version {FORMAT_VERSION})")
    if file_nbytes < HEADER_NBYTES:
        bad(f"file is {file_nbytes} bytes, shorter than the {HEADER_NBYTES}-byte header (truncated)")
    (_, _, header_nbytes, m_off, m_len, m_crc, alignment, p_off, size, reserved,
     h_crc) = _HEADER.unpack_from(buf, 0)
    if zlib.crc32(bytes(buf[0:60])) != h_crc:
        bad("header checksum mismatch (corrupted header)")
    if header_nbytes != HEADER_NBYTES:
        bad(f"header_nbytes is {header_nbytes}, expected {HEADER_NBYTES}")
    if not is_valid_alignment(alignment):
        bad(f"alignment {alignment} is not a power of two >= {MIN_ALIGNMENT}")
    if p_off != align_up(HEADER_NBYTES, alignment):
        bad(f"payload_offset {p_off} is not the header end rounded up to alignment {alignment}")
    if size != file_nbytes:
        bad(f"file is {file_nbytes} bytes but the header records {size} "
            f"({'truncated' if file_nbytes < size else 'bytes appended'})")
    if m_len == 0 or m_off < p_off or m_off + m_len > file_nbytes:
        bad(f"manifest range [{m_off}, {m_off + m_len}) is outside [{p_off}, {file_nbytes})")
    return dict(manifest_offset=m_off, manifest_nbytes=m_len, manifest_crc=m_crc,
                alignment=alignment, payload_offset=p_off, file_nbytes=size)


# ---------------------------------------------------------------------------------------- manifest

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_manifest(m, *, alignment: int, payload_offset: int, manifest_offset: int,
                      where: str) -> dict:
    """Check sections 3.x of the spec; return {object name: object entry}."""
    def bad(rule):
        raise ArtifactError(f"{where}: manifest: {rule}")

    if not isinstance(m, dict):
        bad(f"top level is {type(m).__name__}, expected an object")
    required = {"format": str, "format_version": int, "alignment": int, "metadata": dict,
                "config": dict, "components": list, "objects": list, "bindings": dict,
                "uses": list, "resources": dict}
    for key, typ in required.items():
        if key not in m:
            bad(f"missing required key {key!r}")
        if not isinstance(m[key], typ) or (typ is int and isinstance(m[key], bool)):
            bad(f"key {key!r} is {type(m[key]).__name__}, expected {typ.__name__}")
    if m["format"] != "ninfer":
        bad(f"format is {m['format']!r}, expected 'ninfer'")
    if m["format_version"] != FORMAT_VERSION:
        bad(f"format_version {m['format_version']} disagrees with the header's {FORMAT_VERSION}")
    if m["alignment"] != alignment:
        bad(f"alignment {m['alignment']} disagrees with the header's {alignment}")
    name = m["metadata"].get("name")
    if not isinstance(name, str) or not name:
        bad("metadata.name is missing or not a non-empty string")
    _validate_defaults(m["metadata"].get("defaults"), bad)
    objects = _validate_objects(m["objects"], alignment, payload_offset, manifest_offset, where)
    for logical, b in m["bindings"].items():
        validate_binding(logical, b, objects, where)
    for i, use in enumerate(m["uses"]):
        _validate_use(i, use, m["bindings"], where)
    for rname, oname in m["resources"].items():
        o = objects.get(oname) if isinstance(oname, str) else None
        if o is None:
            raise ArtifactError(f"{where}: resource {rname!r}: object {oname!r} does not exist")
        if o["dtype"] != "uint8" or len(o["shape"]) != 1:
            raise ArtifactError(f"{where}: resource {rname!r}: object {oname!r} must be 1-D uint8, "
                                f"is {o['dtype']} {o['shape']}")
    return objects


# metadata.defaults: the model's own defaults for how it is run, each used unless a request or a
# flag says otherwise (docs/artifact.md 3). Known keys and their types; other keys are ignored, as
# everywhere in the manifest (an additive extension).
DEFAULT_KEYS = {"enable_thinking": bool}


def _validate_defaults(defaults, bad) -> None:
    if defaults is None:
        return
    if not isinstance(defaults, dict):
        bad(f"metadata.defaults is {type(defaults).__name__}, expected an object")
    for key, typ in DEFAULT_KEYS.items():
        if key in defaults and not isinstance(defaults[key], typ):
            bad(f"metadata.defaults.{key} is {type(defaults[key]).__name__}, "
                f"expected {typ.__name__}")


def _validate_objects(entries, alignment, payload_offset, manifest_offset, where) -> dict:
    objects = {}
    for i, o in enumerate(entries):
        label = f"objects[{i}]"
        if isinstance(o, dict) and isinstance(o.get("name"), str) and o["name"]:
            label = f"object {o['name']!r}"

        def bad(rule, label=label):
            raise ArtifactError(f"{where}: {label}: {rule}")

        if not isinstance(o, dict):
            bad("entry is not an object")
        for key in ("name", "dtype", "shape", "layout", "offset", "nbytes", "checksum"):
            if key not in o:
                bad(f"missing required field {key!r}")
        if not isinstance(o["name"], str) or not o["name"]:
            bad("name must be a non-empty string")
        if o["name"] in objects:
            bad("duplicate object name")
        if not (isinstance(o["dtype"], str) and o["dtype"] in DTYPES):
            bad(f"unknown dtype {o['dtype']!r}")
        shape = o["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            bad(f"shape {shape!r} must be a list of non-negative ints")
        if not (isinstance(o["layout"], str) and o["layout"] in LAYOUTS):
            bad(f"unknown layout {o['layout']!r} (v3 knows {', '.join(LAYOUTS)})")
        off, nbytes = o["offset"], o["nbytes"]
        if not _is_int(off) or not _is_int(nbytes) or off < 0 or nbytes < 0:
            bad(f"offset {off!r} and nbytes {nbytes!r} must be non-negative ints")
        expect = math.prod(shape) * DTYPES[o["dtype"]].itemsize
        if nbytes != expect:
            bad(f"nbytes {nbytes} != prod(shape {shape}) * itemsize = {expect}")
        if off % alignment:
            bad(f"offset {off} is not aligned to {alignment}")
        if off < payload_offset or off + nbytes > manifest_offset:
            bad(f"byte range [{off}, {off + nbytes}) is out of bounds of the payload region "
                f"[{payload_offset}, {manifest_offset})")
        ck = o["checksum"]
        if not (isinstance(ck, str) and ck.startswith("crc32:") and len(ck) == 14
                and all(c in "0123456789abcdef" for c in ck[6:])):
            bad(f"checksum {ck!r} is not 'crc32:' + 8 lowercase hex digits")
        if (o["layout"] in QUANT_LAYOUTS) != ("quant" in o):
            bad("a quantized layout needs a 'quant' field and only a quantized layout has one")
        objects[o["name"]] = o
    for name, o in objects.items():
        if "quant" in o:
            _validate_quant(name, o, objects, where)
    spans = sorted((o["offset"], o["offset"] + o["nbytes"], n) for n, o in objects.items()
                   if o["nbytes"] > 0)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ArtifactError(f"{where}: object {b!r}: overlaps object {a!r} "
                                f"(starts at {start_b}, {a!r} ends at {end_a})")
    return objects


def quant_scale_shape(shape, block) -> list:
    """Scale (and zero) shape of a quantized parent of logical `shape` [..., R, C] in blocks
    [br, bc]: one entry per (possibly partial) block, [..., ceil(R / br), ceil(C / bc)]."""
    *lead, rows, cols = shape
    return [*lead, -(-rows // block[0]), -(-cols // block[1])]


def quant_data_shape(layout: str, shape) -> list:
    """Stored shape of a quantized parent: the logical shape, int4 packing two per byte along
    the last axis."""
    if layout == "int4_block":
        return [*shape[:-1], -(-shape[-1] // 2)]
    return list(shape)


def _validate_quant(name: str, o: dict, objects: dict, where: str) -> None:
    def bad(rule):
        raise ArtifactError(f"{where}: object {name!r}: quant: {rule}")

    q, layout = o["quant"], o["layout"]
    if not isinstance(q, dict):
        bad("must be an object")
    if o["dtype"] != QUANT_LAYOUTS[layout]:
        bad(f"layout {layout} stores {QUANT_LAYOUTS[layout]}, the object is {o['dtype']}")
    shape, block = q.get("shape"), q.get("block")
    if not (isinstance(shape, list) and len(shape) >= 2 and all(_is_int(d) and d > 0 for d in shape)):
        bad(f"shape {shape!r} must be a list of >= 2 positive ints (matrices [..., rows, cols])")
    if not (isinstance(block, list) and len(block) == 2 and all(_is_int(d) and d > 0 for d in block)):
        bad(f"block {block!r} must be [rows, cols] of positive ints")
    if o["shape"] != quant_data_shape(layout, shape):
        bad(f"stored shape {o['shape']} != {quant_data_shape(layout, shape)} for logical shape "
            f"{shape} in layout {layout}")
    want = quant_scale_shape(shape, block)
    for role in ("scale", "zero"):
        ref = q.get(role)
        if ref is None:
            if role == "scale":
                bad("missing 'scale' object name")
            continue
        if role == "zero" and layout != "int4_block":
            bad(f"layout {layout} is symmetric: it has no zero points")
        part = objects.get(ref) if isinstance(ref, str) else None
        if part is None:
            bad(f"{role} object {ref!r} does not exist")
        dtypes = SCALE_DTYPES if role == "scale" else ("uint8",)
        if part["layout"] != "row_major" or part["dtype"] not in dtypes or part["shape"] != want:
            bad(f"{role} object {ref!r} must be row_major {' / '.join(dtypes)} of shape {want}, "
                f"is {part['layout']} {part['dtype']} {part['shape']}")


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A quantized binding as stored: decode with `(q - zero) * scale` per block
    (docs/artifact.md 3.2.1; `ninfer.models.qwen3_5.quant.dequantize` is the reference decoder).
    `view` (the binding's, or None) applies to the decoded logical tensor of `shape`."""
    layout: str
    shape: tuple            # logical shape of the parent [..., R, C]
    block: tuple            # (rows, cols) per scale entry
    data: np.ndarray        # stored elements (int4: uint8, two per byte)
    scale: np.ndarray
    zero: np.ndarray | None
    view: dict | None


def logical_shape(o: dict) -> list:
    """The shape an object presents to bindings: its quant shape when quantized."""
    return list(o["quant"]["shape"]) if "quant" in o else list(o["shape"])


def validate_binding(logical: str, b, objects: dict, where: str) -> None:
    def bad(rule):
        raise ArtifactError(f"{where}: binding {logical!r}: {rule}")

    if not isinstance(b, dict) or not isinstance(b.get("object"), str):
        bad("must be an object with a string 'object' field")
    parent = objects.get(b["object"])
    if parent is None:
        bad(f"target object {b['object']!r} does not exist")
    view = b.get("view")
    if view is None:
        return
    shape = logical_shape(parent)
    if not isinstance(view, dict) or view.get("kind") not in VIEW_KINDS:
        bad(f"view {view!r} must be an object with kind in {VIEW_KINDS}")
    start, stop = view.get("start"), view.get("stop")
    if not (_is_int(start) and _is_int(stop)):
        bad(f"view start {start!r} / stop {stop!r} must be ints")
    if view["kind"] == "slice":
        axis = view.get("axis")
        if not _is_int(axis) or not 0 <= axis < len(shape):
            bad(f"view axis {axis!r} out of range for parent {b['object']!r} of shape {shape}")
        if not 0 <= start < stop <= shape[axis]:
            bad(f"view range [{start}, {stop}) on axis {axis} out of range for parent "
                f"{b['object']!r} of shape {shape}")
    else:
        vshape = view.get("shape")
        total = math.prod(shape)
        if not 0 <= start < stop <= total:
            bad(f"view element range [{start}, {stop}) out of range for parent {b['object']!r} "
                f"with {total} elements")
        if not isinstance(vshape, list) or not all(_is_int(d) and d >= 0 for d in vshape):
            bad(f"view shape {vshape!r} must be a list of non-negative ints")
        if math.prod(vshape) != stop - start:
            bad(f"view shape {vshape} holds {math.prod(vshape)} elements, range holds {stop - start}")


def _validate_use(i: int, use, bindings: dict, where: str) -> None:
    def bad(rule):
        raise ArtifactError(f"{where}: uses[{i}]: {rule}")

    if not isinstance(use, dict):
        bad("entry is not an object")
    site, binding = use.get("site"), use.get("binding")
    if not isinstance(site, str) or not site:
        bad("site must be a non-empty string")
    if not (isinstance(binding, str) and binding in bindings):
        bad(f"site {site!r}: binding {binding!r} does not exist")
    inputs = use.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(_is_int(p) and p >= 0 for p in inputs):
        bad(f"site {site!r}: inputs {inputs!r} must be a non-empty list of non-negative ints")
    if use.get("activation") not in ACTIVATIONS:
        bad(f"site {site!r}: activation {use.get('activation')!r} is not one of {ACTIVATIONS}")


def binding_shape(b: dict, objects: dict) -> list:
    """The logical shape a (valid) binding presents."""
    parent = objects[b["object"]]
    view = b.get("view")
    if view is None:
        return logical_shape(parent)
    if view["kind"] == "slice":
        shape = logical_shape(parent)
        shape[view["axis"]] = view["stop"] - view["start"]
        return shape
    return list(view["shape"])
