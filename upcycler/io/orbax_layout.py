"""The Orbax output layout: what `orbax_write` writes and `orbax_read` reads.

    OUT/upcycler.json      the manifest (`upcycler.io.manifest`): spec, lineage, `files` (the side files)
                           and `tensors`: {name: {dtype, shape, sha256}}, the sha256 of each tensor's
                           C-order bytes, whatever Orbax's storage layout
    OUT/params/            an Orbax checkpoint (orbax-checkpoint v1 layout); the pytree is in params/state/
    OUT/params/state/      OCDBT key-value store of zarr3 arrays, uncompressed, one key prefix per leaf
    OUT/tokenizer.json …   side files (tokenizer, generation config), copied

The tree is the canonical names split on "." into nested dicts, e.g. `{"embed": …, "layers": {"0": {"attn":
{"q_proj": …}}}}`, each leaf a host numpy array of the tensor's own dtype (bf16 stays bf16), with routed
experts stacked `[E, …]` and chunked one expert per chunk, so reading expert `e` reads only its bytes.
Training steps (`upcycler.train.loop.checkpointing`) use the same tree and manifest, without digests, and may
hold a second tree of the same shape, `ema/`, the moving average of the weights.
"""

from __future__ import annotations

from upcycler.io.checkpoint import SIDE_FILES

PARAMS = "params"
EMA = "ema"  # training steps with `optimizer.ema`: the weights' moving average, a tree like params/
WEIGHTS = {"params": PARAMS, "ema": EMA}  # what `read_checkpoint(..., weights=)` may read
TREE = "state"  # the v1 layout keeps the pytree of a checkpoint in this subdirectory
STEP_HF = "hf"  # a training step's Hugging Face export (`checkpoint.hf_every`), beside params/
STEP_SIDE_FILES = SIDE_FILES  # what a training step carries beside its arrays: tokenizer, chat template, generation config
COMMIT_FILE = "commit_success.txt"  # in a bucket, Orbax writes a step in place and this file last
CHUNK_BYTES = 64 * 1024**2  # Orbax chunk size; routed experts are additionally chunked one expert per chunk
