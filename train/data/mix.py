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

Batch format (one process's rows B = global_batch_size / process_count):
    inputs [B, L] int32, targets [B, L] int32, mask [B, L] float32, source_id [B] int32,
with `source_id` indexing `DataIterator.source_names`.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Mapping, Sequence

import grain
import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.data.config import MAX_STEP, DataConfig, Phase
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
    """The allocation of one phase: its repeating pattern and how many examples came before it."""

    def __init__(self, start: int, weights: Sequence[float], offset: np.ndarray):
        self.start = start
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


class MixSchedule:
    """Which source, and which example of its stream, fills each row of the global batch at any step."""

    def __init__(self, names: Sequence[str], phases: Sequence[Phase], batch_size: int, seed: int):
        self.names = tuple(names)
        self.batch_size = batch_size
        self.seed = seed
        self._ends = [p.until_step for p in phases[:-1]]
        self._plans: list[_PhasePlan] = []
        start, offset = 0, np.zeros(len(self.names), np.int64)
        for phase in phases:
            plan = _PhasePlan(start, [float(phase.weights.get(n, 0.0)) for n in self.names], offset)
            self._plans.append(plan)
            if phase.until_step is not None:
                offset = plan.drawn((phase.until_step - start) * batch_size)
                start = phase.until_step

    def phase_index(self, step: int) -> int:
        """The phase in force at `step`: the first whose until_step exceeds it, else the last."""
        return bisect.bisect_right(self._ends, step)

    def drawn_before(self, step: int) -> dict[str, int]:
        """Examples taken from each source by all steps before `step`."""
        plan = self._plans[self.phase_index(step)]
        counts = plan.drawn((step - plan.start) * self.batch_size)
        return {name: int(c) for name, c in zip(self.names, counts)}

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source_id [B] int32, example index into that source's stream [B] int64) for the global batch.

        Within a batch, the rows of one source hold consecutive examples of its stream in row order.
        """
        if step < 0:
            raise IndexError(step)
        plan = self._plans[self.phase_index(step)]
        first = (step - plan.start) * self.batch_size
        slots = (first + np.arange(self.batch_size)) % PATTERN_PERIOD
        order = stable_permutation(self.batch_size, derive_seed("rows", self.seed, step))
        source = plan.pattern[slots][order]
        base = plan.drawn(first)
        example = np.empty(self.batch_size, dtype=np.int64)
        for i in np.unique(source):
            rows = np.flatnonzero(source == i)
            example[rows] = base[i] + np.arange(rows.size)
        return source, example


class _Batches:
    """Random access `step -> batch` for the rows [lo, hi) of the global batch; a Grain MapDataset source."""

    def __init__(
        self, schedule: MixSchedule, streams: Sequence[ExampleStream], lo: int, hi: int, seq_len: int
    ):
        self.schedule, self.streams, self.lo, self.hi, self.seq_len = schedule, streams, lo, hi, seq_len

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        source, example = self.schedule.rows(step)
        source, example = source[self.lo : self.hi], example[self.lo : self.hi]
        shape = (self.hi - self.lo, self.seq_len)
        batch = {
            "inputs": np.empty(shape, np.int32),
            "targets": np.empty(shape, np.int32),
            "mask": np.empty(shape, np.float32),
            "source_id": source.astype(np.int32),
        }
        for i in np.unique(source):  # each source's rows read together (concurrently from a bucket)
            rows = np.flatnonzero(source == i)
            stream = self.streams[i]
            pieces = stream.windows.tokens.read_spans([stream.span(int(j)) for j in example[rows]])
            for r, piece in zip(rows, pieces):
                batch["inputs"][r], batch["targets"][r], batch["mask"][r] = stream.windows.example(piece)
        return batch


class DataIterator(grain.DatasetIterator):
    """One process's batches, step after step, prefetched on a Grain thread.

    `get_state()` is `{"version", "step", "seed", "seq_len", "global_batch_size"}` (JSON-able, the same on
    every process); `set_state` resumes at `step` and refuses a state saved with other seed or shapes.
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
        saved = {k: state.get(k) for k in self._identity}
        if state.get("version") != STATE_VERSION or saved != self._identity:
            shown = {k: describe(v) for k, v in saved.items()}
            raise UpcyclerError(
                f"data iterator state {shown} was saved with other settings than {self._identity}; "
                "resume with the same data seed, seq_len and global_batch_size"
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
    streams = [
        ExampleStream(
            Windows(s.tokens, config.seq_len, int(s.meta["eos_id"])), s.name, config.seed, config.shuffle
        )
        for s in sources
    ]
    schedule = MixSchedule(config.source_names, config.phases, config.global_batch_size, config.seed)
    rows = config.global_batch_size // process_count
    batches = _Batches(schedule, streams, process_index * rows, (process_index + 1) * rows, config.seq_len)
    return DataIterator(batches, config, sources, step=start_step)


def _check_compatible(sources: Sequence[TokenSource], config: DataConfig) -> None:
    """Every source long enough for one example, and all tokenised by the same tokenizer."""
    for source in sources:
        if source.tokens.shape[0] < config.seq_len + 1:
            raise UpcyclerError(
                f"{shown_path(source.path)}: source {source.name!r} has {source.tokens.shape[0]} "
                f"tokens, fewer than seq_len + 1 = {config.seq_len + 1}; add text to it or lower seq_len"
            )
    first = sources[0]
    for source in sources[1:]:
        if source.tokenizer_sha256 != first.tokenizer_sha256:
            raise UpcyclerError(
                f"{shown_path(source.path)}: tokenised with another tokenizer than "
                f"{first.name!r}; prepare every source with the checkpoint's tokenizer"
            )
