"""Document readers for `prepare-data`: the documents of one source file, one at a time, in file order.

`read_documents` yields each non-empty document of a file either as a `str` (text still to tokenise) or
as a 1-D int64 `numpy` array (the token ids of an already tokenised document, no EOS appended; ids are
not checked against a vocabulary here, the caller does that). Formats (`FORMATS`):

    text               plain UTF-8 text, cut into documents by `text_unit` (after Hugging Face
                       `datasets`' `sample_by`): `file` (the whole file), `paragraph` (blank lines
                       separate documents) or `line`
    jsonl              JSON Lines, one object per line, the document in its `text_field`
    parquet, arrow     a column `text_field` of strings (text) or of lists of integers (token ids);
                       `arrow` is the IPC stream a `datasets.Dataset.save_to_disk` writes (or an IPC file)
    arrayrecord        an ArrayRecord file, each record one document's UTF-8 text
    arrayrecord-int32  the same, each record one document's little-endian int32 token ids
    megatron           a Megatron-LM indexed dataset: its `.bin`, with the `.idx` next to it

Text and JSONL ending in `.gz`, `.zst` or `.zstd` are decompressed on the fly, and the decompressed bytes
are counted: more than `MAX_EXPANSION` times the file's size (and more than `BOMB_FLOOR_BYTES`) is refused
as a compression bomb. Memory stays bounded by one document, one record batch or one batch of records:
a text document longer than `MAX_DOCUMENT_BYTES` or a JSONL line longer than `MAX_LINE_BYTES` is refused
after reading at most that many bytes of it. Uncompressed JSONL and line text are `splittable`: a
`byte_range` reads only the lines that start inside it, so ranges that tile a file read each document
once. `expand_pattern` also takes a directory written by `Dataset.save_to_disk` (its Arrow files).

Every input is opened through `upcycler.untrusted`, so a FIFO, device or directory is refused without
blocking and a JSONL line is parsed by its bounded JSON parser. A bad record is fatal: the first
unreadable one stops the run with one `UpcyclerError` naming the file (and the line or byte where it
helps), and nothing is written. Skipping would silently change the corpus.
"""

from __future__ import annotations

import glob
import gzip
import importlib
import io
import mmap
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe, escape, load_json_object, open_regular, parse_json, shown_path

Document = str | np.ndarray  # text to tokenise, or the int64 token ids of one tokenised document

FORMATS = ("text", "jsonl", "parquet", "arrow", "arrayrecord", "arrayrecord-int32", "megatron")
TEXT_UNITS = ("file", "paragraph", "line")
COMPRESSIONS = (".gz", ".zst", ".zstd")
MAX_LINE_BYTES = 256 * 1024**2  # one JSONL record; a file without line breaks is not JSON Lines
MAX_DOCUMENT_BYTES = MAX_LINE_BYTES  # one plain-text document (a file, a paragraph or a line)
BOMB_FLOOR_BYTES = 256 * 1024**2  # a compressed file may always decompress to this much
MAX_EXPANSION = 1000  # ... and to at most this many times its own size beyond that
_EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".array_record": "arrayrecord",
    ".arrayrecord": "arrayrecord",
    ".bin": "megatron",
}
_BATCH_ROWS = 1024  # Parquet/Arrow rows turned into Python objects at a time
_RECORD_BATCH = 256  # ArrayRecord records read at a time
_CHUNK = 1 << 20  # bytes read at a time where no line structure bounds the read
_ZSTD_INPUT = 512  # compressed bytes fed to zstd at a time: at most ~16 MiB come out of one feed
_CHECK_ROWS = 1 << 20  # Megatron index entries checked at a time
_FIX_JSONL = "JSON input must be JSON Lines, one object per line; fix or remove that line"
_FIX_COLUMN = "pass --text-field NAME"
_FIX_MEGATRON = "rebuild the dataset with Megatron's preprocess_data.py"
_LONE_CR = re.compile(r"(?<=\r)(?!\n)")  # where universal newlines also end a line: after a lone "\r"
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_MEGATRON_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # the integer codes
_ARRAY_RECORD_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


def detect_format(path: Path) -> str:
    """The input format of `path` from its extension (a trailing `.gz`, `.zst` or `.zstd` is ignored)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    fmt = _EXTENSIONS.get(suffixes[-1]) if suffixes else None
    if fmt is None:
        raise UpcyclerError(
            f"{shown_path(path)}: cannot tell the format from the file name; "
            f"pass --format {'|'.join(FORMATS)}"
        )
    return fmt


def splittable(path: Path, fmt: str, text_unit: str) -> bool:
    """Whether `read_documents` takes a `byte_range` for `path`: uncompressed JSONL, or uncompressed text
    read line by line."""
    if _compression(path) is not None:
        return False
    return fmt == "jsonl" or (fmt == "text" and text_unit == "line")


def check_source_file(path: Path) -> None:
    """Refuse `path` unless it is a readable regular file (a FIFO or device is refused without blocking)."""
    os.close(open_regular(path, "source file"))


def expand_pattern(pattern: str) -> list[Path]:
    """The regular files a `--source` file name or glob names, sorted, each once. A directory written by
    `datasets.Dataset.save_to_disk` stands for its Arrow files (in its own order); other directories a glob
    matches are skipped; anything else that is not a regular file (a FIFO, a device, a named directory) is
    refused, and so is a `DatasetDict` directory (name one split)."""
    matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    files = []
    for path in matches:
        if path.is_dir():
            saved = _saved_dataset_files(path)
            if saved is not None:
                files.extend(saved)
                continue
            if glob.has_magic(pattern):
                continue
        check_source_file(path)
        files.append(path)
    return list(dict.fromkeys(files))


def read_documents(
    path: Path,
    fmt: str,
    *,
    text_field: str = "text",
    text_unit: str = "file",
    byte_range: tuple[int, int] | None = None,
) -> Iterator[Document]:
    """The non-empty documents of `path` in file order, streaming: `str` for text, a 1-D int64 array for
    token ids. With `byte_range=(a, b)` (only where `splittable`), just the documents of the lines that
    start at a byte offset p with a <= p < b."""
    if fmt not in FORMATS:
        raise UpcyclerError(f"{shown_path(path)}: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "text" and text_unit not in TEXT_UNITS:
        raise UpcyclerError(
            f"{shown_path(path)}: unknown text unit {text_unit!r}; use one of {', '.join(TEXT_UNITS)}"
        )
    if byte_range is not None:
        _check_range(path, fmt, text_unit, byte_range)
    if fmt not in ("text", "jsonl") and _compression(path) is not None:
        raise UpcyclerError(
            f"{shown_path(path)}: {fmt} input cannot be read compressed; decompress it first"
        )
    if fmt == "text":
        return _checked(path, _text_documents(path, text_unit, byte_range))
    if fmt == "jsonl":
        return _checked(path, _jsonl_documents(path, text_field, byte_range))
    if fmt == "parquet":
        return _parquet_documents(path, text_field)
    if fmt == "arrow":
        return _arrow_documents(path, text_field)
    if fmt == "megatron":
        return _megatron_documents(path)
    return _arrayrecord_documents(path, ids=fmt == "arrayrecord-int32")


def jsonl_record(line: str | bytes, where: str, text_field: str = "text") -> Iterator[str]:
    """The document of one JSONL line (nothing if its text is null or empty); `UpcyclerError` if unusable."""
    record = parse_json(line, where, _FIX_JSONL)
    if not isinstance(record, dict) or text_field not in record:
        raise UpcyclerError(f"{where}: no field {text_field!r}; {_FIX_COLUMN}")
    yield from _text_value(record[text_field], where, text_field)


# --- arguments and helpers ---------------------------------------------------------------------------


def _check_range(path: Path, fmt: str, text_unit: str, byte_range: tuple[int, int]) -> None:
    """Refuse a byte range the caller should never have asked for (a programming error, not bad input)."""
    if not splittable(path, fmt, text_unit):
        raise ValueError(f"{path}: {fmt} input (text unit {text_unit}) cannot be read by byte range")
    start, end = byte_range
    if not (isinstance(start, int) and isinstance(end, int)) or start < 0:
        raise ValueError(f"byte range {byte_range!r}: expected two integers, the first >= 0")


def _compression(path: Path) -> str | None:
    """The compression suffix of `path` (`.gz`, `.zst`, `.zstd`), or None."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def _require(module: str, path: Path, what: str, package: str) -> ModuleType:
    """The optional module `module`, or one line saying which package reading `what` needs."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UpcyclerError(
            f"{shown_path(path)}: reading {what} needs {package}; install it with `pip install {package}`"
        ) from None


def _checked(path: Path, documents: Iterator[Document]) -> Iterator[Document]:
    """Pass `documents` through, turning decoding and I/O failures into one-line user errors."""
    try:
        yield from documents
    except UnicodeDecodeError:
        raise UpcyclerError(
            f"{shown_path(path)}: not valid UTF-8 text; re-encode the file as UTF-8"
        ) from None
    except (OSError, EOFError, zlib.error) as err:
        raise UpcyclerError(
            f"{shown_path(path)}: cannot read ({escape(str(err))[:120]}); the file may be truncated or "
            "corrupt"
        ) from None


def _mapped(path: Path, what: str = "source file") -> np.ndarray:
    """The bytes of the regular file `path`, memory-mapped read-only (unmapped when the array goes)."""
    fd = open_regular(path, what)
    try:
        if os.fstat(fd).st_size == 0:
            return np.empty(0, np.uint8)
        return np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), np.uint8)
    finally:
        os.close(fd)  # the map keeps its own descriptor


# --- text and JSON Lines -----------------------------------------------------------------------------


class _Inflated(io.RawIOBase):
    """Decompressed bytes, taken piece by piece from `pieces` (b"" at the end) and counted: beyond `cap`
    bytes in all, the file is refused as a compression bomb."""

    def __init__(self, pieces: Callable[[], bytes], cap: int, path: Path) -> None:
        super().__init__()
        self._pieces, self._cap, self._path = pieces, cap, path
        self._count = 0
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        """A readable stream."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Fill `buffer` from the next decompressed piece; 0 at the end."""
        while not self._pending:
            piece = self._pieces()
            if not piece:
                return 0
            self._count += len(piece)
            if self._count > self._cap:
                raise UpcyclerError(
                    f"{shown_path(self._path)}: decompresses to more than {MAX_EXPANSION}x its size (a "
                    "compression bomb?); check the file or decompress it yourself"
                )
            self._pending = memoryview(piece)
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count


def _zstd_pieces(raw: BinaryIO, path: Path) -> Iterator[bytes]:
    """The decompressed bytes of the zstd frames in `raw`, a small feed at a time (so a piece stays
    bounded); a file that ends inside a frame is an `OSError` (zstd's stream reader would stop silently)."""
    zstandard = _require("zstandard", path, "zstd files", "zstandard")
    decompressor = zstandard.ZstdDecompressor()
    frame, data = None, b""
    while True:
        if not data:
            data = raw.read(_ZSTD_INPUT)
            if not data:
                if frame is not None:
                    raise OSError("the file ends inside a zstd frame")
                return
        if frame is None:
            frame = decompressor.decompressobj()
        try:
            piece = frame.decompress(data)
        except zstandard.ZstdError as err:
            raise OSError(str(err)) from None
        data = b""
        if frame.eof:
            data, frame = frame.unused_data, None
        if piece:
            yield piece


@contextmanager
def _open_binary(path: Path) -> Iterator[BinaryIO]:
    """The bytes of the regular file `path`, decompressed (and counted) when it ends in a compression
    suffix."""
    with os.fdopen(open_regular(path, "source file"), "rb") as raw:
        kind = _compression(path)
        if kind is None:
            yield raw
            return
        cap = max(BOMB_FLOOR_BYTES, MAX_EXPANSION * os.fstat(raw.fileno()).st_size)
        if kind == ".gz":
            pieces = partial(gzip.GzipFile(fileobj=raw, mode="rb").read, _CHUNK)
        else:
            pieces = partial(next, _zstd_pieces(raw, path), b"")
        yield io.BufferedReader(_Inflated(pieces, cap, path), _CHUNK)


def _lines(
    f: BinaryIO, limit: int, byte_range: tuple[int, int] | None, too_long: Callable[[int, int], Exception]
) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line) of each line of `f`, line break kept; with `byte_range`, only the
    lines that start inside it (numbered from there). A line longer than `limit` raises
    `too_long(number, offset)` once at most `limit + 1` bytes of it are read."""
    start, end = byte_range if byte_range is not None else (0, None)
    offset = 0
    if start > 0:  # the line under way at `start` belongs to the range before: skip it, keeping nothing
        f.seek(start - 1)
        offset = start - 1
        while piece := f.readline(_CHUNK):
            offset += len(piece)
            if piece.endswith(b"\n"):
                break
            if offset - start > limit:
                raise too_long(0, start - 1)
    number = 0
    while end is None or offset < end:
        line = _read_line(f, limit)
        if not line:
            return
        number += 1
        if len(line) > limit:
            raise too_long(number, offset)
        yield number, offset, line
        offset += len(line)


def _read_line(f: BinaryIO, limit: int) -> bytes:
    """The next line of `f` (b"" at the end), at most `limit + 1` bytes of it: a long line is gathered
    `_CHUNK` bytes at a time, so refusing one costs about `limit` bytes of memory, not twice that."""
    line = f.readline(min(limit + 1, _CHUNK))
    if len(line) < _CHUNK or line.endswith(b"\n"):
        return line
    gathered = bytearray(line)
    while len(gathered) <= limit:
        piece = f.readline(min(limit + 1 - len(gathered), _CHUNK))
        gathered += piece
        if not piece or piece.endswith(b"\n"):
            break
    return gathered  # a bytearray reads like bytes (decode, strip, json.loads) without a copy


def _too_long(path: Path, what: str, offset: int | None = None) -> UpcyclerError:
    """The error for a text document longer than `MAX_DOCUMENT_BYTES`."""
    near = f" near byte {offset:,}" if offset is not None else ""
    return UpcyclerError(
        f"{shown_path(path)}: {what} longer than {MAX_DOCUMENT_BYTES:,} bytes{near}; split the text into "
        "smaller documents (or pick a finer --text-unit)"
    )


def _line_too_long(path: Path, _number: int, offset: int) -> UpcyclerError:
    """The error for a line of plain text longer than `MAX_DOCUMENT_BYTES` (the callback of `_lines`)."""
    return _too_long(path, "a line", offset)


def _universal_lines(line: bytes) -> list[str]:
    """A line of UTF-8 bytes (cut at b"\\n") as text, also cut after each lone "\\r" as Python's universal
    newlines read it, line breaks kept."""
    text = line.decode("utf-8")
    return [part for part in _LONE_CR.split(text) if part] if "\r" in text else [text]


def _text_documents(path: Path, text_unit: str, byte_range: tuple[int, int] | None) -> Iterator[str]:
    """The documents of a plain-text file, cut by `text_unit`."""
    with _open_binary(path) as f:
        if text_unit == "file":
            yield from _whole_file(f, path)
        elif text_unit == "line":
            yield from _line_documents(f, path, byte_range)
        else:
            yield from _paragraphs(f, path)


def _whole_file(f: BinaryIO, path: Path) -> Iterator[str]:
    """The file as one document, read in bounded chunks (an oversized file is refused before reading)."""
    if _compression(path) is None and os.fstat(f.fileno()).st_size > MAX_DOCUMENT_BYTES:
        raise _too_long(path, "a document (the whole file, with --text-unit file)")
    data = bytearray()
    while chunk := f.read(_CHUNK):
        data += chunk
        if len(data) > MAX_DOCUMENT_BYTES:
            raise _too_long(path, "a document (the whole file, with --text-unit file)")
    text = data.decode("utf-8")
    if text.strip():
        yield text


def _line_documents(f: BinaryIO, path: Path, byte_range: tuple[int, int] | None) -> Iterator[str]:
    """Each non-blank line, without its line break."""
    for _, _, line in _lines(f, MAX_DOCUMENT_BYTES, byte_range, partial(_line_too_long, path)):
        for part in _universal_lines(line):
            part = part.rstrip("\r\n")
            if part.strip():
                yield part


def _paragraphs(f: BinaryIO, path: Path) -> Iterator[str]:
    """Runs of non-blank lines, each joined back together without its final line break."""
    paragraph: list[str] = []
    size = 0
    for _, offset, line in _lines(f, MAX_DOCUMENT_BYTES, None, partial(_line_too_long, path)):
        for part in _universal_lines(line):
            if part.strip():
                paragraph.append(part)
            elif paragraph:
                yield "".join(paragraph).rstrip("\r\n")
                paragraph, size = [], 0
        if paragraph:
            size += len(line)
            if size > MAX_DOCUMENT_BYTES:
                raise _too_long(path, "a paragraph", offset)
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def _jsonl_documents(path: Path, text_field: str, byte_range: tuple[int, int] | None) -> Iterator[str]:
    """The documents of a JSON Lines file; blank lines are skipped. A line is named by its number, or
    within a byte range by the byte it starts at."""
    shown = shown_path(path)

    def where(number: int, offset: int) -> str:
        return f"{shown}:{number}" if byte_range is None else f"{shown} near byte {offset:,}"

    def too_long(number: int, offset: int) -> UpcyclerError:
        return UpcyclerError(
            f"{where(number, offset)}: line longer than {MAX_LINE_BYTES:,} bytes; {_FIX_JSONL}"
        )

    with _open_binary(path) as f:
        for number, offset, line in _lines(f, MAX_LINE_BYTES, byte_range, too_long):
            if line.strip():
                yield from jsonl_record(line, where(number, offset), text_field)


def _text_value(value: object, where: str, text_field: str) -> Iterator[str]:
    """The document in one record's text field: nothing if null or empty, an error if not a string."""
    if value is None or value == "":
        return
    if not isinstance(value, str):
        raise UpcyclerError(
            f"{where}: field {text_field!r} is {type(value).__name__}, not text; {_FIX_COLUMN}"
        )
    yield value


# --- Parquet and Arrow -------------------------------------------------------------------------------


def _column_index(pa: ModuleType, schema: Any, text_field: str, path: Path) -> tuple[int, str]:
    """(index, kind) of the column `text_field`: kind `text` for strings, `ids` for lists of integers."""
    names = schema.names
    if text_field not in names:
        raise UpcyclerError(
            f"{shown_path(path)}: no column {text_field!r} (columns: "
            f"{escape(', '.join(names))[:200]}); {_FIX_COLUMN}"
        )
    index = schema.get_field_index(text_field)
    if index < 0:
        raise UpcyclerError(f"{shown_path(path)}: more than one column {text_field!r}; fix the file")
    kind = schema.field(index).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_null(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind) or (
        getattr(pa.types, "is_string_view", lambda _: False)(kind)
    ):
        return index, "text"
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if any(is_list(kind) for is_list in lists) and pa.types.is_integer(kind.value_type):
        return index, "ids"
    raise UpcyclerError(
        f"{shown_path(path)}: column {text_field!r} is {escape(str(kind))[:80]}, neither text nor a list "
        f"of integer token ids; {_FIX_COLUMN}"
    )


def _column_documents(pa: ModuleType, column: Any, kind: str, path: Path) -> Iterator[Document]:
    """The documents of one record batch's column, `_BATCH_ROWS` rows at a time (nulls and empties
    skipped)."""
    for start in range(0, len(column), _BATCH_ROWS):
        rows = column.slice(start, _BATCH_ROWS)
        if kind == "text":
            yield from (value for value in rows.to_pylist() if value)
        else:
            yield from _id_lists(pa, rows, path)


def _id_lists(pa: ModuleType, rows: Any, path: Path) -> Iterator[np.ndarray]:
    """Each non-empty list of a list-of-integers column as an int64 array."""
    compute = importlib.import_module("pyarrow.compute")
    lengths = compute.list_value_length(rows).fill_null(0).to_numpy(zero_copy_only=False)
    values = rows.flatten()
    if values.null_count:
        raise UpcyclerError(f"{shown_path(path)}: a null among the token ids; fix the file")
    try:
        ids = np.array(values.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
    except pa.ArrowInvalid:
        raise UpcyclerError(f"{shown_path(path)}: a token id beyond the int64 range; fix the file") from None
    end = 0
    for length in lengths.tolist():
        end += length
        if length:
            yield ids[end - length : end]


def _parquet_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The documents of a Parquet file, one record batch at a time."""
    pa = _require("pyarrow", path, "Parquet", "pyarrow")
    pq = _require("pyarrow.parquet", path, "Parquet", "pyarrow")
    with os.fdopen(open_regular(path, "source file"), "rb") as raw:
        try:
            parquet = pq.ParquetFile(raw)
            _, kind = _column_index(pa, parquet.schema_arrow, text_field, path)
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field]):
                yield from _column_documents(pa, batch.column(0), kind, path)
        except (pa.ArrowException, OSError, ValueError, MemoryError) as err:
            raise UpcyclerError(
                f"{shown_path(path)}: not a readable Parquet file ({escape(str(err))[:120]}); "
                "check the --source path"
            ) from None


def _ipc_batches(pa: ModuleType, source: Any) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of an Arrow IPC stream (what `save_to_disk` writes) or IPC file."""
    is_file = source.read(6) == b"ARROW1"
    source.seek(0)
    if is_file:
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    reader = pa.ipc.open_stream(source)
    return reader.schema, iter(reader)


def _arrow_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The documents of an Arrow IPC file, one record batch at a time (each fully validated first). The file
    is memory-mapped, so a message cannot claim more bytes than the file holds."""
    pa = _require("pyarrow", path, "Arrow", "pyarrow")
    source = pa.BufferReader(pa.py_buffer(_mapped(path)))
    try:
        schema, batches = _ipc_batches(pa, source)
        index, kind = _column_index(pa, schema, text_field, path)
        for batch in batches:
            batch.validate(full=True)
            yield from _column_documents(pa, batch.column(index), kind, path)
    except (pa.ArrowException, OSError, ValueError, MemoryError) as err:
        raise UpcyclerError(
            f"{shown_path(path)}: not a readable Arrow file ({escape(str(err))[:120]}); "
            "check the --source path"
        ) from None


def _saved_dataset_files(directory: Path) -> list[Path] | None:
    """The Arrow files of a directory written by `Dataset.save_to_disk`, in its order (from `state.json`);
    None for another directory. A `DatasetDict` directory is refused: one split must be named."""
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if (p / "state.json").is_file())
        example = ", ".join(shown_path(directory / s) for s in (splits or ["train"])[:4])
        raise UpcyclerError(
            f"{shown_path(directory)}: a DatasetDict (several splits); pass one split directory, "
            f"e.g. {example}"
        )
    state_path = directory / "state.json"
    if not (state_path.is_file() and (directory / "dataset_info.json").is_file()):
        return None
    fix = "re-save the dataset with Dataset.save_to_disk"
    entries = load_json_object(state_path, fix=fix, what="datasets state.json").get("_data_files")
    if not isinstance(entries, list):
        raise UpcyclerError(f"{shown_path(state_path)}: no list `_data_files`; {fix}")
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise UpcyclerError(f"{shown_path(state_path)}: a `_data_files` entry without a filename; {fix}")
        file = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not _inside(file, directory):
            raise UpcyclerError(
                f"{shown_path(state_path)}: data file {describe(name)} lies outside {shown_path(directory)}; "
                f"{fix}"
            )
        check_source_file(file)
        files.append(file)
    return files


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path`, links resolved, lies inside `directory`."""
    return path.resolve().is_relative_to(directory.resolve())


# --- ArrayRecord -------------------------------------------------------------------------------------


def _arrayrecord_documents(path: Path, *, ids: bool) -> Iterator[Document]:
    """The records of an ArrayRecord file, `_RECORD_BATCH` at a time: UTF-8 text, or (`ids`) little-endian
    int32 token ids."""
    check_source_file(path)
    module = _require("array_record.python.array_record_module", path, "ArrayRecord", "array_record")

    def unreadable(err: object) -> UpcyclerError:
        return UpcyclerError(
            f"{shown_path(path)}: not a readable ArrayRecord file ({escape(str(err))[:120]}); the file may "
            "be truncated or corrupt"
        )

    try:
        reader = module.ArrayRecordReader(os.fspath(path), _ARRAY_RECORD_OPTIONS)
    except (RuntimeError, ValueError, OSError) as err:
        raise unreadable(err) from None
    if not reader.ok():  # nothing to close: closing a failed reader raises
        raise unreadable("no ArrayRecord footer")
    try:
        count = reader.num_records()
        for start in range(0, count, _RECORD_BATCH):
            try:
                records = reader.read(start, min(count, start + _RECORD_BATCH))
            except (RuntimeError, ValueError, OSError) as err:
                raise unreadable(err) from None
            for number, record in enumerate(records, start):
                yield from _record_document(record, number, path, ids)
    finally:
        reader.close()


def _record_document(record: bytes, number: int, path: Path, ids: bool) -> Iterator[Document]:
    """The document in one ArrayRecord record (nothing if empty)."""
    if not record:
        return
    if ids:
        if len(record) % 4:
            raise UpcyclerError(
                f"{shown_path(path)}: record {number} is {len(record):,} bytes, not whole int32 token ids; "
                "pass --format arrayrecord if the records are text"
            )
        yield np.frombuffer(record, "<i4").astype(np.int64)
        return
    try:
        text = record.decode("utf-8")
    except UnicodeDecodeError:
        raise UpcyclerError(
            f"{shown_path(path)}: record {number} is not UTF-8 text; pass --format arrayrecord-int32 if the "
            "records are token ids"
        ) from None
    if text:
        yield text


# --- Megatron indexed datasets -----------------------------------------------------------------------


def _megatron_documents(path: Path) -> Iterator[np.ndarray]:
    """Each sequence of a Megatron-LM indexed dataset (`path` is its `.bin`) as an int64 array."""
    data = _mapped(path, "Megatron data file")
    index_path = path.with_suffix(".idx")
    if not index_path.exists():
        raise UpcyclerError(
            f"{shown_path(index_path)}: missing; a Megatron dataset is read from its .bin with the .idx of "
            "the same name next to it"
        )
    dtype, sizes, pointers = _megatron_index(index_path)
    _check_extents(sizes, pointers, dtype.itemsize, len(data), index_path)
    for start in range(0, len(sizes), _CHECK_ROWS):  # a chunk of the index at a time as Python ints
        rows = slice(start, start + _CHECK_ROWS)
        for size, pointer in zip(sizes[rows].tolist(), pointers[rows].tolist()):
            if size:
                yield data[pointer : pointer + size * dtype.itemsize].view(dtype).astype(np.int64)


def _megatron_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, sizes, pointers) of a Megatron `.idx`, each part checked against the file's length."""
    shown = shown_path(path)
    index = _mapped(path, "Megatron index")
    if len(index) < _MEGATRON_HEADER.size:
        raise UpcyclerError(f"{shown}: {len(index)} bytes, too short for a Megatron index; {_FIX_MEGATRON}")
    magic, version, code, count, documents = _MEGATRON_HEADER.unpack(index[: _MEGATRON_HEADER.size].tobytes())
    if magic != _MEGATRON_MAGIC:
        raise UpcyclerError(f"{shown}: not a Megatron index (no MMIDIDX header); pass the .bin of an "
                            "indexed dataset")
    if version != 1:
        raise UpcyclerError(f"{shown}: Megatron index version {version}, only 1 is read; {_FIX_MEGATRON}")
    if code not in _MEGATRON_DTYPES:
        raise UpcyclerError(f"{shown}: dtype code {code} is not an integer type; token ids must be integers")
    expected = _MEGATRON_HEADER.size + 12 * count + 8 * documents
    if expected != len(index):
        raise UpcyclerError(
            f"{shown}: {len(index):,} bytes, but its {count:,} sequences and {documents:,} documents need "
            f"{expected:,}; {_FIX_MEGATRON}"
        )
    sizes_at = _MEGATRON_HEADER.size
    sizes = index[sizes_at : sizes_at + 4 * count].view("<i4")
    pointers = index[sizes_at + 4 * count : sizes_at + 12 * count].view("<i8")
    _check_document_indices(index[sizes_at + 12 * count :].view("<i8"), count, path)
    return np.dtype(_MEGATRON_DTYPES[code]), sizes, pointers


def _check_document_indices(indices: np.ndarray, count: int, path: Path) -> None:
    """Refuse document boundaries that are not non-decreasing sequence numbers within [0, count]."""
    previous = 0
    for start in range(0, len(indices), _CHECK_ROWS):
        part = indices[start : start + _CHECK_ROWS]
        if part.min() < previous or part.max() > count or np.any(np.diff(part) < 0):
            raise UpcyclerError(
                f"{shown_path(path)}: document indices out of order or beyond the {count:,} sequences; "
                f"{_FIX_MEGATRON}"
            )
        previous = int(part[-1])


def _check_extents(sizes: np.ndarray, pointers: np.ndarray, itemsize: int, length: int, path: Path) -> None:
    """Refuse a sequence of the index `path` with a negative size or one that does not lie inside the `.bin`
    (`length` bytes)."""
    for start in range(0, len(sizes), _CHECK_ROWS):
        size = sizes[start : start + _CHECK_ROWS].astype(np.int64)
        pointer = pointers[start : start + _CHECK_ROWS]
        end = np.clip(pointer, 0, length) + size * itemsize  # clipped: no overflow past int64
        bad = (size < 0) | (pointer < 0) | (pointer > length) | (end > length)
        if bad.any():
            first = start + int(np.argmax(bad))
            raise UpcyclerError(
                f"{shown_path(path)}: sequence {first:,} (size {int(sizes[first]):,} at byte "
                f"{int(pointers[first]):,}) does not lie inside the {length:,}-byte .bin; {_FIX_MEGATRON}"
            )
