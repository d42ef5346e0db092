"""Blend prepared sources by token share, phase by phase, into deterministic global batches.

The global batch of step s is a pure function of (config, s): `MixSchedule.rows(s)` says which source
and which example of that source's endless stream (`ExampleStream`) fills every row. So the iterator's
state is just the next step, a resumed run sees exactly the batches an uninterrupted run would, and a
process reads only its own rows, whatever the process count.

Allocation within a phase: the weights are rounded to integer quotas over a period of `PATTERN_PERIOD`
examples (largest remainder; weights with 4 decimals are exact) and spread over the period by smooth
weighted round-robin, so every prefix of a phase holds each source within one example of its quota
(any run of examples within two).
The rows of each batch are then permuted by a permutation seeded from (seed, step). All examples carry L
targets except the one short example per epoch of a source, so example shares are token shares.

Phases of their own length (`Phase.seq_len`, `Phase.global_batch_size`): each length has its own streams,
the sources cut into windows of that length (`Windows`: the packing is redone, documents still run across
rows with no token boundary lost). Where the length changes, each source's stream of the new length
starts in the same epoch the old one had reached, at the first window that begins at or after the share
of that epoch's tokens already read (`carried`; without shuffling, at the next token not yet a target).
Phases of one length count examples in one stream, exactly as a run of one length does, and a config
whose phases all keep the section's shape gives the batches it always gave.

Batch format (one process's rows B = global_batch_size / process_count, both the phase's):
    inputs [B, L] int32, targets [B, L] int32, mask [B, L] float32, source_id [B] int32,
with `source_id` indexing `DataIterator.source_names`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

import grain
import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.data.config import MAX_STEP, DataConfig, Phase, phase_index
from upcycler.train.data.sources import (
    ExampleStream,
    TokenSource,
    Windows,
    derive_seed,
    open_source,
    stable_permutation,
)
from upcycler.untrusted import describe, integer, shown_path

PATTERN_PERIOD = 10_000
STATE_VERSION = 1
IDENTITY_EXTRA = ("phase_shapes",)  # in a state only when the config's phases set shapes of their own


def quotas(weights: Sequence[float], period: int = PATTERN_PERIOD) -> np.ndarray:
    """Integers summing to `period`, each within 1 of its weight's share (largest remainder, ties to lower index)."""
    exact = np.asarray(weights, dtype=np.float64) * period / np.sum(weights)
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: period - int(counts.sum())]] += 1
    return counts


def interleave(quota: Sequence[int]) -> np.ndarray:
    """Smooth weighted round-robin: source i appears exactly quota[i] times, evenly spread over the period."""
    period = int(sum(quota))
    credit = [0] * len(quota)
    pattern = np.empty(period, dtype=np.int32)
    for t in range(period):
        credit = [c + int(q) for c, q in zip(credit, quota)]
        chosen = credit.index(max(credit))
        credit[chosen] -= period
        pattern[t] = chosen
    return pattern


class _PhasePlan:
    """The allocation of one phase: its repeating pattern, its rows per step, and where each source's
    stream stood when it began."""

    def __init__(self, start: int, weights: Sequence[float], offset: np.ndarray, batch_size: int):
        self.start = start
        self.batch_size = batch_size
        self.quota = quotas(weights)
        self.pattern = interleave(self.quota)
        # where each source sits in the pattern: PATTERN_PERIOD int32s in all, whatever the source count
        self.positions = [np.flatnonzero(self.pattern == i).astype(np.int32) for i in range(len(weights))]
        self.offset = offset

    def drawn(self, n: int) -> np.ndarray:
        """Examples of each source drawn before the phase's n-th example (counting all earlier phases)."""
        full, rest = divmod(n, PATTERN_PERIOD)
        before = np.array([np.searchsorted(p, rest) for p in self.positions], dtype=np.int64)
        return self.offset + full * self.quota + before


Carry = Callable[[int, np.ndarray], np.ndarray]  # (phase k, examples drawn in phase k's streams) -> starts in k+1's


class MixSchedule:
    """Which source, and which example of its stream, fills each row of the global batch at any step.

    `batch_sizes` gives each phase's rows (default: `batch_size` for all); `carry(k, drawn)` says where the
    streams of phase k + 1 start, given the examples drawn from phase k's by its end (default: they are
    the same streams, so where they stood)."""

    def __init__(self, names: Sequence[str], phases: Sequence[Phase], batch_size: int, seed: int, *,
                 batch_sizes: Sequence[int] | None = None, carry: Carry | None = None):
        self.names = tuple(names)
        self.batch_size = batch_size
        self.seed = seed
        self._phases = tuple(phases)
        self._plans: list[_PhasePlan] = []
        sizes = batch_sizes or [batch_size] * len(phases)
        start, offset = 0, np.zeros(len(self.names), np.int64)
        for k, phase in enumerate(phases):
            plan = _PhasePlan(start, [float(phase.weights.get(n, 0.0)) for n in self.names], offset, sizes[k])
            self._plans.append(plan)
            if phase.until_step is not None:
                offset = plan.drawn((phase.until_step - start) * plan.batch_size)
                offset = offset if carry is None else np.asarray(carry(k, offset), np.int64)
                start = phase.until_step

    def phase_index(self, step: int) -> int:
        """The phase in force at `step`: the first whose until_step exceeds it, else the last."""
        return phase_index(self._phases, step)

    def batch_rows(self, step: int) -> int:
        """Rows of the global batch of `step` (its phase's)."""
        return self._plans[self.phase_index(step)].batch_size

    def drawn_before(self, step: int) -> dict[str, int]:
        """Where each source's stream of the phase of `step` stands before it: the examples taken by all
        steps before `step` (counted in the streams of that phase's length)."""
        plan = self._plans[self.phase_index(step)]
        counts = plan.drawn((step - plan.start) * plan.batch_size)
        return {name: int(c) for name, c in zip(self.names, counts)}

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source_id [B] int32, example index into that source's stream [B] int64) for the global batch.

        Within a batch, the rows of one source hold consecutive examples of its stream in row order.
        """
        if step < 0:
            raise IndexError(step)
        plan = self._plans[self.phase_index(step)]
        first = (step - plan.start) * plan.batch_size
        slots = (first + np.arange(plan.batch_size)) % PATTERN_PERIOD
        order = stable_permutation(plan.batch_size, derive_seed("rows", self.seed, step))
        source = plan.pattern[slots][order]
        base = plan.drawn(first)
        example = np.empty(plan.batch_size, dtype=np.int64)
        for i in np.unique(source):
            rows = np.flatnonzero(source == i)
            example[rows] = base[i] + np.arange(rows.size)
        return source, example


class _Batches:
    """Random access `step -> batch` for this process's rows of the global batch (the `process_index`-th
    of `process_count` equal parts); a Grain MapDataset source. `streams[k]` are phase k's."""

    def __init__(self, schedule: MixSchedule, streams: Sequence[Sequence[ExampleStream]],
                 process_index: int, process_count: int):
        self.schedule, self.streams = schedule, streams
        self.process_index, self.process_count = process_index, process_count

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        source, example = self.schedule.rows(step)
        streams = self.streams[self.schedule.phase_index(step)]
        rows = self.schedule.batch_rows(step) // self.process_count
        lo, hi = self.process_index * rows, (self.process_index + 1) * rows
        source, example = source[lo:hi], example[lo:hi]
        shape = (hi - lo, streams[0].windows.seq_len)
        batch = {
            "inputs": np.empty(shape, np.int32),
            "targets": np.empty(shape, np.int32),
            "mask": np.empty(shape, np.float32),
            "source_id": source.astype(np.int32),
        }
        for i in np.unique(source):  # each source's rows read together (concurrently from a bucket)
            rows = np.flatnonzero(source == i)
            stream = streams[i]
            pieces = stream.windows.tokens.read_spans([stream.span(int(j)) for j in example[rows]])
            for r, piece in zip(rows, pieces):
                batch["inputs"][r], batch["targets"][r], batch["mask"][r] = stream.windows.example(piece)
        return batch


class DataIterator(grain.DatasetIterator):
    """One process's batches, step after step, prefetched on a Grain thread.

    `get_state()` is `{"version", "step", "seed", "seq_len", "global_batch_size"}`, with `"phase_shapes"`
    ([until_step, seq_len, global_batch_size] of each phase) when phases set shapes of their own (JSON-able,
    the same on every process); `set_state` resumes at `step` and refuses a state saved with other seed or
    shapes. The step alone places every stream, across changes of length too.
    Works with `grain.checkpoint.CheckpointSave/CheckpointRestore` as well as plain JSON.
    """

    def __init__(self, batches: _Batches, config: DataConfig, sources: Sequence[TokenSource], step: int = 0):
        super().__init__()
        self.source_names = tuple(s.name for s in sources)
        self.vocab_size = int(sources[0].meta["vocab_size"])
        self.eos_id = int(sources[0].meta["eos_id"])
        self.tokenizer_sha256 = sources[0].tokenizer_sha256
        self.schedule = batches.schedule
        self._dataset = grain.MapDataset.source(batches)
        self._identity = {
            "seed": config.seed,
            "seq_len": config.seq_len,
            "global_batch_size": config.global_batch_size,
        }
        if config.phased:
            self._identity["phase_shapes"] = [[p.until_step, *shape] for p, shape in zip(config.phases, config.shapes)]
        self._prefetch = config.prefetch
        self._inner: grain.DatasetIterator | None = None
        self._restart(step)

    def _restart(self, step: int) -> None:
        if self._inner is not None:
            self._inner.close()
        options = grain.ReadOptions(
            num_threads=1 if self._prefetch else 0, prefetch_buffer_size=self._prefetch
        )
        self._inner = iter(self._dataset[step:].to_iter_dataset(options))
        self._step = step

    @property
    def step(self) -> int:
        """The step whose batch `next()` returns."""
        return self._step

    def __next__(self) -> dict[str, np.ndarray]:
        self._assert_not_closed()
        batch = next(self._inner)
        self._step += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {"version": STATE_VERSION, "step": self._step, **self._identity}

    def set_state(self, state: Mapping[str, int]) -> None:
        if not isinstance(state, Mapping):
            raise UpcyclerError(f"data iterator state is {describe(state)}; expected a mapping")
        saved = {k: state.get(k) for k in (*self._identity, *(k for k in IDENTITY_EXTRA if k in state))}
        if state.get("version") != STATE_VERSION or saved != self._identity:
            shown = {k: describe(v) for k, v in saved.items()}
            raise UpcyclerError(
                f"data iterator state {shown} was saved with other settings than {self._identity}; "
                "resume with the same data seed, seq_len and global_batch_size (and phase shapes)"
            )
        step = integer(state.get("step"), "step", "data iterator state", low=0, high=MAX_STEP,
                       fix="resume from an intact checkpoint")
        self._restart(step)

    def start_prefetch(self) -> None:
        self._inner.start_prefetch()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        super().close()


def make_data_iterator(
    config: DataConfig,
    process_index: int = 0,
    process_count: int = 1,
    *,
    start_step: int = 0,
    origin: str = "data config",
) -> DataIterator:
    """Open and check the prepared sources, then iterate this process's rows of each global batch.

    Raises `UpcyclerError` before any batch is built if the config, the sources or the process layout
    is unusable: unknown or missing sources, mixed tokenizers, a source shorter than seq_len + 1 tokens.
    """
    config.check(process_count, origin)
    if not 0 <= process_index < process_count:
        raise UpcyclerError(f"{origin}: process_index {process_index} is outside 0..{process_count - 1}")
    if start_step < 0:
        raise UpcyclerError(f"{origin}: start_step {start_step} is negative; start at step 0 or later")
    sources = [open_source(config.dir, name) for name in config.source_names]
    _check_compatible(sources, config)
    by_length = {length: _streams(sources, config, length) for length, _ in config.shapes}
    streams = [by_length[length] for length, _ in config.shapes]
    schedule = MixSchedule(config.source_names, config.phases, config.global_batch_size, config.seed,
                           batch_sizes=[rows for _, rows in config.shapes],
                           carry=lambda k, drawn: carried(drawn, streams[k], streams[k + 1]))
    batches = _Batches(schedule, streams, process_index, process_count)
    return DataIterator(batches, config, sources, step=start_step)


def _streams(sources: Sequence[TokenSource], config: DataConfig, seq_len: int) -> list[ExampleStream]:
    """Each source's endless stream of examples of `seq_len` tokens (its windows of that length)."""
    return [ExampleStream(Windows(s.tokens, seq_len, int(s.meta["eos_id"])), s.name, config.seed, config.shuffle)
            for s in sources]


def carried(drawn: np.ndarray, old: Sequence[ExampleStream], new: Sequence[ExampleStream]) -> np.ndarray:
    """Where each source's `new` stream starts after `drawn[i]` examples of its `old` one: in the same epoch,
    at the first window of the new length that begins at or after the share of the epoch's tokens read
    (the same streams: where they stood). Preserves the epoch count, so no epoch is skipped or repeated."""
    if all(a is b for a, b in zip(old, new)):
        return drawn
    out = np.empty(len(drawn), np.int64)
    for i, (count, a, b) in enumerate(zip(drawn, old, new)):
        epoch, within = divmod(int(count), a.epoch_size)
        out[i] = epoch * b.epoch_size + -(-within * a.windows.seq_len // b.windows.seq_len)
    return out


def _check_compatible(sources: Sequence[TokenSource], config: DataConfig) -> None:
    """Every source long enough for one example of every phase's length, and all tokenised by the same
    tokenizer."""
    longest = max(length for length, _ in config.shapes)
    for source in sources:
        if source.tokens.shape[0] < longest + 1:
            raise UpcyclerError(
                f"{shown_path(source.path)}: source {source.name!r} has {source.tokens.shape[0]} "
                f"tokens, fewer than seq_len + 1 = {longest + 1}; add text to it or lower seq_len"
            )
    first = sources[0]
    for source in sources[1:]:
        if source.tokenizer_sha256 != first.tokenizer_sha256:
            raise UpcyclerError(
                f"{shown_path(source.path)}: tokenised with another tokenizer than "
                f"{first.name!r}; prepare every source with the checkpoint's tokenizer"
            )
