"""Streaming sha256 of files, in bounded memory."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, streamed by `hashlib.file_digest` (which releases the GIL while hashing)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
