"""`upcycle verify A B`: do two checkpoints compute the same function? (e.g. an upcycle and its parent)

Both are read with `read_checkpoint` (HF or Orbax), run by the JAX model in fp32 at the highest matmul
precision on the same probe tokens (random ids below the smaller vocabulary, from `--seed`), and their
next-token logits compared: max and mean |Δlogits| and KL(A‖B) of the next-token distributions. Exit 0
when max |Δlogits| ≤ `--tolerance`, else exit 1 with a one-line verdict. One model is in memory at a time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

from upcycler.errors import UpcyclerError


def probe_ids(vocab: int, *, batch: int, tokens: int, seed: int) -> np.ndarray:
    """The probe: [batch, tokens] token ids uniform in [0, vocab), reproducible from `seed`."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, tokens), dtype=np.int32)


def checkpoint_logits(ckpt: Any, ids: np.ndarray) -> np.ndarray:
    """fp32 logits [B, L, V] of a (lazy) `Checkpoint` on `ids`; its weights are loaded only here."""
    import jax

    from upcycler.train.model import ModelConfig, forward_jit
    from upcycler.train.params import from_tensors

    params = from_tensors(ckpt.spec, ckpt.tensors, dtype=np.float32)
    with jax.default_matmul_precision("highest"):
        logits, _ = forward_jit(params, ids, ckpt.spec, ModelConfig(compute_dtype="float32"))
    return np.asarray(logits, dtype=np.float32)


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


@click.command("verify")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option(
    "--tolerance", type=float, default=1e-4, show_default=True, help="Largest |Δlogits| that passes."
)
@click.option(
    "--tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Probe sequence length."
)
@click.option("--batch", type=click.IntRange(min=1), default=2, show_default=True, help="Probe sequences.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the probe token ids.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
def command(a: Path, b: Path, tolerance: float, tokens: int, batch: int, seed: int, as_json: bool) -> None:
    """Check that checkpoints A and B compute the same next-token logits (exit 1 when they do not)."""
    stats = compare(a, b, tokens=tokens, batch=batch, seed=seed)
    passed, line = verdict(stats, tolerance)
    if as_json:
        click.echo(json.dumps({**stats, "tolerance": tolerance, "passed": passed, "verdict": line}, indent=2))
    else:
        click.echo(format_stats(stats))
        click.echo(line)
    if not passed:
        sys.exit(1)
