"""Reading and writing checkpoints: the one entry point of `upcycler.io`.

`read_checkpoint(path)` detects an HF or Orbax directory and reads it lazily; `write_checkpoint(ckpt,
out, to=...)` writes one. The modules below form layers, each importing only those under it:

    top      this facade (format detection and dispatch)
    middle   hf_read, hf_write, orbax_read, orbax_write       (one per format and direction)
    bottom   checkpoint (the type), manifest (`upcycler.json`), staging (temp sibling + rename),
             integrity (manifest digests), safetensors_file, orbax_layout, hashing
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import SIDE_FILES, Checkpoint
from upcycler.io.manifest import MANIFEST
from upcycler.locations import hub_id_hint
from upcycler.untrusted import shown_path

__all__ = ["MANIFEST", "SIDE_FILES", "Checkpoint", "detect_format", "read_checkpoint", "write_checkpoint"]


def detect_format(path: Path) -> str:
    """"hf" for a directory with config.json, "orbax" for one written by our Orbax writer."""
    if not path.exists():
        raise UpcyclerError(f"{shown_path(path)}: no such directory; check the path{hub_id_hint(path)}")
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


def read_checkpoint(path: str | Path, weights: str = "params") -> Checkpoint:
    """Read an HF or Orbax checkpoint directory lazily (no tensor bytes are read here); `weights="ema"`
    reads the moving average a training step saved beside its parameters."""
    path = Path(path)
    if detect_format(path) == "hf":
        if weights != "params":
            raise UpcyclerError(f"{shown_path(path)}: a Hugging Face checkpoint holds one set of weights; "
                                f"--weights {weights} reads a training step (RUN_DIR/<step>)")
        from upcycler.io.hf_read import read_hf

        return read_hf(path)
    from upcycler.io.orbax_read import read_orbax

    return read_orbax(path, weights)


def write_checkpoint(ckpt: Checkpoint, out: str | Path, *, to: str = "hf", **options: Any) -> Path:
    """Write `ckpt` to `out` as "hf" or "orbax"; see the writers for the options."""
    out = Path(out)
    if to == "hf":
        from upcycler.io.hf_write import write_hf

        return write_hf(ckpt, out, **options)
    if to == "orbax":
        from upcycler.io.orbax_read import read_orbax
        from upcycler.io.orbax_write import write_orbax

        check = options.pop("check", None)

        def layout_then_check(staged: Path) -> dict | None:
            read_orbax(staged)  # the tree as written: exactly the declared leaves, shapes and dtypes
            return check(staged) if check is not None else None

        return write_orbax(ckpt, out, check=layout_then_check, **options)
    raise UpcyclerError(f"unknown output format {to!r}; use hf or orbax")
