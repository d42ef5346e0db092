"""What `upcycle eval` adds to how the model runs: FlexPrefill's options (the `--prefill-*` flags).

The training config's `ModelConfig` says how the model runs (dtype, attention implementation,
rematerialisation) and is a static argument of every jitted forward; FlexPrefill's selection options
are used only by a prefill for evaluation (`prefill.PrefillModel`, `device_prefill`), so they live here,
declared once with their types, ranges and help, and neither a training config nor a compiled train step
carries them. What this module preserves: the flags, their defaults and the `prefill` block of
`upcycle eval`'s JSON output (the field names) are those of the options it declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from upcycler.schema import Range, field

if TYPE_CHECKING:
    from upcycler.train.model.flexprefill import FlexPrefillOptions

PREFILL_BUDGET_RULES = ("coverage", "reference")
PREFILL_KERNELS = ("auto", "sparse")


@dataclass(frozen=True)
class PrefillConfig:
    """FlexPrefill's selection: coverage γ, pattern threshold τ, block size, budgets, budget rule, the
    density above which a layer runs dense and how the accelerator's kernel is chosen (each an
    `upcycle eval --prefill-*` flag)."""

    prefill_gamma: float = field(0.95, range=Range(0, 1, lo_open=True),
                                 help="flexprefill: the attention mass the selected key blocks must cover.")
    prefill_tau: float = field(0.1, range=Range(0, 1),
                               help="flexprefill: heads whose pooled Q/K estimate is closer than this (√JSD) "
                                    "to the probe choose blocks by pooled Q/K (query-aware); 0: never.")
    prefill_block: int = field(128, range=Range(16, 4096), help="flexprefill: tokens per query and key block.")
    prefill_min_budget: int = field(1024, range=Range(0, 1 << 24),
                                    help="flexprefill: tokens of vertical and of slash blocks kept at least; "
                                         "prompts up to max(2 blocks, this) run dense.")
    prefill_max_budget: int = field(0, range=Range(0, 1 << 24),
                                    help="flexprefill: tokens of vertical and of slash blocks kept at most (0: no limit).")
    prefill_budget_rule: str = field("coverage", choices=PREFILL_BUDGET_RULES,
                                     help="flexprefill: coverage (count blocks until their mass reaches γ) or "
                                          "reference (the official code's tokens // 128 + 1 blocks).")
    prefill_dense_above: float = field(0.5, range=Range(0, 1),
                                       help="flexprefill: a layer whose selection keeps more than this fraction of "
                                            "the causal blocks runs dense.")
    prefill_kernel: str = field("auto", choices=PREFILL_KERNELS,
                                help="flexprefill on a TPU or GPU: auto (the sparse kernel only where the cost model "
                                     "predicts it beats dense attention for the batch) or sparse (whenever the "
                                     "selection is under --prefill-dense-above).")

    def options(self) -> FlexPrefillOptions:
        """The model's FlexPrefill options these flags give."""
        from upcycler.train.model.flexprefill import FlexPrefillOptions

        return FlexPrefillOptions(gamma=self.prefill_gamma, tau=self.prefill_tau, block=self.prefill_block,
                                  min_budget=self.prefill_min_budget, max_budget=self.prefill_max_budget,
                                  budget_rule=self.prefill_budget_rule, dense_above=self.prefill_dense_above,
                                  kernel=self.prefill_kernel)
