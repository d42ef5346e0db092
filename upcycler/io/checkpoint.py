"""`Checkpoint`: a model in flight between a reader and a writer, and the files that travel with it.

A checkpoint is a `ModelSpec`, a lazy `TensorMap`, the lineage so far (what it was read from, what was
done to it), the side files (tokenizer, generation config) that a writer copies, and its inputs: the
directories its tensors are read from (an output may never overlap them) with the digest watches that
check those reads against the inputs' manifests (`upcycler.io.integrity`). Reading and writing one
is `upcycler.io`'s job (`read_checkpoint`, `write_checkpoint`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.integrity import DigestWatch
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.tensors import BF16, TensorMap, dtype_name

SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)

# The dtypes a model's weights may be stored in: what the transforms compute with and the JAX model runs.
WEIGHT_DTYPES = (BF16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def require_weight_dtype(where: str, name: str, dtype: np.dtype, like: tuple[str, np.dtype] | None = None) -> None:
    """Refuse, before any byte is read, a weight stored in a dtype that is not floating point (int32 weights
    would be transformed and written, and only then fail the function check), or, with `like` (the name and
    dtype of the first slice of the same stacked tensor), a slice whose dtype differs from its siblings'."""
    if np.dtype(dtype) not in WEIGHT_DTYPES:
        kinds = ", ".join(dtype_name(d) for d in WEIGHT_DTYPES)
        raise UpcyclerError(f"{where}: tensor {name!r} is stored as {dtype_name(dtype)}; model weights must be "
                            f"floating point ({kinds}); dequantize the checkpoint or convert it from a "
                            "floating-point source first")
    if like is not None and np.dtype(dtype) != like[1]:
        raise UpcyclerError(f"{where}: tensor {name!r} is stored as {dtype_name(dtype)} but {like[0]!r}, another "
                            f"expert of the same tensor, as {dtype_name(like[1])}; re-save the checkpoint in "
                            "one dtype")


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

    def cast(self, dtype: Any) -> Checkpoint:
        """Every floating tensor as `dtype`, except buffers (the router's selection bias), which stay float32
        as the layout declares them: a rounded bias would choose other experts."""
        buffers = {p.name for p in declare_params(self.spec) if p.is_buffer}
        cast = self.tensors.astype(dtype)
        return self.replace(tensors=TensorMap({k: self.tensors[k] if k in buffers else cast[k] for k in cast}))

    def with_step(self, step: dict[str, Any], spec: ModelSpec, tensors: TensorMap) -> Checkpoint:
        """The checkpoint after one more lineage step that produced `spec` and `tensors`."""
        return self.replace(spec=spec, tensors=tensors, lineage=(*self.lineage, step))
