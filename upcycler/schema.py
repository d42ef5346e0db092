"""Typed options declared once: the fields of a frozen dataclass, checked from untrusted data and listed for CLIs.

A config is a frozen dataclass whose fields say `field(default, help=…, choices=…, range=Range(…))`.
From that one declaration:

- `from_mapping(cls, raw, where)` builds an instance from parsed YAML/JSON or flag values. Each value is
  checked for its exact type (bool, int, float, str, Path, `Literal`, `X | None`, `tuple[X, ...]`,
  `Mapping[str, X]`, a nested config dataclass), its choices and its range; bools are not numbers, NaN
  and infinities are refused (`upcycler.untrusted.integer` / `real`), unknown keys are refused with the
  list of known ones. Any input gives an instance or one `UpcyclerError` line naming `where` and the key
  path (`train.yaml: optimizer.lr must be …`).
- `to_plain(instance)` gives the plain data that `from_mapping` turns back into an equal instance.
- `options(cls)` lists the fields as `Option`s (name, key, type, default, help, choices, range), from
  which the command lines generate their flags; `read_options` checks a mapping against such a list.

Conventions: a key that is absent or null takes the field's default (a field without one is required;
null stays None where the type allows it); a float field also takes a numeric string (PyYAML reads
`3e-4` as text) and a text field an integer. With `flags=True` the keys are command-line options:
`router-std` and `router_std` are the same key, and messages name it `--router-std`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path, PurePath
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.locations import Location, local_path, location, recorded_location
from upcycler.untrusted import describe, integer, real

INT64 = (-(2**63), 2**63 - 1)  # the widest integer any option takes without a range of its own


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric option: `lo`/`hi` bounds (None = unbounded), each open or closed."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, value: float) -> bool:
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else _number(self.lo)
        hi = "inf" if self.hi is None else _number(self.hi)
        return f"{'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


@dataclass(frozen=True)
class Option:
    """One option as the command line and config files see it."""

    name: str  # the Python name, e.g. "router_std"
    type: Any  # the annotation without `| None`: bool, int, float, str, Path, or a compound type
    default: Any = None  # None when required
    help: str = ""
    choices: tuple | None = None
    range: Range | None = None
    key: str = ""  # the key in a config file, when it is not `name` (a keyword such as "async")
    metavar: str | None = None
    required: bool = False
    optional: bool = False  # null is a value of its own (the annotation says `| None`)

    @property
    def flag(self) -> str:
        return "--" + (self.key or self.name).rstrip("_").replace("_", "-")


def field(default: Any = MISSING, *, help: str = "", choices: tuple | None = None, range: Range | None = None,
          key: str | None = None, metavar: str | None = None) -> Any:
    """A dataclass field that is also a config key and a command-line option; no default: required."""
    meta = {"help": help, "choices": choices, "range": range, "key": key, "metavar": metavar}
    return dataclasses.field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


@functools.cache
def options(cls: type) -> tuple[Option, ...]:
    """The options of config dataclass `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint, optional = _strip_none(hints[f.name])
        required = f.default is MISSING and f.default_factory is MISSING
        default = None if required else f.default if f.default is not MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        if typing.get_origin(hint) is typing.Literal:
            hint, choices = str, typing.get_args(hint)
        out.append(Option(f.name, hint, default, f.metadata.get("help", ""), choices, f.metadata.get("range"),
                          f.metadata.get("key", f.name), f.metadata.get("metavar"), required, optional))
    return tuple(out)


def from_mapping(cls: type, raw: Any, where: str, *, flags: bool = False, fix: str = "fix the config") -> Any:
    """An instance of config dataclass `cls` from `raw`, every value checked; else one-line `UpcyclerError`."""
    return cls(**read_options(options(cls), raw, where, flags=flags, fix=fix))


def read_options(opts: tuple[Option, ...], raw: Any, where: str, *, flags: bool = False,
                 fix: str = "fix the config", path: str = "") -> dict[str, Any]:
    """`{option name: checked value}` for every option in `opts`, from the mapping `raw` at key `path`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise UpcyclerError(f"{where}: {path or 'the config'} must be a mapping of keys to values, "
                            f"not {describe(raw)}; {fix}")
    known = {o.key or o.name: o for o in opts}
    given = {}
    for key, value in raw.items():
        name = key.replace("-", "_") if flags and isinstance(key, str) else key
        if name not in known:
            listed = ", ".join(o.flag if flags else k for k, o in known.items())
            raise UpcyclerError(f"{where}: {path + ': ' if path else ''}unknown {'option' if flags else 'key'} "
                                f"{describe(key)}; allowed: {listed}")
        given[name] = value
    out = {}
    for key, opt in known.items():
        shown = opt.flag if flags else f"{path}.{key}" if path else key
        value = given.get(key)
        if value is None and opt.optional and key in given:
            out[opt.name] = None
        elif value is None and opt.required:
            raise UpcyclerError(f"{where}: needs {shown}; add it")
        elif value is None:
            out[opt.name] = opt.default
        else:
            out[opt.name] = check_value(opt, value, where, name=shown, fix=fix)
    return out


def check_value(opt: Option, value: Any, where: str, *, name: str | None = None, fix: str = "fix the config") -> Any:
    """`value` as option `opt`: its type, one of its choices, inside its range (None: only if optional)."""
    name = name or opt.name
    if value is None and opt.optional:
        return None
    checked = _typed(opt.type, value, name, where, fix, " or null" if opt.optional else "", opt.range)
    if opt.choices is not None and checked not in opt.choices:
        raise UpcyclerError(f"{where}: {name} is {describe(value)}; use one of {', '.join(map(str, opt.choices))}")
    return checked


def to_plain(value: Any) -> Any:
    """Plain YAML/JSON-able data (config keys, lists, strings for paths) that `from_mapping` reads back; a
    local copy of a remote source is written as its origin (`upcycler.locations.recorded_location`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {o.key or o.name: to_plain(getattr(value, o.name)) for o in options(type(value))}
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, PurePath):
        return recorded_location(value)
    return value


def validate(instance: Any, where: str, fix: str = "fix the config") -> None:
    """Raise `UpcyclerError` unless every field of a config built in code passes `from_mapping`'s checks."""
    from_mapping(type(instance), to_plain(instance), where, fix=fix)


_KINDS = {bool: "true or false", int: "int", float: "float", str: "text", Path: "a path",
          Location: "a path or gs:// URL"}


def _typed(hint: Any, value: Any, name: str, where: str, fix: str, or_null: str = "",
           bounds: Range | None = None) -> Any:
    """`value` as the type `hint` (a scalar, a tuple, a mapping or a config dataclass) and inside `bounds`,
    else `UpcyclerError`."""
    hint, optional = _strip_none(hint)
    if value is None and optional:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return hint(**read_options(options(hint), value, where, fix=fix, path=name))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise UpcyclerError(f"{where}: {name} must be a list, not {describe(value)}; {fix}")
        return tuple(_typed(args[0], v, f"{name}[{k}]", where, fix) for k, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise UpcyclerError(f"{where}: {name} must be a mapping, not {describe(value)}; {fix}")
        for k in value:
            if not isinstance(k, str):
                raise UpcyclerError(f"{where}: {name} has the key {describe(k)}; keys must be text; {fix}")
        return {k: _typed(args[1], v, f"{name}.{k}" if k.isprintable() else f"{name}[{k!r}]", where, fix)
                for k, v in value.items()}
    if origin is typing.Literal:
        if value not in args:
            raise UpcyclerError(f"{where}: {name} is {describe(value)}; use one of {', '.join(map(str, args))}")
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is float and isinstance(value, str):
        value = _yaml_float(value)
        number = isinstance(value, float)
    if hint is str and number and isinstance(value, int):
        value = str(value)
    ok = {bool: isinstance(value, bool), int: number and isinstance(value, int), float: number,
          str: isinstance(value, str),
          Path: isinstance(value, (str, PurePath)) and str(value) != "" and "\0" not in str(value)}.get(
        Path if hint is Location else hint)
    if ok is None:
        raise TypeError(f"unsupported option type {hint!r}")
    if not ok:
        raise UpcyclerError(f"{where}: {name} must be {_KINDS[hint]}{or_null}, not {describe(value)}; {fix}")
    if hint is Path:
        checked = local_path(value, f"{where}: {name}")
    elif hint is Location:
        checked = location(value, f"{where}: {name}")
    else:
        checked = real(value, name, where, fix=fix) if hint is float else value
    if bounds is not None and not bounds.contains(checked):
        raise UpcyclerError(f"{where}: {name} {describe(value)} is outside {bounds}; {fix}")
    if hint is int and bounds is None:
        return integer(value, name, where, low=INT64[0], high=INT64[1], fix=fix)
    return checked


def _strip_none(hint: Any) -> tuple[Any, bool]:
    """(`X`, True) for `X | None`; (`hint`, False) otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _yaml_float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _number(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"
