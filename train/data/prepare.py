"""Tokenise text sources once into sharded token files (the engine of `upcycle prepare-data`).

A prepared directory holds, per named source (the layout is `upcycler.train.data.format`), the shards
`NAME.shards/NNNNN.tokens` and the index `NAME.index.json`, written last. How it gets there:

1. Everything that can be checked before tokenising is checked first (formats, existing outputs, inputs
   that would be overwritten), so a bad argument fails in seconds, not after an hour of tokenising.
2. The work is planned (`plan.py`): each source's files cut into units, one shard each, by size alone.
3. The units run on Apache Beam (`engine.py`; the DirectRunner by default, `workers` processes) in a work
   directory named after the plan's key (`OUT/.prepare-KEY/`, or under the upcycler cache for a bucket
   OUT). A preparation that was killed or interrupted resumes where it stopped when run again with the
   same inputs and options (`resume.py`): a unit whose shard is whole is not sent to the engine again, one
   that was under way goes on from its last checkpoint, and the summary says why each unit it tokenises
   was not reused.
4. When every unit is done, the indexes go to the work directory's journal, then the shards are moved into
   OUT and each source's index after them, so a source is complete exactly when its index exists, and a
   failed run (a bad line, a full disk) changes nothing in OUT. A rerun of the same command after a kill
   while publishing finishes publishing (its journal says those outputs are its own); another command is
   refused them. A bad input removes the work directory, and so does an engine failure before any work
   was kept (a runner that cannot start); an interrupt keeps it for the rerun.

Replacing a source (`overwrite`) replaces all it wrote: a held-out split `NAME.heldout` written with an
earlier `--heldout` is removed when the new preparation of NAME writes none (`stale_splits`).

The output is the same bytes whatever the runner and the number of workers. An input file is never an
output: one that would be overwritten is refused.

With a held-out fraction (`--heldout`), every source NAME is also written as `NAME.heldout`, the documents
`format.held_out` picks (NAME keeps the rest); both indexes record `split` and `heldout_fraction`. A source
whose split would leave either side without a document is refused like a bad input (one line naming the
source and a fraction that would do), nothing written: an empty `NAME.heldout` could not be read, and a
source this small is better evaluated on a larger fraction or data of its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.io.object_store import is_bucket_url
from upcycler.io.remote_sources import mirror_glob
from upcycler.io.staging import make_parents
from upcycler.locations import local_path, recorded_location
from upcycler.train.data.config import SOURCE_NAME
from upcycler.train.data.decompression import declared_size
from upcycler.train.data.engine import DEFAULT_RUNNER, EngineFailure, check_engine, run_units
from upcycler.train.data.format import (
    BLOCK_BYTES,
    INDEX_SUFFIX,
    META_SUFFIX,
    SHARDED_FORMAT_VERSION,
    SHARDS_SUFFIX,
    TOKENS_SUFFIX,
    heldout_name,
    token_dtype,
)
from upcycler.train.data.plan import (
    UNIT_BYTES,
    Plan,
    Settings,
    check_heldout_fraction,
    make_plan,
    step_bytes_for,
)
from upcycler.train.data.readers import MAX_EXPANSION, detect_format, expand_pattern
from upcycler.train.data.resume import (
    LOCK,
    REUSED,
    discard,
    holds_progress,
    read_journal,
    redone_reasons,
    unit_states,
    write_journal,
)
from upcycler.train.data.shard_writer import (
    ERROR_SUFFIX,
    PARTIAL,
    SHARDS,
    digest_path,
    read_record,
    shard_paths,
)
from upcycler.train.data.tokenizer import TokenizerInfo
from upcycler.units import human_bytes
from upcycler.untrusted import describe, load_json_object, shown_path

WORK_PREFIX = ".prepare-"
BYTES_PER_TOKEN = 3  # of text, for the estimate of the disk a preparation needs (real text: about 3 to 5)


class _Busy(UpcyclerError):
    """Another preparation holds the work directory: it is theirs, left as it is."""


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
        seen = set(known)
        for file in files:
            if file not in seen:
                known.append(file)
                seen.add(file)
    return sources


def output_names(name: str) -> tuple[str, ...]:
    """What preparing source `name` writes in OUT, and the single-file format's names it replaces."""
    return f"{name}{INDEX_SUFFIX}", f"{name}{SHARDS_SUFFIX}", f"{name}{META_SUFFIX}", f"{name}{TOKENS_SUFFIX}"


def written_sources(sources: Iterable[str], heldout_fraction: float) -> list[str]:
    """The sources a preparation writes: each of `sources`, followed by its `NAME.heldout` when there is
    a held-out split. A source that is also another's held-out split is refused."""
    if not heldout_fraction:
        return list(sources)
    names = list(sources)
    for name in names:
        if heldout_name(name) in names:
            raise UpcyclerError(
                f"--source {heldout_name(name)}: --heldout writes the held-out split of --source {name} under "
                "that name; rename this source"
            )
    return [n for name in names for n in (name, heldout_name(name))]


def stale_splits(sources: Iterable[str], heldout_fraction: float, split_of: Callable[[str], object]) -> list[str]:
    """The held-out splits `NAME.heldout` that an earlier `--heldout` preparation of the `sources` wrote and
    that this one (without a split, nor a source of that name) would leave behind: `split_of(name)` is the
    `split` its index records (None where there is no such index, or it is a source prepared in its own
    right)."""
    names = list(sources)
    if heldout_fraction:
        return []
    return [heldout_name(n) for n in names if heldout_name(n) not in names and split_of(heldout_name(n)) == "heldout"]


def prepare_sources(
    tokenizer: TokenizerInfo,
    sources: Mapping[str, Sequence[Path]],
    out_dir: Path,
    *,
    fmt: str | None = None,
    text_field: str = "text",
    text_unit: str = "file",
    overwrite: bool = False,
    runner: str = DEFAULT_RUNNER,
    workers: int = 1,
    beam_options: Sequence[str] = (),
    unit_bytes: int = UNIT_BYTES,
    eos: str | None = None,
    heldout_fraction: float = 0.0,
    max_expansion: float = MAX_EXPANSION,
    announce: Callable[[str], None] | None = None,
) -> list[dict]:
    """Tokenise every source into `out_dir` (local; see `prepare_into_bucket` for a bucket); returns each
    written source's index, in order (with a held-out split, NAME's then NAME.heldout's), with
    `shards_tokenised` / `shards_reused` / `shards_redone` (why units were tokenised on a resume) added (not
    written). `announce` is told the disk the output needs before any is written."""
    heldout_fraction = check_heldout_fraction(heldout_fraction)
    written = written_sources(sources, heldout_fraction)
    stale = stale_splits(sources, heldout_fraction, lambda name: _local_split(out_dir, name))
    _refuse_inputs_as_outputs(out_dir, sources, [*written, *stale])
    plan = _plan(tokenizer, sources, fmt, text_field, text_unit, unit_bytes, eos, heldout_fraction, max_expansion)
    work = out_dir / f"{WORK_PREFIX}{plan.key}"
    journal = read_journal(work, plan, written)  # the same command, killed while publishing: its outputs
    if journal is None and not overwrite:
        existing = [out_dir / n for name in [*written, *stale] for n in output_names(name)
                    if os.path.lexists(out_dir / n)]
        if existing:
            raise UpcyclerError(f"{shown_path(existing[0])}: already exists; choose another --out or pass --overwrite")
    check_engine(runner, workers, beam_options)
    created = make_parents(out_dir, "--out")
    if journal is None and announce is not None:
        announce(disk_note(plan, out_dir))
    try:
        with _working_in(work) as resumed:
            indexes = _published_again(journal) if journal is not None else build_shards(
                plan, work, runner=runner, workers=workers, beam_options=beam_options, resumed=resumed)
            _publish_local(work, out_dir, indexes, stale)
            discard(work)
    except _Busy:
        raise
    except EngineFailure:  # the runner's own failure: work that can be resumed is kept for the rerun
        if not holds_progress(work):
            _remove_work(work, created)
        raise
    except UpcyclerError:  # a bad input: nothing of this preparation can be used again
        _remove_work(work, created)
        raise
    return indexes


def prepare_into_bucket(tokenizer: TokenizerInfo, sources: Mapping[str, Sequence[Path]], out: str, *,
                        overwrite: bool = False, announce: Callable[[str], None] | None = None,
                        **options) -> list[dict]:
    """`prepare_sources` into the bucket directory `out`: the work happens in this host's upcycler cache
    (where a rerun resumes it), then the shards are uploaded and each source's index after them. With
    `overwrite`, the sources' earlier indexes are removed before any upload and their stale shards after.
    A rerun of the same command after a kill while uploading uploads again (its journal says the objects
    of those names are its own)."""
    import hashlib

    from upcycler.io import bucket_output
    from upcycler.io import object_store as store
    from upcycler.io.remote_sources import cache_root

    heldout_fraction = check_heldout_fraction(options.pop("heldout_fraction", 0.0))
    existing = store.list_objects(out)
    stale = stale_splits(sources, heldout_fraction, lambda name: _bucket_split(store, out, existing, name))
    names = [n for name in [*written_sources(sources, heldout_fraction), *stale] for n in output_names(name)]
    taken = sorted(o for o in existing if o.split("/")[0] in names)
    plan = _plan(tokenizer, sources, options.pop("fmt", None), options.pop("text_field", "text"),
                 options.pop("text_unit", "file"), options.pop("unit_bytes", UNIT_BYTES), options.pop("eos", None),
                 heldout_fraction, options.pop("max_expansion", MAX_EXPANSION))
    root = cache_root() / "prepare" / hashlib.sha256(out.encode()).hexdigest()[:16]
    work = root / f"{WORK_PREFIX}{plan.key}"
    journal = read_journal(work, plan, written_sources(sources, heldout_fraction))
    if taken and not overwrite and journal is None:
        raise UpcyclerError(f"{describe(store.join(out, taken[0]), 200)}: already exists; choose another --out or "
                            "pass --overwrite")
    engine = {"runner": options.get("runner", DEFAULT_RUNNER), "workers": options.get("workers", 1),
              "beam_options": options.get("beam_options", ())}
    check_engine(**engine)
    if journal is None and announce is not None:
        announce(disk_note(plan, root))
    try:
        with _working_in(work) as resumed:
            indexes = (_published_again(journal) if journal is not None
                       else build_shards(plan, work, **engine, resumed=resumed))
            commits = [o for o in taken if o.endswith((INDEX_SUFFIX, META_SUFFIX))]
            store.remove([store.join(out, o) for o in commits])  # from here no replaced source looks complete
            uploaded = bucket_output.add_files(work / SHARDS, out, is_marker=lambda n: n.endswith(INDEX_SUFFIX))
            store.remove([store.join(out, o) for o in taken if o not in uploaded and o not in commits])
            discard(work)
    except _Busy:
        raise
    except EngineFailure:
        if not holds_progress(work):
            _remove_work(work, [])
        raise
    except UpcyclerError:
        _remove_work(work, [])
        raise
    return indexes


def _local_split(out_dir: Path, name: str) -> object:
    """The `split` the index of source `name` in `out_dir` records (None without one, or unreadable)."""
    path = out_dir / f"{name}{INDEX_SUFFIX}"
    try:
        return load_json_object(path).get("split") if path.is_file() else None
    except UpcyclerError:
        return None


def _bucket_split(store, out: str, existing: Mapping, name: str) -> object:
    """`_local_split` of the bucket directory `out`, whose objects are `existing`."""
    if f"{name}{INDEX_SUFFIX}" not in existing:
        return None
    try:
        index = json.loads(store.read_bytes(store.join(out, f"{name}{INDEX_SUFFIX}")))
    except (UpcyclerError, ValueError):
        return None
    return index.get("split") if isinstance(index, dict) else None


def _published_again(journal: Sequence[dict]) -> list[dict]:
    """The indexes an interrupted run of the same plan was publishing, as this run reports them: every
    shard reused."""
    return [index | {"shards_tokenised": 0, "shards_reused": index["shards_tokenised"] + index["shards_reused"],
                     "shards_redone": []} for index in journal]


def _remove_work(work: Path, created: Sequence[Path]) -> None:
    """Remove the work directory, and the directories created for the output (innermost first) if empty."""
    shutil.rmtree(work, ignore_errors=True)
    for directory in reversed(created):
        with suppress(OSError):
            directory.rmdir()


def disk_note(plan: Plan, where: Path) -> str:
    """One line on the disk the preparation needs (an estimate from the inputs' sizes, decompressed where a
    file declares its size) and what is free at `where`."""
    sizes = [(f, declared_size(Path(f.path)) if f.fmt in ("text", "jsonl") else f.size)
             for files in plan.files.values() for f in files]
    text = sum(size for _, size in sizes if size is not None)
    unknown = sum(size is None for _, size in sizes)
    itemsize = token_dtype(plan.settings.vocab_size).itemsize
    need = text * itemsize // BYTES_PER_TOKEN
    inputs = sum(f.size for f, _ in sizes)
    undeclared = f", {unknown} compressed file(s) of undeclared size not counted" if unknown else ""
    return (f"prepare-data: {len(sizes)} input file(s), {human_bytes(inputs)} ({human_bytes(text)} of text"
            f"{undeclared}) in {len(plan.units)} shard(s); the output needs about {human_bytes(need)} of disk, "
            f"{human_bytes(_free_bytes(where))} free at {shown_path(where)}")


def _free_bytes(where: Path) -> int:
    """The free bytes of the filesystem holding `where` (or its nearest existing parent)."""
    for directory in (where, *where.parents):
        with suppress(OSError):
            return shutil.disk_usage(directory).free
    return 0


def _plan(tokenizer: TokenizerInfo, sources: Mapping[str, Sequence[Path]], fmt: str | None, text_field: str,
          text_unit: str, unit_bytes: int, eos: str | None, heldout_fraction: float,
          max_expansion: float = MAX_EXPANSION) -> Plan:
    formats = {name: [(f, fmt or detect_format(f)) for f in files] for name, files in sources.items()}
    settings = Settings(str(tokenizer.path), tokenizer.sha256, eos, tokenizer.eos_id, tokenizer.vocab_size,
                        text_field, text_unit, heldout_fraction, max_expansion, step_bytes_for(unit_bytes))
    return make_plan(settings, formats, unit_bytes)


def _refuse_inputs_as_outputs(out_dir: Path, sources: Mapping[str, Sequence[Path]], names: Iterable[str]) -> None:
    """An input that is (after resolving symlinks) one of the outputs of sources `names` is refused."""
    written = {os.path.realpath(out_dir / n): out_dir / n for name in names for n in output_names(name)}
    for path in (f for files in sources.values() for f in files):
        real = os.path.realpath(path)
        hit = next((shown for target, shown in written.items()
                    if real == target or real.startswith(target + os.sep)), None)
        if hit is not None:
            raise UpcyclerError(
                f"{shown_path(path)}: is an input and would be overwritten by {shown_path(hit)}; "
                "choose another --out"
            )


@contextmanager
def _working_in(work: Path) -> Iterator[bool]:
    """Create the work directory `work` (removing other plans' beside it) and hold its lock; yields whether
    an earlier run of the plan had made it (this run resumes that one)."""
    _remove_other_work(work)
    resumed = work.is_dir()
    work.mkdir(parents=True, exist_ok=True)
    with _locked(work):
        yield resumed


def build_shards(plan: Plan, work: Path, *, runner: str, workers: int, beam_options: Sequence[str],
                 resumed: bool = False) -> list[dict]:
    """Run the plan's units that `work` does not hold finished (the caller holds its lock), write each
    source's index into `work/SHARDS` and then the journal; returns the indexes, which say why units were
    tokenised when this run `resumed` an earlier one. Raises the first unit's error, in plan order."""
    states = unit_states(plan, work)
    for stale in work.rglob(f"*{ERROR_SUFFIX}"):
        stale.unlink()
    shutil.rmtree(work / PARTIAL, ignore_errors=True)
    pending = [unit for unit in plan.units if states[unit].reason != REUSED]
    if pending or _missing_digests(plan, work):
        run_units(plan, str(work), units=pending, runner=runner, workers=workers, beam_options=beam_options)
    indexes = [index for name in plan.files for index in _indexes(plan, name, work, states, resumed)]
    for index in indexes:
        _write_json(work / SHARDS / f"{index['name']}{INDEX_SUFFIX}", _stored(index))
    write_journal(work, plan, indexes)
    return indexes


def _missing_digests(plan: Plan, work: Path) -> bool:
    """Whether the digest of an input split over several units is not recorded in `work` yet."""
    return any(not digest_path(work, unit.source, piece.file).exists()
               for unit in plan.units for piece in unit.pieces if piece.start is not None)


def _remove_other_work(work: Path) -> None:
    """Work directories of other plans beside `work` (inputs or options changed since) cannot resume: they
    are removed, unless another preparation holds one (other sources prepared into the same OUT at once)."""
    with suppress(OSError):
        for entry in os.scandir(work.parent):
            if entry.name.startswith(WORK_PREFIX) and entry.path != str(work) and entry.is_dir(follow_symlinks=False):
                with suppress(UpcyclerError), _locked(Path(entry.path)):
                    shutil.rmtree(entry.path, ignore_errors=True)


@contextmanager
def _locked(work: Path):
    """Hold the work directory's lock: a second preparation of the same plan is refused, not interleaved."""
    with open(work / LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise _Busy(
                f"{shown_path(work)}: another prepare-data is preparing the same sources; wait for it"
            ) from None
        yield


def _indexes(plan: Plan, name: str, work: Path, states: Mapping, resumed: bool) -> list[dict]:
    """Source `name`'s index and, with a held-out split, `NAME.heldout`'s after it, from the units' records
    and the files' digests (errors raised in order). On a resumed run, each says why its units that were
    not reused were tokenised."""
    records = _records(plan, name, work)
    files = _files(plan, name, work, records)
    unit_states_of = [states[unit] for unit in plan.units_of(name)]
    tokenised = sum(state.reason != REUSED for state in unit_states_of)
    redone = redone_reasons(unit_states_of) if resumed else []
    fraction = plan.settings.heldout_fraction
    sides = {name: records} if not fraction else {name: records, heldout_name(name): [r["heldout"] for r in records]}
    _check_sides(plan, name, sides)
    formats = {f.fmt for f in plan.files[name]}
    indexes = []
    for source, shards in sides.items():
        index = _index(plan.settings, source, [s for s in shards if s["tokens"]], formats, files)
        if fraction:
            index |= {"split": "train" if source == name else "heldout", "heldout_fraction": fraction}
        indexes.append(index | {"shards_tokenised": tokenised, "shards_reused": len(records) - tokenised,
                                "shards_redone": redone})
    return indexes


def _records(plan: Plan, name: str, work: Path) -> list[dict]:
    """The records of source `name`'s units, in order; a unit's recorded error is raised."""
    records = []
    for unit in plan.units_of(name):
        error_path = shard_paths(work, unit)[2]
        if error_path.exists():
            raise UpcyclerError(error_path.read_text())
        record = read_record(work, unit)
        if record is None:
            raise UpcyclerError(f"prepare-data: the engine did not finish shard {unit.index} of {name!r}; rerun")
        records.append(record)
    return records


def _files(plan: Plan, name: str, work: Path, records: Sequence[dict]) -> list[dict]:
    """The index's `files` of source `name`: each input's recorded path, size and sha256."""
    digests = {int(k): v for record in records for k, v in record["digests"].items()}
    files = []
    for number, file in enumerate(plan.files[name]):
        if number not in digests:  # a file split over several units: hashed on its own
            digest = digest_path(work, name, number)
            if digest.with_suffix(ERROR_SUFFIX).exists():
                raise UpcyclerError(digest.with_suffix(ERROR_SUFFIX).read_text())
            digests[number] = json.loads(digest.read_text())["sha256"]
        files.append({"path": recorded_location(Path(file.path)), "bytes": file.size, "sha256": digests[number]})
    return files


def _check_sides(plan: Plan, name: str, sides: Mapping[str, Sequence[dict]]) -> None:
    """Refuse a source without text, and a held-out split that leaves either side without a document."""
    where = shown_path(plan.files[name][0].path)
    tokens = {source: sum(r["tokens"] for r in records) for source, records in sides.items()}
    if not sum(tokens.values()):
        raise UpcyclerError(f"{where}: source {name!r} has no text; check --format and --text-field")
    fraction = plan.settings.heldout_fraction
    documents = sum(r["documents"] for records in sides.values() for r in records)
    if not tokens[name]:
        raise UpcyclerError(f"{where}: all {documents:,} documents of source {name!r} fall in its --heldout "
                            f"{fraction:g} split, none is left to train on; pass a smaller --heldout")
    if fraction and not tokens[heldout_name(name)]:
        raise UpcyclerError(
            f"{where}: none of the {documents:,} documents of source {name!r} falls in its --heldout {fraction:g} "
            f"split; pass a larger --heldout (about {min(0.5, 3 / documents):.2g} holds out a few of them)"
        )


def _index(settings: Settings, source: str, shards: Sequence[dict], formats: set[str], files: list[dict]) -> dict:
    """The index of `source` (a source, or a held-out split) made of `shards` (its non-empty ones), read
    from `files` in `formats`."""
    return {
        "format_version": SHARDED_FORMAT_VERSION,
        "name": source,
        "dtype": token_dtype(settings.vocab_size).name,
        "num_tokens": sum(s["tokens"] for s in shards),
        "num_documents": sum(s["documents"] for s in shards),
        "vocab_size": settings.vocab_size,
        "eos_id": settings.eos_id,
        "tokenizer": {"file": settings.tokenizer_path, "sha256": settings.tokenizer_sha256},
        "input": _input_settings(formats, settings.text_field, settings.text_unit),
        "files": files,
    } | _shard_list(shards)


def _shard_list(shards: Sequence[dict]) -> dict:
    """The index's `shards` (and `block_bytes`), with every shard's block checksums, or (when a shard was
    tokenised by a version that did not checksum blocks, and the work resumed) with none."""
    fields = ("file", "tokens", "documents", "sha256", "block_crc32c")
    if not all("block_crc32c" in s for s in shards):
        fields = fields[:-1]
    listed = {"shards": [{k: s[k] for k in fields} for s in shards]}
    return ({"block_bytes": BLOCK_BYTES} if "block_crc32c" in fields else {}) | listed


def _stored(index: dict) -> dict:
    """The index as written: without this run's counts of tokenised and reused shards."""
    return {k: v for k, v in index.items() if not k.startswith("shards_")}


def _input_settings(formats: set[str], text_field: str, text_unit: str) -> dict:
    """The reading options that shaped the documents, for the index."""
    settings: dict = {"formats": sorted(formats)}
    if formats - {"text"}:
        settings["text_field"] = text_field
    if "text" in formats:
        settings["text_unit"] = text_unit
    return settings


def _publish_local(work: Path, out_dir: Path, indexes: Sequence[dict], stale: Sequence[str]) -> None:
    """Move each source's shards into OUT, then its index. What they replace goes first (earlier indexes
    and single-file outputs of the same names, and the `stale` held-out splits), so no source looks complete
    with another preparation's shards. A rerun after a kill part-way (its journal) moves what is still in
    `work` and keeps what is already in OUT: a source whose shards left `work` has its own in OUT."""
    try:
        for name in stale:
            _remove_outputs(out_dir, name)
        for index in indexes:
            if os.path.lexists(work / SHARDS / output_names(index["name"])[1]):
                _remove_outputs(out_dir, index["name"])
        for position in (1, 0):  # every source's shards, then every index
            for index in indexes:
                name = output_names(index["name"])[position]
                if os.path.lexists(work / SHARDS / name):
                    os.replace(work / SHARDS / name, out_dir / name)
    except OSError as err:
        raise UpcyclerError(f"{shown_path(out_dir)}: cannot write ({err.strerror}); free space or choose "
                            "another --out") from None


def _remove_outputs(out_dir: Path, name: str) -> None:
    """Remove source `name` from `out_dir`: its index (and single-file outputs) first, then its shards."""
    index_name, shards_name, *single = output_names(name)
    for old in (index_name, *single):
        (out_dir / old).unlink(missing_ok=True)
    if os.path.lexists(out_dir / shards_name):
        shutil.rmtree(out_dir / shards_name)


def _write_json(path: Path, value: dict) -> None:
    try:
        path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise UpcyclerError(
            f"{path.name}: cannot write ({err.strerror}); free disk space or choose another --out"
        ) from None
