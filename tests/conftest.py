"""Shared pytest fixtures: tiny models per family, cached for the session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import make_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """`tiny_dir(family, **overrides)` -> path of a saved tiny model, built once per argument set."""
    cache: dict = {}

    def build(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny(family, tmp_path_factory.mktemp(family), **overrides)
        return cache[key]

    return build
