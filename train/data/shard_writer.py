"""One unit of `prepare-data`'s work: read a unit's documents, tokenise them and commit its shard.

`write_shard` is what the engine runs on a worker, once per unit. It is idempotent: a shard whose record
is already in the work directory is not tokenised again (that is how an interrupted preparation resumes).
A unit of several steps (`plan.unit_steps`) checkpoints each: a step's ids are written to a file of its
own with its record, and the shard is put together from the steps when all are there, so a worker killed
part-way through a unit loses at most the step under way, and the rerun goes on from the next. Every file
appears by rename from the unit's partial directory, its record after it, so a worker killed at any
instant leaves either a whole file with its record or nothing that counts. A bad input does not raise
through the engine (whose errors arrive wrapped in its own tracebacks): the unit writes the one-line
message beside the shard (`ERROR_SUFFIX`) and stops, and `prepare` reports it.

What this module preserves: the tokens of a unit are exactly each document's `tokenizers` encoding
(without special tokens) followed by the EOS id, whatever its steps; a pre-tokenised document (Megatron,
ArrayRecord of ids, an integer column) is taken as it is, with EOS appended unless it already ends with
EOS. With a held-out split (`Settings.heldout_fraction`), each document goes whole, in input order, either
to the unit's shard or to its shard of `NAME.heldout` (`format.held_out` decides, from the document's
tokens alone); a held-out shard that receives no document is not kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Self

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.hashing import sha256_file
from upcycler.train.data.format import (
    SHARD_HEADER_BYTES,
    BlockChecksums,
    held_out,
    heldout_name,
    shard_file,
    shard_header,
    token_dtype,
)
from upcycler.train.data.plan import InputFile, Piece, Settings, Unit, unit_steps
from upcycler.train.data.readers import read_documents
from upcycler.untrusted import shown_path

SHARDS = "shards"  # the work directory's subdirectory laid out as the output will be
PARTIAL = "partial"  # files being written, by unit (a killed worker's are removed when the work resumes)
STEPS = "steps"  # the finished steps of units under way, by unit (removed once the unit's shard is whole)
RECORDS = "records"  # each finished unit's record (its shard's counts and sha256, its inputs' digests)
DIGESTS = "digests"  # the sha256 of each input file split over several units
RECORD_SUFFIX = ".json"
ERROR_SUFFIX = ".error"
_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20
_COPY_BYTES = 4 << 20  # a step's ids are copied into the shard this many bytes at a time
_tokenizers: dict[str, object] = {}  # one loaded tokenizer per worker process


def shard_paths(work: Path, unit: Unit) -> tuple[Path, Path, Path]:
    """The unit's shard (under `work/SHARDS`, laid out as in OUT), its record and its error file."""
    shard = work / SHARDS / shard_file(unit.source, unit.index)
    record = work / RECORDS / unit.source / f"{unit.index:05d}{RECORD_SUFFIX}"
    return shard, record, record.with_suffix(ERROR_SUFFIX)


def partial_dir(work: Path, unit: Unit) -> Path:
    """Where the unit's files are written before they are whole: anything here is a kill's leftover."""
    return work / PARTIAL / unit.source / f"{unit.index:05d}"


def steps_dir(work: Path, unit: Unit) -> Path:
    """Where the finished steps of a unit under way are kept."""
    return work / STEPS / unit.source / f"{unit.index:05d}"


def digest_path(work: Path, source: str, number: int) -> Path:
    """The record of the sha256 of input file `number` of `source` (one split over several units)."""
    return work / DIGESTS / source / f"{number:05d}{RECORD_SUFFIX}"


def read_record(work: Path, unit: Unit) -> dict | None:
    """The record of the unit's finished shard, or None if it is not finished."""
    record = shard_paths(work, unit)[1]
    return json.loads(record.read_text()) if record.exists() else None


def shard_intact(work: Path, record: Mapping, dtype: np.dtype) -> bool:
    """Whether the shards a unit's `record` describes (its held-out one too, where kept) are in `work/SHARDS`
    whole: the header the record implies, and as many bytes as its tokens."""
    sides = [record] + ([record["heldout"]] if record.get("heldout", {}).get("tokens") else [])
    return all(_holds(work / SHARDS / side["file"], side, dtype) for side in sides)


def _holds(path: Path, side: Mapping, dtype: np.dtype) -> bool:
    """Whether the shard at `path` starts with the header its record `side` implies and has its size."""
    header = shard_header(dtype, side["tokens"], side["documents"], side["sha256"])
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return size == SHARD_HEADER_BYTES + side["tokens"] * dtype.itemsize and f.read(len(header)) == header
    except OSError:
        return False


def finished_step(work: Path, unit: Unit, number: int, pieces: Sequence[Piece], settings: Settings) -> dict | None:
    """The record of step `number` of `unit` if it is finished for exactly `pieces` (its id files whole),
    else None: `kept` (and with a held-out split `held`) {`tokens`, `documents`, `sha256`}, and `digests`."""
    itemsize = token_dtype(settings.vocab_size).itemsize
    record_path, files = _step_paths(work, unit, number)
    try:
        record = json.loads(record_path.read_text())
        sides = {"kept": record["kept"]} | ({"held": record["held"]} if settings.heldout_fraction else {})
        whole = all(files[side].stat().st_size == counts["tokens"] * itemsize for side, counts in sides.items())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if whole and record.get("pieces") == _described(pieces) else None


def write_shard(unit: Unit, files: Mapping[int, InputFile], settings: Settings, work: str) -> dict:
    """Tokenise `unit` into its shard in `work` unless it is there already; returns its record
    (`file`, `tokens`, `documents`, `sha256`; with a held-out split, `heldout`: the same four of the
    unit's `NAME.heldout` shard; `digests`: the sha256 of each whole input file it read, by file number;
    and `tokenised`: whether this call did the work). `files` holds the unit's inputs by number."""
    _, record_path, error_path = shard_paths(Path(work), unit)
    if record_path.exists():
        return json.loads(record_path.read_text()) | {"tokenised": False}
    try:
        record = _write_unit(unit, files, settings, Path(work))
    except UpcyclerError as err:
        return _failed(error_path, str(err))
    except OSError as err:  # the inputs' read errors are UpcyclerErrors already: this is the shard's write
        return _failed(error_path, f"{shown_path(work)}: cannot write ({err.strerror}); "
                                   "free disk space or choose another --out")
    _write_atomically(record_path, json.dumps(record).encode())
    shutil.rmtree(steps_dir(Path(work), unit), ignore_errors=True)  # the shard holds them now
    with suppress(OSError):
        partial_dir(Path(work), unit).rmdir()
    return record | {"tokenised": True}


def _write_unit(unit: Unit, files: Mapping[int, InputFile], settings: Settings, work: Path) -> dict:
    """The unit's shard(s), written and moved into place; returns their record. A unit of one step is
    tokenised straight into its shard; one of several goes step by step, each kept, then joined."""
    steps = unit_steps(unit, files, settings.step_bytes)
    if len(steps) == 1:
        with _shard_files(work, unit, settings) as (kept, held):
            digests = _tokenise(steps[0], files, settings, kept, held)
            return _commit_shards(kept, held) | {"digests": digests}
    records = [_step(work, unit, number, pieces, files, settings) for number, pieces in enumerate(steps)]
    with _shard_files(work, unit, settings) as (kept, held):
        for number, record in enumerate(records):
            step_files = _step_paths(work, unit, number)[1]
            kept.add_file(step_files["kept"], record["kept"])
            if held is not None:
                held.add_file(step_files["held"], record["held"])
        digests = {int(k): v for record in records for k, v in record["digests"].items()}
        return _commit_shards(kept, held) | {"digests": digests}


def _step(work: Path, unit: Unit, number: int, pieces: Sequence[Piece], files: Mapping[int, InputFile],
          settings: Settings) -> dict:
    """Step `number` of `unit` (its `pieces`), tokenised into id files of its own unless it is finished
    already; returns its record (see `finished_step`)."""
    done = finished_step(work, unit, number, pieces, settings)
    if done is not None:
        return done
    record_path, paths = _step_paths(work, unit, number)
    dtype = token_dtype(settings.vocab_size)
    sides = ("kept", "held") if settings.heldout_fraction else ("kept",)
    with ExitStack() as stack:
        sinks = {side: stack.enter_context(_TokenFile(paths[side], partial_dir(work, unit) / paths[side].name,
                                                      dtype, header=False)) for side in sides}
        digests = _tokenise(pieces, files, settings, sinks["kept"], sinks.get("held"))
        record = {side: sink.commit(keep_empty=True) for side, sink in sinks.items()}
    record |= {"pieces": _described(pieces), "digests": digests}
    _write_atomically(record_path, json.dumps(record).encode())
    return record


def _step_paths(work: Path, unit: Unit, number: int) -> tuple[Path, dict[str, Path]]:
    """Step `number` of `unit`: its record and its id files (`kept`, `held`)."""
    folder, stem = steps_dir(work, unit), f"{number:05d}"
    return folder / f"{stem}{RECORD_SUFFIX}", {"kept": folder / f"{stem}.tokens",
                                              "held": folder / f"{stem}.heldout.tokens"}


def _described(pieces: Sequence[Piece]) -> list[list]:
    """`pieces` as a step's record holds them (what identifies the step)."""
    return [[p.file, p.start, p.stop] for p in pieces]


@contextmanager
def _shard_files(work: Path, unit: Unit, settings: Settings) -> Iterator[tuple[_TokenFile, _TokenFile | None]]:
    """The unit's shard being written, and its held-out shard with a held-out split (else None)."""
    dtype = token_dtype(settings.vocab_size)
    names = [unit.source] + ([heldout_name(unit.source)] if settings.heldout_fraction else [])
    with ExitStack() as stack:
        sinks = [stack.enter_context(_TokenFile(work / SHARDS / shard_file(name, unit.index),
                                                partial_dir(work, unit) / f"{name}.tokens", dtype, header=True,
                                                file=shard_file(name, unit.index))) for name in names]
        yield sinks[0], (sinks[1] if len(sinks) > 1 else None)


def _commit_shards(kept: _TokenFile, held: _TokenFile | None) -> dict:
    """Move the unit's shard into place (and its held-out one, unless empty); returns their record."""
    record = kept.commit(keep_empty=True)
    if held is not None:
        record["heldout"] = held.commit(keep_empty=False)
    return record


def _tokenise(pieces: Sequence[Piece], files: Mapping[int, InputFile], settings: Settings, kept: _TokenFile,
              held: _TokenFile | None) -> dict[int, str]:
    """Tokenise the documents of `pieces` into `kept` (with a held-out split, each document into `kept` or
    `held`, as `format.held_out` picks); returns the sha256 of each whole input file read, by number."""
    tokenizer = _tokenizer(settings)
    fraction = settings.heldout_fraction
    for piece in pieces:
        file = files[piece.file]
        path = Path(file.path)
        byte_range = None if piece.start is None else (piece.start, piece.stop)
        docs = read_documents(path, file.fmt, text_field=settings.text_field, text_unit=settings.text_unit,
                              byte_range=byte_range, max_expansion=settings.max_expansion)
        for ids, ends in _token_batches(tokenizer, settings, path, docs):
            if held is None:
                kept.add(ids, len(ends))
                continue
            chosen = held_out(ids, ends, fraction)
            tokens = np.repeat(chosen, np.diff(ends, prepend=0))
            kept.add(ids[~tokens], int((~chosen).sum()))
            held.add(ids[tokens], int(chosen.sum()))
    return {p.file: sha256_file(Path(files[p.file].path)) for p in pieces if p.start is None}


class _TokenFile:
    """Token ids being written: a partial file, their digest and counts, renamed to `path` (`commit`) only
    when whole, and the partial is named for this process (two workers never share one). With `header`, a
    shard (ids behind a shard header; `file` is its name in the output); without, a step's bare ids.
    Leaving the `with` block closes the partial file."""

    def __init__(self, path: Path, partial: Path, dtype: np.dtype, *, header: bool, file: str | None = None):
        self.path, self.file, self.dtype, self.header = path, file, dtype, header
        self.partial = partial.with_name(f"{partial.name}.{os.getpid()}")
        self.digest = hashlib.sha256()
        self.blocks = BlockChecksums() if header else None
        self.tokens = self.documents = 0

    def __enter__(self) -> Self:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(self.partial, "wb")  # closed by __exit__
        if self.header:
            self.out.write(b"\0" * SHARD_HEADER_BYTES)
        return self

    def __exit__(self, *exc) -> None:
        self.out.close()

    def add(self, ids: np.ndarray, documents: int) -> None:
        """Append `ids` (`documents` whole documents)."""
        self._write(ids.astype(self.dtype).tobytes())
        self.tokens += ids.size
        self.documents += documents

    def add_file(self, path: Path, counts: Mapping) -> None:
        """Append a step's id file (its record's `counts`: `tokens`, `documents`), a bounded piece at a time."""
        with open(path, "rb") as f:
            while data := f.read(_COPY_BYTES):
                self._write(data)
        self.tokens += counts["tokens"]
        self.documents += counts["documents"]

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.digest.update(data)
        if self.blocks is not None:
            self.blocks.update(data)

    def commit(self, *, keep_empty: bool) -> dict:
        """Write the header (a shard's) and move the file into place (an empty one is dropped unless
        `keep_empty`); returns its record (`tokens`, `documents`, `sha256`, and a shard's `file` and
        `block_crc32c`)."""
        if self.header:
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
        record = {"tokens": self.tokens, "documents": self.documents, "sha256": self.digest.hexdigest()}
        if self.blocks is not None:
            record["block_crc32c"] = self.blocks.text()
        return ({"file": self.file} if self.file else {}) | record


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
    record_path = digest_path(Path(work), source, number)
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
