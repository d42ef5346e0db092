"""An attention changed to fit a target family (`--allow-approximate`), made as close as it can be and measured.

`moe_target.fit_attention` finds the fewest attention changes a family needs: zero biases added (exact),
biases or q/k norms dropped, q/k norms inserted. The lossy ones are not written blind: `approximate`

1. fits inserted q/k norms on calibration data (`--calibration DIR`, prepared with the source's tokenizer)
   instead of leaving them at weight 1, with the trainer's JAX model (the context's `attention_fit`,
   `upcycler.train.evaluation.attention_fit`, run before anything is written);
2. measures the result against the source — the same dense model with its own attention — on held-out
   windows of the same data: mean KL(source ‖ approximated) per token and top-1 agreement, reported in the
   write's notes and recorded in its manifest (`approximate_attention`), together with what the unfitted
   change would have given (weight-1 norms), so the fit's gain is on record;
3. refuses, with those numbers, when the top-1 agreement is below `--min-agreement`.

Where the MoE built around it is exact (the default routers, a power-of-two or fp32 scale), the written model
is as far from its source as this dense one is.
"""

from __future__ import annotations

from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import Checkpoint
from upcycler.spec import ModelSpec
from upcycler.tensors import TensorMap, constant
from upcycler.transforms.moe_target import Target, apply_attention
from upcycler.transforms.registry import TransformContext, record, report


def approximate(target: Target, source: ModelSpec, tensors: TensorMap, context: TransformContext, *,
                calibration: Path | None, sequences: int, length: int, min_agreement: float) -> TensorMap:
    """`tensors` with the attention changes of `target` made, inserted q/k norms fitted with the attention fit
    `context` lends (module docstring)."""
    changed = apply_attention(target, source, tensors)
    if not target.lossy:
        return changed
    flag = "--allow-approximate"
    if context.attention_fit is None:
        raise UpcyclerError(f"{flag} fits and measures the changed attention with the JAX model; this command "
                            "cannot (use `upcycle dense-to-moe` or `upcycle run`)")
    if calibration is None:
        raise UpcyclerError(f"{flag}: {'; '.join(target.lossy)} changes what the model computes; pass "
                            "--calibration DIR (`upcycle prepare-data` output made with the source's tokenizer) "
                            "to fit the change and measure it against the source")
    # the model as this step sees it (a recipe's earlier steps may have changed it), with its tokenizer files
    reference = Checkpoint(spec=source, tensors=tensors, side_files=context.side_files)
    inserted = dict(target.attention).get("qk_norm") is True
    fit = context.attention_fit()
    tokens = fit.tokens(Path(calibration), reference, sequences, length)  # checked (and cheap) even in --dry-run
    if not fit.measures:  # --dry-run: nothing is computed
        report(f"{'q/k norms fitted and ' if inserted else ''}the changed attention measured against the source "
               f"on {tokens.calibration.size:,} tokens of {calibration} when written")
        return changed
    approximated = reference.replace(spec=source.replace(**dict(target.attention)), tensors=changed)
    measured: dict[str, float] = {}
    if inserted:
        measured["unfitted_kl"], measured["unfitted_top1"] = fit.agreement(reference, approximated, tokens.heldout)
        norms = fit.fit_qk_norms(reference, approximated, tokens.calibration)
        changed = changed.updated({name: constant(w.astype(changed[name].dtype)) for name, w in norms.items()})
        approximated = approximated.replace(tensors=changed)
    measured["kl"], measured["top1"] = fit.agreement(reference, approximated, tokens.heldout)
    where = (f"{tokens.heldout.size:,} held-out tokens of {tokens.heldout_from}")
    unfitted = (f" (weight-1 norms: {measured['unfitted_top1']:.1%}, KL {measured['unfitted_kl']:.3f}; fitted on "
                f"{tokens.calibration.size:,} tokens)" if inserted else "")
    summary = (f"top-1 agreement with the source {measured['top1']:.1%}, KL {measured['kl']:.3f} nats/token on "
               f"{where}{unfitted}")
    if measured["top1"] < min_agreement:
        raise UpcyclerError(f"{flag}: {'; '.join(target.lossy)} leaves the model far from its source: {summary}, "
                            f"below --min-agreement {min_agreement:g}; choose a --target that holds the source's "
                            "attention, or lower --min-agreement to write it anyway")
    report(f"approximate attention: {summary}", exact=False)
    record(approximate_attention={"changes": list(target.lossy), "heldout": tokens.heldout_from,
                                  "heldout_tokens": int(tokens.heldout.size),
                                  "calibration_tokens": int(tokens.calibration.size),
                                  **{k: round(v, 6) for k, v in measured.items()}})
    return changed
