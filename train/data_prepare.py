"""Tokenise text sources once into memory-mappable token arrays (the engine of `upcycle prepare-data`).

A prepared directory holds, per named source:
- `NAME.tokens.npy`: a 1-D uint16 array (uint32 when the vocabulary has more than 65536 entries) with
  every document's tokens followed by one EOS id, documents in file order, files in sorted order;
- `NAME.meta.json`: token and document counts, vocab size, EOS id, the tokenizer's sha256 and every
  input file with its size and sha256.
Documents are tokenised in small batches and appended to a temporary file, so memory stays bounded by
one batch whatever the corpus size. The token file is renamed into place when complete and the metadata
is written last, so a source is complete exactly when its metadata exists.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.data_readers import detect_format, read_documents
from upcycler.train.data_tokenizer import TokenizerInfo, sha256_file

FORMAT_VERSION = 1
TOKENS_SUFFIX = ".tokens.npy"
META_SUFFIX = ".meta.json"
NPY_HEADER_BYTES = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def parse_sources(specs: Iterable[str]) -> dict[str, list[Path]]:
    """Parse `NAME=GLOB_OR_FILE` specs into sorted file lists; a repeated NAME adds more files to it."""
    sources: dict[str, list[Path]] = {}
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not _NAME.fullmatch(name) or not pattern:
            raise UpcyclerError(
                f"--source {spec!r}: expected NAME=GLOB_OR_FILE with NAME like web or code_v2"
            )
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise UpcyclerError(f"{pattern}: matches no file; fix the --source {name}=... path or glob")
        known = sources.setdefault(name, [])
        for file in files:
            if file not in known:
                known.append(file)
    return sources


def prepare_sources(
    tokenizer: TokenizerInfo,
    sources: Mapping[str, Sequence[Path]],
    out_dir: Path,
    *,
    fmt: str | None = None,
    text_field: str = "text",
    text_unit: str = "file",
    overwrite: bool = False,
) -> list[dict]:
    """Tokenise every source into `out_dir`; returns each source's metadata, in order.

    Everything that can be checked before tokenising (formats, existing outputs) is checked first, so
    a bad argument fails in seconds, not after an hour of tokenising.
    """
    formats = {name: [(f, fmt or detect_format(f)) for f in files] for name, files in sources.items()}
    for name in sources:
        existing = [
            p for p in (out_dir / f"{name}{TOKENS_SUFFIX}", out_dir / f"{name}{META_SUFFIX}") if p.exists()
        ]
        if existing and not overwrite:
            raise UpcyclerError(f"{existing[0]}: already exists; choose another --out or pass --overwrite")
    if out_dir.exists() and not out_dir.is_dir():
        raise UpcyclerError(f"{out_dir}: exists and is not a directory; choose another --out")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return [
            _prepare_source(name, files, out_dir, tokenizer, text_field=text_field, text_unit=text_unit)
            for name, files in formats.items()
        ]
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise


def _prepare_source(
    name: str,
    files: Sequence[tuple[Path, str]],
    out_dir: Path,
    tok: TokenizerInfo,
    *,
    text_field: str,
    text_unit: str,
) -> dict:
    """Tokenise one source's files into `NAME.tokens.npy`, then write `NAME.meta.json`."""
    (out_dir / f"{name}{META_SUFFIX}").unlink(missing_ok=True)
    dtype = token_dtype(tok.vocab_size)
    num_docs = 0
    with _TokenFile(out_dir / f"{name}{TOKENS_SUFFIX}", dtype) as out:
        for path, fmt in files:
            docs = read_documents(path, fmt, text_field=text_field, text_unit=text_unit)
            for ids, count in _tokenised_batches(tok, docs):
                out.append(ids)
                num_docs += count
        if out.count == 0:
            raise UpcyclerError(
                f"{files[0][0]}: source {name!r} has no text; check --format and --text-field"
            )
    meta = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "tokens_file": f"{name}{TOKENS_SUFFIX}",
        "dtype": dtype.name,
        "num_tokens": out.count,
        "num_documents": num_docs,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": {"file": str(tok.path), "sha256": tok.sha256},
        "input": _input_settings({fmt for _, fmt in files}, text_field, text_unit),
        "files": [{"path": str(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p, _ in files],
    }
    _write_json_atomic(out_dir / f"{name}{META_SUFFIX}", meta)
    return meta


def _input_settings(formats: set[str], text_field: str, text_unit: str) -> dict:
    """The reading options that shaped the documents, for the metadata."""
    settings: dict = {"formats": sorted(formats)}
    if formats - {"text"}:
        settings["text_field"] = text_field
    if "text" in formats:
        settings["text_unit"] = text_unit
    return settings


def _tokenised_batches(tok: TokenizerInfo, docs: Iterable[str]) -> Iterator[tuple[np.ndarray, int]]:
    """Token ids of `docs`, each document followed by EOS, in bounded batches: (ids, documents in it)."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield _encode(tok, batch)
            batch, chars = [], 0
    if batch:
        yield _encode(tok, batch)


def _encode(tok: TokenizerInfo, docs: list[str]) -> tuple[np.ndarray, int]:
    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)
    flat: list[int] = []
    count = 0
    for encoding in encode(docs, add_special_tokens=False):
        if encoding.ids:
            flat.extend(encoding.ids)
            flat.append(tok.eos_id)
            count += 1
    return np.asarray(flat, dtype=np.int64), count


def npy_header(dtype: np.dtype, count: int) -> bytes:
    """A version-1.0 `.npy` header for a 1-D array, always `NPY_HEADER_BYTES` long so it can be rewritten."""
    text = repr({"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (count,)}).encode("latin1")
    size = NPY_HEADER_BYTES - 10
    return b"\x93NUMPY\x01\x00" + size.to_bytes(2, "little") + text + b" " * (size - len(text) - 1) + b"\n"


class _TokenFile:
    """A 1-D `.npy` file built by appending, under a temporary name renamed into place only on success."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path = path
        self.dtype = dtype
        self.count = 0
        self._tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Self:
        self._file = self._guard(lambda: open(self._tmp, "wb"))  # noqa: SIM115 - closed in __exit__
        self._guard(lambda: self._file.write(npy_header(self.dtype, 0)))
        return self

    def append(self, ids: np.ndarray) -> None:
        self._guard(lambda: self._file.write(ids.astype(self.dtype).tobytes()))
        self.count += ids.size

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._guard(self._finish)
                self._file.close()
                self._guard(lambda: os.replace(self._tmp, self.path))
        finally:
            self._file.close()
            self._tmp.unlink(missing_ok=True)

    def _finish(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, self.count))
        self._file.flush()
        os.fsync(self._file.fileno())

    def _guard(self, action):
        try:
            return action()
        except OSError as err:
            raise UpcyclerError(
                f"{self._tmp}: cannot write ({err.strerror}); free disk space or choose another --out"
            ) from None


def _write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        raise UpcyclerError(
            f"{path}: cannot write ({err.strerror}); free disk space or choose another --out"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
