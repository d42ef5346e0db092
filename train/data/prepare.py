"""Tokenise text sources once into memory-mappable token arrays (the engine of `upcycle prepare-data`).

A prepared directory holds, per named source (the layout is `upcycler.train.data.format`):
- `NAME.tokens.npy`: every document's tokens followed by one EOS id, documents in file order, files in
  sorted order;
- `NAME.meta.json`: token and document counts, vocab size, EOS id, the tokenizer's sha256 and every
  input file with its size and sha256.
Documents are tokenised in small batches and appended to a temporary file, so memory stays bounded by
one batch whatever the corpus size. Everything is written into a hidden staging directory and moved
into OUT only when every source is complete (`upcycler.train.outputs`), metadata last, so a source is
complete exactly when its metadata exists, and a failed run (a bad line, a full disk, an interrupt)
changes nothing in OUT. An input file is never an output: one that would be overwritten is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.hashing import sha256_file
from upcycler.io.object_store import is_bucket_url
from upcycler.io.remote_sources import mirror_glob
from upcycler.io.staging import staged_files
from upcycler.locations import local_path, recorded_location
from upcycler.train.data.config import SOURCE_NAME
from upcycler.train.data.format import FORMAT_VERSION, META_SUFFIX, TOKENS_SUFFIX, npy_header, token_dtype
from upcycler.train.data.readers import detect_format, expand_pattern, read_documents
from upcycler.train.data.tokenizer import TokenizerInfo
from upcycler.untrusted import describe, shown_path

_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20


def parse_sources(specs: Iterable[str]) -> dict[str, list[Path]]:
    """Parse `NAME=GLOB_OR_FILE` specs into sorted file lists; a repeated NAME adds more files to it."""
    sources: dict[str, list[Path]] = {}
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not SOURCE_NAME.fullmatch(name) or not pattern:
            raise UpcyclerError(
                f"--source {describe(spec)}: expected NAME=GLOB_OR_FILE with NAME like web or code_v2"
            )
        if is_bucket_url(pattern):
            files = mirror_glob(pattern)  # each object fetched into this host's cache
        else:
            local_path(pattern, f"--source {name}")  # another URL is refused, not globbed as a local name
            files = expand_pattern(pattern)
        if not files:
            raise UpcyclerError(
                f"{shown_path(pattern)}: matches no file; fix the --source {name}=... path or glob"
            )
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
    outputs = {out_dir / f"{name}{suffix}" for name in sources for suffix in (TOKENS_SUFFIX, META_SUFFIX)}
    for name in sources:
        existing = [
            p for p in (out_dir / f"{name}{TOKENS_SUFFIX}", out_dir / f"{name}{META_SUFFIX}") if p.exists()
        ]
        if existing and not overwrite:
            raise UpcyclerError(
                f"{shown_path(existing[0])}: already exists; choose another --out or pass --overwrite"
            )
    _refuse_inputs_as_outputs(outputs, [f for files in sources.values() for f in files])
    with staged_files(out_dir, "--out", is_marker=lambda n: n.endswith(META_SUFFIX)) as stage:
        return [
            _prepare_source(name, files, stage, tokenizer, text_field=text_field, text_unit=text_unit)
            for name, files in formats.items()
        ]


def _refuse_inputs_as_outputs(outputs: Iterable[Path], inputs: Iterable[Path]) -> None:
    """An input that is (after resolving symlinks) one of the files about to be written is refused."""
    written = {os.path.realpath(p): p for p in outputs}
    for path in inputs:
        if os.path.realpath(path) in written:
            raise UpcyclerError(
                f"{shown_path(path)}: is an input and would be overwritten by "
                f"{shown_path(written[os.path.realpath(path)])}; choose another --out"
            )


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
                f"{shown_path(files[0][0])}: source {name!r} has no text; check --format and --text-field"
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
        "files": [{"path": recorded_location(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                  for p, _ in files],
    }
    _write_json(out_dir / f"{name}{META_SUFFIX}", meta)
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


class _TokenFile:
    """A 1-D `.npy` file built by appending; its header is rewritten with the final count on success."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path = path
        self.dtype = dtype
        self.count = 0

    def __enter__(self) -> Self:
        self._file = _guard(self.path, lambda: open(self.path, "wb"))  # noqa: SIM115 - closed in __exit__
        _guard(self.path, lambda: self._file.write(npy_header(self.dtype, 0)))
        return self

    def append(self, ids: np.ndarray) -> None:
        _guard(self.path, lambda: self._file.write(ids.astype(self.dtype).tobytes()))
        self.count += ids.size

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                _guard(self.path, self._finish)
        finally:
            self._file.close()

    def _finish(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, self.count))
        self._file.flush()
        os.fsync(self._file.fileno())


def _write_json(path: Path, value: dict) -> None:
    _guard(path, lambda: path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8"))


def _guard(path: Path, action):
    """Run `action`, turning a failed write (a full disk, say) into one line naming the output."""
    try:
        return action()
    except OSError as err:
        raise UpcyclerError(
            f"{path.name}: cannot write ({err.strerror}); free disk space or choose another --out"
        ) from None
