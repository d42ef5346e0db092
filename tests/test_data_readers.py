"""The document readers of `prepare-data` (`upcycler.train.data.readers`): every format gives back the
documents written to it (text, or int64 token ids), byte ranges of a splittable file tile it exactly, and
every hostile input (a compression bomb, an endless line, a corrupt ArrayRecord, a Megatron index that
points outside its data, a `DatasetDict`) stops with one `UpcyclerError` line naming the file."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from data_formats import MEGATRON_DTYPES, write_arrayrecord, write_arrow_table, write_megatron
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upcycler.errors import UpcyclerError
from upcycler.train.data import decompression, text_readers
from upcycler.train.data.readers import (
    FORMATS,
    detect_format,
    expand_pattern,
    read_documents,
    splittable,
)
from upcycler.untrusted import shown_path

TEXTS = ["hello world", "ünïcödé ✓ 日本語 🙂", "tabs\tand  spaces", "x", "a longer one " * 40]
IDS = [[5, 1, 2], [7], [], [0, 65535, 3, 9], [42] * 300]


def _read(path: Path, fmt: str | None = None, **options) -> list:
    """Every document of `path` (text as str, token ids as plain lists)."""
    docs = list(read_documents(path, fmt or detect_format(path), **options))
    for doc in docs:
        assert isinstance(doc, str) or (doc.dtype == np.int64 and doc.ndim == 1), doc
    return [doc if isinstance(doc, str) else doc.tolist() for doc in docs]


def _refused(call: Callable[[], object], file: Path, match: str) -> str:
    """`call` raises one `UpcyclerError` line that matches `match` and names `file`; the message."""
    with pytest.raises(UpcyclerError, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and shown_path(file) in message, message
    return message


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _zstd(data: bytes, frames: int = 1) -> bytes:
    """`data` zstd-compressed, cut into `frames` frames (as pzstd writes them)."""
    step = -(-len(data) // frames) or 1
    compressor = zstandard.ZstdCompressor()
    return b"".join(compressor.compress(data[i : i + step]) for i in range(0, len(data), step))


def _nonempty(texts: list[str]) -> list[str]:
    return [t for t in texts if t]


# --- round trips -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "d.ndjson.zstd", "d.json"])
def test_jsonl_round_trips_plain_and_compressed(tmp_path: Path, name: str) -> None:
    data = _jsonl(TEXTS + ["", "last"]) + b"\n\n"
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith((".zst", ".zstd")):
        data = _zstd(data, frames=3)
    (tmp_path / name).write_bytes(data)
    assert detect_format(tmp_path / name) == "jsonl"
    assert _read(tmp_path / name) == TEXTS + ["last"]


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
def test_text_units_round_trip_plain_and_compressed(tmp_path: Path, suffix: str) -> None:
    data = b"one\ntwo\r\n\n  \nthree\rfour\n\nfive"
    compress = {"": bytes, ".gz": gzip.compress, ".zst": _zstd}[suffix]
    path = tmp_path / f"t.txt{suffix}"
    path.write_bytes(compress(data))
    assert detect_format(path) == "text"
    assert _read(path, text_unit="file") == [data.decode()]
    assert _read(path, text_unit="paragraph") == ["one\ntwo", "three\rfour", "five"]
    assert _read(path, text_unit="line") == ["one", "two", "three", "four", "five"]


def test_arrow_stream_and_file_give_text_and_token_ids(tmp_path: Path) -> None:
    table = pa.table({
        "text": pa.array(TEXTS[:4] + [None], pa.string()),
        "input_ids": pa.array(IDS[:4] + [None], pa.list_(pa.int32())),
        "wide": pa.array(IDS[:4] + [[1]], pa.large_list(pa.uint16())),
    })
    stream = write_arrow_table(tmp_path / "d.arrow", table)
    assert detect_format(stream) == "arrow"
    assert _read(stream) == TEXTS[:4]
    assert _read(stream, text_field="input_ids") == [i for i in IDS[:4] if i]
    assert _read(stream, text_field="wide") == [i for i in IDS[:4] if i] + [[1]]
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=3)
    assert _read(tmp_path / "f.arrow", text_field="input_ids") == [i for i in IDS[:4] if i]


def test_parquet_gives_text_and_token_ids(tmp_path: Path) -> None:
    table = pa.table({"text": TEXTS, "input_ids": pa.array(IDS, pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    assert _read(tmp_path / "d.parquet") == TEXTS
    assert _read(tmp_path / "d.parquet", text_field="input_ids") == [i for i in IDS if i]


def test_array_record_gives_text_and_int32_token_ids(tmp_path: Path) -> None:
    texts = write_arrayrecord(tmp_path / "t.array_record", [t.encode() for t in TEXTS] + [b""])
    assert detect_format(texts) == "arrayrecord" and detect_format(Path("x.arrayrecord")) == "arrayrecord"
    assert _read(texts) == TEXTS
    ids = write_arrayrecord(tmp_path / "i.array_record", [np.asarray(i, "<i4").tobytes() for i in IDS])
    assert _read(ids, "arrayrecord-int32") == [i for i in IDS if i]
    big = [list(range(k, k + 5)) for k in range(600)]  # more than one batch of records
    many = write_arrayrecord(tmp_path / "m.array_record", [np.asarray(i, "<i4").tobytes() for i in big])
    assert _read(many, "arrayrecord-int32") == big


@pytest.mark.parametrize("code", sorted(MEGATRON_DTYPES))
def test_megatron_indexed_dataset_gives_token_ids(tmp_path: Path, code: int) -> None:
    docs = [[1, 2, 3], [], [127], [4, 5] * 50]
    path = write_megatron(tmp_path / "corpus_text_document", docs, MEGATRON_DTYPES[code])
    assert detect_format(path) == "megatron"
    assert _read(path) == [d for d in docs if d]


def test_save_to_disk_directory_expands_to_its_arrow_files_in_order(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    saved.mkdir()
    shards = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]  # state.json's order, not sorted
    for k, name in enumerate(shards):
        write_arrow_table(saved / name, pa.table({"text": [f"shard {k} doc {j}" for j in range(3)]}))
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in shards]}))
    (saved / "dataset_info.json").write_text("{}")
    files = expand_pattern(str(saved))
    assert files == [saved / n for n in shards]
    assert expand_pattern(f"{tmp_path}/sav*") == files
    expected = [f"shard {k} doc {j}" for k in range(2) for j in range(3)]
    assert [doc for f in files for doc in _read(f)] == expected
    (tmp_path / "plain").mkdir()
    _refused(lambda: expand_pattern(str(tmp_path / "plain")), tmp_path / "plain", "is a directory")


def test_detect_format_ignores_compression_and_lists_the_formats(tmp_path: Path) -> None:
    names = ("a.txt.zstd", "a.jsonl.gz", "a.md.zst", "a.BIN")
    assert [detect_format(Path(n)) for n in names] == ["text", "jsonl", "text", "megatron"]
    message = _refused(lambda: detect_format(tmp_path / "a.csv"), tmp_path / "a.csv", "--format")
    assert all(fmt in message for fmt in FORMATS)
    (tmp_path / "a.arrow.zst").write_bytes(b"")
    _refused(lambda: _read(tmp_path / "a.arrow.zst"), tmp_path / "a.arrow.zst", "decompress it first")


# --- byte ranges -------------------------------------------------------------------------------------

RANGE_TEXTS = ["short", "", "ünïcödé ✓ 日本語", "x" * 300, "  ", "é", "🙂🙂🙂", "mid", "", "tail"]


def _range_files(tmp_path: Path) -> list[tuple[Path, str, str]]:
    """(file, format, text unit) of a JSONL file and a line-text file, both with blank lines, multi-byte
    characters and a last line without its line break."""
    jsonl = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" if t else "\n" for t in RANGE_TEXTS)
    (tmp_path / "r.jsonl").write_bytes(jsonl.rstrip("\n").encode())
    (tmp_path / "r.txt").write_bytes("\n".join(RANGE_TEXTS + ["\r\nlast\r\n", "really last"]).encode())
    return [(tmp_path / "r.jsonl", "jsonl", "file"), (tmp_path / "r.txt", "text", "line")]


def _tiled(path: Path, fmt: str, unit: str, cuts: list[int]) -> list:
    """The documents of the ranges between `cuts` (0 and the file's size added), in order."""
    points = [0, *sorted(cuts), path.stat().st_size]
    ranges = itertools.pairwise(points)
    return [doc for a, b in ranges for doc in _read(path, fmt, text_unit=unit, byte_range=(a, b))]


def test_two_ranges_tile_the_file_at_every_cut_point(tmp_path: Path) -> None:
    for path, fmt, unit in _range_files(tmp_path):
        assert splittable(path, fmt, unit)
        whole = _read(path, fmt, text_unit=unit)
        assert len(whole) >= 8
        for cut in range(path.stat().st_size + 1):  # line starts, mid-line, mid-character
            assert _tiled(path, fmt, unit, [cut]) == whole, cut
        assert _read(path, fmt, text_unit=unit, byte_range=(0, 10**9)) == whole


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.sampled_from([1, 3, 7]), seed=st.lists(st.integers(0, 10**6), min_size=6, max_size=6))
def test_any_ranges_tile_the_file(tmp_path: Path, parts: int, seed: list[int]) -> None:
    for path, fmt, unit in _range_files(tmp_path):
        size = path.stat().st_size
        cuts = [s % (size + 1) for s in seed[: parts - 1]]
        assert _tiled(path, fmt, unit, cuts) == _read(path, fmt, text_unit=unit)


def test_a_range_is_refused_where_the_input_is_not_splittable(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS)))
    (tmp_path / "a.txt").write_text("a\n\nb\n")
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "a.parquet")
    cases = [(tmp_path / "a.jsonl.gz", "jsonl", "file"), (tmp_path / "a.txt", "text", "paragraph"),
             (tmp_path / "a.txt", "text", "file"), (tmp_path / "a.parquet", "parquet", "file")]
    for path, fmt, unit in cases:
        assert not splittable(path, fmt, unit)
        with pytest.raises(ValueError, match="byte range"):
            read_documents(path, fmt, text_unit=unit, byte_range=(0, 5))


def test_a_bad_line_in_a_range_is_named_by_its_byte(tmp_path: Path) -> None:
    (tmp_path / "b.jsonl").write_bytes(_jsonl(["ok"]) + b'{"body": 1}\n')
    start = len(_jsonl(["ok"]))
    _refused(lambda: _read(tmp_path / "b.jsonl", byte_range=(1, 100)), tmp_path / "b.jsonl",
             f"near byte {start}: no field 'text'")


# --- hostile inputs ----------------------------------------------------------------------------------


def _compressed_blanks(path: Path, total: int, line: int = 1 << 16) -> Path:
    """`total` bytes of blank lines (skipped by every reader, so it reads on), streamed through the
    compressor `path`'s suffix names; the file stays a few KB."""
    blank = b" " * (line - 1) + b"\n"
    with open(path, "wb") as raw:
        if path.suffix == ".gz":
            out = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9)
        else:
            out = zstandard.ZstdCompressor(level=3).stream_writer(raw)
        chunk = blank * (_MIB // line)
        for _ in range(total // _MIB):
            out.write(chunk)
        out.close()
    return path


_MIB = 1 << 20


def test_zstd_bomb_is_refused_after_a_few_mib_and_a_trusted_file_may_expand_more(tmp_path: Path) -> None:
    """1 GiB of blanks in a few kB of zstd is refused once `BOMB_FLOOR_BYTES` have come out (not after the
    whole file's 1,000x), naming the ratio seen and the option; `max_expansion` admits a file the user trusts."""
    bomb = _compressed_blanks(tmp_path / "bomb.jsonl.zst", 1024 * _MIB)
    began = time.perf_counter()
    peak = _peak_bytes(lambda: _refused(lambda: _read(bomb), bomb, r"expands [\d,]+x \(more than --max-expansion 100;"))
    assert time.perf_counter() - began < 2 and peak < 64 * _MIB
    message = _refused(lambda: _read(bomb, max_expansion=200), bomb, "more than --max-expansion 200")
    ratio = float(re.search(r"expands ([\d,]+)x", message)[1].replace(",", ""))
    assert f"pass --max-expansion {10 ** math.ceil(math.log10(ratio * 1.01))} " in message, message
    small = _compressed_blanks(tmp_path / "small.jsonl.gz", 8 * _MIB)
    assert _read(small, max_expansion=1e6) == []  # blank lines: read to the end, no document


@pytest.mark.parametrize("name", ["bomb.jsonl.gz", "bomb.txt.zst", "bomb.txt.gz"])
def test_compression_bombs_are_refused(tmp_path: Path, name: str) -> None:
    bomb = _compressed_blanks(tmp_path / name, 32 * _MIB)
    for unit in ("line", "paragraph", "file"):
        _refused(lambda unit=unit: _read(bomb, text_unit=unit), bomb, "more than --max-expansion 100")


def test_real_text_compressed_hard_is_not_a_bomb(tmp_path: Path) -> None:
    """Real text (the standard library's modules) compressed by zstd stays far below the default ratio."""
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(Path(os.__file__).parent.glob("*.py")))[:12 * _MIB]
    path = tmp_path / "real.txt.zst"
    path.write_bytes(_zstd(text.encode()))
    assert len(text.encode()) / path.stat().st_size < decompression.MAX_EXPANSION / 5
    assert _read(path, text_unit="file") == [text]


def _peak_bytes(call: Callable[[], object]) -> int:
    """The most memory Python allocated while `call` ran."""
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_an_endless_line_is_refused_without_reading_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text_readers, "MAX_DOCUMENT_BYTES", 4096)
    monkeypatch.setattr(text_readers, "MAX_LINE_BYTES", 4096)
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.write(b"x")
        f.truncate(300 * _MIB)  # sparse: 300 MiB without a line break, a few KB on disk
    os.link(huge, tmp_path / "huge.jsonl")
    cases = [(huge, {"text_unit": u}) for u in ("line", "paragraph", "file")]
    cases += [(tmp_path / "huge.jsonl", {}), (huge, {"text_unit": "line", "byte_range": (10, 20)})]
    for path, options in cases:
        def call(path=path, options=options):
            _refused(lambda: _read(path, **options), path, "longer than 4,096 bytes")
        began = time.perf_counter()
        assert _peak_bytes(call) < 4 * _MIB, options
        assert time.perf_counter() - began < 2, options
    big = tmp_path / "big.txt.zst"
    big.write_bytes(_zstd(b"y" * (64 * _MIB)))  # 30,000x: trusted, so that its length is what is refused
    assert _peak_bytes(lambda: _refused(lambda: _read(big, text_unit="file", max_expansion=1e6), big,
                                        "longer than")) < 40 * _MIB


def test_lines_longer_than_a_read_chunk_are_gathered_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text_readers, "MAX_DOCUMENT_BYTES", 3 * _MIB)
    monkeypatch.setattr(text_readers, "MAX_LINE_BYTES", 3 * _MIB)
    long = "ü" * (_MIB + 7)  # 2 MiB of UTF-8, more than one read chunk
    lines = [json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in ["a", long, "b"]]
    (tmp_path / "l.jsonl").write_text("".join(lines))
    (tmp_path / "l.txt").write_text(f"a\n{long}\nb")
    assert _read(tmp_path / "l.jsonl") == ["a", long, "b"]
    assert _read(tmp_path / "l.txt", text_unit="line") == ["a", long, "b"]
    cut = 2 + _MIB  # inside the long line: it belongs to the range before
    assert _read(tmp_path / "l.txt", text_unit="line", byte_range=(cut, 10**9)) == ["b"]
    (tmp_path / "l.jsonl").write_bytes(_jsonl(["a", long * 2]))
    message = _refused(lambda: _read(tmp_path / "l.jsonl"), tmp_path / "l.jsonl", "longer than 3,145,728")
    assert "l.jsonl:2:" in message


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.jsonl.zst"])
def test_truncated_or_corrupt_compression_is_refused(tmp_path: Path, name: str) -> None:
    data = _jsonl(TEXTS * 50)
    packed = gzip.compress(data) if name.endswith(".gz") else _zstd(data)
    path = tmp_path / name
    path.write_bytes(packed[: len(packed) // 2])
    _refused(lambda: _read(path), path, "cannot read .*truncated or corrupt")
    path.write_bytes(packed + b"trailing junk")
    _refused(lambda: _read(path), path, "cannot read")


def test_corrupt_array_record_is_refused(tmp_path: Path) -> None:
    good = write_arrayrecord(tmp_path / "g.array_record", [os.urandom(300) for _ in range(60)])
    data = good.read_bytes()
    junk = tmp_path / "junk.array_record"
    junk.write_bytes(np.random.default_rng(0).bytes(5000))
    truncated = tmp_path / "cut.array_record"
    truncated.write_bytes(data[: len(data) // 2])
    flipped = tmp_path / "flip.array_record"
    flipped.write_bytes(data[:2000] + bytes(b ^ 0xFF for b in data[2000:2100]) + data[2100:])
    for path in (junk, truncated, flipped):
        _refused(lambda path=path: _read(path, "arrayrecord-int32"), path, "not a readable ArrayRecord file")
    _refused(lambda: _read(good, "arrayrecord"), good, "record 0 is not UTF-8")
    odd = write_arrayrecord(tmp_path / "odd.array_record", [b"12345"])
    _refused(lambda: _read(odd, "arrayrecord-int32"), odd, "record 0 is 5 bytes, not whole int32")
    fifo = tmp_path / "fifo.array_record"
    os.mkfifo(fifo)
    _refused(lambda: _read(fifo), fifo, "not a regular file")


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_columnar_file_without_a_usable_column_is_refused(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"d.{fmt}"
    table = pa.table({"body": TEXTS, "id": list(range(len(TEXTS)))})
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        write_arrow_table(path, table)
    _refused(lambda: _read(path), path, r"no column 'text' \(columns: body, id\); pass --text-field NAME")
    _refused(lambda: _read(path, text_field="id"), path, "'id' is int64, neither text nor a list")
    path.write_bytes(b"PAR1 not really" if fmt == "parquet" else np.random.default_rng(1).bytes(3000))
    _refused(lambda: _read(path), path, f"not a readable {'Parquet' if fmt == 'parquet' else 'Arrow'} file")


def _patched(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_bad_megatron_datasets_are_refused(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [4, 5]]

    def fresh(name: str) -> tuple[Path, Path]:
        path = write_megatron(tmp_path / name, docs, "<i4")
        return path, path.with_suffix(".idx")

    path, idx = fresh("magic")
    _patched(idx, 0, b"NOTMMIDX")
    _refused(lambda: _read(path), idx, "not a Megatron index")
    path, idx = fresh("past")
    _patched(idx, 34 + 8 + 8, struct.pack("<q", 100))  # the second pointer, past the 20-byte .bin
    _refused(lambda: _read(path), idx, r"sequence 1 \(size 2 at byte 100\) does not lie inside the 20-byte")
    path, idx = fresh("negative")
    _patched(idx, 34, struct.pack("<i", -1))
    _refused(lambda: _read(path), idx, "sequence 0 .size -1")
    path, idx = fresh("float")
    _patched(idx, 17, bytes([6]))
    _refused(lambda: _read(path), idx, "dtype code 6 is not an integer type")
    path, idx = fresh("count")
    _patched(idx, 18, struct.pack("<Q", 2**40))
    _refused(lambda: _read(path), idx, "but its 1,099,511,627,776 sequences")
    path, idx = fresh("version")
    _patched(idx, 9, struct.pack("<Q", 2))
    _refused(lambda: _read(path), idx, "version 2")
    path, idx = fresh("order")
    _patched(idx, 34 + 24, struct.pack("<q", 2) + struct.pack("<q", 1))
    _refused(lambda: _read(path), idx, "document indices out of order")
    path, idx = fresh("short")
    idx.write_bytes(b"MMIDIDX")
    _refused(lambda: _read(path), idx, "too short")
    path, idx = fresh("missing")
    idx.unlink()
    _refused(lambda: _read(path), idx, "missing; a Megatron dataset")


def test_dataset_dict_and_escaping_save_to_disk_directories_are_refused(tmp_path: Path) -> None:
    splits = tmp_path / "dd"
    for split in ("train", "test"):
        (splits / split).mkdir(parents=True)
        (splits / split / "state.json").write_text(json.dumps({"_data_files": []}))
        (splits / split / "dataset_info.json").write_text("{}")
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    message = _refused(lambda: expand_pattern(str(splits)), splits, "a DatasetDict")
    assert shown_path(splits / "train") in message
    _refused(lambda: expand_pattern(f"{tmp_path}/d*"), splits, "pass one split directory")
    escaping = tmp_path / "esc"
    escaping.mkdir()
    write_arrow_table(tmp_path / "outside.arrow", pa.table({"text": ["secret"]}))
    (escaping / "dataset_info.json").write_text("{}")
    for name in ("../outside.arrow", str(tmp_path / "outside.arrow")):
        (escaping / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
        _refused(lambda: expand_pattern(str(escaping)), escaping / "state.json", "lies outside")
    (escaping / "state.json").write_text(json.dumps({"_data_files": [{"filename": 3}]}))
    _refused(lambda: expand_pattern(str(escaping)), escaping / "state.json", "without a filename")
    (escaping / "state.json").write_text("[1, 2")
    _refused(lambda: expand_pattern(str(escaping)), escaping / "state.json", "unreadable JSON")
