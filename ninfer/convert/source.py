"""A Hugging Face checkpoint directory as the converter sees it: config, tensor index, frontend files.

Tensors are read through safetensors' `safe_open` (memory-mapped), one tensor or one row block at a
time, so converting a checkpoint larger than RAM needs only bounded memory.
"""
from __future__ import annotations

import contextlib
import json
import math
import pathlib
import re
import struct

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from ..errors import ArtifactError, ConvertError
from ..models.qwen3_5.config import ModelConfig, parse_hf_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<k>\d+)-of-(?P<n>\d+)\.safetensors$")

# Read at most this many bytes of one tensor at once (an embedding of a large vocab is GBs).
CHUNK_BYTES = 64 << 20

SAFETENSORS_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64), "BOOL": np.dtype(np.bool_),
}

# Frontend files carried verbatim as artifact resources (docs/artifact.md section 3.5).
RESOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                  "preprocessor_config.json", "video_preprocessor_config.json",
                  "processor_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                  "config.json")


class TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape")

    def __init__(self, name, file, dtype, shape):
        self.name, self.file, self.dtype, self.shape = name, file, dtype, tuple(shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class CheckpointSource:
    """Open with `CheckpointSource(src_dir)`; use as a context manager (it holds the shard maps)."""

    def __init__(self, src_dir):
        self.dir = pathlib.Path(src_dir)
        if not self.dir.is_dir():
            raise ConvertError(f"checkpoint directory {self.dir} does not exist or is not a directory")
        self.hf_config = self._read_json("config.json", required=True)
        try:
            self.config: ModelConfig = parse_hf_config(self.hf_config)
        except ArtifactError as exc:
            raise ConvertError(f"{self.dir / 'config.json'}: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
            raise ConvertError(f"{self.dir / 'config.json'}: malformed config "
                               f"({type(exc).__name__}: {exc})") from exc
        self.quantization = source_quantization(self.hf_config, self.dir / "config.json")
        self._stack = contextlib.ExitStack()
        self._handles = {}
        try:
            self.tensors: dict[str, TensorInfo] = self._index_tensors()
        except BaseException:
            self.close()
            raise

    # -- tensors -------------------------------------------------------------------------------

    def read_chunks(self, name: str, row_multiple: int = 1):
        """Yield the tensor in row blocks along axis 0 (the whole tensor when it is small), each
        block but the last a multiple of `row_multiple` rows (quantization blocks stay whole)."""
        try:
            yield from self._read_chunks(name, row_multiple)
        except (SafetensorError, OSError) as exc:
            info = self.tensors[name]
            raise ConvertError(f"{self.dir / info.file}: cannot read tensor {name!r} ({exc})") from exc

    def read_whole(self, name: str) -> np.ndarray:
        """A small tensor (a scale) in one piece."""
        return np.concatenate(list(self.read_chunks(name)))

    def _read_chunks(self, name: str, row_multiple: int = 1):
        info = self.tensors[name]
        sl = self._handle(info.file).get_slice(name)
        rows = info.shape[0] if info.shape else 0
        row_bytes = info.nbytes // rows if rows else info.nbytes
        raw = info.dtype.kind == "V" and info.dtype.itemsize == 1       # float8: numpy has none
        if raw:
            sl = _RawRows(self.dir / info.file, self._raw_offset(info), info)
        if not info.shape or info.nbytes <= CHUNK_BYTES or row_bytes == 0:
            whole = sl[()] if raw else self._handle(info.file).get_tensor(name)
            yield self._checked(info, whole)
            return
        step = max(1, CHUNK_BYTES // row_bytes) // row_multiple * row_multiple or row_multiple
        for start in range(0, rows, step):
            yield self._checked(info, sl[start:min(start + step, rows)])

    def _raw_offset(self, info: TensorInfo) -> int:
        """File offset of a tensor's first byte (safetensors: u64 header size, JSON header with
        data_offsets relative to the end of the header)."""
        path = self.dir / info.file
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        begin, end = header[info.name]["data_offsets"]
        if end - begin != info.nbytes:
            raise ConvertError(f"{path}: tensor {info.name!r} spans {end - begin} bytes, its "
                               f"shape needs {info.nbytes}")
        return 8 + n + begin

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- frontend resources ----------------------------------------------------------------------

    def resources(self) -> dict:
        """{resource name: bytes} of the frontend files present, plus `chat_template.jinja`."""
        out = {}
        for fname in RESOURCE_FILES:
            p = self.dir / fname
            if p.is_file():
                out[fname] = self._read_bytes(p)
        template = self._chat_template()
        if template is not None:
            out["chat_template.jinja"] = template.encode("utf-8")
        return out

    def _chat_template(self):
        p = self.dir / "chat_template.jinja"
        if p.is_file():
            return self._read_bytes(p).decode("utf-8", errors="strict")
        for fname in ("chat_template.json", "tokenizer_config.json"):
            data = self._read_json(fname, required=False)
            t = (data or {}).get("chat_template")
            if isinstance(t, list):      # named templates: [{"name": ..., "template": ...}]
                named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
                t = named.get("default", next(iter(named.values()), None))
            if isinstance(t, str):
                return t
        return None

    # -- internals -----------------------------------------------------------------------------

    def _index_tensors(self) -> dict:
        index_path = self.dir / INDEX_FILE
        if index_path.is_file():
            index = self._read_json(INDEX_FILE, required=True)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index_path}: no 'weight_map' object")
            bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
            if bad is not None:
                raise ConvertError(f"{index_path}: weight_map[{bad!r}] is not a file name")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.dir / f).is_file():
                    raise ConvertError(f"{self.dir}: shard {f!r} listed in {INDEX_FILE} is missing")
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise ConvertError(f"{self.dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors "
                                   "weights found")
            weight_map = None
            self._check_shard_series(files)     # without an index, the file names are the list
        tensors = {}
        for f in files:
            handle = self._handle(f)
            for name in handle.keys():
                if weight_map is not None and weight_map.get(name) != f:
                    continue      # the index is authoritative about which copy to use
                if name in tensors:
                    raise ConvertError(f"{self.dir}: tensor {name!r} appears in both "
                                       f"{tensors[name].file!r} and {f!r}")
                sl = handle.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ConvertError(f"{self.dir / f}: tensor {name!r} has dtype "
                                       f"{sl.get_dtype()}, which the converter does not import")
                tensors[name] = TensorInfo(name, f, dtype, sl.get_shape())
        if weight_map is not None:
            for name, f in weight_map.items():
                if name not in tensors:
                    raise ConvertError(f"{self.dir}: tensor {name!r} listed in {INDEX_FILE} under "
                                       f"{f!r} is not in that file")
        return tensors

    def _check_shard_series(self, files) -> None:
        # model-00001-of-00003.safetensors ...: every member of a series must be present.
        series = {}
        for f in files:
            m = _SHARD.match(f)
            if m:
                series.setdefault((m["stem"], m["n"]), set()).add(int(m["k"]))
        for (stem, n), ks in series.items():
            width = len(n)
            for k in range(1, int(n) + 1):
                if k not in ks:
                    raise ConvertError(f"{self.dir}: shard "
                                       f"'{stem}-{k:0{width}d}-of-{n}.safetensors' is missing")

    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            path = self.dir / fname
            try:
                h = self._stack.enter_context(safe_open(str(path), framework="numpy"))
            except (SafetensorError, OSError, ValueError) as exc:
                raise ConvertError(f"{path}: unreadable safetensors file ({exc})") from exc
            self._handles[fname] = h
        return h

    @staticmethod
    def _checked(info: TensorInfo, arr) -> np.ndarray:
        arr = np.asarray(arr)
        if arr.dtype != info.dtype:
            raise ConvertError(f"tensor {info.name!r} in {info.file!r}: read as {arr.dtype}, "
                               f"header says {info.dtype}")
        return arr

    def _read_bytes(self, path: pathlib.Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ConvertError(f"{path}: cannot read ({exc.strerror or exc})") from exc

    def _read_json(self, fname: str, *, required: bool):
        p = self.dir / fname
        if not p.is_file():
            if required:
                raise ConvertError(f"{self.dir}: {fname} not found (not a Hugging Face checkpoint "
                                   "directory?)")
            return None
        try:
            data = json.loads(self._read_bytes(p).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConvertError(f"{p}: invalid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ConvertError(f"{p}: expected a JSON object, got {type(data).__name__}")
        return data


class DrafterSource(CheckpointSource):
    """A DFlash drafter's Hugging Face directory (config.json in z-lab's layout + safetensors),
    for the target `text` (TextConfig): `dflash` is its DFlashConfig, `tensors` its weights."""

    def __init__(self, src_dir, text):
        from ..models.qwen3_5.config import parse_dflash_config
        self.dir = pathlib.Path(src_dir)
        if not self.dir.is_dir():
            raise ConvertError(f"DFlash drafter directory {self.dir} does not exist or is not a "
                               "directory")
        self.hf_config = self._read_json("config.json", required=True)
        try:
            self.dflash = parse_dflash_config(self.hf_config, text)
        except ArtifactError as exc:
            raise ConvertError(f"{self.dir / 'config.json'}: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ConvertError(f"{self.dir / 'config.json'}: malformed drafter config "
                               f"({type(exc).__name__}: {exc})") from exc
        self.quantization = None
        self._stack = contextlib.ExitStack()
        self._handles = {}
        try:
            self.tensors = self._index_tensors()
        except BaseException:
            self.close()
            raise

    def resources(self) -> dict:
        return {}


def source_quantization(hf_config: dict, where) -> dict | None:
    """The checkpoint's `quantization_config` when the converter can import it value-preserving
    (block-wise FP8 e4m3 with dynamic activations, as Qwen's FP8 releases), else ConvertError
    naming the method; None for an unquantized checkpoint."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        qc = (hf_config.get("text_config") or {}).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConvertError(f"{where}: quantization_config is not an object")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConvertError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                           "(the converter imports block-wise FP8 checkpoints, quant_method 'fp8', "
                           "and unquantized ones; convert the unquantized release, with --quantize "
                           "for smaller weights)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConvertError(f"{where}: FP8 fmt {qc.get('fmt')!r} is not supported (only 'e4m3')")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConvertError(f"{where}: FP8 weight_block_size {block!r} is not [rows, cols] "
                           "(per-tensor FP8 checkpoints are not supported, block-wise ones are)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConvertError(f"{where}: FP8 activation_scheme {qc.get('activation_scheme')!r} is "
                           "not supported (only 'dynamic'; static input scales are not imported)")
    skip = qc.get("modules_to_not_convert") or []
    return {"method": "fp8", "block": tuple(block), "modules_to_not_convert": list(skip)}


class _RawRows:
    """Row slices of a tensor read straight from its file, for the dtypes safetensors' numpy
    reader cannot build (float8_e4m3fn: numpy has no such type; ml_dtypes does)."""

    def __init__(self, path, offset: int, info: TensorInfo):
        self.path, self.offset, self.info = path, offset, info

    def __getitem__(self, rows):
        info = self.info
        if rows == ():                          # the whole tensor
            start, stop, row_bytes = 0, 1, info.nbytes
        else:
            start, stop = rows.start, rows.stop
            row_bytes = info.nbytes // info.shape[0]
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * row_bytes)
            raw = f.read((stop - start) * row_bytes)
        if len(raw) != (stop - start) * row_bytes:
            raise OSError(f"short read of {info.name!r} (truncated file?)")
        shape = info.shape if rows == () else (stop - start, *info.shape[1:])
        return np.frombuffer(raw, info.dtype).reshape(shape)
