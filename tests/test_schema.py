"""The option schema: one declaration gives checked configs, plain data and the list of flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from upcycler.errors import UpcyclerError
from upcycler.schema import Range, field, from_mapping, options, read_options, to_plain, validate


@dataclass(frozen=True)
class Inner:
    lr: float = field(0.1, range=Range(0, 1, hi_open=True), help="Learning rate.")
    kind: Literal["a", "b"] = field("a", help="Which kind.")


@dataclass(frozen=True)
class Outer:
    steps: int = field(range=Range(1, 100), help="How many steps.")
    out: Path = field(help="Where to write.")
    name: str | None = field(None, choices=("x", "y"), help="A name.")
    flag: bool = field(False, key="async", help="A keyword as a key.")
    inner: Inner = Inner()
    phases: tuple[Inner, ...] = ()
    weights: Mapping[str, float] | None = field(None, help="Share of each source.")


def build(raw, **kw):
    return from_mapping(Outer, raw, "train.yaml", **kw)


def test_a_valid_mapping_round_trips():
    raw = {"steps": 3, "out": "o", "async": True, "inner": {"lr": "3e-4", "kind": "b"},
           "phases": [{"lr": 0.5}], "name": None, "weights": {"web": 1}}
    config = build(raw)
    assert config == Outer(3, Path("o"), None, True, Inner(3e-4, "b"), (Inner(0.5),), {"web": 1.0})
    assert build(to_plain(config)) == config
    assert to_plain(config)["async"] is True and to_plain(config)["out"] == "o"
    validate(config, "code")


@pytest.mark.parametrize("raw, message", [
    ({"out": "o"}, "train.yaml: needs steps"),
    ({"steps": True, "out": "o"}, "train.yaml: steps must be int, not True"),
    ({"steps": 1.0, "out": "o"}, "steps must be int"),
    ({"steps": 0, "out": "o"}, "steps 0 is outside [1, 100]"),
    ({"steps": 9 ** 99, "out": "o"}, "steps"),
    ({"steps": 1, "out": "a\0b"}, "out must be a path"),
    ({"steps": 1, "out": "o", "inner": {"lr": 1}}, "inner.lr 1 is outside [0, 1)"),
    ({"steps": 1, "out": "o", "inner": {"lr": "nan"}}, "inner.lr must be a finite number"),
    ({"steps": 1, "out": "o", "inner": {"lr": float("inf")}}, "inner.lr must be a finite number"),
    ({"steps": 1, "out": "o", "inner": {"kind": "c"}}, "inner.kind is 'c'; use one of a, b"),
    ({"steps": 1, "out": "o", "inner": [1]}, "inner must be a mapping"),
    ({"steps": 1, "out": "o", "inner": {"lrr": 1}}, "inner: unknown key 'lrr'; allowed: lr, kind"),
    ({"steps": 1, "out": "o", "phases": [{"lr": -1}]}, "phases[0].lr -1 is outside"),
    ({"steps": 1, "out": "o", "phases": {"lr": 1}}, "phases must be a list"),
    ({"steps": 1, "out": "o", "name": "z"}, "name is 'z'; use one of x, y"),
    ({"steps": 1, "out": "o", "async": 1}, "async must be true or false"),
    ({"steps": 1, "out": "o", "stepz": 1}, "unknown key 'stepz'"),
    ({"steps": 1, "out": "o", "weights": {"web": True}}, "weights.web must be float"),
    ({"steps": 1, "out": "o", "weights": {1: 0.5}}, "weights has the key 1"),
    ([1], "train.yaml: the config must be a mapping"),
])
def test_bad_values_give_one_line_naming_the_key(raw, message):
    with pytest.raises(UpcyclerError) as err:
        build(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_flags_mode_takes_dashes_and_names_flags():
    with pytest.raises(UpcyclerError, match="unknown option 'colour'"):
        build({"steps": 1, "out": "o", "colour": 1}, flags=True)
    with pytest.raises(UpcyclerError, match="needs --steps"):
        build({"out": "o"}, flags=True)
    with pytest.raises(UpcyclerError, match="--async must be true or false"):
        build({"steps": 1, "out": "o", "async": "yes"}, flags=True)


def test_options_list_what_a_command_line_needs():
    steps, _, name, flag, inner, *_ = options(Outer)
    assert (steps.name, steps.type, steps.required, steps.range, steps.help) == (
        "steps", int, True, Range(1, 100), "How many steps.")
    assert (name.optional, name.choices, name.default) == (True, ("x", "y"), None)
    assert (flag.key, flag.flag, flag.default) == ("async", "--async", False)
    assert options(Inner)[1].choices == ("a", "b") and inner.type is Inner
    checked = read_options(options(Inner), {"lr": 0.5}, "merge", flags=True)
    assert checked == {"lr": 0.5, "kind": "a"}
