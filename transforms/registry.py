"""The registry of transforms: a frozen config dataclass plus one pure function, under its CLI name.

    @register("depth", Depth)
    def depth(cfg: Depth, spec: ModelSpec, tensors: TensorMap) -> tuple[ModelSpec, TensorMap]: ...

The config's fields are the transform's options, declared once: `option(default, help=…, choices=…)`
gives each field its help text and allowed values, and both the command line (`upcycler/cli/transforms.py`
turns every field into a click option) and recipes (`Transform.make_config` checks a YAML mapping) are
derived from them, so flags and config never drift apart; both pass through `make_config`, which checks
each value's type and choices and refuses NaN and infinities for float options. A field without a
default is a required option.

A transform never writes anything. What it wants the user to know (which family `auto` picked, that a
step is not function-preserving) it says with `report(...)`; `Transform.apply` collects those notes,
so a chain of transforms is still plain function composition over `(ModelSpec, TensorMap)`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.tensors import TensorMap
from upcycler.untrusted import describe, integer, real

TransformFn = Callable[[Any, ModelSpec, TensorMap], tuple[ModelSpec, TensorMap]]


@dataclass(frozen=True)
class Note:
    """Something a transform tells the user; `exact=False` marks a step that changes the model's function."""

    text: str
    exact: bool = True


_NOTES: ContextVar[list[Note] | None] = ContextVar("transform_notes", default=None)


def report(text: str, *, exact: bool = True) -> None:
    """Tell the user something about the transform being applied (collected by `Transform.apply`)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append(Note(text, exact))


@contextmanager
def _collecting() -> Iterator[list[Note]]:
    notes: list[Note] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def option(default: Any = dataclasses.MISSING, *, help: str, choices: tuple[str, ...] | None = None,
           metavar: str | None = None) -> Any:
    """A config field that is also a command-line option (`--field-name`) and a recipe key."""
    meta = {"help": help, "choices": choices, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class OptionInfo:
    """One option of a transform, as the command line and recipes see it."""

    name: str  # field name, e.g. "router_std"
    type: type  # int, float, str or bool
    required: bool
    default: Any
    help: str
    choices: tuple[str, ...] | None
    metavar: str | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Applied:
    """The result of one transform: the new model and what the transform reported."""

    spec: ModelSpec
    tensors: TensorMap
    notes: tuple[Note, ...]

    @property
    def exact(self) -> bool:
        return all(n.exact for n in self.notes)


@dataclass(frozen=True)
class Transform:
    """A registered transform: its CLI name, its config class and its function."""

    name: str
    config: type
    fn: TransformFn

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()

    @property
    def summary(self) -> str:
        return self.doc.splitlines()[0] if self.doc else self.name

    def options(self) -> list[OptionInfo]:
        hints = typing.get_type_hints(self.config)
        out = []
        for f in dataclasses.fields(self.config):
            required = f.default is dataclasses.MISSING
            out.append(OptionInfo(
                f.name, _base_type(hints[f.name]), required, None if required else f.default,
                f.metadata.get("help", ""), f.metadata.get("choices"), f.metadata.get("metavar"),
            ))
        return out

    def make_config(self, values: Mapping[str, Any], where: str = "") -> Any:
        """The config from a mapping (recipe keys may use - or _), type-checked, with one-line errors."""
        where = where or self.name
        known = {o.name: o for o in self.options()}
        kwargs = {}
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise UpcyclerError(f"{where}: unknown option {describe(key)}; "
                                    f"{self.name} takes {', '.join(known)}")
            kwargs[name] = _check_value(known[name], value, where)
        missing = [o.flag for o in known.values() if o.required and o.name not in kwargs]
        if missing:
            raise UpcyclerError(f"{where}: {self.name} needs {', '.join(missing)}")
        return self.config(**kwargs)

    def apply(self, cfg: Any, spec: ModelSpec, tensors: TensorMap) -> Applied:
        """Run the transform, collecting its notes. Nothing is read or computed beyond the spec."""
        with _collecting() as notes:
            spec, tensors = self.fn(cfg, spec, tensors)
        return Applied(spec, tensors, tuple(notes))


TRANSFORMS: dict[str, Transform] = {}


def register(name: str, config: type) -> Callable[[TransformFn], TransformFn]:
    """Register `fn(cfg, spec, tensors) -> (spec, tensors)` as the transform `name` with options `config`."""
    if not (dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"{config.__name__} must be a frozen dataclass")

    def decorate(fn: TransformFn) -> TransformFn:
        if name in TRANSFORMS:
            raise ValueError(f"transform {name!r} registered twice")
        TRANSFORMS[name] = Transform(name, config, fn)
        return fn

    return decorate


def transform_named(name: str) -> Transform:
    """The registered transform `name`, or a one-line error listing the choices."""
    try:
        return TRANSFORMS[name]
    except KeyError:
        raise UpcyclerError(f"unknown transform {describe(name)}; "
                            f"choose one of {', '.join(sorted(TRANSFORMS))}") from None


def config_dict(cfg: Any) -> dict[str, Any]:
    """The options of a config as a plain dict (for lineage and recipes)."""
    return dataclasses.asdict(cfg)


def _base_type(hint: Any) -> type:
    """int / float / str / bool from a field annotation, unwrapping `X | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _base_type(args[0])
    if hint in (int, float, str, bool):
        return hint
    raise TypeError(f"unsupported option type {hint!r}")


def _check_value(opt: OptionInfo, value: Any, where: str) -> Any:
    """`value` as option `opt` (its type, one of its choices; a float finite, an int within 64 bits), else
    a one-line error naming the option. A null (None) for an optional option means its default."""
    if value is None and not opt.required:
        return opt.default
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, (str, int)) and not isinstance(value, bool),
    }[opt.type]
    if not ok:
        raise UpcyclerError(f"{where}: {opt.flag} must be {opt.type.__name__}, not {describe(value)}")
    if opt.type is float:
        return real(value, opt.flag, where, fix=f"give {opt.flag} a finite number")
    if opt.type is int:  # 64 bits is plenty for any count or seed, and keeps messages short
        return integer(value, opt.flag, where, low=-(2**63), high=2**63 - 1,
                       fix=f"give {opt.flag} a smaller number")
    value = opt.type(value)
    if opt.choices and value not in opt.choices:
        raise UpcyclerError(f"{where}: {opt.flag} must be one of {', '.join(opt.choices)}, "
                            f"not {describe(value)}")
    return value
