"""Document readers for `prepare-data`: plain text, JSONL and Parquet files, one document at a time.

`read_documents` yields the documents of one file as strings, in file order, and holds at most one
document (or one Parquet record batch) in memory. Empty documents are skipped. Files ending in `.gz`
are decompressed on the fly (text and JSONL). Every input is opened through `upcycler.untrusted`, so a
FIFO, device or directory is refused without blocking, and a JSONL line is parsed with its bounded JSON
parser (no deep nesting, no huge numbers, no NaN).

A bad record is fatal: the first unreadable JSONL line (not JSON, not an object, no text field, a
non-text value, not UTF-8, longer than `MAX_LINE_BYTES`) stops the run with one `UpcyclerError` naming
the file and the line, and nothing is written. Skipping would silently change the corpus.

Plain text is cut into documents by `text_unit`, after Hugging Face `datasets`' `sample_by`:
`file` (the whole file is one document), `paragraph` (blank lines separate documents) or `line`.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from upcycler.errors import UpcyclerError
from upcycler.untrusted import escape, open_regular, parse_json, shown_path

FORMATS = ("text", "jsonl", "parquet")
TEXT_UNITS = ("file", "paragraph", "line")
MAX_LINE_BYTES = 256 * 1024**2  # one JSONL record; a file without line breaks is not JSON Lines
_EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}
_PARQUET_BATCH_ROWS = 1024
_FIX_JSONL = "JSON input must be JSON Lines, one object per line; fix or remove that line"


def detect_format(path: Path) -> str:
    """The input format of `path` from its extension (a trailing `.gz` is ignored)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    fmt = _EXTENSIONS.get(suffixes[-1]) if suffixes else None
    if fmt is None:
        raise UpcyclerError(
            f"{shown_path(path)}: cannot tell the format from the file name; pass --format text|jsonl|parquet"
        )
    return fmt


def check_source_file(path: Path) -> None:
    """Refuse `path` unless it is a readable regular file (a FIFO or device is refused without blocking)."""
    os.close(open_regular(path, "source file"))


def expand_pattern(pattern: str) -> list[Path]:
    """The regular files a `--source` file name or glob names, sorted; directories a glob matches are skipped,
    anything else that is not a regular file (a FIFO, a device, a named directory) is refused."""
    matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    files = []
    for path in matches:
        if glob.has_magic(pattern) and path.is_dir():
            continue
        check_source_file(path)
        files.append(path)
    return files


def read_documents(
    path: Path, fmt: str, *, text_field: str = "text", text_unit: str = "file"
) -> Iterator[str]:
    """Yield the non-empty documents of `path` in file order, streaming."""
    if fmt == "text":
        yield from _checked(path, _text_documents(path, text_unit))
    elif fmt == "jsonl":
        yield from _checked(path, _jsonl_documents(path, text_field))
    elif fmt == "parquet":
        yield from _parquet_documents(path, text_field)
    else:
        raise UpcyclerError(f"{shown_path(path)}: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


@contextmanager
def _open_binary(path: Path) -> Iterator[BinaryIO]:
    """The bytes of the regular file `path`, decompressed when it ends in `.gz`."""
    with os.fdopen(open_regular(path, "source file"), "rb") as raw:
        if path.suffix.lower() == ".gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped
        else:
            yield raw


@contextmanager
def _open_text(path: Path) -> Iterator[io.TextIOWrapper]:
    """`path` as UTF-8 text, line endings kept as written."""
    with _open_binary(path) as binary:
        text = io.TextIOWrapper(binary, encoding="utf-8", newline="")
        try:
            yield text
        finally:
            text.detach()  # the binary stream is closed by its own context


def _checked(path: Path, documents: Iterator[str]) -> Iterator[str]:
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


def _text_documents(path: Path, text_unit: str) -> Iterator[str]:
    if text_unit not in TEXT_UNITS:
        raise UpcyclerError(
            f"{shown_path(path)}: unknown text unit {text_unit!r}; use one of {', '.join(TEXT_UNITS)}"
        )
    with _open_text(path) as f:
        if text_unit == "file":
            text = f.read()
            if text.strip():
                yield text
        elif text_unit == "line":
            for line in f:
                line = line.rstrip("\r\n")
                if line.strip():
                    yield line
        else:
            yield from _paragraphs(f)


def _paragraphs(lines: io.TextIOWrapper) -> Iterator[str]:
    """Runs of non-blank lines, each joined back together without its final line break."""
    paragraph: list[str] = []
    for line in lines:
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).rstrip("\r\n")
            paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with _open_binary(path) as f:
        lineno = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            where = f"{shown_path(path)}:{lineno}"
            if len(line) > MAX_LINE_BYTES:
                raise UpcyclerError(
                    f"{where}: line longer than {MAX_LINE_BYTES:,} bytes; {_FIX_JSONL}"
                )
            if line.strip():
                yield from jsonl_record(line, where, text_field)


def jsonl_record(line: str | bytes, where: str, text_field: str = "text") -> Iterator[str]:
    """The document of one JSONL line (nothing if its text is null or empty); `UpcyclerError` if unusable."""
    record = parse_json(line, where, _FIX_JSONL)
    if not isinstance(record, dict) or text_field not in record:
        raise UpcyclerError(f"{where}: no field {text_field!r}; pass --text-field NAME")
    yield from _text_value(record[text_field], where, text_field)


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UpcyclerError(
            f"{shown_path(path)}: reading Parquet needs pyarrow; install it with `pip install pyarrow`"
        ) from None
    with os.fdopen(open_regular(path, "source file"), "rb") as raw:
        try:
            parquet = pq.ParquetFile(raw)
            columns = parquet.schema_arrow.names
            if text_field not in columns:
                raise UpcyclerError(
                    f"{shown_path(path)}: no column {text_field!r} (columns: "
                    f"{escape(', '.join(columns))[:200]}); pass --text-field NAME"
                )
            for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
                for value in batch.column(0).to_pylist():
                    yield from _text_value(value, shown_path(path), text_field)
        except (pa.ArrowException, OSError, ValueError) as err:
            raise UpcyclerError(
                f"{shown_path(path)}: not a readable Parquet file ({escape(str(err))[:120]}); "
                "check the --source path"
            ) from None


def _text_value(value: object, where: str, text_field: str) -> Iterator[str]:
    """The document in one record's text field: nothing if null or empty, an error if not a string."""
    if value is None or value == "":
        return
    if not isinstance(value, str):
        raise UpcyclerError(
            f"{where}: field {text_field!r} is {type(value).__name__}, not text; pass --text-field NAME"
        )
    yield value
