"""The data section of a training config: prepared sources, example length, batch size and phase weights.

Schema (YAML, under `data:`):

    dir: prepared/                 # a directory written by `upcycle prepare-data`
    seq_len: 2048                  # L: each example is L+1 tokens, giving L inputs and L targets
    global_batch_size: 256         # rows per step, summed over all processes
    seed: 0
    sources: [web, code, math]     # optional: the source ids, in this order; default: first seen in phases
    shuffle: true                  # reshuffle each source's examples every epoch
    prefetch: 2                    # batches prepared ahead on a background thread; 0 = none
    phases:
      - {until_step: 1000, weights: {web: 0.7, code: 0.2, math: 0.1}}
      - {weights: {web: 0.5, code: 0.3, math: 0.2}}

Phase k covers the steps from the previous phase's `until_step` (0 for the first) up to but excluding
its own `until_step`. The last phase may omit `until_step`; either way it covers every later step.
Weights are shares of training tokens and must sum to 1.

Every value is checked for its exact type and range (`upcycler.untrusted.integer` / `real`: no bools
as numbers, no NaN or infinity, no number beyond what the pipeline can index), and source names are
plain file-name stems (they name files in `dir`), so a config from anywhere yields a usable
`DataConfig` or one `UpcyclerError` line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe, integer, real

WEIGHT_TOLERANCE = 1e-6
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a file-name stem: no separators, no leading dot
MAX_STEP = 2**31 - 1  # the trainer counts steps in int32
MAX_SEQ_LEN = 1 << 22
MAX_BATCH = 1 << 22
MAX_TOKENS_PER_STEP = 1 << 34
MAX_PREFETCH = 1024
MAX_SEED = 2**63 - 1
_FIX = "fix the data section"
_KEYS = {"dir", "seq_len", "global_batch_size", "phases", "seed", "sources", "shuffle", "prefetch"}
_PHASE_KEYS = {"weights", "until_step"}


@dataclass(frozen=True)
class Phase:
    """Token shares per source, in force for every step before `until_step` (None: to the end)."""

    weights: Mapping[str, float]
    until_step: int | None = None


@dataclass(frozen=True)
class DataConfig:
    """Where the prepared sources are and how to cut, mix and batch them; see the module docstring."""

    dir: Path
    seq_len: int
    global_batch_size: int
    phases: tuple[Phase, ...]
    seed: int = 0
    sources: tuple[str, ...] | None = None
    shuffle: bool = True
    prefetch: int = 2

    @property
    def source_names(self) -> tuple[str, ...]:
        """Source names in `source_id` order: `sources` if given, else first appearance in the phases."""
        if self.sources is not None:
            return tuple(self.sources)
        names: dict[str, None] = {}
        for phase in self.phases:
            names.update(dict.fromkeys(phase.weights))
        return tuple(names)

    def check(self, process_count: int = 1, origin: str = "data config") -> None:
        """Raise `UpcyclerError` naming `origin` and the fix unless the config is usable as it stands."""
        integer(self.seq_len, "seq_len", origin, low=1, high=MAX_SEQ_LEN, fix=_FIX)
        integer(self.global_batch_size, "global_batch_size", origin, low=1, high=MAX_BATCH, fix=_FIX)
        integer(process_count, "process_count", origin, low=1, fix="start at least one process")
        integer(self.seed, "seed", origin, low=0, high=MAX_SEED, fix=_FIX)
        integer(self.prefetch, "prefetch", origin, low=0, high=MAX_PREFETCH, fix=_FIX)
        if not isinstance(self.shuffle, bool):
            raise UpcyclerError(f"{origin}: shuffle must be true or false, not {describe(self.shuffle)}")
        if self.seq_len * self.global_batch_size > MAX_TOKENS_PER_STEP:
            raise UpcyclerError(
                f"{origin}: global_batch_size × seq_len is {self.seq_len * self.global_batch_size:,} tokens "
                f"per step, more than {MAX_TOKENS_PER_STEP:,}; lower one of them"
            )
        if self.global_batch_size % process_count:
            raise UpcyclerError(
                f"{origin}: global_batch_size {self.global_batch_size} is not divisible by the "
                f"{process_count} processes; make it a multiple of {process_count}"
            )
        if self.sources is not None and len(set(self.sources)) != len(self.sources):
            raise UpcyclerError(f"{origin}: sources lists a name twice; list each source once")
        if not self.phases:
            raise UpcyclerError(f"{origin}: phases is empty; give at least one phase with weights")
        for name in self.source_names:
            if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name):
                raise UpcyclerError(
                    f"{origin}: source name {describe(name)} is not a name like web or code_v2 "
                    "(letters, digits, _ . -); use the NAME given to prepare-data"
                )
        previous = 0
        for k, phase in enumerate(self.phases):
            where = f"{origin}: phases[{k}]"
            self._check_weights(phase.weights, where)
            previous = _check_until(phase.until_step, previous, k == len(self.phases) - 1, where)

    def _check_weights(self, weights: Mapping[str, float], where: str) -> None:
        if not isinstance(weights, Mapping) or not weights:
            raise UpcyclerError(f"{where}.weights is empty; give each source's token share")
        known = set(self.source_names)
        for name, weight in weights.items():
            if name not in known:
                raise UpcyclerError(
                    f"{where}.weights: unknown source {describe(name)}; use one of "
                    f"{', '.join(self.source_names)}"
                )
            real(weight, f"weights.{name}", where, low=0, fix="weights are non-negative token shares")
        total = math.fsum(weights.values())
        if abs(total - 1.0) > WEIGHT_TOLERANCE:
            raise UpcyclerError(f"{where}.weights sum to {total:.6g}, not 1; rescale them to sum to 1")

    @classmethod
    def from_dict(cls, raw: Mapping, origin: str = "data config") -> DataConfig:
        """Build and `check` a config from parsed YAML/JSON, with one-line errors naming `origin`."""
        if not isinstance(raw, Mapping):
            raise UpcyclerError(f"{origin}: the data section must be a mapping; see the documented schema")
        _no_unknown_keys(raw, _KEYS, origin)
        for key in ("dir", "seq_len", "global_batch_size", "phases"):
            if key not in raw:
                raise UpcyclerError(f"{origin}: missing {key!r}; add it to the data section")
        phases = raw["phases"]
        if not isinstance(phases, list):
            raise UpcyclerError(f"{origin}: phases must be a list of {{until_step, weights}} mappings")
        sources = raw.get("sources")
        if sources is not None and (
            not isinstance(sources, list) or not all(isinstance(s, str) for s in sources)
        ):
            raise UpcyclerError(f"{origin}: sources must be a list of source names")
        config = cls(
            dir=path_value(raw["dir"], "dir", origin, "the directory prepare-data wrote"),
            seq_len=raw["seq_len"],
            global_batch_size=raw["global_batch_size"],
            phases=tuple(_phase(p, f"{origin}: phases[{k}]") for k, p in enumerate(phases)),
            seed=raw.get("seed", 0),
            sources=None if sources is None else tuple(sources),
            shuffle=raw.get("shuffle", True),
            prefetch=raw.get("prefetch", 2),
        )
        config.check(origin=origin)
        return config


def path_value(value: object, name: str, origin: str, what: str) -> Path:
    """`value` as a Path if it is a usable path string (not empty, no NUL byte); `UpcyclerError` otherwise."""
    text = str(value) if isinstance(value, PurePath) else value
    if not isinstance(text, str) or not text or "\0" in text:
        raise UpcyclerError(f"{origin}: {name} must be a path ({what}), not {describe(value)}")
    return Path(text)


def key_names(raw: Mapping) -> set[str]:
    """The keys of a parsed mapping as text, for comparing with the known keys (any key type is safe)."""
    return {k if isinstance(k, str) else describe(k) for k in raw}


def _phase(raw: object, where: str) -> Phase:
    if not isinstance(raw, Mapping):
        raise UpcyclerError(f"{where} must be a mapping like {{until_step: 1000, weights: {{web: 1.0}}}}")
    _no_unknown_keys(raw, _PHASE_KEYS, where)
    weights = raw.get("weights")
    if not isinstance(weights, Mapping):
        raise UpcyclerError(f"{where}.weights must map source names to token shares")
    return Phase(weights=dict(weights), until_step=raw.get("until_step"))


def _check_until(until: object, previous: int, last: bool, where: str) -> int:
    """Check one phase's end step against the previous one; returns the new lower bound."""
    if until is None:
        if not last:
            raise UpcyclerError(f"{where}: only the last phase may omit until_step; add it")
        return previous
    if not _is_int(until) or not previous < until <= MAX_STEP:
        raise UpcyclerError(
            f"{where}.until_step is {describe(until)}; phase steps must be integers increasing strictly "
            f"from {previous} (at most {MAX_STEP:,})"
        )
    return until


def _no_unknown_keys(raw: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(key_names(raw) - allowed)
    if unknown:
        raise UpcyclerError(
            f"{where}: unknown key {describe(unknown[0])}; allowed: {', '.join(sorted(allowed))}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
