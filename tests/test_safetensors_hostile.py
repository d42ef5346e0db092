"""Hostile safetensors files: `read_header` accepts exactly what the official `safetensors` library accepts.

Every case is fed, as the same bytes, to the official reader (`safetensors.deserialize`) and to ours; both
must accept (and then agree on every tensor's name, dtype, shape and bytes) or both must refuse, ours with
one `UpcyclerError` line naming the file. The two deliberate differences are asserted as such: a repeated
tensor name is refused by us although the official reader keeps the last entry, and a tensor we cannot hold
(a dtype numpy lacks, too many or too large dimensions) is refused as "not supported" although the file is
valid. Then Hypothesis compares the two readers on
generated headers, mutated files and random bytes, and the real CLI is run on a tiny model whose
`model.safetensors` is made hostile.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import time
from math import prod
from pathlib import Path

import numpy as np
import pytest
import safetensors
from cli_helpers import assert_clean_failure, leftovers, run_cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save
from tiny_models import make_tiny

from upcycler.errors import UpcyclerError
from upcycler.io.safetensors_file import encode_header, lazy_tensor, read_header
from upcycler.tensors import BF16

OURS = {"BF16": BF16, "F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "i1", "U8": "u1", "I16": "<i2",
        "I32": "<i4", "I64": "<i8", "BOOL": "?"}
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
        "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
        "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
U64 = 2**64 - 1
SLOW = 5.0  # seconds: no header, however hostile, may take longer than this to judge


# ---------------------------------------------------------------- building files

class Raw(str):
    """JSON text inserted verbatim (for what json.dumps cannot write: 1e400, -0, NaN, bad escapes)."""


def js(value) -> str:
    """JSON text of `value`; a list of 2-tuples is an object written pair by pair (repeated keys kept)."""
    if isinstance(value, Raw):
        return value
    if isinstance(value, list) and value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return "{" + ",".join(f"{json.dumps(k)}:{js(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(js(v) for v in value) + "]"
    if isinstance(value, dict):
        return js(list(value.items())) if value else "{}"
    return json.dumps(value)


def frame(header: str | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte length (the true one unless `length` lies), header, data."""
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def t(dtype, shape, begin, end, **extra) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end], **extra}


def u8(n: int = 1, begin: int = 0) -> dict:
    return t("U8", [n], begin, begin + n)


def split(data: bytes) -> tuple[dict, bytes]:
    """The header (as a dict) and data of a well-formed file."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def official_save() -> bytes:
    return save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "empty": np.zeros((0, 4), np.int64),
                 "flag": np.array(True), "h": np.arange(5, dtype=np.float16)}, metadata={"format": "pt"})


def our_encode() -> bytes:
    arrays = {"b": np.arange(12, dtype=np.int32).reshape(3, 4), "a": np.ones(3, np.float64)}
    head = encode_header([(k, v.shape, v.dtype) for k, v in arrays.items()], {"format": "pt"})
    return head + b"".join(v.tobytes() for v in arrays.values())


BASE = official_save()
BASE_HEADER, BASE_DATA = split(BASE)


def relayout(**changes) -> bytes:
    """BASE with some of its tensors' header entries replaced, data unchanged."""
    return frame(js({**BASE_HEADER, **changes}), BASE_DATA)


def nested(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


# ---------------------------------------------------------------- the catalogue

VALID = {
    "official save, metadata, zero-size and scalar": BASE,
    "official save, no metadata": save({"x": np.arange(4, dtype=np.uint8)}),
    "our encode_header (space padded)": our_encode(),
    "empty header {}": frame("{}"),
    "empty header padded with spaces": frame("{}      "),
    "metadata null": frame('{"__metadata__":null}'),
    "metadata after the tensors": frame(js([("a", u8()), ("__metadata__", {"k": "v"})]), b"x"),
    "repeated metadata key (last wins)": frame('{"__metadata__":{"k":"1","k":"2"}}'),
    "tensors listed out of offset order": frame(js({"b": u8(1, 1), "a": u8(1, 0)}), b"xy"),
    "several zero-size tensors at one offset": frame(js({"a": t("F32", [0, 3], 0, 0), "b": t("I8", [0], 0, 0),
                                                         "c": u8(2)}), b"xy"),
    "zero-size tensor at the end": frame(js({"a": u8(2), "z": t("BF16", [4, 0], 2, 2)}), b"xy"),
    "tensor info as positional array": frame('{"a":["U8",[1],[0,1]]}', b"x"),
    "dtype as {NAME: null}": frame('{"a":{"dtype":{"I16":null},"shape":[1],"data_offsets":[0,2]}}', b"xy"),
    "unknown fields ignored (any JSON, repeated keys)": frame(js({"a": {**u8(), "q": None, "z": Raw(
        '[{"k":-1.5e300,"k":[1e-400,18446744073709551615,-9223372036854775808]}]')}}), b"x"),
    "unknown field nested 125 deep (127 in all)": frame(js({"a": {**u8(), "z": nested(125)}}), b"x"),
    "escaped and non-ASCII names, surrogate pair":
        frame('{"\\u00e4\\ud83d\\ude00\\n":' + js(u8()) + ', "ö": ' + js(u8(1, 1)) + "}", b"xy"),
    "empty tensor name": frame(js({"": u8()}), b"x"),
    "JSON whitespace around and inside": frame(' \t\n{ "a" : { "dtype" : "U8" , "shape" : [ 1 ] ,'
                                               ' "data_offsets" : [ 0 , 1 ] } }\r\n ', b"x"),
    "scalar tensor": frame(js({"s": t("F64", [], 0, 8)}), bytes(8)),
}

UNSUPPORTED = {  # valid for the official reader, dtypes we cannot hold
    "F8_E4M3": frame(js({"a": t("F8_E4M3", [2], 0, 2)}), b"xy"),
    "U16": frame(js({"a": u8(), "b": t("U16", [1], 1, 3)}), b"xyz"),
    "C64": frame(js({"a": t("C64", [1], 0, 8)}), bytes(8)),
    "F4 (two per byte)": frame(js({"a": t("F4", [2], 0, 1)}), b"x"),
    "empty tensor with a dimension of 2**63": frame(js({"a": t("U8", [2**63, 0], 0, 0)})),
    "empty tensor whose other dimensions reach 2**63 bytes":
        frame(js({"a": t("F32", [0, 2**31, 2**30], 0, 0)})),
    "33 dimensions": frame(js({"a": t("U8", [1] * 33, 0, 1)}), b"x"),
}

DUPLICATE = {  # the official reader keeps the last entry; we refuse
    "same tensor listed twice": frame(js([("a", u8()), ("a", u8())]), b"x"),
    "tensor listed twice, different shapes": frame(js([("a", u8(1)), ("a", u8(2))]), b"xy"),
    "name repeated through an escape": frame('{"a":' + js(u8()) + ',"\\u0061":' + js(u8()) + "}", b"x"),
}

_w = BASE_HEADER["w"]
MALFORMED = {
    # layout: rule 5 and 6
    "overlapping offsets": frame(js({"a": u8(2, 0), "b": u8(2, 1)}), b"xyz"),
    "overlapping offsets, span unlike the shape": relayout(h=t("F16", [5], *_w["data_offsets"])),
    "gap between tensors": frame(js({"a": u8(1, 0), "b": u8(1, 2)}), b"xyz"),
    "first tensor not at offset 0": frame(js({"a": u8(1, 1)}), b"xy"),
    "offsets out of order with a gap": frame(js({"b": u8(1, 2), "a": u8(1, 0)}), b"xyz"),
    "end before begin": frame(js({"a": t("U8", [0], 0, 0), "b": t("U8", [1], 1, 0)}), b"x"),
    "offsets span disagrees with shape": frame(js({"a": t("F32", [2], 0, 4)}), b"xyzw"),
    "zero-size tensor beyond the data": frame(js({"a": u8(), "z": t("U8", [0], 5, 5)}), b"x"),
    "trailing bytes after the data": BASE + b"\0",
    "trailing bytes, empty header": frame("{}", b"x"),
    "data truncated by one byte": BASE[:-1],
    "two tensors with the same offsets": frame(js({"a": u8(), "b": u8()}), b"x"),
    # shape and offset values: rule 4
    "negative shape": frame(js({"a": t("U8", [-1], 0, 0)})),
    "float shape 2.0": frame(js({"a": t("U8", [Raw("2.0")], 0, 2)}), b"xy"),
    "shape 1e400": frame(js({"a": t("U8", [Raw("1e400")], 0, 1)}), b"x"),
    "shape -0": frame(js({"a": t("U8", [Raw("-0")], 0, 0)})),
    "shape true": frame(js({"a": t("U8", [True], 0, 1)}), b"x"),
    "shape string": frame(js({"a": t("U8", ["1"], 0, 1)}), b"x"),
    "shape NaN": frame(js({"a": t("U8", [Raw("NaN")], 0, 1)}), b"x"),
    "shape Infinity": frame(js({"a": t("U8", [Raw("Infinity")], 0, 1)}), b"x"),
    "shape null": frame('{"a":{"dtype":"U8","shape":null,"data_offsets":[0,1]}}', b"x"),
    "shape an object": frame('{"a":{"dtype":"U8","shape":{"0":1},"data_offsets":[0,1]}}', b"x"),
    "shape 2**64": frame(js({"a": t("U8", [2**64], 0, 1)}), b"x"),
    "shape product overflows before a zero": frame(js({"a": t("U8", [U64, 2, 0], 0, 0)})),
    "bit count overflows": frame(js({"a": t("F32", [2**60], 0, 0)})),
    "shape far larger than the data": frame(js({"a": t("U8", [U64], 0, U64)}), b"x"),
    "F4 odd count (half a byte)": frame(js({"a": t("F4", [3], 0, 1)}), b"x"),
    "offsets float": frame(js({"a": t("U8", [1], Raw("0.0"), 1)}), b"x"),
    "offsets negative": frame(js({"a": t("U8", [1], -1, 0)}), b"x"),
    "offsets three numbers": frame('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,1]}}', b"x"),
    "offsets an object": frame('{"a":{"dtype":"U8","shape":[1],"data_offsets":{"0":0,"1":1}}}', b"x"),
    "offsets beyond 2**64": frame(js({"a": t("U8", [1], 2**64, 2**64 + 1)}), b"x"),
    "offsets at 2**64-1": frame(js({"a": t("U8", [1], U64, 0)}), b"x"),
    "missing data_offsets": frame('{"a":{"dtype":"U8","shape":[1]}}', b"x"),
    "missing dtype": frame('{"a":{"shape":[1],"data_offsets":[0,1]}}', b"x"),
    "dtype listed twice": frame('{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
    "unknown dtype u8": frame(js({"a": t("u8", [1], 0, 1)}), b"x"),
    "dtype null": frame(js({"a": t(None, [1], 0, 1)}), b"x"),
    "dtype {NAME: []}": frame('{"a":{"dtype":{"U8":[]},"shape":[1],"data_offsets":[0,1]}}', b"x"),
    "dtype with two names":
        frame('{"a":{"dtype":{"U8":null,"I8":null},"shape":[1],"data_offsets":[0,1]}}', b"x"),
    "tensor info a number": frame('{"a":1}'),
    "tensor info array of two": frame('{"a":["U8",[1]]}', b"x"),
    "tensor info array of four": frame('{"a":["U8",[1],[0,1],0]}', b"x"),
    # metadata: rule 3
    "metadata value an integer": frame('{"__metadata__":{"format":1}}'),
    "metadata a list": frame('{"__metadata__":[]}'),
    "metadata a string": frame('{"__metadata__":"pt"}'),
    "metadata value an object": frame('{"__metadata__":{"a":{}}}'),
    "metadata listed twice": frame('{"__metadata__":{},"__metadata__":{}}'),
    "metadata that looks like a tensor": frame(js({"__metadata__": u8()}), b"x"),
    # JSON: rule 2
    "[ x 100000": frame("[" * 100_000),
    "{ x 100000": frame('{"a":' * 100_000),
    "unknown field nested 126 deep (128 in all)": frame(js({"a": {**u8(), "z": nested(126)}}), b"x"),
    "header a list": frame("[]"),
    "header null": frame("null"),
    "header a string": frame('"x"'),
    "header a number": frame("1"),
    "empty header": frame(""),
    "trailing comma": frame('{"__metadata__":{},}'),
    "comment after the object": frame("{}//"),
    "NUL padding": frame("{}\0\0"),
    "form feed padding": frame("{}\x0c"),
    "UTF-8 byte order mark": frame("\ufeff{}"),
    "control character in a name": frame('{"a\x01":' + js(u8()) + "}", b"x"),
    "lone surrogate in a name": frame('{"\\ud800":' + js(u8()) + "}", b"x"),
    "lone low surrogate in metadata": frame('{"__metadata__":{"a":"\\udc00"}}'),
    "lone surrogate in an unknown field": frame(js({"a": {**u8(), "z": "\ud800"}}), b"x"),  # dumps escapes it
    "1e400 in an unknown field": frame(js({"a": {**u8(), "z": Raw("1e400")}}), b"x"),
    "400-digit integer in an unknown field": frame(js({"a": {**u8(), "z": Raw("9" * 400)}}), b"x"),
    "bad escape": frame('{"\\x":{}}'),
    # bytes and lengths: rule 1
    "empty file": b"",
    "seven bytes": b"\x02\0\0\0\0\0\0",
    "length beyond the file": frame("{}", length=3),
    "length cuts the JSON short": frame(js({"a": u8()}), b"x", length=5),
    "length over the 100,000,000 cap": frame("{}", length=100_000_001),
    "length 2**64-1": frame("{}", length=U64),
    "header not UTF-8": frame(b'{"\xff":1}'),
    "overlong UTF-8": frame(b'{"\xc0\xaf":1}'),
    "UTF-8 encoded surrogate": frame(b'{"\xed\xa0\x80":' + js(u8()).encode() + b"}", b"x"),
}


def official_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
    except safetensors.SafetensorError:
        return False
    return True


def ours(data: bytes, path: Path):
    """(True, entries) or (False, the one-line message); any other exception fails the test."""
    path.write_bytes(data)
    began = time.monotonic()
    try:
        entries, _ = read_header(path)
    except UpcyclerError as err:
        message = str(err)
        assert "\n" not in message and message.startswith(f"{path}:"), message
        return False, message
    finally:
        assert time.monotonic() - began < SLOW, "read_header took too long"
    return True, entries


def same_tensors(data: bytes, entries: dict) -> None:
    """Our entries hold exactly the official reader's tensors: names, dtypes, shapes and bytes."""
    theirs = dict(safetensors.deserialize(data))
    assert set(theirs) == set(entries)
    for name, info in theirs.items():
        entry = entries[name]
        assert entry.dtype == np.dtype(OURS[info["dtype"]]) and list(entry.shape) == info["shape"], name
        assert data[entry.start:entry.start + entry.nbytes] == bytes(info["data"]), name
        if entry.shape:  # LazyTensor.load turns a 0-d array into shape (1,) (np.ascontiguousarray)
            assert lazy_tensor(entry).load().tobytes() == bytes(info["data"]), name


def agree(data: bytes, path: Path) -> str:
    """Compare both readers on `data`; returns our verdict: accept, refuse, duplicate or unsupported."""
    theirs = official_accepts(data)
    accepted, detail = ours(data, path)
    if accepted:
        assert theirs, "we accept a file the official reader refuses"
        same_tensors(data, detail)
        return "accept"
    if re.search(r"\(tensor .* is listed twice\)", detail):
        return "duplicate"  # deliberate: the official reader silently keeps the last entry
    if "is not supported" in detail:
        assert theirs, f"'not supported' for a file that is not even valid: {detail}"
        return "unsupported"
    assert not theirs, f"we refuse a file the official reader accepts: {detail}"
    assert "not a valid safetensors file" in detail or "truncated" in detail, detail
    return "refuse"


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile") / "model.safetensors"


def test_catalogue_is_large_enough():
    assert len(MALFORMED) >= 30 and len(VALID) >= 10


@pytest.mark.parametrize("name", VALID)
def test_valid_files_are_read_like_the_official_reader(name, spot):
    assert agree(VALID[name], spot) == "accept"


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_files_are_refused_like_the_official_reader(name, spot):
    assert not official_accepts(MALFORMED[name]), "the catalogue case is not malformed after all"
    assert agree(MALFORMED[name], spot) == "refuse"


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_dtypes_we_cannot_hold_are_not_supported(name, spot):
    assert agree(UNSUPPORTED[name], spot) == "unsupported"


@pytest.mark.parametrize("name", DUPLICATE)
def test_a_repeated_tensor_name_is_refused(name, spot):
    assert official_accepts(DUPLICATE[name])  # the documented difference: it keeps the last entry
    assert agree(DUPLICATE[name], spot) == "duplicate"


def test_messages_say_what_is_wrong(spot):
    expect = {"overlapping offsets": "overlap", "gap between tensors": "gap", "trailing bytes after the data":
              "stray bytes", "data truncated by one byte": "truncated", "[ x 100000": "nested too deeply",
              "shape 1e400": "out of range", "shape -0": "non-negative integers", "float shape 2.0":
              "non-negative integers", "header not UTF-8": "not UTF-8", "length over the 100,000,000 cap":
              "limit", "metadata value an integer": "not a string", "bit count overflows": "2**64",
              "shape product overflows before a zero": "2**64", "lone surrogate in a name": "surrogate"}
    for name, words in expect.items():
        accepted, message = ours(MALFORMED[name], spot)
        assert not accepted and words in message, (name, message)
    assert "F8_E4M3" in ours(UNSUPPORTED["F8_E4M3"], spot)[1]


def test_fifo_and_device_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(UpcyclerError, match="not a regular file"):
        read_header(fifo)
    link = tmp_path / "zero.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(UpcyclerError, match="not a regular file"):
        read_header(link)


def test_a_shard_swapped_for_a_fifo_after_its_header_is_refused_on_read(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(our_encode())
    entries, _ = read_header(path)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(UpcyclerError, match="not a regular file"):
        lazy_tensor(entries["a"]).load()


# ---------------------------------------------------------------- Hypothesis

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = st.sampled_from(["a", "b", "c", "", "é", "__metadata__"])


@st.composite
def structured(draw) -> bytes:
    """Random tensors laid out mostly right, with random faults: offsets, shapes, forms, metadata, length."""
    pairs, end = [], 0
    for name in draw(st.lists(NAMES, max_size=4, unique=draw(st.integers(0, 3)) > 0)):
        dtype = draw(st.sampled_from(sorted(BITS)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        if shape and draw(st.integers(0, 9)) == 0:  # now and then one dimension out of the ordinary
            odd = draw(st.sampled_from([2**32, 2**63, U64, -1, Raw("1.0")]))
            shape[draw(st.integers(0, len(shape) - 1))] = odd
        exact = all(type(d) is int and d >= 0 for d in shape)
        nbytes = prod(shape) * BITS[dtype] // 8 if exact else 1
        begin = end + draw(st.sampled_from([0] * 8 + [-1, 1, -end]))
        stop = begin + nbytes + draw(st.sampled_from([0] * 8 + [-1, 1]))
        form = draw(st.sampled_from(["object", "object", "object", "array", "extra", "tagged"]))
        if form == "array":
            info = Raw(js([dtype, shape, [begin, stop]]))
        elif form == "tagged":
            info = Raw(js({"dtype": Raw(js({dtype: None})), "shape": shape, "data_offsets": [begin, stop]}))
        else:
            info = t(dtype, shape, begin, stop, **({"extra": draw(JSON)} if form == "extra" else {}))
        pairs.append((name, info))
        end = max(end, stop if type(stop) is int else 0)
    if draw(st.booleans()):
        values = st.text(max_size=3) | JSON
        metadata = draw(st.none() | st.dictionaries(st.text(max_size=3), values, max_size=2))
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", metadata))
    pairs = draw(st.permutations(pairs))
    header = (js(pairs) if pairs else "{}") + " " * draw(st.integers(0, 8))
    data_len = max(0, end + draw(st.sampled_from([0] * 6 + [-1, 1, 8])))
    data_len = data_len if data_len <= 4096 else 0  # a huge shape is refused whatever data follows
    return frame(header, bytes(range(256)) * (data_len // 256) + bytes(range(data_len % 256)))


JSON = st.recursive(  # any JSON value, keys and strings biased towards the header's own words
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=4)
    | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(sorted(BITS)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "a", "b"]) | st.text(max_size=3),
        inner, max_size=4),
    max_leaves=24,
)


@FUZZ
@given(structured())
def test_fuzz_structured_headers_agree_with_the_official_reader(spot, data):
    event(agree(data, spot))


@FUZZ
@given(JSON, st.integers(0, 16))
def test_fuzz_any_json_header_agrees_with_the_official_reader(spot, header, data_len):
    event(agree(frame(json.dumps(header), bytes(data_len)), spot))


@FUZZ
@given(st.sampled_from(sorted(VALID) + sorted(UNSUPPORTED)), st.lists(
    st.tuples(st.sampled_from(["flip", "delete", "insert"]), st.integers(0, 10**6), st.binary(max_size=4)),
    min_size=1, max_size=3))
def test_fuzz_mutated_files_agree_with_the_official_reader(spot, name, edits):
    data = bytearray(VALID.get(name) or UNSUPPORTED[name])
    for kind, where, chunk in edits:
        i = where % (len(data) + 1)
        if kind == "flip" and i < len(data):
            data[i] = chunk[0] if chunk else data[i] ^ 0xFF
        elif kind == "delete":
            del data[i:i + 1 + len(chunk)]
        else:
            data[i:i] = chunk
    event(agree(bytes(data), spot))


@FUZZ
@given(st.binary(max_size=80) | st.binary(max_size=80).map(frame))
def test_fuzz_random_bytes_agree_with_the_official_reader(spot, data):
    event(agree(data, spot))


# ---------------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("tiny") / "src")


@pytest.fixture
def src(tiny, tmp_path):
    return Path(shutil.copytree(tiny, tmp_path / "src", symlinks=True))


def state(directory: Path) -> dict:
    """Each entry's type, mtime and content (bytes, or a symlink's target); FIFOs and devices are not read."""
    out = {}
    for p in sorted(directory.rglob("*")):
        info = p.lstat()
        content = (p.read_bytes() if stat.S_ISREG(info.st_mode)
                   else os.readlink(p) if stat.S_ISLNK(info.st_mode) else None)
        out[str(p.relative_to(directory))] = (stat.S_IFMT(info.st_mode), info.st_mtime_ns, content)
    return out


def rewrite(shard: Path, edit) -> None:
    """Replace `shard` with `edit(header pairs, data)` -> bytes, where pairs are the header's entries."""
    header, data = split(shard.read_bytes())
    shard.write_bytes(edit(list(header.items()), data))


def convert_refused(src: Path, tmp_path: Path, mentions: str) -> str:
    before = state(src)
    proc = run_cli("convert", src, tmp_path / "out", check=False, timeout=120)
    line = assert_clean_failure(proc, mentions="model.safetensors")
    assert mentions in line, line
    assert state(src) == before, "input was modified"
    assert leftovers(tmp_path, "out") == [], "something that looks like an output was left behind"
    return line


def overlapping(pairs, data):
    """The later of two equal-sized tensors is pointed at the bytes of the earlier one."""
    infos = sorted((info for name, info in pairs if name != "__metadata__"), key=lambda i: i["data_offsets"])
    size = [i["data_offsets"][1] - i["data_offsets"][0] for i in infos]
    first, second = next((a, b) for j, a in enumerate(infos) for k, b in enumerate(infos)
                         if j < k and size[j] == size[k])
    second["data_offsets"] = list(first["data_offsets"])
    return frame(js(pairs), data)


def duplicated(pairs, data):
    last = max((p for p in pairs if p[0] != "__metadata__"), key=lambda p: p[1]["data_offsets"])
    return frame(js(pairs + [last]), data)


def huge_shape(pairs, data):
    _name, info = next(p for p in pairs if p[0] != "__metadata__")
    info["shape"] = [Raw("1e400")]
    return frame(js(pairs), data)


@pytest.mark.parametrize("edit, mentions", [
    (overlapping, "overlap"),
    (duplicated, "listed twice"),
    (lambda pairs, data: frame(js(pairs), data + b"\0" * 16), "stray bytes"),
    (lambda pairs, data: frame("[" * 100_000, data), "nested too deeply"),
    (huge_shape, "out of range"),
], ids=["overlapping-offsets", "duplicate-name", "trailing-bytes", "deep-nesting", "shape-1e400"])
def test_cli_refuses_a_hostile_header(src, tmp_path, edit, mentions):
    shard = src / "model.safetensors"
    rewrite(shard, edit)
    assert not official_accepts(shard.read_bytes()) or edit is duplicated
    convert_refused(src, tmp_path, mentions)


def test_cli_does_not_block_on_a_fifo(src, tmp_path):
    shard = src / "model.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    convert_refused(src, tmp_path, "not a regular file")


def test_cli_refuses_a_symlink_to_dev_zero(src, tmp_path):
    shard = src / "model.safetensors"
    shard.unlink()
    shard.symlink_to("/dev/zero")
    convert_refused(src, tmp_path, "not a regular file")
