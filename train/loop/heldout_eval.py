"""Held-out evaluation during training: the loss of the current parameters on fixed held-out batches.

Sources: `eval.sources` (prepared sources in `eval.dir`, default `data.dir`), or by default `NAME.heldout`
for every training source NAME that `upcycle prepare-data --heldout FRACTION` split. They must share the
training sources' tokenizer and hold at least one example (seq_len + 1 tokens).

Batches: the first `eval.batches` × `data.global_batch_size` examples of each source in stream order (cut
as the training examples are, `upcycler.train.data.sources.Windows`, never shuffled), each process reading
its own rows; a source with fewer examples is read whole, its last batch padded and masked. They are the
same at every evaluation, on any process layout, before and after a resume. With `eval.seq_len: phase`
the rows have the length and the batch of the data phase in force at the evaluated step (the batches of
each shape are read once, and the evaluation is compiled once per shape, when first due).

The evaluation is its own compiled function of the parameters (not donated) and a batch: it never touches
the train state, the data iterator or a random key, so turning it on leaves the training losses and
parameters bit-identical. It runs after every `eval.every`-th step and after the last, and is logged on
that step's record as `eval/loss/<source>` (the token-weighted mean cross-entropy over all its batches)
and `eval/ppl/<source>` (its exponential). A run that starts from its init also evaluates the starting
parameters, before its first step: the baseline of every curve, on step 0's record as
`eval_start/loss/<source>` and `eval_start/ppl/<source>` (`baseline`). `HeldoutEvaluation` rides on the
loop as a technique (`upcycler.train.techniques.protocol`); its time is the clock's `eval` (its compile:
`program_startup`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train import model as model_lib
from upcycler.train.config import EvalConfig, LossConfig, TrainConfig
from upcycler.train.data.format import HELDOUT_SUFFIX, heldout_name
from upcycler.train.data.sources import Windows, open_source, prepared_names
from upcycler.train.loop import sharding
from upcycler.train.loop.train_step import batch_shardings, global_batch, loss_fn
from upcycler.untrusted import shown_path


class HeldoutEval:
    """The held-out batches of this process and the compiled evaluation (see the module docstring)."""

    def __init__(self, config: TrainConfig, spec: ModelSpec, tokenizer_sha256: str,
                 process_index: int, process_count: int):
        assert config.eval is not None
        self.options: EvalConfig = config.eval
        self.steps = config.steps
        self.spec = spec
        self.model_cfg = config.model.run_config()
        directory = self.options.dir or config.data.dir
        self.names = list(self.options.sources or default_sources(directory, config.data.source_names))
        self.data = config.data
        shapes = sorted(set(self.data.shapes)) if self.options.seq_len == "phase" else [self.shape(0)]
        self.batches = {shape: {name: _source_batches(directory, name, config, tokenizer_sha256, shape,
                                                      process_index, process_count) for name in self.names}
                        for shape in shapes}
        self._compiled: dict[tuple[int, int], Any] = {}

    def due(self, step: int) -> bool:
        """Whether to evaluate after step `step` (0-based)."""
        return (step + 1) % self.options.every == 0 or step + 1 == self.steps

    def shape(self, step: int) -> tuple[int, int]:
        """(seq_len, global_batch_size) of the batches evaluated after step `step`."""
        if self.options.seq_len == "phase":
            return self.data.shape_at(step)
        return self.data.seq_len, self.data.global_batch_size

    def compile(self, params: Any, mesh: Mesh, param_shardings: Any, step: int = 0) -> None:
        """Compile the evaluation for these parameters' layout and the shape of `step`'s batches (once per
        shape; timed as program start-up)."""
        shape = self.shape(step)
        if shape in self._compiled:
            return
        spec, cfg = self.spec, self.model_cfg

        def evaluate(params, batch):
            weights = model_lib.weights_for_compute(params, spec, cfg)
            _, metrics = loss_fn(weights, batch, spec=spec, cfg=cfg, loss=LossConfig(), num_sources=1)
            return metrics["source_loss"][0], metrics["source_tokens"][0]

        first = global_batch(next(iter(self.batches[shape].values()))[0], mesh)
        jitted = jax.jit(evaluate, in_shardings=(param_shardings, batch_shardings(mesh)),
                         out_shardings=sharding.replicated(mesh))
        with jax.set_mesh(mesh):
            self._compiled[shape] = jitted.lower(params, first).compile()

    def run(self, params: Any, mesh: Mesh, step: int = 0) -> dict[str, float]:
        """`eval/loss/<source>` and `eval/ppl/<source>` of `params` after step `step`, at that step's shape
        (compiled by `compile` first)."""
        out: dict[str, float] = {}
        shape = self.shape(step)
        compiled = self._compiled[shape]
        for name, batches in self.batches[shape].items():
            total, tokens = 0.0, 0.0
            for local in batches:
                loss_sum, count = jax.device_get(compiled(params, global_batch(local, mesh)))
                total += float(loss_sum)
                tokens += float(count)
            loss = total / tokens
            out[f"eval/loss/{name}"] = loss
            out[f"eval/ppl/{name}"] = math.exp(loss) if loss < 700 else float("inf")
        return out


    def baseline(self, params: Any, mesh: Mesh) -> dict[str, float]:
        """`run` on the starting parameters at step 0's shape, named `eval_start/…` (before any step changed
        them)."""
        return {key.replace("eval/", "eval_start/", 1): value for key, value in self.run(params, mesh).items()}


def default_sources(directory: Any, training: tuple[str, ...]) -> list[str]:
    """NAME.heldout for every training source NAME whose index says it is the train side of a held-out
    split (`split: train`): a NAME.heldout beside an unsplit NAME may overlap it and is not used."""
    prepared = set(prepared_names(directory))
    found = [heldout_name(n) for n in training
             if heldout_name(n) in prepared and open_source(directory, n).meta.get("split") == "train"]
    if not found:
        raise UpcyclerError(
            f"{shown_path(directory)}: eval: no held-out source (none of {', '.join(training)} was prepared with "
            f"a NAME{HELDOUT_SUFFIX} split); run `upcycle prepare-data --heldout 0.01 …` or name sources in "
            "eval.sources"
        )
    return found


def _source_batches(directory: Any, name: str, config: TrainConfig, tokenizer_sha256: str,
                    shape: tuple[int, int], process_index: int, process_count: int) -> list[dict[str, np.ndarray]]:
    """This process's rows of the first `eval.batches` global batches of `shape` (seq_len, rows) of source
    `name` (see the module docstring)."""
    source = open_source(directory, name)
    if source.tokenizer_sha256 != tokenizer_sha256:
        raise UpcyclerError(f"{shown_path(source.path)}: eval source {name!r} was tokenised with another tokenizer "
                            "than the training data; prepare it with the checkpoint's tokenizer")
    seq_len, batch = shape
    rows = batch // process_count
    lo, hi = process_index * rows, (process_index + 1) * rows
    if source.tokens.shape[0] < seq_len + 1:
        raise UpcyclerError(f"{shown_path(source.path)}: eval source {name!r} has {source.tokens.shape[0]} tokens, "
                            f"fewer than seq_len + 1 = {seq_len + 1}; hold out more (prepare-data --heldout) or "
                            "drop it from eval.sources")
    windows = Windows(source.tokens, seq_len, int(source.meta["eos_id"]))
    count = min(len(windows), config.eval.batches * batch)  # type: ignore[union-attr]
    out = []
    for first in range(0, count, batch):
        rows = [windows[i] if i < count else _padding(seq_len) for i in range(first + lo, first + hi)]
        out.append({
            "inputs": np.stack([r[0] for r in rows]),
            "targets": np.stack([r[1] for r in rows]),
            "mask": np.stack([r[2] for r in rows]),
            "source_id": np.zeros(len(rows), np.int32),
        })
    return out


def _padding(seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row that counts for nothing: zero tokens, mask 0."""
    zeros = np.zeros(seq_len, np.int32)
    return zeros, zeros, np.zeros(seq_len, np.float32)
