"""Per-step training metrics: the JSONL log, model FLOPs and MFU, and the progress display.

`RUN_DIR/metrics.jsonl` gets one JSON object per step, written by the primary process only:

    step            the step's index (0-based; checkpoint N holds the state before step N)
    loss            mean next-token cross-entropy over the batch's real (mask = 1) target tokens
    loss/<source>   the same per data source (absent when the batch holds no token of that source)
    lb_loss, z_loss load-balancing and router z losses (mean over MoE layers; absent for dense models)
    total_loss      loss + lb_coef·lb_loss + z_coef·z_loss, what the gradient is of
    grad_norm       global L2 norm of the gradients before clipping
    lr              learning rate used by this step
    tokens          real target tokens in the batch
    step_time, tokens_per_s   wall time of the step and B·L / step_time
    mfu             model FLOPs utilisation against `metrics.peak_flops` per device (only when set)
    expert_load     per MoE layer, the fraction of token copies each expert received (every
                    `metrics.expert_load_every` steps); sums to 1 per layer

A resumed run first drops the lines of steps at or after its start step (they were not checkpointed), so
the log always describes one uninterrupted trajectory.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from upcycler.layout import declare_params
from upcycler.spec import ModelSpec

METRICS_FILE = "metrics.jsonl"


def matmul_params(spec: ModelSpec) -> int:
    """Parameters that take part in a matmul for one token: every weight matrix but the embedding
    lookup (the LM head counts, tied or not), routed experts counted `top_k` times, norms and biases not."""
    total = spec.vocab_size * spec.hidden_size if spec.tie_embeddings else 0
    for p in declare_params(spec):
        if p.name == "embed" or len(p.shape) < 2 or p.is_buffer:
            continue
        if p.expert_stacked:
            total += p.numel // p.shape[0] * spec.moe.top_k  # type: ignore[union-attr]
        else:
            total += p.numel
    return total


def flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6·matmul params + causal attention 6·layers·H·h·L."""
    attention = 6 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len
    return 6.0 * matmul_params(spec) + attention


class MetricsLog:
    """Appends one JSON line per step to RUN_DIR/metrics.jsonl (a no-op on non-primary processes)."""

    def __init__(self, run_dir: Path, *, enabled: bool, start_step: int):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self._file: TextIO | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _truncate_from(self.path, start_step)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def step_record(
    step: int,
    raw: Mapping[str, Any],
    *,
    sources: Sequence[str],
    step_time: float,
    batch_tokens: int,
    flops_per_step: float,
    peak_flops: float | None,
    num_devices: int,
    with_load: bool,
) -> dict[str, Any]:
    """The JSON record of one step from the train step's (host) metric arrays."""
    rec: dict[str, Any] = {"step": step, "loss": float(raw["loss"])}
    src_loss, src_tokens = np.asarray(raw["source_loss"]), np.asarray(raw["source_tokens"])
    for name, loss_sum, count in zip(sources, src_loss, src_tokens):
        if count > 0:
            rec[f"loss/{name}"] = float(loss_sum / count)
    for key in ("lb_loss", "z_loss"):
        if key in raw:
            rec[key] = float(raw[key])
    rec.update(
        total_loss=float(raw["total_loss"]),
        grad_norm=float(raw["grad_norm"]),
        lr=float(raw["lr"]),
        tokens=int(raw["tokens"]),
        step_time=step_time,
        tokens_per_s=batch_tokens / step_time,
    )
    if peak_flops:
        rec["mfu"] = flops_per_step / step_time / (peak_flops * num_devices)
    if with_load and "expert_counts" in raw:
        counts = np.asarray(raw["expert_counts"], dtype=np.float64)
        totals = np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
        rec["expert_load"] = np.round(counts / totals, 6).tolist()
    return rec


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of RUN_DIR/metrics.jsonl, in file order (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _truncate_from(path: Path, start_step: int) -> None:
    """Keep only the complete records of steps before `start_step`."""
    if not path.exists():
        return
    kept = [json.dumps(r) for r in read_metrics(path.parent) if r.get("step", math.inf) < start_step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


class Progress:
    """A tqdm bar on an interactive terminal; otherwise a plain line every `every` steps (primary only)."""

    def __init__(self, *, enabled: bool, start: int, total: int, every: int = 10):
        self.every = every
        self.enabled = enabled
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        summary = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s"
        if "mfu" in record:
            summary += f" mfu {100 * record['mfu']:.1f}%"
        if self._bar is not None:
            self._bar.set_postfix_str(summary, refresh=False)
            self._bar.update(1)
        elif record["step"] % self.every == 0:
            print(f"step {record['step']}: {summary}", flush=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
