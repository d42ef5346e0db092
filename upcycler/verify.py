"""Do two checkpoints compute the same function? Probe both with the JAX model and compare their logits.

Both are read with `read_checkpoint` (HF or Orbax) and run in fp32 at the highest matmul precision on the
same probe tokens (random ids below the smaller vocabulary, from a seed); the statistics are max and mean
|Δlogits| and KL(A‖B) of the next-token distributions. One model is in memory at a time. Used by
`upcycle verify` and the notebooks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.evaluate import checkpoint_logits


def probe_ids(vocab: int, *, batch: int, tokens: int, seed: int) -> np.ndarray:
    """The probe: [batch, tokens] token ids uniform in [0, vocab), reproducible from `seed`."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, tokens), dtype=np.int32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(a: Path, b: Path, *, tokens: int = 64, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """Run both checkpoints on one probe and return the statistics (see the module docstring)."""
    from upcycler.io.checkpoint import read_checkpoint
    from upcycler.train.model import unsupported

    ckpt_a, ckpt_b = read_checkpoint(a), read_checkpoint(b)
    for path, ckpt in ((a, ckpt_a), (b, ckpt_b)):
        reasons = unsupported(ckpt.spec)
        if reasons:
            raise UpcyclerError(f"{path}: the JAX model cannot run this checkpoint: {'; '.join(reasons)}")
    spec_a, spec_b = ckpt_a.spec, ckpt_b.spec
    vocab = min(spec_a.vocab_size, spec_b.vocab_size)
    ids = probe_ids(vocab, batch=batch, tokens=tokens, seed=seed)
    logits_a = checkpoint_logits(ckpt_a, ids)
    logits_b = checkpoint_logits(ckpt_b, ids)
    logits_a, logits_b = logits_a[..., :vocab], logits_b[..., :vocab]
    delta = np.abs(logits_a.astype(np.float64) - logits_b)
    logp_a, logp_b = _log_softmax(logits_a), _log_softmax(logits_b)
    kl = (np.exp(logp_a) * (logp_a - logp_b)).sum(axis=-1)
    return {
        "a": {"path": str(a), "family": spec_a.family, "params": spec_a.total_params()},
        "b": {"path": str(b), "family": spec_b.family, "params": spec_b.total_params()},
        "probe": {"batch": batch, "tokens": tokens, "seed": seed, "vocab": vocab},
        "vocab_compared": vocab if spec_a.vocab_size != spec_b.vocab_size else None,
        "max_abs_diff": float(delta.max()),
        "mean_abs_diff": float(delta.mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
    }


def verdict(stats: dict[str, Any], tolerance: float) -> tuple[bool, str]:
    """(passed, one-line verdict); NaN anywhere fails."""
    worst = stats["max_abs_diff"]
    if worst <= tolerance:
        return True, f"same function: max |Δlogits| {worst:.2e} ≤ tolerance {tolerance:.1e}"
    return False, f"different functions: max |Δlogits| {worst:.2e} > tolerance {tolerance:.1e}"


def format_stats(stats: dict[str, Any]) -> str:
    a, b, probe = stats["a"], stats["b"], stats["probe"]
    lines = [
        f"A               {a['path']} ({a['family']}, {a['params']:,} params)",
        f"B               {b['path']} ({b['family']}, {b['params']:,} params)",
        f"probe           {probe['batch']} × {probe['tokens']} tokens, seed {probe['seed']}",
        f"max |Δlogits|   {stats['max_abs_diff']:.3e}",
        f"mean |Δlogits|  {stats['mean_abs_diff']:.3e}",
        f"KL(A‖B)         {stats['kl_mean']:.3e} mean, {stats['kl_max']:.3e} max over positions",
    ]
    if stats["vocab_compared"] is not None:
        lines.append(
            f"note            vocabularies differ; compared the first {stats['vocab_compared']} entries"
        )
    return "\n".join(lines)
