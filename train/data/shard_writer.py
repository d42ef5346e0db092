"""One unit of `prepare-data`'s work: read a unit's documents, tokenise them and commit its shard.

`write_shard` is what the engine runs on a worker, once per unit. It is idempotent: a shard whose record
is already in the work directory is not tokenised again (that is how an interrupted preparation resumes).
A shard appears by rename, its record after it, so a worker killed at any instant leaves either a whole
shard with its record or nothing that counts. A bad input does not raise through the engine (whose errors
arrive wrapped in its own tracebacks): the unit writes the one-line message beside the shard
(`ERROR_SUFFIX`) and stops, and `prepare` reports it.

What this module preserves: the tokens of a unit are exactly each document's `tokenizers` encoding
(without special tokens) followed by the EOS id; a pre-tokenised document (Megatron, ArrayRecord of ids,
an integer column) is taken as it is, with EOS appended unless it already ends with EOS. With a held-out
split (`Settings.heldout_fraction`), each document goes whole, in input order, either to the unit's shard
or to its shard of `NAME.heldout` (`format.held_out` decides, from the document's tokens alone); a
held-out shard that receives no document is not kept.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Self

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.hashing import sha256_file
from upcycler.train.data.format import (
    SHARD_HEADER_BYTES,
    held_out,
    heldout_name,
    shard_file,
    shard_header,
    token_dtype,
)
from upcycler.train.data.plan import InputFile, Settings, Unit
from upcycler.train.data.readers import read_documents
from upcycler.untrusted import shown_path

SHARDS = "shards"  # the work directory's subdirectory laid out as the output will be
PARTIAL = "partial"  # shards being written (a killed worker's are removed when the work resumes)
RECORD_SUFFIX = ".json"
ERROR_SUFFIX = ".error"
_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20
_tokenizers: dict[str, object] = {}  # one loaded tokenizer per worker process


def shard_paths(work: Path, unit: Unit) -> tuple[Path, Path, Path]:
    """The unit's shard (under `work/SHARDS`, laid out as in OUT), its record and its error file."""
    shard = work / SHARDS / shard_file(unit.source, unit.index)
    record = work / "records" / unit.source / f"{unit.index:05d}{RECORD_SUFFIX}"
    return shard, record, record.with_suffix(ERROR_SUFFIX)


def read_record(work: Path, unit: Unit) -> dict | None:
    """The record of the unit's finished shard, or None if it is not finished."""
    record = shard_paths(work, unit)[1]
    return json.loads(record.read_text()) if record.exists() else None


def write_shard(unit: Unit, files: Mapping[int, InputFile], settings: Settings, work: str) -> dict:
    """Tokenise `unit` into its shard in `work` unless it is there already; returns its record
    (`file`, `tokens`, `documents`, `sha256`; with a held-out split, `heldout`: the same four of the
    unit's `NAME.heldout` shard; `digests`: the sha256 of each whole input file it read, by file number;
    and `tokenised`: whether this call did the work). `files` holds the unit's inputs by number."""
    _, record_path, error_path = shard_paths(Path(work), unit)
    if record_path.exists():
        return json.loads(record_path.read_text()) | {"tokenised": False}
    try:
        record = _tokenise(unit, files, settings, Path(work))
    except UpcyclerError as err:
        return _failed(error_path, str(err))
    except OSError as err:  # the inputs' read errors are UpcyclerErrors already: this is the shard's write
        return _failed(error_path, f"{shown_path(work)}: cannot write ({err.strerror}); "
                                   "free disk space or choose another --out")
    _write_atomically(record_path, json.dumps(record).encode())
    return record | {"tokenised": True}


def _tokenise(unit: Unit, files: Mapping[int, InputFile], settings: Settings, work: Path) -> dict:
    tokenizer = _tokenizer(settings)
    dtype = token_dtype(settings.vocab_size)
    fraction = settings.heldout_fraction
    with ExitStack() as stack:
        kept = stack.enter_context(_Shard(work, unit.source, unit.index, dtype))
        held = stack.enter_context(_Shard(work, heldout_name(unit.source), unit.index, dtype)) if fraction else None
        for piece in unit.pieces:
            file = files[piece.file]
            path = Path(file.path)
            byte_range = None if piece.start is None else (piece.start, piece.stop)
            docs = read_documents(path, file.fmt, text_field=settings.text_field,
                                  text_unit=settings.text_unit, byte_range=byte_range)
            for ids, ends in _token_batches(tokenizer, settings, path, docs):
                if held is None:
                    kept.add(ids, len(ends))
                    continue
                chosen = held_out(ids, ends, fraction)
                tokens = np.repeat(chosen, np.diff(ends, prepend=0))
                kept.add(ids[~tokens], int((~chosen).sum()))
                held.add(ids[tokens], int(chosen.sum()))
        record = kept.commit(keep_empty=True)
        if held is not None:
            record["heldout"] = held.commit(keep_empty=False)
    digests = {p.file: sha256_file(Path(files[p.file].path)) for p in unit.pieces if p.start is None}
    return record | {"digests": digests}


class _Shard:
    """One shard being written: a partial file outside the shards, its digest and counts, renamed into
    place (`commit`) only when whole. Leaving the `with` block closes the partial file."""

    def __init__(self, work: Path, source: str, index: int, dtype: np.dtype):
        self.file = shard_file(source, index)
        self.path = work / SHARDS / self.file
        self.partial = work / PARTIAL / f"{source}-{self.path.name}.{os.getpid()}"  # never among the shards
        self.dtype = dtype
        self.digest = hashlib.sha256()
        self.tokens = self.documents = 0

    def __enter__(self) -> Self:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(self.partial, "wb")  # closed by __exit__
        self.out.write(b"\0" * SHARD_HEADER_BYTES)
        return self

    def __exit__(self, *exc) -> None:
        self.out.close()

    def add(self, ids: np.ndarray, documents: int) -> None:
        data = ids.astype(self.dtype).tobytes()
        self.out.write(data)
        self.digest.update(data)
        self.tokens += ids.size
        self.documents += documents

    def commit(self, *, keep_empty: bool) -> dict:
        """Write the header and move the shard into place (an empty one is dropped unless `keep_empty`);
        returns its record (`file`, `tokens`, `documents`, `sha256`)."""
        self.out.seek(0)
        self.out.write(shard_header(self.dtype, self.tokens, self.documents, self.digest.hexdigest()))
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        if self.tokens or keep_empty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.partial, self.path)
        else:
            self.partial.unlink()
        return {"file": self.file, "tokens": self.tokens, "documents": self.documents,
                "sha256": self.digest.hexdigest()}


def _tokenizer(settings: Settings):
    """The tokenizer of `settings`, loaded once per process and checked to be the one planned with."""
    loaded = _tokenizers.get(settings.tokenizer_sha256)
    if loaded is None:
        from upcycler.train.data.tokenizer import load_tokenizer

        info = load_tokenizer(Path(settings.tokenizer_path), settings.eos)
        if info.sha256 != settings.tokenizer_sha256:
            raise UpcyclerError(f"{shown_path(info.path)}: changed while preparing; run prepare-data again")
        loaded = _tokenizers[settings.tokenizer_sha256] = info.tokenizer
    return loaded


def _token_batches(tokenizer, settings: Settings, path: Path,
                   docs: Iterable[str | np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Token ids of `docs`, each document followed by EOS, in bounded batches: (ids, the end offset of each
    document in them)."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        if isinstance(doc, str):
            batch.append(doc)
            chars += len(doc)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                yield _encode(tokenizer, settings.eos_id, batch)
                batch, chars = [], 0
            continue
        if batch:
            yield _encode(tokenizer, settings.eos_id, batch)
            batch, chars = [], 0
        ids = _adopt(doc, settings, path)
        yield ids, np.array([ids.size], dtype=np.int64)
    if batch:
        yield _encode(tokenizer, settings.eos_id, batch)


def _encode(tokenizer, eos_id: int, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The ids of the non-empty encodings of `docs`, each followed by EOS, and each one's end offset."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    flat: list[int] = []
    ends: list[int] = []
    for encoding in encode(docs, add_special_tokens=False):
        if encoding.ids:
            flat.extend(encoding.ids)
            flat.append(eos_id)
            ends.append(len(flat))
    return np.asarray(flat, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def _adopt(ids: np.ndarray, settings: Settings, path: Path) -> np.ndarray:
    """A pre-tokenised document's ids, checked against the vocabulary, with EOS appended unless present."""
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= settings.vocab_size:
        bad = low if low < 0 else high
        raise UpcyclerError(
            f"{shown_path(path)}: token id {bad} is outside the tokenizer's vocabulary of "
            f"{settings.vocab_size}; pass the --tokenizer these ids were made with"
        )
    if ids[-1] == settings.eos_id:
        return ids.astype(np.int64, copy=False)
    return np.append(ids.astype(np.int64, copy=False), settings.eos_id)


def digest_file(source: str, number: int, file: InputFile, work: str) -> dict:
    """The sha256 of one input file split over several units, recorded in the work directory (once: a
    resumed run reuses it)."""
    record_path = Path(work) / "digests" / source / f"{number:05d}.json"
    if record_path.exists():
        return json.loads(record_path.read_text())
    try:
        digest = sha256_file(Path(file.path))
    except OSError as err:
        return _failed(record_path.with_suffix(ERROR_SUFFIX),
                       f"{shown_path(file.path)}: cannot read ({err.strerror}); check the --source path")
    record = {"path": file.path, "bytes": file.size, "sha256": digest}
    _write_atomically(record_path, json.dumps(record).encode())
    return record


def _failed(error_path: Path, message: str) -> dict:
    """Record a unit's one-line failure for `prepare` to report."""
    error_path.parent.mkdir(parents=True, exist_ok=True)
    error_path.write_text(message)
    return {"error": message}


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)
