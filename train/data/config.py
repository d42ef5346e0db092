"""The data section of a training config: prepared sources, example length, batch size and phase weights.

Schema (YAML, under `data:`):

    dir: prepared/                 # a directory written by `upcycle prepare-data`
    seq_len: 2048                  # L: each example is L+1 tokens, giving L inputs and L targets
    global_batch_size: 256         # rows per step, summed over all processes
    microbatches: 1                # gradient accumulation: the step runs its rows in this many parts
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

Every value is checked for its exact type and range by `upcycler.schema` against the fields declared
below (no bools as numbers, no NaN or infinity, no number beyond what the pipeline can index); `check`
adds what involves several fields (weights that sum to 1, phases in order, a batch that splits over the
processes), and source names are plain file-name stems (they name files in `dir`), so a config from
anywhere yields a usable `DataConfig` or one `UpcyclerError` line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from upcycler.errors import UpcyclerError
from upcycler.locations import Location
from upcycler.schema import Range, field, from_mapping, validate
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


@dataclass(frozen=True)
class Phase:
    """Token shares per source, in force for every step before `until_step` (None: to the end)."""

    weights: Mapping[str, float] = field(help="Token share of each source; the shares sum to 1.")
    until_step: int | None = field(None, range=Range(1, MAX_STEP), help="First step after this phase.")


@dataclass(frozen=True)
class DataConfig:
    """Where the prepared sources are and how to cut, mix and batch them; see the module docstring."""

    dir: Location = field(help="The directory prepare-data wrote (a path or gs:// URL).")
    seq_len: int = field(range=Range(1, MAX_SEQ_LEN), help="Tokens per example (plus one for the targets).")
    global_batch_size: int = field(range=Range(1, MAX_BATCH), help="Rows per step, over all processes.")
    phases: tuple[Phase, ...] = field(help="The mixture phases, in order of steps.")
    seed: int = field(0, range=Range(0, MAX_SEED), help="Seed of the shuffles.")
    microbatches: int = field(1, range=Range(1, MAX_BATCH),
                              help="Run each step's rows in this many parts, accumulating gradients "
                                   "(the same update as one batch; less activation memory).")
    sources: tuple[str, ...] | None = field(None, help="Source ids in order (default: first seen in phases).")
    shuffle: bool = field(True, help="Reshuffle each source's examples every epoch.")
    prefetch: int = field(2, range=Range(0, MAX_PREFETCH), help="Batches prepared ahead (0: none).")

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
        validate(self, origin, _FIX)
        integer(process_count, "process_count", origin, low=1, fix="start at least one process")
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
        config = from_mapping(cls, raw, origin, fix=_FIX)
        config.check(origin=origin)
        return config


def _check_until(until: object, previous: int, last: bool, where: str) -> int:
    """Check one phase's end step against the previous one; returns the new lower bound."""
    if until is None:
        if not last:
            raise UpcyclerError(f"{where}: only the last phase may omit until_step; add it")
        return previous
    if not previous < until:
        raise UpcyclerError(
            f"{where}.until_step is {describe(until)}; phase steps must be integers increasing strictly "
            f"from {previous} (at most {MAX_STEP:,})"
        )
    return until
