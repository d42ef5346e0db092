"""Evaluate checkpoints with the JAX model: logits on given tokens, and next-token loss on held-out text.

Used by `upcycle verify` (same function?) and by the notebooks (held-out loss of dense vs upcycled
models trained on the same budget). Everything runs in fp32 at the highest matmul precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def checkpoint_logits(ckpt: Any, ids_BL: np.ndarray) -> np.ndarray:
    """fp32 logits [B, L, V] of a (lazy) `Checkpoint` on token ids [B, L]; weights are loaded only here."""
    import jax

    from upcycler.train.model import ModelConfig, forward_jit
    from upcycler.train.model.params import from_tensors

    params = from_tensors(ckpt.spec, ckpt.tensors, dtype=np.float32)
    with jax.default_matmul_precision("highest"):
        logits, _ = forward_jit(params, ids_BL, ckpt.spec, ModelConfig(compute_dtype="float32"))
    return np.asarray(logits, dtype=np.float32)


def heldout_loss(path: str | Path, tokens: np.ndarray, *, seq_len: int = 128, batch: int = 8,
                 max_windows: int = 32) -> float:
    """Mean next-token cross-entropy (nats) of the checkpoint at `path` over consecutive windows of `tokens`.

    Windows of `seq_len + 1` tokens overlap by one token (every token after the first is a target once);
    at most `max_windows` windows, evaluated `batch` at a time.
    """
    import jax

    from upcycler.io import read_checkpoint
    from upcycler.train.model import ModelConfig, forward_jit
    from upcycler.train.model.params import from_tensors

    ckpt = read_checkpoint(path)
    params = from_tensors(ckpt.spec, ckpt.tensors, dtype=np.float32)
    count = min(max_windows, (len(tokens) - 1) // seq_len)
    if count < 1:
        raise ValueError(f"need at least {seq_len + 1} tokens, got {len(tokens)}")
    windows = np.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(count)]).astype(np.int32)
    total, n = 0.0, 0
    with jax.default_matmul_precision("highest"):
        for start in range(0, count, batch):
            chunk = windows[start:start + batch]
            logits, _ = forward_jit(params, chunk[:, :-1], ckpt.spec, ModelConfig(compute_dtype="float32"))
            logp = jax.nn.log_softmax(logits, axis=-1)
            picked = np.take_along_axis(np.asarray(logp), chunk[:, 1:, None], axis=-1)[..., 0]
            total += float(-picked.sum())
            n += picked.size
    return total / n
