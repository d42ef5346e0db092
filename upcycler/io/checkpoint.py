"""`Checkpoint`: a model in flight between a reader and a writer, and the files that travel with it.

A checkpoint is a `ModelSpec`, a lazy `TensorMap`, the lineage so far (what it was read from, what was
done to it), the side files (tokenizer, generation config) that a writer copies, and its inputs: the
directories its tensors are read from (an output may never overlap them) with the digest watches that
check those reads against the inputs' manifests (`upcycler.io.integrity`). `read_checkpoint`
detects the format of a directory; `write_checkpoint` dispatches on the requested output format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io.integrity import DigestWatch
from upcycler.io.staging import MANIFEST
from upcycler.spec import ModelSpec
from upcycler.tensors import TensorMap
from upcycler.untrusted import shown_path

__all__ = ["MANIFEST", "SIDE_FILES", "Checkpoint", "detect_format", "read_checkpoint", "write_checkpoint"]
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


@dataclass(frozen=True)
class Checkpoint:
    """A model read from disk (or produced by transforms), not yet written anywhere."""

    spec: ModelSpec
    tensors: TensorMap
    source: Path | None = None
    lineage: tuple[dict[str, Any], ...] = ()
    side_files: tuple[Path, ...] = ()
    inputs: tuple[Path, ...] = ()  # directories whose bytes the tensors read
    watches: tuple[DigestWatch, ...] = ()  # manifest digests of what is read from them

    def check_inputs(self) -> None:
        """Compare everything read from the inputs with their manifests; raise naming what differs."""
        for watch in self.watches:
            watch.check()

    def replace(self, **changes: Any) -> Checkpoint:
        return dataclasses.replace(self, **changes)

    def with_step(self, step: dict[str, Any], spec: ModelSpec, tensors: TensorMap) -> Checkpoint:
        """The checkpoint after one more lineage step that produced `spec` and `tensors`."""
        return self.replace(spec=spec, tensors=tensors, lineage=(*self.lineage, step))


def detect_format(path: Path) -> str:
    """"hf" for a directory with config.json, "orbax" for one written by our Orbax writer."""
    if not path.exists():
        raise UpcyclerError(f"{shown_path(path)}: no such directory; check the path")
    if not path.is_dir():
        raise UpcyclerError(f"{shown_path(path)}: not a directory; pass the checkpoint directory, not a file "
                            "inside it")
    if (path / "config.json").exists():
        return "hf"
    if (path / "params").is_dir() and (path / MANIFEST).exists():
        return "orbax"
    raise UpcyclerError(
        f"{shown_path(path)}: no config.json (Hugging Face) or params/ + {MANIFEST} (Orbax) found; "
        "point at a checkpoint directory"
    )


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read an HF or Orbax checkpoint directory lazily (no tensor bytes are read here)."""
    path = Path(path)
    if detect_format(path) == "hf":
        from upcycler.io.hf_read import read_hf

        return read_hf(path)
    from upcycler.io.orbax_io import read_orbax

    return read_orbax(path)


def write_checkpoint(ckpt: Checkpoint, out: str | Path, *, to: str = "hf", **options: Any) -> Path:
    """Write `ckpt` to `out` as "hf" or "orbax"; see the writers for the options."""
    out = Path(out)
    if to == "hf":
        from upcycler.io.hf_write import write_hf

        return write_hf(ckpt, out, **options)
    if to == "orbax":
        from upcycler.io.orbax_io import write_orbax

        return write_orbax(ckpt, out, **options)
    raise UpcyclerError(f"unknown output format {to!r}; use hf or orbax")
