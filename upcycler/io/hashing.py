"""Streaming sha256 of files, in bounded memory."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
