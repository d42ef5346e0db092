"""What every document reader of `prepare-data` shares: the `Document` type, opening a source file as a
regular file (a FIFO or device is refused without blocking) or memory-mapping it, and loading the
optional package a format needs.
"""

from __future__ import annotations

import importlib
import mmap
import os
from pathlib import Path
from types import ModuleType

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.untrusted import open_regular, shown_path

Document = str | np.ndarray  # text to tokenise, or the int64 token ids of one tokenised document

FIX_COLUMN = "pass --text-field NAME"  # the hint where a record has no usable text field


def check_source_file(path: Path) -> None:
    """Refuse `path` unless it is a readable regular file (a FIFO or device is refused without blocking)."""
    os.close(open_regular(path, "source file"))


def mapped(path: Path, what: str = "source file") -> np.ndarray:
    """The bytes of the regular file `path`, memory-mapped read-only (unmapped when the array goes)."""
    fd = open_regular(path, what)
    try:
        if os.fstat(fd).st_size == 0:
            return np.empty(0, np.uint8)
        return np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), np.uint8)
    finally:
        os.close(fd)  # the map keeps its own descriptor


def optional_module(module: str, path: Path, what: str, package: str) -> ModuleType:
    """The optional module `module`, or one line saying which package reading `what` needs."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UpcyclerError(
            f"{shown_path(path)}: reading {what} needs {package}; install it with `pip install {package}`"
        ) from None
