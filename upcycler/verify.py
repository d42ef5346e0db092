"""Do two checkpoints compute the same function? Probe both with the JAX model and compare their logits.

Both are read with `read_checkpoint` (HF or Orbax) and run in fp32 at the highest matmul precision on the
same probe tokens (random ids below the smaller vocabulary, from a seed); the statistics are max and mean
|Δlogits| and KL(A‖B) of the next-token distributions. One model is in memory at a time. Used by
`upcycle verify` and the notebooks.

Options are checked before any weight is read: a finite tolerance ≥ 0, a seed ≥ 0, and a probe of
bounded size: at most `MAX_TOKENS` positions per sequence and the models' `max_position_embeddings`,
`MAX_BATCH` sequences, `MAX_PROBE` positions in all and `MAX_LOGITS` logits per model, so a typo cannot
ask for hundreds of GB. A model whose logits are not finite (NaN or inf weights) is an error naming its
path and, when it has one, the first non-finite tensor: its logits cannot be compared with anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.tensors import BF16
from upcycler.train.evaluate import checkpoint_logits
from upcycler.untrusted import escape, integer, real, shown_path

MAX_TOKENS = 8192  # positions per probe sequence
MAX_BATCH = 64  # probe sequences
MAX_PROBE = 16384  # positions in all (batch × tokens)
MAX_LOGITS = 2**27  # positions × vocabulary: 512 MiB of fp32 logits per model (compared in fp64)


def check_options(*, tokens: int, batch: int, seed: int, tolerance: float = 0.0) -> None:
    """Refuse a probe or tolerance that is invalid or absurdly large, naming the option and its limit."""
    real(tolerance, "the tolerance", "--tolerance", low=0.0, fix="pass a small number, e.g. --tolerance 1e-4")
    integer(tokens, "the probe length", "--tokens", high=MAX_TOKENS, fix="pass e.g. --tokens 64")
    integer(batch, "the number of probe sequences", "--batch", high=MAX_BATCH, fix="pass e.g. --batch 2")
    integer(seed, "the seed", "--seed", low=0, fix="pass a non-negative integer")
    if tokens * batch > MAX_PROBE:
        raise UpcyclerError(f"--batch × --tokens: {batch:,} × {tokens:,} probe positions is more than "
                            f"{MAX_PROBE:,}; pass a smaller --batch or --tokens")


def probe_ids(vocab: int, *, batch: int, tokens: int, seed: int) -> np.ndarray:
    """The probe: [batch, tokens] token ids uniform in [0, vocab), reproducible from `seed`."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, tokens), dtype=np.int32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(a: Path, b: Path, *, tokens: int = 64, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """Run both checkpoints on one probe and return the statistics (see the module docstring)."""
    from upcycler.io import read_checkpoint
    from upcycler.train.model import unsupported

    check_options(tokens=tokens, batch=batch, seed=seed)
    ckpt_a, ckpt_b = read_checkpoint(a), read_checkpoint(b)
    for path, ckpt in ((a, ckpt_a), (b, ckpt_b)):
        reasons = unsupported(ckpt.spec)
        if reasons:
            raise UpcyclerError(f"{shown_path(path)}: the JAX model cannot run this checkpoint: "
                                f"{'; '.join(reasons)}")
        limit = ckpt.spec.max_position_embeddings
        if tokens > limit:
            raise UpcyclerError(f"--tokens: {tokens:,} is more than the max_position_embeddings of "
                                f"{shown_path(path)} ({limit:,}); pass --tokens {limit} or less")
    spec_a, spec_b = ckpt_a.spec, ckpt_b.spec
    widest = max(spec_a.vocab_size, spec_b.vocab_size)
    if batch * tokens * widest > MAX_LOGITS:
        raise UpcyclerError(f"--batch × --tokens: {batch:,} × {tokens:,} positions × a vocabulary of "
                            f"{widest:,} is more than {MAX_LOGITS:,} logits per model; pass a smaller "
                            f"--batch or --tokens (at most {MAX_LOGITS // widest:,} positions in all)")
    vocab = min(spec_a.vocab_size, spec_b.vocab_size)
    ids = probe_ids(vocab, batch=batch, tokens=tokens, seed=seed)
    logits_a = checkpoint_logits(ckpt_a, ids)
    logits_b = checkpoint_logits(ckpt_b, ids)
    ckpt_a.check_inputs()  # upcycler outputs: what was read matches their manifests
    ckpt_b.check_inputs()
    _require_finite([(a, ckpt_a, logits_a), (b, ckpt_b, logits_b)])
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


def _require_finite(runs: list[tuple[Path, Any, np.ndarray]]) -> None:
    """Refuse models whose logits hold NaN or inf, naming each one and its first non-finite tensor."""
    bad = []
    for path, ckpt, logits in runs:
        if not np.isfinite(logits).all():
            name = _first_non_finite(ckpt)
            why = (f"non-finite weights (NaN or inf in tensor {escape(name)})" if name
                   else "non-finite logits (its weights overflow fp32)")
            bad.append(f"{shown_path(path)}: {why}")
    if bad:
        raise UpcyclerError("; ".join(bad) + "; their logits are not finite and cannot be compared; "
                            "re-create the checkpoint from a good source")


def _first_non_finite(ckpt: Any) -> str | None:
    """The name of the first tensor of `ckpt` holding NaN or inf (one tensor in memory at a time)."""
    for name, tensor in ckpt.tensors.items():
        values = tensor.load()
        if (values.dtype.kind in "fc" or values.dtype == BF16) and not np.isfinite(values).all():
            return name
    return None


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
