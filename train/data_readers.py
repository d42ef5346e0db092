"""Document readers for `prepare-data`: plain text, JSONL and Parquet files, one document at a time.

`read_documents` yields the documents of one file as strings, in file order, and holds at most one
document (or one Parquet record batch) in memory. Empty documents are skipped. Files ending in `.gz`
are decompressed on the fly (text and JSONL). Bad input raises `UpcyclerError` naming the file (and the
line, for JSONL) and the fix.

Plain text is cut into documents by `text_unit`, after Hugging Face `datasets`' `sample_by`:
`file` (the whole file is one document), `paragraph` (blank lines separate documents) or `line`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from upcycler.errors import UpcyclerError

FORMATS = ("text", "jsonl", "parquet")
TEXT_UNITS = ("file", "paragraph", "line")
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


def detect_format(path: Path) -> str:
    """The input format of `path` from its extension (a trailing `.gz` is ignored)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    fmt = _EXTENSIONS.get(suffixes[-1]) if suffixes else None
    if fmt is None:
        raise UpcyclerError(
            f"{path}: cannot tell the format from the file name; pass --format text|jsonl|parquet"
        )
    return fmt


def read_documents(
    path: Path, fmt: str, *, text_field: str = "text", text_unit: str = "file"
) -> Iterator[str]:
    """Yield the non-empty documents of `path` in file order, streaming."""
    if fmt == "text":
        yield from _checked_utf8(path, _text_documents(path, text_unit))
    elif fmt == "jsonl":
        yield from _checked_utf8(path, _jsonl_documents(path, text_field))
    elif fmt == "parquet":
        yield from _parquet_documents(path, text_field)
    else:
        raise UpcyclerError(f"{path}: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def _open_text(path: Path) -> TextIO:
    """Open `path` as UTF-8 text, decompressing `.gz`, keeping line endings as written."""
    try:
        if path.suffix.lower() == ".gz":
            return gzip.open(path, "rt", encoding="utf-8", newline="")
        return open(path, encoding="utf-8", newline="")
    except OSError as err:
        raise UpcyclerError(f"{path}: cannot read ({err.strerror}); check the --source path") from None


def _checked_utf8(path: Path, documents: Iterator[str]) -> Iterator[str]:
    """Pass `documents` through, turning decoding and I/O failures into one-line user errors."""
    try:
        yield from documents
    except UnicodeDecodeError:
        raise UpcyclerError(f"{path}: not valid UTF-8 text; re-encode the file as UTF-8") from None
    except (OSError, EOFError) as err:
        raise UpcyclerError(f"{path}: cannot read ({err}); the file may be truncated or corrupt") from None


def _text_documents(path: Path, text_unit: str) -> Iterator[str]:
    if text_unit not in TEXT_UNITS:
        raise UpcyclerError(f"{path}: unknown text unit {text_unit!r}; use one of {', '.join(TEXT_UNITS)}")
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


def _paragraphs(lines: TextIO) -> Iterator[str]:
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
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UpcyclerError(
                    f"{path}:{lineno}: not valid JSON ({err.msg}); JSON input must be JSON Lines, one object per line"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                raise UpcyclerError(f"{path}:{lineno}: no field {text_field!r}; pass --text-field NAME")
            yield from _text_value(record[text_field], f"{path}:{lineno}", text_field)


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UpcyclerError(
            f"{path}: reading Parquet needs pyarrow; install it with `pip install pyarrow`"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise UpcyclerError(f"{path}: not a readable Parquet file ({err}); check the --source path") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise UpcyclerError(
            f"{path}: no column {text_field!r} (columns: {', '.join(columns)}); pass --text-field NAME"
        )
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            yield from _text_value(value, str(path), text_field)


def _text_value(value: object, where: str, text_field: str) -> Iterator[str]:
    """The document in one record's text field: nothing if null or empty, an error if not a string."""
    if value is None or value == "":
        return
    if not isinstance(value, str):
        raise UpcyclerError(
            f"{where}: field {text_field!r} is {type(value).__name__}, not text; pass --text-field NAME"
        )
    yield value
