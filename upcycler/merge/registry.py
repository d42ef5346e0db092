"""The registry of merge methods: one small, pure function per method, declared with a decorator.

Two kinds of method exist:

- *Averaging* methods (`@averaging`) only choose the weights of a weighted average,
  `weights(n, *, options…) -> w` with `w` of length n. The average itself is one shared streaming
  kernel (`upcycler.merge.averaging.weighted_average`) that holds a single fp32 accumulator, so memory
  does not grow with the number of inputs.
- *Tensor* methods (`@merge_method`) merge the tensors stored under one name (one expert at a time for
  stacked experts): `fn(tensors, [base], [weights], [rng], *, options…) -> fp32 array`, where `tensors`
  is an iterator that reads each input only when advanced and yields fresh fp32 arrays (a method may
  modify them in place).

A method's options are its keyword-only parameters, annotated `Annotated[float, Range(…), "help"]`
with a default. They are read as `upcycler.schema.Option`s and checked by `upcycler.schema.read_options`
like every other option; the command line derives `--option` flags from them (`lambda_` becomes
`--lambda`).
Parameters named `base`, `weights` and `rng` in the signature say that the method needs a base model,
takes per-input weights, and draws random numbers (seeded per tensor, see `upcycler.merge.plan`).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.schema import Option, Range, read_options
from upcycler.untrusted import describe

Tensors = Iterator[np.ndarray]
Kind = Literal["average", "tensor"]


@dataclass(frozen=True)
class Method:
    """A registered merge method."""

    name: str
    kind: Kind
    fn: Callable[..., np.ndarray]
    paper: str
    args: tuple[Option, ...]
    needs_base: bool
    weights: Literal["required", "optional", "none"]
    seeded: bool
    min_inputs: int
    max_inputs: int | None
    streams: bool  # True: memory does not grow with the number of inputs

    @property
    def summary(self) -> str:
        return (self.fn.__doc__ or self.name).strip().splitlines()[0]

    def bind(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every option of this method, from `given` or its default; refuses options it does not take, and
        values that are not finite numbers or are outside the option's range."""
        for name in given:
            if name not in {a.name for a in self.args}:
                flag = Option(name, float).flag
                raise UpcyclerError(f"method {self.name} takes no {flag}; see `upcycle merge --help`")
        return read_options(self.args, given, f"merge --method {self.name}", flags=True,
                            fix="see `upcycle merge --help`")


METHODS: dict[str, Method] = {}


def averaging(name: str, *, paper: str, min_inputs: int = 1) -> Callable:
    """Register `fn(n, [weights], *, options…) -> weights` as a weighted-average method."""
    return _register(name, "average", paper, min_inputs=min_inputs, max_inputs=None, streams=True)


def merge_method(name: str, *, paper: str, min_inputs: int = 1, max_inputs: int | None = None,
                 streams: bool = True) -> Callable:
    """Register `fn(tensors, [base], [weights], [rng], *, options…) -> array` as a tensor merge method.

    `streams=False` declares that the method holds every input's tensor at once.
    """
    return _register(name, "tensor", paper, min_inputs=min_inputs, max_inputs=max_inputs, streams=streams)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise UpcyclerError(f"unknown merge method {describe(name)}; use one of {', '.join(METHODS)}") from None


def _register(name: str, kind: Kind, paper: str, *, min_inputs: int, max_inputs: int | None,
              streams: bool) -> Callable:
    def decorate(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        params = inspect.signature(fn).parameters
        weights = "none"
        if "weights" in params:
            weights = "optional" if params["weights"].default is not inspect.Parameter.empty else "required"
        METHODS[name] = Method(
            name=name, kind=kind, fn=fn, paper=paper, args=_args(fn), needs_base="base" in params,
            weights=weights, seeded="rng" in params, min_inputs=min_inputs, max_inputs=max_inputs,
            streams=streams,
        )
        return fn

    return decorate


def _args(fn: Callable) -> tuple[Option, ...]:
    """The keyword-only parameters of `fn`, read from their `Annotated[type, Range?, help]` hints."""
    hints = typing.get_type_hints(fn, include_extras=True)
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        hint = hints[p.name]
        base, *meta = typing.get_args(hint)
        rng = next((m for m in meta if isinstance(m, Range)), None)
        text = next((m for m in meta if isinstance(m, str)), "")
        out.append(Option(p.name, base, p.default, text, range=rng))
    return tuple(out)
