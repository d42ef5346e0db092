"""`upcycle verify A B`: do two checkpoints compute the same function? (e.g. an upcycle and its parent)

Runs both with the JAX model, one layer at a time, on the same probe tokens (`upcycler.verify`) and prints
max and mean |Δlogits|, KL(A‖B), top-1 agreement and A's own fp32 noise floor. Exit 0 when max |Δlogits|
is within `NOISE_FACTOR` × that floor (or ≤ `--tolerance`, an absolute bound, when given), else exit 1
with a one-line verdict that names its criterion and the first layer that differs. Bad options (a NaN,
infinite or negative tolerance, a probe beyond its limits), vocabularies that differ (unless
`--shared-vocab`) and a model with NaN/inf weights are errors:
one `error:` line naming the option or the model, exit 2, before or instead of a verdict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from upcycler.cli.path_type import SOURCE
from upcycler.verify import MAX_BATCH, MAX_TOKENS, NOISE_FACTOR, check_options, compare, format_stats, verdict


@click.command("verify")
@click.argument("a", type=SOURCE)
@click.argument("b", type=SOURCE)
@click.option(
    "--tolerance", type=float, default=None,
    help=f"Largest max |Δlogits| that passes, absolute (default: {NOISE_FACTOR:g} × A's measured fp32 noise floor).",
)
@click.option(
    "--tokens", type=int, default=64, show_default=True,
    help=f"Probe sequence length (at most {MAX_TOKENS} and the models' max_position_embeddings).",
)
@click.option(
    "--batch", type=int, default=2, show_default=True, help=f"Probe sequences (at most {MAX_BATCH})."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the probe token ids.")
@click.option(
    "--shared-vocab", is_flag=True,
    help="When the vocabularies differ (a padded or extended embedding), compare the logits of the ids both have.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
def command(a: Path, b: Path, tolerance: float | None, tokens: int, batch: int, seed: int, shared_vocab: bool,
            as_json: bool) -> None:
    """Check that checkpoints A and B compute the same next-token logits (exit 1 when they do not)."""
    check_options(tokens=tokens, batch=batch, seed=seed, tolerance=tolerance)
    stats = compare(a, b, tokens=tokens, batch=batch, seed=seed, shared_vocab=shared_vocab)
    passed, line = verdict(stats, tolerance)
    if as_json:
        click.echo(json.dumps({**stats, "tolerance": tolerance, "passed": passed, "verdict": line}, indent=2))
    else:
        click.echo(format_stats(stats))
        click.echo(line)
    if not passed:
        sys.exit(1)
