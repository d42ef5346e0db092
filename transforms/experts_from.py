"""Experts from several dense models (Branch-Train-MiX): which model each expert and each shared tensor comes from.

`dense-to-moe BASE OUT --experts-from code=ckpt_code/ math=ckpt_math/ …` builds the MoE from N dense
models of BASE's architecture (typically fine-tunes of BASE on N domains). `open_sources` opens them
lazily (headers only, through `registry.read_input`, so the command knows every directory it reads),
refuses anything that is not interchangeable with BASE (the first differing architecture field, a tensor
of another dtype, another tokenizer) and decides, before a byte is read:

- which source each routed expert is cut from: virtual group g (the R experts that share one router row)
  takes source ⌊g·N/(E/R)⌋, which is expert e ← source ⌊e·N/E⌋ whenever the N sources divide the groups
  evenly; or the recipe's explicit `expert_sources` (one name per expert, whole groups alike);
- where the tensors outside the routed experts come from (`pick`): `base` (BASE's own), `mean` (the
  element-wise mean of the N sources, summed one source at a time in fp32 and cast once: `mean_of`), or one
  source by name. `--shared-params` chooses for attention, norms, embeddings and head; `--shared-ffn`
  for the shared experts and the dense first layers.
- whether the sources are BASE itself (`Sources.identical`): BASE's directory, or the same weight files
  by name, size and sha256 (manifest records, else the files hashed; the only bytes read at this stage),
  which makes the upcycle function-preserving and verified.

Memory stays that of one tensor per source read at a time: a mean reads its sources one after another
(`mean_of` over `read_ahead`), and an expert slice is cut from one source's dense tensor.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.manifest import read_manifest
from upcycler.locations import recorded_location
from upcycler.merge import field_value, first_difference
from upcycler.spec import LIMITS_ENV, ModelSpec, limits_on
from upcycler.summary import expert_runs
from upcycler.tensors import LazyTensor, TensorMap, dtype_name, read_ahead
from upcycler.transforms.registry import read_input
from upcycler.untrusted import describe, open_regular, shown_path

CHOICES = ("base", "mean")  # besides a source's name: where shared tensors come from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_SOURCES = 256  # --experts-from models opened (headers, manifest, tokenizer) before a byte is written


@dataclass(frozen=True)
class Sources:
    """The N dense models experts are cut from, and which one each routed expert takes."""

    names: tuple[str, ...]
    checkpoints: tuple[Checkpoint, ...]
    expert_source: tuple[int, ...]  # per routed expert: index into `names`
    identical: bool  # every source holds BASE's own weight files (same digests): the function is preserved

    def of_expert(self, e: int) -> TensorMap:
        return self.checkpoints[self.expert_source[e]].tensors

    def pick(self, choice: str, base: TensorMap, name: str) -> LazyTensor:
        """Tensor `name` from `choice`: BASE's, the mean of the sources (`mean_of`, cast once to BASE's
        dtype), or one source's."""
        if choice == "base":
            return base[name]
        if choice != "mean":
            return self.checkpoints[self.names.index(choice)].tensors[name]
        like = base[name]
        readers = [c.tensors[name].load for c in self.checkpoints]
        return LazyTensor(like.shape, like.dtype, lambda: mean_of(read_ahead(readers), len(readers), like.dtype))

    def lineage(self) -> dict[str, Any]:
        """What the lineage step records: every source with its own lineage, and each expert's source."""
        return {"sources": [{"name": n, "source": recorded_location(c.source), "lineage": list(c.lineage)}
                            for n, c in zip(self.names, self.checkpoints)],
                "expert_sources": [self.names[k] for k in self.expert_source]}


def mean_of(arrays: Iterator[np.ndarray], n: int, dtype: np.dtype) -> np.ndarray:
    """The element-wise mean of `n` arrays read one at a time, cast once to `dtype`: summed in fp32 (fp64 for
    fp32 inputs), which holds the sum of 16-bit values exactly unless their magnitudes span more than about
    2^14, then divided by n. So it is the fp64 mean cast once (up to a double rounding on an exact tie), and
    the mean of identical inputs is that input, bit for bit."""
    acc: np.ndarray | None = None
    for x in arrays:
        if acc is None:
            acc = np.array(x, dtype=np.float64 if x.dtype.itemsize >= 4 else np.float32)
        else:
            np.add(acc, x, out=acc, casting="unsafe")
        del x
    assert acc is not None
    acc /= n
    return acc.astype(dtype)


def open_sources(experts_from: Mapping[str, Path], spec: ModelSpec, base: TensorMap, *, groups: int, group: int,
                 assignment: Sequence[str] | None, choices: Mapping[str, str],
                 base_checkpoint: Checkpoint | None) -> Sources:
    """Open and check the sources of `--experts-from` against BASE (`spec`, `base`; `base_checkpoint` when
    the caller has it, for the tokenizer and the digests); `groups` virtual groups of `group` experts.

    `choices` maps each option (`--shared-params`, `--shared-ffn`) to its value, checked here."""
    names = tuple(experts_from)
    if not names:
        raise UpcyclerError("--experts-from needs at least one NAME=PATH")
    if len(names) > MAX_SOURCES and limits_on():
        raise UpcyclerError(f"--experts-from: {len(names):,} sources exceed the limit of {MAX_SOURCES}; pass "
                            f"fewer (or set {LIMITS_ENV}=off)")
    for name in names:
        if not _NAME.fullmatch(name) or name in CHOICES:
            raise UpcyclerError(f"--experts-from: source name {describe(name)} must be letters, digits, '_', '.' "
                                f"or '-' (at most 64) and not {' or '.join(CHOICES)}; rename it")
    for flag, value in choices.items():
        if value not in (*CHOICES, *names):
            raise UpcyclerError(f"{flag} is {describe(value)}; use {', '.join(CHOICES)} or a source name "
                                f"({', '.join(names)})")
    expert_source = _assign(names, groups, group, assignment)  # before opening any source
    checkpoints = tuple(read_input(Path(experts_from[n])) for n in names)
    for name, ckpt in zip(names, checkpoints):
        _check_compatible(name, ckpt, spec, base, base_checkpoint)
    base_digests: dict[str, str] = {}  # BASE's files hashed at most once, whatever the number of sources
    identical = base_checkpoint is not None and all(_same_weights(base_checkpoint, c, base_digests)
                                                    for c in checkpoints)
    return Sources(names, checkpoints, expert_source, identical)


def _check_compatible(name: str, ckpt: Checkpoint, spec: ModelSpec, base: TensorMap,
                      base_checkpoint: Checkpoint | None) -> None:
    """Refuse a source that is not interchangeable with BASE, naming the first difference."""
    where = f"--experts-from {name}={shown_path(ckpt.source) if ckpt.source else '?'}"
    field = first_difference(spec, ckpt.spec)
    if field is not None:
        a, b = field_value(spec, field), field_value(ckpt.spec, field)
        raise UpcyclerError(f"{where}: {field} is {b!r} but BASE has {a!r}; every source must have BASE's "
                            "architecture (experts are cut from its dense MLPs)")
    for tensor_name, like in base.items():
        other = ckpt.tensors.get(tensor_name)
        if other is None or other.dtype != like.dtype:
            found = "missing" if other is None else dtype_name(other.dtype)
            raise UpcyclerError(f"{where}: tensor {tensor_name} is {found}, BASE's is {dtype_name(like.dtype)}; "
                                "convert the source to BASE's dtype first (`upcycle convert --dtype`)")
    if base_checkpoint is not None:
        _check_tokenizer(where, ckpt, base_checkpoint)


def _check_tokenizer(where: str, ckpt: Checkpoint, base: Checkpoint) -> None:
    """The tokenizer files of a source must be BASE's, byte for byte (both may have none)."""
    mine = {p.name: p for p in base.side_files if p.name in TOKENIZER_FILES}
    theirs = {p.name: p for p in ckpt.side_files if p.name in TOKENIZER_FILES}
    for file in sorted(set(mine) | set(theirs)):
        if file not in theirs or file not in mine:
            has = "has no" if file not in theirs else "has a"
            raise UpcyclerError(f"{where}: {has} {file} {'but BASE has one' if file in mine else 'that BASE lacks'}; "
                                "every source must share BASE's tokenizer")
        if _digest(theirs[file]) != _digest(mine[file]):
            raise UpcyclerError(f"{where}: {file} differs from BASE's; every source must share BASE's tokenizer "
                                "(experts of another vocabulary see other token ids)")


def _digest(path: Path, what: str = "tokenizer file") -> str:
    """sha256 of a regular file, streamed (a file of any size in bounded memory; never a FIFO)."""
    with os.fdopen(open_regular(path, what), "rb") as f:
        try:
            return hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as err:
            raise UpcyclerError(f"{shown_path(path)}: cannot read ({err.strerror}); check the file") from None


def _same_weights(base: Checkpoint, other: Checkpoint, base_digests: dict[str, str]) -> bool:
    """True when `other` holds BASE's weights byte for byte: BASE's own directory, or the same safetensors
    files (names, sizes and sha256) under any other path. Then every expert is cut from BASE's own FFNs and
    the upcycle preserves the function. A file's digest is its manifest's record when the directory has an
    `upcycler.json`, else hashed here (only when the names and sizes already agree); BASE's are kept in
    `base_digests` for the next source."""
    if base.source is None or other.source is None:
        return False
    if Path(base.source).resolve() == Path(other.source).resolve():
        return True
    mine, theirs = _weight_sizes(Path(base.source)), _weight_sizes(Path(other.source))
    if not mine or mine != theirs:
        return False
    if not base_digests:
        base_digests.update(_weight_digests(Path(base.source), mine))
    return base_digests == _weight_digests(Path(other.source), theirs)


def _weight_sizes(root: Path) -> dict[str, int]:
    """The safetensors files of a checkpoint directory and their sizes."""
    return {p.name: p.stat().st_size for p in sorted(root.glob("*.safetensors")) if p.is_file()}


def _weight_digests(root: Path, sizes: dict[str, int]) -> dict[str, str]:
    """sha256 of each weight file of `root`: the manifest's record where it has one of that size, else the
    file hashed."""
    try:
        recorded = read_manifest(root).file_records()
    except UpcyclerError:
        recorded = {}
    return {name: recorded[name][1] if recorded.get(name, (None,))[0] == size else _digest(root / name, "weight file")
            for name, size in sizes.items()}


def _assign(names: tuple[str, ...], groups: int, group: int, assignment: Sequence[str] | None) -> tuple[int, ...]:
    """Per routed expert, the index of its source: the recipe's names, or source ⌊g·N/groups⌋ for group g."""
    n = len(names)
    experts = groups * group
    if assignment is None:
        if groups < n:
            raise UpcyclerError(f"--experts {experts} in virtual groups of {group} gives {groups} group(s) for {n} "
                                "sources; every source needs a group: raise --experts or pass fewer sources")
        return tuple(g * n // groups for g in range(groups) for _ in range(group))
    if len(assignment) != experts:
        raise UpcyclerError(f"--expert-sources has {len(assignment)} names for {experts} experts; give one per expert")
    unknown = [a for a in assignment if a not in names]
    if unknown:
        raise UpcyclerError(f"--expert-sources names {describe(unknown[0])}, which is not a source; use one of "
                            f"{', '.join(names)}")
    unused = [a for a in names if a not in assignment]
    if unused:
        raise UpcyclerError(f"--expert-sources gives no expert to source {unused[0]}; drop it from --experts-from "
                            "or give it an expert")
    for g in range(groups):
        members = set(assignment[g * group:(g + 1) * group])
        if len(members) > 1:
            raise UpcyclerError(f"--expert-sources mixes {', '.join(sorted(members))} in virtual group {g} (experts "
                                f"{g * group}–{(g + 1) * group - 1}), whose experts share one router row and "
                                "together hold one dense FFN; give a group one source")
    return tuple(names.index(a) for a in assignment)


def describe_assignment(sources: Sources) -> str:
    """`code: experts 0–3; math: experts 4–7` (runs of consecutive experts per source)."""
    per = {n: [e for e, k in enumerate(sources.expert_source) if sources.names[k] == n] for n in sources.names}
    return expert_runs(per)
