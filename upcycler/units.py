"""Sizes and counts for people: parsing "5GB" and printing 1.23B, in one place."""

from __future__ import annotations

import re

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe

_SIZE = re.compile(r"^\s*(\d{1,15}(?:\.\d{1,9})?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int, what: str = "size", most: int | None = None) -> int:
    """'5GB' -> 5e9, '512MiB' -> 512·2^20, '1000' (or 1000) -> 1000 bytes; at least one byte (at most `most`).

    `what` names the option or key in the one-line error (e.g. "--shard-size").
    """
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    m = _SIZE.match(text) if isinstance(text, str) else None
    if not m:
        raise UpcyclerError(f"{what}: {describe(text)} is not a size; use e.g. 5GB, 500MB, 2GiB")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(unit) + 1 if unit else 0
    size = int(number * (1024 if binary else 1000) ** power)
    if size < 1:
        raise UpcyclerError(f"{what}: {describe(text)} is less than one byte; use e.g. 5GB, 500MB, 2GiB")
    if most is not None and size > most:
        raise UpcyclerError(f"{what}: {describe(text)} is more than the limit of {most:,} bytes; use e.g. 16GiB")
    return size


_COUNT = re.compile(r"^\s*(\d{1,15}(?:\.\d{1,9})?)\s*([KMBT]?)\s*$", re.IGNORECASE)


def parse_count(text: str, what: str = "count") -> int:
    """'2.3B' -> 2_300_000_000, '800M', '12K', '1.2T', '5000' (parameters, tokens); at least one."""
    m = _COUNT.match(text) if isinstance(text, str) else None
    count = int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()]) if m else 0
    if count < 1:
        raise UpcyclerError(f"{what}: {describe(text)} is not a count; use e.g. 2.3B, 800M or 5000")
    return count


def human_count(n: int) -> str:
    """1234567 -> '1.23M' (parameters, tokens)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    """1234567 -> '1.23 MB' (decimal units, as disks and the Hub count)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
