"""What `prepare-data` will do, decided before any token is made: its units of work and their identity.

A source's files (in sorted order) are cut into **units**, one shard each: consecutive small files are
grouped until they hold `unit_bytes` of input, and a large file that can be split by byte ranges (plain
JSONL, line-per-document text) is cut into ranges of about `unit_bytes`, each holding the lines that start
inside it (`readers.read_documents(byte_range=...)`). The units depend only on the files' sizes and
`unit_bytes`, never on the engine or its number of workers, so every runner writes the same shards.

A unit is written in **steps** (`unit_steps`): its byte ranges cut into sub-ranges of about
`Settings.step_bytes` (an eighth of a unit, between `MIN_STEP_BYTES` and `STEP_BYTES`: `step_bytes_for`),
the lines starting in each, and its whole files grouped to about as much. A step is a checkpoint, not an
output: the unit's shard is the same for any cut, and a worker killed part-way through a unit loses at most
the step under way.

The plan's `key` is a digest of everything that shapes the output (tokenizer, EOS, reading options,
held-out fraction, unit size, and each input's path, size and modification time): an interrupted
preparation resumes in the work directory of the same key, and a changed input or option starts afresh.
A fraction of 0 (no split) leaves the key as it was before splits existed; the step size and the
compression-bomb limit (`max_expansion`, which decides only whether an input is refused) never shape the
output, so they are not in the key either.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.train.data.readers import MAX_EXPANSION, splittable
from upcycler.untrusted import real

UNIT_BYTES = 64 * 1024**2  # input bytes per shard: a few seconds of tokenising, tens of MB of tokens
MAX_FILES_PER_UNIT = 4096  # so that 10,000 tiny files still make a few units, not one huge record
STEP_BYTES = 1024**2  # the most input bytes between a unit's checkpoints: the most work a kill costs a worker
MIN_STEP_BYTES = 64 * 1024  # the fewest (a checkpoint costs a few small files)


@dataclass(frozen=True)
class InputFile:
    """One input file of a source, as it was when the plan was made."""

    path: str
    fmt: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Piece:
    """All of input file `file` (`start`, `stop` None) or the lines starting in its bytes [start, stop)."""

    file: int
    start: int | None = None
    stop: int | None = None


@dataclass(frozen=True)
class Unit:
    """Shard `index` of `source`: the documents of `pieces`, in order."""

    source: str
    index: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Settings:
    """Everything besides the inputs that shapes the tokens: what a worker needs to tokenise a unit."""

    tokenizer_path: str
    tokenizer_sha256: str
    eos: str | None
    eos_id: int
    vocab_size: int
    text_field: str
    text_unit: str
    heldout_fraction: float = 0.0  # the share of documents written to NAME.heldout (`format.held_out`)
    max_expansion: float = MAX_EXPANSION  # a compressed input expanding more is refused (`decompression`)
    step_bytes: int = STEP_BYTES  # input bytes between a unit's checkpoints (`unit_steps`)


def check_heldout_fraction(value: object) -> float:
    """`value` as a held-out fraction: a finite number with 0 <= value < 1, else one error line."""
    fix = "pass a fraction such as 0.01 (0 for no held-out split)"
    fraction = real(value, "the held-out fraction", "--heldout", fix=fix)
    if not 0 <= fraction < 1:
        raise UpcyclerError(f"--heldout: the held-out fraction must be at least 0 and below 1, not {fraction:g}; {fix}")
    return fraction


@dataclass(frozen=True)
class Plan:
    """The units of every source, the sources' files, the settings, and the plan's identity."""

    settings: Settings
    files: Mapping[str, tuple[InputFile, ...]]
    units: tuple[Unit, ...]
    unit_bytes: int

    @property
    def key(self) -> str:
        """A digest of everything that shapes the output (names the resumable work directory)."""
        settings = asdict(self.settings) | {"tokenizer_path": None}
        del settings["max_expansion"], settings["step_bytes"]  # never shape the output
        if not settings["heldout_fraction"]:
            del settings["heldout_fraction"]  # the key of a preparation without a split is unchanged
        described = {
            "settings": settings,
            "unit_bytes": self.unit_bytes,
            "files": {name: [asdict(f) for f in files] for name, files in self.files.items()},
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]

    def units_of(self, source: str) -> list[Unit]:
        return [u for u in self.units if u.source == source]


def make_plan(settings: Settings, sources: Mapping[str, Sequence[tuple[Path, str]]],
              unit_bytes: int = UNIT_BYTES) -> Plan:
    """Cut every source's files into units (see the module docstring)."""
    files: dict[str, tuple[InputFile, ...]] = {}
    units: list[Unit] = []
    for name, inputs in sources.items():
        described = []
        for path, fmt in inputs:
            stat = os.stat(path)
            described.append(InputFile(str(path), fmt, stat.st_size, stat.st_mtime_ns))
        files[name] = tuple(described)
        units.extend(_units(name, described, settings.text_unit, unit_bytes))
    return Plan(settings, files, tuple(units), unit_bytes)


def _units(source: str, files: Sequence[InputFile], text_unit: str, unit_bytes: int) -> list[Unit]:
    units: list[Unit] = []
    group: list[Piece] = []
    held = 0

    def flush() -> None:
        nonlocal group, held
        if group:
            units.append(Unit(source, len(units), tuple(group)))
            group, held = [], 0

    for number, file in enumerate(files):
        if file.size > unit_bytes and splittable(Path(file.path), file.fmt, text_unit):
            flush()
            for start, stop in _cuts(0, file.size, unit_bytes):
                units.append(Unit(source, len(units), (Piece(number, start, stop),)))
            continue
        group.append(Piece(number))
        held += file.size
        if held >= unit_bytes or len(group) >= MAX_FILES_PER_UNIT:
            flush()
    flush()
    return units


def step_bytes_for(unit_bytes: int) -> int:
    """The step size of units of `unit_bytes`: about an eighth of one, within [MIN_STEP_BYTES, STEP_BYTES]."""
    return min(STEP_BYTES, max(MIN_STEP_BYTES, unit_bytes // 8))


def unit_steps(unit: Unit, files: Mapping[int, InputFile] | Sequence[InputFile],
               step_bytes: int) -> tuple[tuple[Piece, ...], ...]:
    """The steps of `unit` in order (see the module docstring): each byte range cut into sub-ranges of about
    `step_bytes` that tile it (so the steps read exactly the unit's lines), consecutive whole files grouped
    until they hold `step_bytes`. `files` holds at least the unit's inputs, by file number."""
    steps: list[tuple[Piece, ...]] = []
    group: list[Piece] = []
    held = 0
    for piece in unit.pieces:
        if piece.start is None:
            group.append(piece)
            held += files[piece.file].size
            if held >= step_bytes:
                steps.append(tuple(group))
                group, held = [], 0
            continue
        if group:
            steps.append(tuple(group))
            group, held = [], 0
        steps.extend((Piece(piece.file, a, b),) for a, b in _cuts(piece.start, piece.stop, step_bytes))
    if group:
        steps.append(tuple(group))
    return tuple(steps)


def piece_bytes(piece: Piece, files: Mapping[int, InputFile] | Sequence[InputFile]) -> int:
    """The input bytes `piece` covers."""
    return files[piece.file].size if piece.start is None else piece.stop - piece.start


def _cuts(start: int, stop: int, most: int) -> list[tuple[int, int]]:
    """[start, stop) cut into the fewest near-equal ranges of at most about `most` bytes."""
    count = max(1, -(-(stop - start) // most))
    bounds = [start + (stop - start) * k // count for k in range(count + 1)]
    return list(itertools.pairwise(bounds))
