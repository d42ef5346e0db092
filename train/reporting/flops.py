"""Model FLOPs of training, counted from the architecture: what MFU is measured with.

`flops_per_token` is the one analytic count (forward + backward) behind the trainer's `mfu` (against the
per-device peak of `peak`), the compile-only report and planner (`upcycler.train.aot`) and the step
benchmark; it reads only the `ModelSpec`, never a compiled program.

What this module preserves: one count for all of them, 6 FLOPs per matmul parameter per token (routed
experts counted `top_k` times; the embedding lookup, norms and biases not) plus causal attention's
6·layers·heads·head_dim·seq_len.
"""

from __future__ import annotations

from upcycler.layout import declare_params
from upcycler.spec import ModelSpec


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
