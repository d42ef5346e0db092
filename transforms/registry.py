"""The registry of transforms: a frozen config dataclass plus one pure function, under its CLI name.

    @register("depth", Depth)
    def depth(cfg: Depth, spec: ModelSpec, tensors: TensorMap,
              context: TransformContext) -> tuple[ModelSpec, TensorMap]: ...

The config's fields are the transform's options, declared once: `option(default, help=…, choices=…)`
(that is `upcycler.schema.field`) gives each field its help text and allowed values, and both the
command line (`upcycler/cli/transforms.py` turns every field into a click option) and recipes
(`Transform.make_config` checks a YAML mapping) are derived from them, so flags and config never drift
apart; both pass through `make_config` (`upcycler.schema.from_mapping`), which checks each value's type,
choices and range and refuses NaN and infinities for float options. A field without a default is a
required option.

A transform never writes anything. What it wants the user to know (which family `auto` picked, that a
step is not function-preserving) it says with `report(...)`; what its lineage step should carry beyond
its config (depth's layer map) it gives `record(...)`. A transform that takes tensors from other
checkpoints (dense-to-moe's `--experts-from`) opens them with `read_input(path)`, so the command knows
every directory the output is read from (it may not overlap any of them, and every read is checked
against its manifest). Everything else a transform may use beyond its config, spec and tensors (the
source as read, the output dtype, and what a higher layer lends: the JAX model, to calibrate a router or
fit an attention) comes in its `TransformContext`, its fourth argument, built by whoever applies it
(`transforms.pipeline.plan`, from what the command lends). `Transform.apply` collects notes, records and
inputs, so a chain of transforms is still plain function composition over `(ModelSpec, TensorMap)`.

What the command does around a transform (the paths it reads besides the source, the check of its write,
what it reports after the write, an advisor on its command line) the transform declares in its
`TransformHooks` (`declare(name, hooks)`), so the command names no transform.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.io.checkpoint import Checkpoint
from upcycler.layout import account
from upcycler.schema import Option, from_mapping, options, to_plain
from upcycler.schema import field as option  # noqa: F401  (the name transform configs declare options with)
from upcycler.spec import ModelSpec
from upcycler.tensors import TensorMap
from upcycler.untrusted import describe


class RouterInputsService(Protocol):
    """The JAX model's router inputs on calibration data, which `dense-to-moe --router-init centroids` points
    its router rows at, and how the written model then routes that data
    (`upcycler.train.evaluation.calibration.RouterInputs`)."""

    def check(self, data: Path, names: Sequence[str], base: Checkpoint, length: int,
              sequences: int = 1) -> None:
        """Refuse calibration data `data` (one prepared source per name in `names`) that cannot be measured
        with `base`'s model, before anything is written."""
        ...

    def mean(self, ckpt: Checkpoint, data: Path, name: str, sequences: int, length: int,
             layers: Sequence[int]) -> np.ndarray:
        """[len(layers), D] float64: the mean FFN input of `ckpt` at `layers` on source `name` of `data`."""
        ...

    def shares(self, ckpt: Checkpoint, data: Path, names: Sequence[str], expert_sources: Sequence[str],
               sequences: int, length: int) -> np.ndarray:
        """[M, S, S]: per MoE layer of `ckpt`, the share of source s's routed tokens (of `data`) that go to
        the experts cut from source t, by the model's own first forward."""
        ...


class CalibrationTokens(Protocol):
    """Token windows [n, L] an attention is fitted and measured on, and where the held-out ones come from."""

    @property
    def calibration(self) -> np.ndarray: ...

    @property
    def heldout(self) -> np.ndarray: ...

    @property
    def heldout_from(self) -> str: ...


class AttentionFitService(Protocol):
    """The JAX model's fit and measurement of an attention changed under `dense-to-moe --allow-approximate`
    (`upcycler.train.evaluation.attention_fit.AttentionFit`)."""

    @property
    def measures(self) -> bool:
        """False for a dry run: the calibration data is checked and nothing is computed."""
        ...

    def tokens(self, data: Path, model: Checkpoint, sequences: int, length: int) -> CalibrationTokens:
        """Calibration and held-out windows from the prepared data `data`, checked against `model`."""
        ...

    def fit_qk_norms(self, reference: Checkpoint, approximated: Checkpoint,
                     ids_BL: np.ndarray) -> dict[str, np.ndarray]:
        """{canonical name: weight} of the inserted q/k norms that bring `approximated` closest to
        `reference`."""
        ...

    def agreement(self, reference: Checkpoint, approximated: Checkpoint,
                  ids_BL: np.ndarray) -> tuple[float, float]:
        """(mean KL(reference ‖ approximated) per token, top-1 agreement) on the windows `ids_BL`."""
        ...


@dataclass(frozen=True)
class TransformContext:
    """What a transform may use besides its config, the spec and the tensors: the fourth argument of every
    transform function. `transforms.pipeline.plan` builds one per step, from the source it read, the
    recipe's output and what the command lends (`upcycler.cli.transforms.planned`); the empty context
    (every field at its default) is a caller that lends nothing, and a transform that cannot do without a
    missing service refuses in one line. A transform keeps what it takes from here for as long as its lazy
    tensors need it: the writer may call a lent service long after the transform returned."""

    checkpoint: Checkpoint | None = None
    """The source checkpoint as read, for the first step of a recipe only (a later step's input is no
    checkpoint on disk): `dense-to-moe --experts-from` compares the other models' weights and tokenizer
    with it."""
    side_files: tuple[Path, ...] = ()
    """The source's files beside its weights (its tokenizer and the like), for every step: an attention fit
    checks that the calibration data was prepared with that tokenizer."""
    output_dtype: np.dtype | None = None
    """The dtype the recipe writes (`--dtype`), None for the source's: a scale is applied in the wider of it
    and the source's dtype, so it rounds once."""
    router_inputs: Callable[[], RouterInputsService] | None = None
    """Makes the JAX model's router-input measurement (`--router-init centroids`), called when a transform
    needs it, so a command that never calibrates never imports JAX; None where the caller cannot run the
    model."""
    attention_fit: Callable[[], AttentionFitService] | None = None
    """Makes the JAX model's attention fit (`--allow-approximate`), called when a transform needs it; None
    where the caller cannot run the model."""


TransformFn = Callable[[Any, ModelSpec, TensorMap, TransformContext], tuple[ModelSpec, TensorMap]]


@dataclass(frozen=True)
class Note:
    """Something a transform tells the user; `exact=False` marks a step that changes the model's function,
    `rounds=True` one that preserves it up to one rounding of some weights (a scale that is not a power of
    two): exact in fp32, not to the last bit in a 16-bit dtype."""

    text: str
    exact: bool = True
    rounds: bool = False


@dataclass
class _Collected:
    notes: list[Note] = dataclasses.field(default_factory=list)
    recorded: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: list[Checkpoint] = dataclasses.field(default_factory=list)


_COLLECTED: ContextVar[_Collected | None] = ContextVar("transform_collected", default=None)


def report(text: str, *, exact: bool = True, rounds: bool = False) -> None:
    """Tell the user something about the transform being applied (collected by `Transform.apply`)."""
    collected = _COLLECTED.get()
    if collected is not None:
        collected.notes.append(Note(text, exact, rounds))


def record(**fields: Any) -> None:
    """Add JSON-ready fields to the lineage step of the transform being applied (collected by
    `Transform.apply` into `Applied.recorded`; `upcycler.io.manifest.transform_step` writes them)."""
    collected = _COLLECTED.get()
    if collected is not None:
        collected.recorded.update(fields)


def read_input(path: Path) -> Checkpoint:
    """Open another checkpoint lazily (headers only) as an input of the transform being applied: its
    directories join the output's inputs and its reads are checked against its manifest."""
    ckpt = read_checkpoint(path)
    collected = _COLLECTED.get()
    if collected is not None:
        collected.inputs.append(ckpt)
    return ckpt


@contextmanager
def _collecting() -> Iterator[_Collected]:
    collected = _Collected()
    token = _COLLECTED.set(collected)
    try:
        yield collected
    finally:
        _COLLECTED.reset(token)


@dataclass(frozen=True)
class Applied:
    """The result of one transform: the new model, what the transform reported and what it recorded for
    its lineage step."""

    spec: ModelSpec
    tensors: TensorMap
    notes: tuple[Note, ...]
    recorded: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inputs: tuple[Checkpoint, ...] = ()  # other checkpoints the tensors read (`read_input`)

    @property
    def exact(self) -> bool:
        return all(n.exact for n in self.notes)


@dataclass(frozen=True)
class AfterWrite:
    """What a transform says once its output is written (`TransformHooks.after_write`): a text for people
    (the command prints it on stderr) and the fields it adds to the command's `--json` result."""

    text: str
    fields: Mapping[str, Any]


class TransformHooks:
    """What a transform declares besides its options and its function, for the command that runs it: the
    paths its config names (`inputs`), the check a write of it runs (`write_check`), what it reports after
    the write (`after_write`) and the advisor its command carries (`advisor`). The command asks every
    transform the same questions, so it names none. These defaults declare nothing: no input besides the
    source, the command's full check, nothing to say after the write, no advisor."""

    advisor: str | None = None
    """The module of the command line's advisor for this transform, imported by the command line alone (it
    is a layer above the transforms, and so is the trainer the advice compiles with): its
    `command_options(fn)` adds the advisor's options to the transform's command, and its
    `from_command(src, out, as_json, values) -> bool` takes them out of the command's values and, when
    they ask for advice, gives it (True: the command is done and writes nothing)."""

    def inputs(self, config: Any) -> list[Path]:
        """The local paths `config` names that the transform reads besides its source (data, other
        checkpoints): the command refuses an output that overlaps any of them before planning."""
        return []

    def write_check(self, plan: Any) -> Callable[[Path], dict] | None:
        """The check a write of `plan` (a `transforms.pipeline.Plan` with a step of this transform) runs on
        its staged output instead of the command's full one (`upcycler.verify.check_written`); None: the
        full check."""
        return None

    def after_write(self, plan: Any, step: int, out: Path, lent: TransformContext) -> AfterWrite | None:
        """What to report once `plan` is written to `out`, about its step number `step` (this transform),
        measured with what the command lends (`lent`: its services, as a `TransformContext`); None:
        nothing."""
        return None


NO_HOOKS = TransformHooks()


@dataclass(frozen=True)
class Transform:
    """A registered transform: its CLI name, its config class, its function and what it declares for the
    command that runs it (`hooks`)."""

    name: str
    config: type
    fn: TransformFn
    hooks: TransformHooks = NO_HOOKS

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()

    @property
    def summary(self) -> str:
        return self.doc.splitlines()[0] if self.doc else self.name

    def options(self) -> tuple[Option, ...]:
        return options(self.config)

    def make_config(self, values: Mapping[str, Any], where: str = "") -> Any:
        """The config from a mapping (recipe keys may use - or _), type-checked, with one-line errors."""
        return from_mapping(self.config, values, where or self.name, flags=True,
                            fix=f"see `upcycle {self.name} --help`")

    def apply(self, cfg: Any, spec: ModelSpec, tensors: TensorMap,
              context: TransformContext | None = None) -> Applied:
        """Run the transform with `context` (None: the empty context, a caller that lends nothing),
        collecting its notes and recorded fields, and account for every tensor: the result holds exactly the
        tensors its spec declares (each source tensor carried, transformed or dropped on purpose). Nothing is
        read or computed beyond the spec."""
        with _collecting() as collected:
            spec, tensors = self.fn(cfg, spec, tensors, TransformContext() if context is None else context)
        try:
            account(spec, tensors)
        except UpcyclerError as err:
            raise UpcyclerError(f"{self.name} produced an inconsistent model (a bug; please report it): {err}") \
                from None
        return Applied(spec, tensors, tuple(collected.notes), dict(collected.recorded), tuple(collected.inputs))


TRANSFORMS: dict[str, Transform] = {}


def register(name: str, config: type) -> Callable[[TransformFn], TransformFn]:
    """Register `fn(cfg, spec, tensors, context) -> (spec, tensors)` as the transform `name` with options
    `config` (`context`: its `TransformContext`)."""
    if not (dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"{config.__name__} must be a frozen dataclass")

    def decorate(fn: TransformFn) -> TransformFn:
        if name in TRANSFORMS:
            raise ValueError(f"transform {name!r} registered twice")
        TRANSFORMS[name] = Transform(name, config, fn)
        return fn

    return decorate


def declare(name: str, hooks: TransformHooks) -> None:
    """Give the registered transform `name` its hooks, from a module of its own that may import what the
    transform's module cannot (its write check, which imports the transform)."""
    if name not in TRANSFORMS:
        raise ValueError(f"transform {name!r} is not registered")
    if TRANSFORMS[name].hooks is not NO_HOOKS:
        raise ValueError(f"transform {name!r} declared its hooks twice")
    TRANSFORMS[name] = dataclasses.replace(TRANSFORMS[name], hooks=hooks)


def transform_named(name: str) -> Transform:
    """The registered transform `name`, or a one-line error listing the choices."""
    try:
        return TRANSFORMS[name]
    except KeyError:
        raise UpcyclerError(f"unknown transform {describe(name)}; "
                            f"choose one of {', '.join(sorted(TRANSFORMS))}") from None


def config_dict(cfg: Any) -> dict[str, Any]:
    """The options of a config as a plain dict (for lineage and recipes)."""
    return to_plain(cfg)
