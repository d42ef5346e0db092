"""Plain text and JSON Lines for `prepare-data`: documents cut from a file's lines.

Text is cut by `text_unit`: the whole file, paragraphs (runs of non-blank lines) or lines; lines end at
"\\n", "\\r\\n" or a lone "\\r", as Python's universal newlines read them. JSON Lines hold one object per
line, the document in its `text_field`, parsed by `upcycler.untrusted`'s bounded JSON parser. Both are
read through `decompression.open_binary`, so they may be compressed.

Memory stays bounded by one document: a text document longer than `MAX_DOCUMENT_BYTES` or a JSONL line
longer than `MAX_LINE_BYTES` is refused after reading at most that many bytes of it. With a `byte_range`
(uncompressed files read line by line only), just the lines that start inside it are read, so ranges that
tile a file read each document once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import BinaryIO

from upcycler.errors import UpcyclerError
from upcycler.train.data.decompression import CHUNK, MAX_EXPANSION, compression, open_binary
from upcycler.train.data.source_files import FIX_COLUMN
from upcycler.untrusted import parse_json, shown_path

MAX_LINE_BYTES = 256 * 1024**2  # one JSONL record; a file without line breaks is not JSON Lines
MAX_DOCUMENT_BYTES = MAX_LINE_BYTES  # one plain-text document (a file, a paragraph or a line)
_FIX_JSONL = "JSON input must be JSON Lines, one object per line; fix or remove that line"
_LONE_CR = re.compile(r"(?<=\r)(?!\n)")  # where universal newlines also end a line: after a lone "\r"


def text_documents(path: Path, text_unit: str, byte_range: tuple[int, int] | None,
                   max_expansion: float = MAX_EXPANSION) -> Iterator[str]:
    """The documents of a plain-text file, cut by `text_unit` (a compressed one refused beyond
    `max_expansion`, see `decompression`)."""
    with open_binary(path, max_expansion) as f:
        if text_unit == "file":
            yield from _whole_file(f, path)
        elif text_unit == "line":
            yield from _line_documents(f, path, byte_range)
        else:
            yield from _paragraphs(f, path)


def _whole_file(f: BinaryIO, path: Path) -> Iterator[str]:
    """The file as one document, read in bounded chunks (an oversized file is refused before reading)."""
    if compression(path) is None and os.fstat(f.fileno()).st_size > MAX_DOCUMENT_BYTES:
        raise _too_long(path, "a document (the whole file, with --text-unit file)")
    data = bytearray()
    while chunk := f.read(CHUNK):
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


def jsonl_documents(path: Path, text_field: str, byte_range: tuple[int, int] | None,
                    max_expansion: float = MAX_EXPANSION) -> Iterator[str]:
    """The documents of a JSON Lines file; blank lines are skipped. A line is named by its number, or
    within a byte range by the byte it starts at (a compressed file is refused beyond `max_expansion`)."""
    shown = shown_path(path)

    def where(number: int, offset: int) -> str:
        return f"{shown}:{number}" if byte_range is None else f"{shown} near byte {offset:,}"

    def too_long(number: int, offset: int) -> UpcyclerError:
        return UpcyclerError(
            f"{where(number, offset)}: line longer than {MAX_LINE_BYTES:,} bytes; {_FIX_JSONL}"
        )

    with open_binary(path, max_expansion) as f:
        for number, offset, line in _lines(f, MAX_LINE_BYTES, byte_range, too_long):
            if line.strip():
                yield from jsonl_record(line, where(number, offset), text_field)


def jsonl_record(line: str | bytes, where: str, text_field: str = "text") -> Iterator[str]:
    """The document of one JSONL line (nothing if its text is null or empty); `UpcyclerError` if unusable."""
    record = parse_json(line, where, _FIX_JSONL)
    if not isinstance(record, dict) or text_field not in record:
        raise UpcyclerError(f"{where}: no field {text_field!r}; {FIX_COLUMN}")
    yield from _text_value(record[text_field], where, text_field)


def _text_value(value: object, where: str, text_field: str) -> Iterator[str]:
    """The document in one record's text field: nothing if null or empty, an error if not a string."""
    if value is None or value == "":
        return
    if not isinstance(value, str):
        raise UpcyclerError(
            f"{where}: field {text_field!r} is {type(value).__name__}, not text; {FIX_COLUMN}"
        )
    yield value


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
        while piece := f.readline(CHUNK):
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
    `CHUNK` bytes at a time, so refusing one costs about `limit` bytes of memory, not twice that."""
    line = f.readline(min(limit + 1, CHUNK))
    if len(line) < CHUNK or line.endswith(b"\n"):
        return line
    gathered = bytearray(line)
    while len(gathered) <= limit:
        piece = f.readline(min(limit + 1 - len(gathered), CHUNK))
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
