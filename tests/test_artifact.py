"""Artifact v3: writer -> reader round trips, zero-copy views, atomic writes, and every malformed case
raising ArtifactError with a message that names the object and the broken rule."""
import json
import mmap
import os
import struct
import zlib

import ml_dtypes
import numpy as np
import pytest

import ninfer
from ninfer.artifact import Artifact, ArtifactWriter
from ninfer.artifact import format as fmt
from ninfer.models import model_config
from ninfer.models.qwen3_5.config import parse_hf_config

CONFIG = parse_hf_config({"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4,
                          "hidden_size": 32, "vocab_size": 64})

DTYPE_CASES = ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "int8", "uint8",
               "int16", "int32", "int64", "uint32", "bool"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (4, 1, 3), (0, 6)]


def random_array(rng, dtype_name, shape):
    dt = fmt.DTYPES[dtype_name]
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dtype_name == "bool":
        raw &= 1
    return raw.view(dt).reshape(shape)


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def write_basic(path, rng, alignment=fmt.DEFAULT_ALIGNMENT):
    """An artifact with three objects, whole and view bindings, a use and a resource."""
    src = {
        "embed": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "fused": rng.standard_normal((3, 10, 8)).astype(np.float32),
        "norm": rng.standard_normal((8,)).astype(ml_dtypes.bfloat16),
    }
    with ArtifactWriter(path, CONFIG, name="basic", alignment=alignment) as w:
        for name, arr in src.items():
            w.add_object(name, arr)
        w.bind("text.embed_tokens.weight", "embed")
        w.bind("text.lm_head.weight", "embed")
        w.bind("text.norm.weight", "norm")
        w.bind("text.fused", "fused")
        w.bind("text.gate", "fused", {"kind": "slice", "axis": 1, "start": 0, "stop": 5})
        w.bind("text.up", "fused", {"kind": "slice", "axis": 1, "start": 5, "stop": 10})
        w.bind("text.flat", "fused", {"kind": "elements", "start": 80, "stop": 160, "shape": [10, 8]})
        w.add_use("text.lm_head", "text.lm_head.weight")
        w.add_resource("tokenizer.json", b'{"model": {}}')
    return src


@pytest.fixture
def basic(tmp_path):
    path = tmp_path / "basic.ninfer"
    src = write_basic(path, np.random.default_rng(0))
    return path, src


# ------------------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("alignment", [64, 4096])
def test_round_trip_dtypes_and_shapes(tmp_path, alignment):
    rng = np.random.default_rng(alignment)
    path = tmp_path / "rt.ninfer"
    arrays = {}
    with ArtifactWriter(path, CONFIG, alignment=alignment) as w:
        for dname in DTYPE_CASES:
            for shape in SHAPES:
                name = f"text.{dname}.{'x'.join(map(str, shape)) or 'scalar'}"
                arrays[name] = random_array(rng, dname, shape)
                w.add_object(name, arrays[name])
                w.bind(name, name)
    with Artifact(path, verify="eager") as art:
        assert art.name == CONFIG.architecture          # default metadata.name
        assert model_config(art) == CONFIG
        assert sorted(art.binding_names()) == sorted(arrays)
        for name, ref in arrays.items():
            got = art.tensor(name)
            assert same_bytes(got, ref), name
        for o in art.manifest["objects"]:
            assert o["offset"] % alignment == 0
    assert os.path.getsize(path) % 1 == 0 and not os.path.exists(str(path) + ".partial")


def test_views_metadata_and_resources(basic):
    path, src = basic
    with Artifact(path) as art:
        assert art.name == "basic"
        assert art.has("text.gate") and not art.has("text.nope")
        assert same_bytes(art.tensor("text.gate"), src["fused"][:, 0:5])
        assert same_bytes(art.tensor("text.up"), src["fused"][:, 5:10])
        assert same_bytes(art.tensor("text.flat"), src["fused"].reshape(-1)[80:160].reshape(10, 8))
        assert same_bytes(art.tensor("text.lm_head.weight"), src["embed"])
        info = art.binding_info("text.up")
        assert info == {"object": "fused", "dtype": "float32", "shape": [3, 5, 8],
                        "view": {"kind": "slice", "axis": 1, "start": 5, "stop": 10}}
        assert art.resource("tokenizer.json") == b'{"model": {}}'
        assert art.resource("chat_template.jinja") is None
        assert art.uses == [{"site": "text.lm_head", "binding": "text.lm_head.weight",
                             "inputs": [0], "activation": "A16Only"}]
        assert art.manifest["components"] == ["text"]


def test_streamed_object_pieces(tmp_path):
    rng = np.random.default_rng(1)
    full = rng.standard_normal((4, 6, 3)).astype(ml_dtypes.bfloat16)
    path = tmp_path / "s.ninfer"
    with ArtifactWriter(path, CONFIG) as w:
        with w.begin_object("experts", "bfloat16", full.shape) as sink:
            for e in range(4):
                sink.write(full[e, :2])
                sink.write(full[e, 2:])
        w.bind("text.experts", "experts")
    with Artifact(path) as art:
        assert same_bytes(art.tensor("text.experts"), full)


def test_sink_rejects_wrong_dtype_and_size(tmp_path):
    w = ArtifactWriter(tmp_path / "x.ninfer", CONFIG)
    sink = w.begin_object("o", "float32", (2, 3))
    with pytest.raises(ninfer.ArtifactError, match="piece dtype float64 != object dtype float32"):
        sink.write(np.zeros(3))
    sink.write(np.zeros(3, np.float32))
    with pytest.raises(ninfer.ArtifactError, match="got 12 bytes, shape \\[2, 3\\] needs 24"):
        sink.close()
    with pytest.raises(ninfer.ArtifactError, match="exceed its 24 bytes"):
        sink.write(np.zeros(4, np.float32))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_writer_rejects_bad_bindings(tmp_path):
    w = ArtifactWriter(tmp_path / "x.ninfer", CONFIG)
    w.add_object("o", np.zeros((4, 2), np.float32))
    with pytest.raises(ninfer.ArtifactError, match="binding 'a': target object 'p' does not exist"):
        w.bind("a", "p")
    with pytest.raises(ninfer.ArtifactError, match=r"binding 'b': view range \[2, 5\) on axis 0"):
        w.bind("b", "o", {"kind": "slice", "axis": 0, "start": 2, "stop": 5})
    w.bind("c", "o")
    with pytest.raises(ninfer.ArtifactError, match="bound twice"):
        w.bind("c", "o")
    with pytest.raises(ninfer.ArtifactError, match="duplicate object name"):
        w.add_object("o", np.zeros(1, np.float32))
    with pytest.raises(ninfer.ArtifactError, match="activation 'A2'"):
        w.add_use("site", "c", activation="A2")
    with pytest.raises(ninfer.ArtifactError, match="not a .ninfer dtype"):
        w.add_object("z", np.zeros(2, np.complex64))
    w.abort()


# ------------------------------------------------------------------------------------ zero copy

def test_zero_copy_read_only_views(basic):
    path, _ = basic
    art = Artifact(path)
    embed = art.tensor("text.embed_tokens.weight")
    head = art.tensor("text.lm_head.weight")
    gate, up = art.tensor("text.gate"), art.tensor("text.up")
    assert np.shares_memory(embed, head)                 # tied: one resident object
    assert not embed.flags.writeable and not gate.flags.writeable
    with pytest.raises(ValueError):
        embed[0, 0] = 1
    assert np.shares_memory(gate, art.tensor("text.fused")) and not np.shares_memory(gate, up)
    base = embed
    while isinstance(base, np.ndarray):
        base = base.base
    mapping = base.obj if isinstance(base, memoryview) else base
    assert isinstance(mapping, mmap.mmap)                # a view of the mapping, not a copy
    start = np.frombuffer(mapping, np.uint8).__array_interface__["data"][0]
    offset = next(o["offset"] for o in art.manifest["objects"] if o["name"] == "embed")
    assert embed.__array_interface__["data"][0] == start + offset
    before = embed.copy()
    art.close()
    assert same_bytes(embed, before)                     # views outlive close()
    with pytest.raises(ninfer.ArtifactError, match="closed"):
        art.tensor("text.norm.weight")


# ------------------------------------------------------------------------------------ atomic writes

def test_exception_inside_writer_leaves_nothing(tmp_path):
    out = tmp_path / "o.ninfer"
    with pytest.raises(RuntimeError):
        with ArtifactWriter(out, CONFIG) as w:
            w.add_object("a", np.zeros(1000, np.float32))
            assert os.path.exists(str(out) + ".partial") and not out.exists()
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_existing_output_replaced_only_at_finish(tmp_path):
    out = tmp_path / "o.ninfer"
    out.write_bytes(b"old")
    w = ArtifactWriter(out, CONFIG)
    w.add_object("a", np.ones(3, np.float32))
    w.bind("text.a", "a")
    assert out.read_bytes() == b"old"
    w.abort()
    assert out.read_bytes() == b"old" and not os.path.exists(str(out) + ".partial")
    w = ArtifactWriter(out, CONFIG)
    w.add_object("a", np.ones(3, np.float32))
    w.bind("text.a", "a")
    assert w.finish() == str(out)
    with pytest.raises(ninfer.ArtifactError, match="already finished"):
        w.add_object("b", np.ones(1, np.float32))
    with Artifact(out) as art:
        assert art.tensor("text.a").tolist() == [1, 1, 1]


def test_unwritable_destination_is_artifact_error(tmp_path):
    with pytest.raises(ninfer.ArtifactError, match="cannot create"):
        ArtifactWriter(tmp_path / "no" / "such" / "dir.ninfer", CONFIG)


# ------------------------------------------------------------------------------------ malformed files

def read_header(data):
    return struct.unpack_from("<8sIIQQIIQQII", data, 0)


def rewrite_manifest(path, edit):
    """Apply edit(manifest) and rewrite manifest + header with valid checksums, so that only the
    structural rule under test is broken."""
    data = bytearray(path.read_bytes())
    (_, _, _, m_off, m_len, _, align, p_off, _, _, _) = read_header(data)
    manifest = json.loads(bytes(data[m_off:m_off + m_len]))
    edit(manifest)
    blob = json.dumps(manifest).encode()
    data = data[:m_off] + blob
    data[0:64] = fmt.pack_header(manifest_offset=m_off, manifest_nbytes=len(blob),
                                 manifest_crc=zlib.crc32(blob), alignment=align,
                                 payload_offset=p_off, file_nbytes=len(data))
    path.write_bytes(bytes(data))


def obj(manifest, name):
    return next(o for o in manifest["objects"] if o["name"] == name)


def expect_error(path, *fragments, verify="lazy"):
    with pytest.raises(ninfer.ArtifactError) as info:
        Artifact(path, verify=verify)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert str(path) in msg
    return msg


def test_artifact_error_is_ninfer_error():
    assert issubclass(ninfer.ArtifactError, ninfer.Error)


@pytest.mark.parametrize("keep", [0, 5, 40, "half", "minus1"])
def test_truncated_file(basic, keep):
    path, _ = basic
    data = path.read_bytes()
    n = {"half": len(data) // 2, "minus1": len(data) - 1}.get(keep, keep)
    path.write_bytes(data[:n])
    msg = expect_error(path, "header")
    assert "truncated" in msg or "too short" in msg


def test_appended_bytes(basic):
    path, _ = basic
    path.write_bytes(path.read_bytes() + b"\0" * 10)
    expect_error(path, "bytes appended")


def test_bad_magic(basic):
    path, _ = basic
    data = bytearray(path.read_bytes())
    data[1:7] = b"GGUF00"
    path.write_bytes(bytes(data))
    expect_error(path, "bad magic", "not a .ninfer file")


def test_unknown_version(basic):
    path, _ = basic
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 4)
    path.write_bytes(bytes(data))
    expect_error(path, "unsupported format version 4")


def test_flipped_header_byte(basic):
    path, _ = basic
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01                                     # inside manifest_offset
    path.write_bytes(bytes(data))
    expect_error(path, "header checksum mismatch")


def test_flipped_manifest_byte(basic):
    path, _ = basic
    data = bytearray(path.read_bytes())
    m_off = read_header(data)[3]
    data[m_off + 10] ^= 0x20
    path.write_bytes(bytes(data))
    expect_error(path, "manifest: checksum mismatch")


def test_flipped_payload_byte_lazy_and_eager(basic):
    path, _ = basic
    data = bytearray(path.read_bytes())
    manifest = json.loads(bytes(data[read_header(data)[3]:]))
    norm = obj(manifest, "norm")
    data[norm["offset"] + 3] ^= 0x10
    path.write_bytes(bytes(data))
    expect_error(path, "object 'norm'", "payload checksum mismatch", verify="eager")
    with Artifact(path) as art:                          # lazy: opens, other objects still readable
        art.tensor("text.embed_tokens.weight")
        with pytest.raises(ninfer.ArtifactError, match="object 'norm': payload checksum mismatch"):
            art.tensor("text.norm.weight")
    with Artifact(path, verify="none") as art:           # structural checks only
        assert art.tensor("text.norm.weight").shape == (8,)


def test_offset_out_of_bounds(basic):
    path, _ = basic

    def edit(m):
        obj(m, "norm")["offset"] = 1 << 40
    rewrite_manifest(path, edit)
    expect_error(path, "object 'norm'", "out of bounds of the payload region")


def test_offset_inside_header(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: obj(m, "norm").update(offset=0))
    expect_error(path, "object 'norm'", "out of bounds")


def test_unaligned_offset(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: obj(m, "norm").update(offset=obj(m, "norm")["offset"] + 2))
    expect_error(path, "object 'norm'", "not aligned to 4096")


def test_overlapping_objects(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: obj(m, "fused").update(offset=obj(m, "embed")["offset"]))
    msg = expect_error(path, "overlaps object")
    assert "'fused'" in msg and "'embed'" in msg


def test_nbytes_disagrees_with_shape(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: obj(m, "norm").update(shape=[9]))
    expect_error(path, "object 'norm'", "nbytes 16 != prod(shape [9]) * itemsize = 18")


@pytest.mark.parametrize("field,value,fragment", [
    ("dtype", "bfloat17", "unknown dtype 'bfloat17'"),
    ("layout", "tiled_q4", "unknown layout 'tiled_q4'"),
    ("checksum", "md5:abc", "is not 'crc32:'"),
    ("shape", [-1, 2], "must be a list of non-negative ints"),
])
def test_bad_object_fields(basic, field, value, fragment):
    path, _ = basic
    rewrite_manifest(path, lambda m: obj(m, "norm").update({field: value}))
    expect_error(path, "object 'norm'", fragment)


def test_missing_required_key(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: m.pop("bindings"))
    expect_error(path, "missing required key 'bindings'")


def test_missing_metadata_name(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: m["metadata"].pop("name"))
    expect_error(path, "metadata.name")


def test_manifest_version_disagrees(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: m.update(format_version=2))
    expect_error(path, "format_version 2 disagrees")


def test_manifest_not_json(basic):
    path, _ = basic
    data = bytearray(path.read_bytes())
    (_, _, _, m_off, _, _, align, p_off, _, _, _) = read_header(data)
    blob = b'{"format": "ninfer", '
    data = data[:m_off] + blob
    data[0:64] = fmt.pack_header(manifest_offset=m_off, manifest_nbytes=len(blob),
                                 manifest_crc=zlib.crc32(blob), alignment=align,
                                 payload_offset=p_off, file_nbytes=len(data))
    path.write_bytes(bytes(data))
    expect_error(path, "manifest: not valid UTF-8 JSON")


def expect_config_error(path, *fragments):
    """The container opens it (the config is plain JSON to it); the model family's parser
    refuses it with an ArtifactError naming the file."""
    from ninfer.models.qwen3_5.load import model_config as qwen3_5_model_config
    with Artifact(path) as art, pytest.raises(ninfer.ArtifactError) as info:
        qwen3_5_model_config(art)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert str(path) in msg


def test_malformed_model_config(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: m["config"]["text"].update(num_hidden_layers=5))
    expect_config_error(path, "model config", "layer_types has 4 entries for 5 layers")


@pytest.mark.parametrize("field,value", [("num_key_value_heads", "2"), ("layer_types", 7),
                                         ("hidden_size", None), ("bogus_field", 1)])
def test_wrongly_typed_model_config(basic, field, value):
    path, _ = basic
    rewrite_manifest(path, lambda m: m["config"]["text"].update({field: value}))
    expect_config_error(path, "model config")


@pytest.mark.parametrize("value", [1e308, 0.0, -0.25, 1.5])
def test_rotary_factor_out_of_range(basic, value):
    """1e308 made rotary_dim int(inf): an OverflowError escaped the reader."""
    path, _ = basic
    rewrite_manifest(path, lambda m: m["config"]["text"].update(partial_rotary_factor=value))
    expect_config_error(path, "model config", "partial_rotary_factor")


def test_missing_binding_requested(basic):
    path, _ = basic
    with Artifact(path) as art:
        with pytest.raises(ninfer.ArtifactError,
                           match="binding 'text.layers.0.mlp.down_proj.weight': missing"):
            art.tensor("text.layers.0.mlp.down_proj.weight")
        with pytest.raises(ninfer.ArtifactError, match="binding 'x': missing"):
            art.binding_info("x")


def test_binding_target_missing(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: m["bindings"]["text.norm.weight"].update(object="gone"))
    expect_error(path, "binding 'text.norm.weight'", "target object 'gone' does not exist")


@pytest.mark.parametrize("view,fragment", [
    ({"kind": "slice", "axis": 1, "start": 5, "stop": 11}, "view range [5, 11) on axis 1 out of range"),
    ({"kind": "slice", "axis": 3, "start": 0, "stop": 1}, "view axis 3 out of range"),
    ({"kind": "slice", "axis": 1, "start": 4, "stop": 4}, "view range [4, 4)"),
    ({"kind": "elements", "start": 200, "stop": 260, "shape": [60]}, "element range [200, 260) out of range"),
    ({"kind": "elements", "start": 0, "stop": 10, "shape": [3, 3]}, "holds 9 elements, range holds 10"),
    ({"kind": "stride", "start": 0, "stop": 1}, "kind in"),
])
def test_view_out_of_range(basic, view, fragment):
    path, _ = basic
    rewrite_manifest(path, lambda m: m["bindings"]["text.up"].update(view=view))
    expect_error(path, "binding 'text.up'", fragment)


def test_use_rules(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: m["uses"][0].update(binding="text.nothing"))
    expect_error(path, "uses[0]", "binding 'text.nothing' does not exist")
    write_basic(path, np.random.default_rng(0))
    rewrite_manifest(path, lambda m: m["uses"][0].update(activation="A2"))
    expect_error(path, "uses[0]", "activation 'A2'")
    write_basic(path, np.random.default_rng(0))
    rewrite_manifest(path, lambda m: m["uses"][0].update(inputs=[-1]))
    expect_error(path, "uses[0]", "inputs [-1]")


def test_resource_must_be_bytes(basic):
    path, _ = basic
    rewrite_manifest(path, lambda m: m["resources"].update({"chat_template.jinja": "norm"}))
    expect_error(path, "resource 'chat_template.jinja'", "must be 1-D uint8")


def test_bad_verify_mode(basic):
    path, _ = basic
    with pytest.raises(ninfer.ArtifactError, match="verify='always'"):
        Artifact(path, verify="always")


def test_missing_file(tmp_path):
    with pytest.raises(ninfer.ArtifactError, match="cannot open"):
        Artifact(tmp_path / "absent.ninfer")


@pytest.mark.parametrize("path", [None, 3.5, ["m.ninfer"]])
def test_path_that_is_not_a_path(path):
    with pytest.raises(ninfer.ArtifactError, match="not a file path"):
        Artifact(path)


# ------------------------------------------------------------------------------------ fuzzing

def covered_ranges(path):
    """Byte ranges a reader must notice changes in: header, every object, the manifest."""
    data = path.read_bytes()
    m_off, m_len = read_header(data)[3], read_header(data)[4]
    manifest = json.loads(data[m_off:m_off + m_len])
    ranges = [(0, 64), (m_off, m_off + m_len)]
    ranges += [(o["offset"], o["offset"] + o["nbytes"]) for o in manifest["objects"]]
    return ranges


def test_fuzz_flipped_bytes(basic):
    """Every flipped byte in the header, the manifest or a payload is an ArtifactError at an eager
    open; a flip in zero padding (covered by nothing) may go unnoticed, nothing else escapes."""
    path, _ = basic
    pristine = path.read_bytes()
    ranges = covered_ranges(path)
    rng = np.random.default_rng(7)
    positions = [int(p) for p in rng.choice(len(pristine), size=150, replace=False)]
    positions += [lo for lo, _ in ranges] + [hi - 1 for _, hi in ranges if hi > 0]
    for pos in positions:
        data = bytearray(pristine)
        data[pos] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(data))
        covered = any(lo <= pos < hi for lo, hi in ranges)
        try:
            Artifact(path, verify="eager").close()
        except ninfer.ArtifactError:
            continue
        assert not covered, f"flip at byte {pos} went unnoticed"


def _mutations(rng):
    return [None, True, -1, 0, 2 ** 70, 3.5, "x", [], {}, [1, "a"], [-3]]


def _leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, path + (i,))
    yield path


def test_fuzz_manifest_values(basic):
    """Replacing any manifest value by a value of another type (checksums kept valid) either still
    reads or raises ArtifactError: never a TypeError/KeyError from deep inside the reader."""
    path, _ = basic
    pristine = path.read_bytes()
    m_off, m_len = read_header(pristine)[3], read_header(pristine)[4]
    base = json.loads(pristine[m_off:m_off + m_len])
    rng = np.random.default_rng(11)
    leaves = [p for p in _leaves(base) if p]
    picks = [leaves[int(i)] for i in rng.choice(len(leaves), size=min(120, len(leaves)), replace=False)]
    for leaf in picks:
        for value in _mutations(rng)[:: 1 + int(rng.integers(0, 3))]:
            path.write_bytes(pristine)

            def edit(m, leaf=leaf, value=value):
                node = m
                for k in leaf[:-1]:
                    node = node[k]
                node[leaf[-1]] = value
            rewrite_manifest(path, edit)
            try:
                with Artifact(path, verify="eager") as art:
                    for b in art.binding_names():
                        art.tensor(b)
                    for r in art.resource_names():
                        art.resource(r)
            except ninfer.ArtifactError:
                pass
