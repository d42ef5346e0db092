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
      - {weights: {web: 0.5, code: 0.3, math: 0.2}, seq_len: 8192, batch: keep_tokens}

Phase k covers the steps from the previous phase's `until_step` (0 for the first) up to but excluding
its own `until_step`. The last phase may omit `until_step`; either way it covers every later step.
Weights are shares of training tokens and must sum to 1.

A phase may train at its own length (progressive lengthening, as Llama 3 and ProLong train): `seq_len`
(default `seq_len` above) and `global_batch_size` (default the one above), or `batch: keep_tokens` for
the rows that keep the tokens per step of `seq_len` × `global_batch_size` above. At a change of length
each source is cut afresh into windows of the new length and continues from the same epoch and the same
share of it (`upcycler.train.data.mix`); the learning-rate schedule stays in steps.

Every value is checked for its exact type and range by `upcycler.schema` against the fields declared
below (no bools as numbers, no NaN or infinity, no number beyond what the pipeline can index); `check`
adds what involves several fields (weights that sum to 1, phases in order, a batch that splits over the
processes, in every phase), and source names are plain file-name stems (they name files in `dir`), so a config from
anywhere yields a usable `DataConfig` or one `UpcyclerError` line.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
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
BATCH_MODES = ("rows", "keep_tokens")


@dataclass(frozen=True)
class Phase:
    """Token shares per source, in force for every step before `until_step` (None: to the end)."""

    weights: Mapping[str, float] = field(help="Token share of each source; the shares sum to 1.")
    until_step: int | None = field(None, range=Range(1, MAX_STEP), help="First step after this phase.")
    seq_len: int | None = field(None, range=Range(1, MAX_SEQ_LEN),
                                help="Tokens per example in this phase (default: data.seq_len); the sources are "
                                     "cut into windows of this length afresh, and the step is compiled once "
                                     "for each length.")
    global_batch_size: int | None = field(None, range=Range(1, MAX_BATCH),
                                          help="Rows per step in this phase (default: data.global_batch_size).")
    batch: str = field("rows", choices=BATCH_MODES,
                       help="rows: global_batch_size rows per step (the phase's, else data's); keep_tokens: "
                            "data.global_batch_size × data.seq_len / seq_len rows, the same tokens per step.")


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

    def phase_shape(self, k: int) -> tuple[int, int]:
        """(seq_len, global_batch_size) of phase `k`: its own, else the section's; with `batch: keep_tokens`
        the rows that keep the section's tokens per step (exact once `check` passed)."""
        phase = self.phases[k]
        seq_len = phase.seq_len or self.seq_len
        if phase.batch == "keep_tokens":
            return seq_len, self.seq_len * self.global_batch_size // seq_len
        return seq_len, phase.global_batch_size or self.global_batch_size

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every phase's (seq_len, global_batch_size), in phase order."""
        return tuple(self.phase_shape(k) for k in range(len(self.phases)))

    @property
    def phased(self) -> bool:
        """Whether some phase trains at another shape than the section's seq_len × global_batch_size."""
        return any(shape != (self.seq_len, self.global_batch_size) for shape in self.shapes)

    def phase_at(self, step: int) -> int:
        """The phase in force at `step` (`phase_index`)."""
        return phase_index(self.phases, step)

    def shape_at(self, step: int) -> tuple[int, int]:
        """(seq_len, global_batch_size) of the batch of `step`."""
        return self.phase_shape(self.phase_at(step))

    def longest_shape(self) -> tuple[int, int]:
        """The shape of the longest rows (the largest batch among equally long ones): where a row's
        attention and activations peak."""
        return max(self.shapes)

    def tokens_before(self, step: int) -> int:
        """Tokens in the batches of the steps before `step` (padding included), phase by phase."""
        total, start = 0, 0
        for k in range(len(self.phases)):
            last = k == len(self.phases) - 1
            end = step if last else min(step, self.phases[k].until_step)
            seq_len, batch = self.phase_shape(k)
            total += max(end - start, 0) * seq_len * batch
            if last or end == step:
                return total
            start = self.phases[k].until_step
        return total

    def check(self, process_count: int = 1, origin: str = "data config") -> None:
        """Raise `UpcyclerError` naming `origin` and the fix unless the config is usable as it stands."""
        validate(self, origin, _FIX)
        integer(process_count, "process_count", origin, low=1, fix="start at least one process")
        self._check_shape(self.seq_len, self.global_batch_size, process_count, origin, "")
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
            self._check_phase_batch(phase, where)
            self._check_shape(*self.phase_shape(k), process_count, origin, f"phases[{k}] ")

    def _check_shape(self, seq_len: int, batch: int, process_count: int, origin: str, which: str) -> None:
        """One shape the run trains at: within the tokens a step may hold, its rows split over the processes."""
        if seq_len * batch > MAX_TOKENS_PER_STEP:
            raise UpcyclerError(
                f"{origin}: {which}global_batch_size × seq_len is {seq_len * batch:,} tokens "
                f"per step, more than {MAX_TOKENS_PER_STEP:,}; lower one of them"
            )
        if batch % process_count:
            raise UpcyclerError(
                f"{origin}: {which}global_batch_size {batch} is not divisible by the "
                f"{process_count} processes; make it a multiple of {process_count}"
            )

    def _check_phase_batch(self, phase: Phase, where: str) -> None:
        """`batch: keep_tokens` alone decides the rows, and the tokens per step divide into them."""
        if phase.batch != "keep_tokens":
            return
        if phase.global_batch_size is not None:
            raise UpcyclerError(f"{where}: batch keep_tokens sets the rows itself, and global_batch_size "
                                f"{phase.global_batch_size} sets them too; drop one of them")
        tokens, seq_len = self.seq_len * self.global_batch_size, phase.seq_len or self.seq_len
        if tokens % seq_len:
            raise UpcyclerError(
                f"{where}: batch keep_tokens cannot keep {tokens:,} tokens per step (seq_len × "
                f"global_batch_size) in rows of seq_len {seq_len}: it does not divide them; pick a seq_len "
                f"that divides {tokens:,}, or set global_batch_size"
            )

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


def phase_index(phases: Sequence[Phase], step: int) -> int:
    """The phase in force at `step`: the first whose until_step exceeds it, else the last."""
    return bisect.bisect_right([p.until_step for p in phases[:-1]], step)


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
