"""The Hugging Face export of a training step in a bucket run_dir (`checkpoint.hf_every` with gs://).

The step's weights (`STEP/params/`) and its manifest and tokenizer files are mirrored into this host's
upcycler cache (`upcycler.io.remote_sources.mirror`; the optimiser state is not fetched), converted there
as a local step is, and the result published to `STEP/hf/` with the bucket commit protocol
(`upcycler.io.bucket_output`): a killed export is never taken as finished and the next one replaces it.

What this module preserves: the export holds the bytes a local run_dir's export of the same step holds.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from upcycler.io import object_store
from upcycler.io.bucket_output import check_output, publish
from upcycler.io.manifest import MANIFEST
from upcycler.io.orbax_layout import PARAMS, STEP_HF, STEP_SIDE_FILES
from upcycler.io.remote_sources import cache_root, mirror
from upcycler.locations import remember_origin


def export_step(step_dir: Path, dtype: str, *, convert: Callable[..., Path]) -> Path:
    """Export the committed bucket step `step_dir` to `step_dir/hf/` in `dtype` with `convert` (the local
    export, `checkpointing.export_hf(local_step, dtype, out=…)`); returns the export's location."""
    url = str(step_dir)
    local = mirror(f"{url}/{PARAMS}").parent
    for name in (MANIFEST, *STEP_SIDE_FILES):
        if object_store.object_info(f"{url}/{name}") is not None:
            mirror(f"{url}/{name}")
    remember_origin(local, url)
    out = f"{url}/{STEP_HF}"
    check_output(out, overwrite=True)
    root = cache_root() / "staging"
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix="export-", dir=root))
    try:
        publish(convert(local, dtype, out=stage / STEP_HF), out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return step_dir / STEP_HF
