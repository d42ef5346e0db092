"""`optimizer.trainable` against a model, without JAX: which canonical tensors it selects.

`check(trainable, spec, lineage)` is what `upcycler.train.loop.preflight` runs before a run directory exists:
`new_layers` must find the layers a depth growth recorded, a regular expression must select at least
one trainable tensor. A regex is searched with a time bound (`SEARCH_SECONDS` over all the model's
names), so a pattern that backtracks exponentially (`(a|a)*b`, `(\\w+)+!`) is refused naming the limit
instead of hanging the command; `upcycler.train.loop.optim.trainable_rows` searches the same way.
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io.manifest import new_layers as recorded_new_layers
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.untrusted import describe

SEARCH_SECONDS = 2.0  # the whole search of a pattern over every tensor name of a model


class _TooSlow(Exception):
    pass


def _raise_too_slow(signum: int, frame: Any) -> None:
    raise _TooSlow


def search(pattern: str, names: Sequence[str]) -> list[bool]:
    """Whether the regex `pattern` is found in each of `names`; `UpcyclerError` when the search takes more
    than `SEARCH_SECONDS` (bounded with SIGALRM on the main thread; elsewhere unbounded)."""
    compiled = re.compile(pattern)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return [compiled.search(name) is not None for name in names]
    previous = signal.signal(signal.SIGALRM, _raise_too_slow)
    pending, _ = signal.setitimer(signal.ITIMER_REAL, SEARCH_SECONDS)
    try:
        return [compiled.search(name) is not None for name in names]
    except _TooSlow:
        raise UpcyclerError(
            f"optimizer.trainable {describe(pattern)}: searching the model's {len(names)} tensor names took "
            f"over {SEARCH_SECONDS:g} s (nested repeats such as (a+)+ backtrack exponentially); simplify the "
            "regular expression, e.g. 'experts|router'"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:  # someone else's timer was running: give it back what was left
            signal.setitimer(signal.ITIMER_REAL, pending)


def new_layer_set(spec: ModelSpec, lineage: Sequence[Mapping[str, Any]]) -> frozenset[int]:
    """The layers every depth growth in `lineage` inserted (`optimizer.trainable: new_layers`)."""
    layers = recorded_new_layers(lineage)
    fix = ("grow the model with `upcycle depth` (which records them), or name the tensors to train with a "
           "regex, e.g. optimizer.trainable: '^layers\\.(4|9)\\.'")
    if layers is None:
        raise UpcyclerError("optimizer.trainable new_layers: the init checkpoint's lineage (upcycler.json) records "
                            f"no depth growth with its new layers; {fix}")
    if not layers:
        raise UpcyclerError("optimizer.trainable new_layers: the depth growth in the init checkpoint's lineage "
                            f"added no layer; {fix}")
    if any(j >= spec.num_layers for j in layers):
        raise UpcyclerError(f"optimizer.trainable new_layers: the lineage's new layers {list(layers)} are not all "
                            f"among the model's {spec.num_layers} layers; {fix}")
    return frozenset(layers)


def nothing_matches(trainable: str) -> UpcyclerError:
    return UpcyclerError(f"optimizer.trainable {describe(trainable)} matches no trainable tensor of the "
                         "model; fix the pattern (it is searched in canonical names such as "
                         "layers.3.attn.q_proj, embed, final_norm)")


def check(trainable: str, spec: ModelSpec, lineage: Sequence[Mapping[str, Any]] = ()) -> None:
    """Raise `UpcyclerError` unless `trainable` selects at least one trainable tensor of `spec`."""
    if trainable == "all":
        return
    if trainable == "new_layers":
        new_layer_set(spec, lineage)
        return
    names = [d.name for d in declare_params(spec) if not d.is_buffer]
    if not any(search(trainable, names)):
        raise nothing_matches(trainable)
