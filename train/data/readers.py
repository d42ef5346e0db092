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

Text and JSONL may be compressed (`.gz`, `.zst`, `.zstd`), read through a guard against compression
bombs. Memory stays bounded by one document, one record batch or one batch of records. Uncompressed
JSONL and line text are `splittable`: a `byte_range` reads only the lines that start inside it, so
ranges that tile a file read each document once. `expand_pattern` also takes a directory written by
`Dataset.save_to_disk` (its Arrow files).

Every input is opened through `upcycler.untrusted`, so a FIFO, device or directory is refused without
blocking and a JSONL line is parsed by its bounded JSON parser. A bad record is fatal: the first
unreadable one stops the run with one `UpcyclerError` naming the file (and the line or byte where it
helps), and nothing is written. Skipping would silently change the corpus.

This module is the face: format names, detection, file patterns and the dispatch. The readers themselves,
each with the limits it enforces (patch a limit in the module that holds it):

    text_readers.py      plain text and JSON Lines: lines, byte ranges, paragraphs, whole files
                         (`MAX_LINE_BYTES`, `MAX_DOCUMENT_BYTES`)
    columnar_readers.py  Parquet, Arrow IPC and the `Dataset.save_to_disk` directory
    record_readers.py    ArrayRecord files and Megatron-LM indexed datasets
    decompression.py     a file's bytes, decompressed on the fly, with the bomb guard
                         (`COMPRESSIONS`, `BOMB_FLOOR_BYTES`, `MAX_EXPANSION`)
    source_files.py      what they all share: the `Document` type, opening and mapping a source file,
                         optional packages
"""

from __future__ import annotations

import glob
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.train.data.columnar_readers import arrow_documents, parquet_documents, saved_dataset_files
from upcycler.train.data.decompression import BOMB_FLOOR_BYTES, COMPRESSIONS, MAX_EXPANSION, compression
from upcycler.train.data.record_readers import arrayrecord_documents, megatron_documents
from upcycler.train.data.source_files import Document, check_source_file
from upcycler.train.data.text_readers import (
    MAX_DOCUMENT_BYTES,
    MAX_LINE_BYTES,
    jsonl_documents,
    jsonl_record,
    text_documents,
)
from upcycler.untrusted import escape, shown_path

__all__ = [
    "BOMB_FLOOR_BYTES", "COMPRESSIONS", "FORMATS", "MAX_DOCUMENT_BYTES", "MAX_EXPANSION", "MAX_LINE_BYTES",
    "TEXT_UNITS", "Document", "check_source_file", "detect_format", "expand_pattern", "jsonl_record",
    "read_documents", "splittable",
]

FORMATS = ("text", "jsonl", "parquet", "arrow", "arrayrecord", "arrayrecord-int32", "megatron")
TEXT_UNITS = ("file", "paragraph", "line")
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
    if compression(path) is not None:
        return False
    return fmt == "jsonl" or (fmt == "text" and text_unit == "line")


def expand_pattern(pattern: str) -> list[Path]:
    """The regular files a `--source` file name or glob names, sorted, each once. A directory written by
    `datasets.Dataset.save_to_disk` stands for its Arrow files (in its own order); other directories a glob
    matches are skipped; anything else that is not a regular file (a FIFO, a device, a named directory) is
    refused, and so is a `DatasetDict` directory (name one split)."""
    matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    files = []
    for path in matches:
        if path.is_dir():
            saved = saved_dataset_files(path)
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
    max_expansion: float = MAX_EXPANSION,
) -> Iterator[Document]:
    """The non-empty documents of `path` in file order, streaming: `str` for text, a 1-D int64 array for
    token ids. With `byte_range=(a, b)` (only where `splittable`), just the documents of the lines that
    start at a byte offset p with a <= p < b. A compressed file that expands more than `max_expansion`
    times is refused (`decompression`)."""
    if fmt not in FORMATS:
        raise UpcyclerError(f"{shown_path(path)}: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "text" and text_unit not in TEXT_UNITS:
        raise UpcyclerError(
            f"{shown_path(path)}: unknown text unit {text_unit!r}; use one of {', '.join(TEXT_UNITS)}"
        )
    if byte_range is not None:
        _check_range(path, fmt, text_unit, byte_range)
    if fmt not in ("text", "jsonl") and compression(path) is not None:
        raise UpcyclerError(
            f"{shown_path(path)}: {fmt} input cannot be read compressed; decompress it first"
        )
    if fmt == "text":
        return _checked(path, text_documents(path, text_unit, byte_range, max_expansion))
    if fmt == "jsonl":
        return _checked(path, jsonl_documents(path, text_field, byte_range, max_expansion))
    if fmt == "parquet":
        return parquet_documents(path, text_field)
    if fmt == "arrow":
        return arrow_documents(path, text_field)
    if fmt == "megatron":
        return megatron_documents(path)
    return arrayrecord_documents(path, ids=fmt == "arrayrecord-int32")


# --- arguments and helpers ---------------------------------------------------------------------------


def _check_range(path: Path, fmt: str, text_unit: str, byte_range: tuple[int, int]) -> None:
    """Refuse a byte range the caller should never have asked for (a programming error, not bad input)."""
    if not splittable(path, fmt, text_unit):
        raise ValueError(f"{path}: {fmt} input (text unit {text_unit}) cannot be read by byte range")
    start, end = byte_range
    if not (isinstance(start, int) and isinstance(end, int)) or start < 0:
        raise ValueError(f"byte range {byte_range!r}: expected two integers, the first >= 0")


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
