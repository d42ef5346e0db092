"""The one door for untrusted bytes: regular files only, size caps, bounded JSON and YAML, bounded messages.

Every file a user hands us (config.json, a manifest, a recipe, a training config, a data line, a metrics
line) is read through here, so a FIFO cannot hang a read, `/dev/zero` cannot fill memory, `[`×100000
cannot overflow the stack, a YAML alias bomb cannot expand, and no value from a file reaches an error
message unbounded. Numbers taken from files are checked with `integer` / `real` before anything is sized
by them. Every failure is an `UpcyclerError` naming the file; a file in a local copy of a remote source
(a bucket mirror, a Hub snapshot) is named by its origin (`show_as`), not by the cache.

What this module preserves: a valid document parses to exactly what `json.loads` / `yaml.safe_load`
would give (YAML anchors and aliases keep working within a bound on the expanded size).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from upcycler.errors import UpcyclerError

MAX_JSON_BYTES = 64 * 1024**2  # a sharded index of a very large model is a few MB
MAX_YAML_BYTES = 1024**2  # recipes and training configs are a few KB
MAX_YAML_NODES = 100_000  # nodes after expanding aliases
MAX_NESTING = 64  # levels of lists/mappings in any config we read


def describe(value: Any, limit: int = 60) -> str:
    """A short, single-line rendering of a value from a file, for error messages (never unbounded)."""
    if isinstance(value, bool) or value is None:
        text = repr(value)
    elif isinstance(value, int):
        text = repr(value) if value.bit_length() < 200 else f"<integer of {value.bit_length()} bits>"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = repr(value[: limit + 1])
    elif isinstance(value, (list, tuple)):
        text = f"<list of {len(value)}>"
    elif isinstance(value, dict):
        text = f"<mapping of {len(value)}>"
    else:
        text = f"<{type(value).__name__}>"
    return escape(text if len(text) <= limit else text[: limit - 1] + "…")


def escape(text: str) -> str:
    """`text` on one line: control characters (newlines included) shown as escapes."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii")
                   for c in text)


_SHOWN_AS: dict[str, str] = {}


def show_as(local: str | os.PathLike, shown: str) -> None:
    """From now on in this process, messages name the local directory or file `local`, and every path
    under it, as `shown` (the origin it is a copy of: a bucket URL, a Hub id)."""
    local = os.fspath(local).rstrip("/")
    if local:
        _SHOWN_AS[local] = shown.rstrip("/")


def _as_shown(text: str) -> str:
    """`text` with a local copy's path replaced by its origin (`show_as`); else unchanged."""
    for local, shown in _SHOWN_AS.items():
        if text == local or text.startswith(local + "/"):
            return shown + text[len(local):]
    return text


def shown_path(path: str | os.PathLike) -> str:
    """A path as it may appear in a one-line message: a path in a local copy of a remote source is named
    by its origin (`show_as`), so a message points at what the user gave."""
    return escape(_as_shown(os.fspath(path)))


def open_regular(path: Path, what: str = "file") -> int:
    """A read-only descriptor of `path`, which must be a regular file (never blocks on a FIFO or device)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UpcyclerError(f"{shown_path(path)}: missing; check the path") from None
    except IsADirectoryError:
        raise UpcyclerError(f"{shown_path(path)}: is a directory; pass the {what} itself") from None
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot open ({err.strerror}); "
                            "check the file and its permissions") from None
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        os.close(fd)
        raise UpcyclerError(f"{shown_path(path)}: is a directory; pass the {what} itself")
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UpcyclerError(f"{shown_path(path)}: not a regular file (a device, pipe or socket); "
                            f"replace it with the real {what}")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: Path, *, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of the regular file `path`, refused when larger than `max_bytes`; the buffer is sized by
    the file, not by the cap (a 1 KB file never costs a 64 MB allocation)."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(min(size, max_bytes) + 1)
            if size < len(data) <= max_bytes:  # it grew after fstat: read on, up to the cap
                data += f.read(max_bytes + 1 - len(data))
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot read ({err.strerror}); check the file") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UpcyclerError(f"{shown_path(path)}: larger than {max_bytes:,} bytes, too large for a {what}; "
                            "check that this is the right file")
    return data


def read_text(path: Path, *, max_bytes: int, what: str = "file") -> str:
    """The UTF-8 text of the regular file `path` (size-capped)."""
    data = read_bytes(path, max_bytes=max_bytes, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UpcyclerError(f"{shown_path(path)}: not UTF-8 text (a binary file?); pass the {what}") from None


def parse_json(text: str | bytes, where: str, fix: str = "fix the file") -> Any:
    """The JSON value of `text`; NaN/Infinity literals, huge numbers and deep nesting are refused."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UpcyclerError(f"{where}: unreadable JSON ({escape(str(err))[:120]}); {fix}") from None
    except RecursionError:
        raise UpcyclerError(f"{where}: JSON nested too deeply; {fix}") from None
    except ValueError as err:  # a number with too many digits, or a NaN/Infinity literal
        raise UpcyclerError(f"{where}: unreadable JSON ({escape(str(err))[:120]}); {fix}") from None
    _check_depth(value, where, fix)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")



def load_json_object(path: Path, *, fix: str = "fix or re-download it", max_bytes: int = MAX_JSON_BYTES,
                     what: str = "JSON file") -> dict[str, Any]:
    """The JSON object stored in the regular file `path`."""
    value = parse_json(read_bytes(path, max_bytes=max_bytes, what=what), shown_path(path), fix)
    if not isinstance(value, dict):
        raise UpcyclerError(f"{shown_path(path)}: expected a JSON object, found {describe(value)}; {fix}")
    return value


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents whose alias-expanded size or nesting is out of bounds."""


def parse_yaml(text: str, where: str, fix: str = "fix the file") -> Any:
    """The value of a YAML document, like `yaml.safe_load`, with aliases and nesting bounded."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # the reader already refuses some characters
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {}, 0, where, fix)
        if size > MAX_YAML_NODES:
            raise UpcyclerError(f"{where}: YAML expands to more than {MAX_YAML_NODES:,} nodes "
                                f"(aliases of aliases?); {fix}")
        value = loader.construct_document(node)
    except yaml.YAMLError as err:
        first = escape(str(err).splitlines()[0] if str(err) else type(err).__name__)[:160]
        raise UpcyclerError(f"{where}: not valid YAML ({first}); {fix}") from None
    except RecursionError:
        raise UpcyclerError(f"{where}: YAML nested too deeply; {fix}") from None
    except ValueError as err:  # e.g. an integer with too many digits
        raise UpcyclerError(f"{where}: not valid YAML ({escape(str(err))[:120]}); {fix}") from None
    finally:
        if loader is not None:
            loader.dispose()
    return value


def _expanded_size(node: yaml.Node, memo: dict[int, int], depth: int, where: str, fix: str) -> int:
    """How many nodes the document has once every alias is expanded (memoised: linear in the real size)."""
    if depth > MAX_NESTING:
        raise UpcyclerError(f"{where}: YAML nested more than {MAX_NESTING} levels deep; {fix}")
    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = MAX_YAML_NODES + 1  # a node that contains itself expands without end
    size = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        size += _expanded_size(child, memo, depth + 1, where, fix)
        if size > MAX_YAML_NODES:
            break
    memo[id(node)] = size
    return size


def load_yaml(path: Path, *, what: str, fix: str = "fix the file", max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The YAML document stored in the regular file `path` (size-capped, aliases bounded)."""
    return parse_yaml(read_text(path, max_bytes=max_bytes, what=what), shown_path(path), fix)


def _check_depth(value: Any, where: str, fix: str) -> None:
    """Refuse JSON nested deeper than `MAX_NESTING` (iteratively: no recursion on hostile input)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise UpcyclerError(f"{where}: JSON nested more than {MAX_NESTING} levels deep; {fix}")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def integer(value: Any, name: str, where: str, *, low: int = 1, high: int | None = None,
            fix: str = "fix the file") -> int:
    """`value` if it is an integer in [low, high] (bools, floats and strings are refused)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise UpcyclerError(f"{where}: {name} must be an integer, not {describe(value)}; {fix}")
    if value < low or (high is not None and value > high):
        bound = f"between {low:,} and {high:,}" if high is not None else f"at least {low:,}"
        raise UpcyclerError(f"{where}: {name} must be {bound}, not {describe(value)}; {fix}")
    return value


def real(value: Any, name: str, where: str, *, low: float | None = None, high: float | None = None,
         fix: str = "fix the file") -> float:
    """`value` as a finite float in [low, high] (integers are accepted; bools, strings, NaN, inf are not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UpcyclerError(f"{where}: {name} must be a number, not {describe(value)}; {fix}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise UpcyclerError(f"{where}: {name} must be a finite number, not {describe(value)}; {fix}")
    if (low is not None and number < low) or (high is not None and number > high):
        bound = (f"between {low:g} and {high:g}" if low is not None and high is not None
                 else f"at least {low:g}" if low is not None else f"at most {high:g}")
        raise UpcyclerError(f"{where}: {name} must be {bound}, not {describe(value)}; {fix}")
    return number


def duplicate_key(text: str) -> tuple[Any, int] | None:
    """(the first key given twice in one mapping, its 1-based line) of a YAML document that `parse_yaml`
    accepted, or None. YAML forbids duplicate keys but PyYAML keeps the last silently; a recipe that lists
    a source twice under one name would lose one. Merge keys (`<<`) may be overridden, as YAML allows."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
    finally:
        loader.dispose()
    stack, seen = ([node] if node is not None else []), set()
    while stack:
        item = stack.pop()
        if id(item) in seen:  # aliases share nodes: each is visited once
            continue
        seen.add(id(item))
        if isinstance(item, yaml.MappingNode):
            keys = set()
            for key, value in item.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if (key.tag, key.value) in keys:
                        return key.value, key.start_mark.line + 1
                    keys.add((key.tag, key.value))
                stack.extend((key, value))
        elif isinstance(item, yaml.SequenceNode):
            stack.extend(item.value)
    return None
