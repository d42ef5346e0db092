"""Digests: the streaming sha256 of files, and the xxh3-128 of a tensor's bytes, in bounded memory."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import xxhash


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, streamed by `hashlib.file_digest` (which releases the GIL while hashing)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tensor_digest(array: np.ndarray) -> str:
    """The hex xxh3-128 of `array`'s C-order bytes: what `ShardWriter` records for a tensor it wrote."""
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
