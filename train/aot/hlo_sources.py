"""Where an instruction of an HLO module came from: the Python stack that traced it, read from the module text.

An HLO module printed by XLA carries four tables before its computations — `FileNames`, `FunctionNames`,
`FileLocations` and `StackFrames` — and each instruction's metadata names its innermost frame
(`stack_frame_id=N`). A frame points at a file location and at its caller's frame; a frame that names
itself (or 0) as its parent is the outermost. This module reads the tables and answers, for a frame, the
stack innermost first, so a traffic or time figure can be charged to the line of our code that asked for
it (`hbm_traffic.breakdown`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_ENTRY = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


@dataclass(frozen=True)
class Frame:
    """One Python frame: the file (as the tracing process saw it), the line and the function."""

    file: str
    line: int
    function: str

    def short(self) -> str:
        """`dir/file.py:line function`: the file's last two path parts, enough to find it in the tree."""
        parts = self.file.replace("\\", "/").split("/")
        return f"{'/'.join(parts[-2:])}:{self.line} {self.function}"


class SourceTables:
    """The stack-frame tables of one HLO module's text."""

    def __init__(self, hlo_text: str):
        tables: dict[str, dict[int, str]] = {name: {} for name in _TABLES}
        current = None
        for line in hlo_text.splitlines():
            if line in _TABLES:
                current = tables[line]
                continue
            if current is None:
                continue
            entry = _ENTRY.match(line)
            if entry is None:  # a blank line, or the computations begin
                current = None
                continue
            current[int(entry.group(1))] = entry.group(2)
        self._files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
        self._functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
        self._locations = {k: _fields(v) for k, v in tables["FileLocations"].items()}
        self._frames = {k: _fields(v) for k, v in tables["StackFrames"].items()}

    def stack(self, frame_id: int) -> list[Frame]:
        """The frames of `frame_id`, innermost first; empty for 0 or an id the tables do not hold."""
        out: list[Frame] = []
        seen: set[int] = set()
        while frame_id and frame_id in self._frames and frame_id not in seen:
            seen.add(frame_id)
            frame = self._frames[frame_id]
            location = self._locations.get(frame.get("file_location_id", 0), {})
            out.append(Frame(self._files.get(location.get("file_name_id", 0), "?"), location.get("line", 0),
                             self._functions.get(location.get("function_name_id", 0), "?")))
            frame_id = frame.get("parent_frame_id", 0)
        return out


def _fields(entry: str) -> dict[str, int]:
    """`{file_name_id=3 line=12 …}` as a dict of its integer fields."""
    return {name: int(value) for name, value in _FIELD.findall(entry)}
