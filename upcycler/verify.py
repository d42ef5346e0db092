"""Do two checkpoints compute the same function? Probe both with the JAX model and judge the difference
against the fp32 noise floor of the models themselves.

Both are read with `read_checkpoint` (HF or Orbax) and run one layer at a time (`upcycler.train.evaluation.layerwise`:
fp32, highest matmul precision, one layer in memory) on the same probe tokens (random ids from a seed).
Two models whose vocabularies differ have logits that cannot be compared as a whole: that is an error
naming both sizes, unless `shared_vocab` asks for the tokens both have (the probe draws its ids below the
smaller vocabulary and the logits of the first that many entries are compared: right when one embedding
was padded or extended after tokenizer surgery and the shared ids mean the same tokens). Reported: max and mean |Δlogits|, KL(A‖B) of the next-token
distributions, top-1 agreement, and the scale of A's logits.

The verdict. A 30-layer model whose logits reach |38| differs from itself by ~1e-4 when only its fp32
summation order changes, so no fixed absolute threshold fits every model. The *noise floor* is measured
on A: max |Δlogits| between A and A with the neurons of every FFN (and expert) in a shuffled order, which
is the same function summed in another order; it is taken as at least one fp32 ulp of A's largest logit.
B passes when max |Δlogits| ≤ `NOISE_FACTOR` × that floor (an upcycle splits every FFN sum into experts
and re-weights them, a few reorderings' worth of rounding). `--tolerance T` replaces the criterion by an
absolute bound: max |Δlogits| ≤ T. When both models have the same number of layers they are walked in
lockstep and the first layer whose residual stream differs by more than `NOISE_FACTOR` × its own floor is
named, so a failure says where it starts.

Options are checked before any weight is read: a finite tolerance ≥ 0, a seed ≥ 0, and a probe of
bounded size: at most `MAX_TOKENS` positions per sequence and the models' `max_position_embeddings`,
`MAX_BATCH` sequences, `MAX_PROBE` positions in all and `MAX_LOGITS` logits per model, so a typo cannot
ask for hundreds of GB. A model whose logits are not finite (NaN or inf weights) is an error naming its
path and, when it has one, the first non-finite tensor: its logits cannot be compared with anything.

`check_written` is the check a function-preserving write runs on its staged output before it is renamed
into place (a smaller probe: one sequence of 32 tokens); its record goes into `upcycler.json` and the
model card. `dense-to-moe` runs its own check beside the write instead (`transforms.moe_write_check`).
`shift` is the same comparison for a write that changes the function on purpose (`context`'s new RoPE): no
verdict, only how far it moved the model within the length it was trained at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.tensors import BF16
from upcycler.untrusted import escape, integer, real, shown_path

MAX_TOKENS = 8192  # positions per probe sequence
MAX_BATCH = 64  # probe sequences
MAX_PROBE = 16384  # positions in all (batch × tokens)
MAX_LOGITS = 2**27  # positions × vocabulary: 512 MiB of fp32 logits per model (compared in fp64)
NOISE_FACTOR = 10.0  # B may differ from A by this many times A's own fp32 noise floor
FP32_ULP = 2.0**-23  # relative spacing of fp32 numbers: the smallest floor, relative to the largest logit
CHECK_PROBE = {"batch": 1, "tokens": 32, "seed": 0}  # the probe of the check after every write
SHIFT_PROBE = {"batch": 1, "tokens": 512, "seed": 0}  # the probe of `shift`, at most the original length


def check_options(*, tokens: int, batch: int, seed: int, tolerance: float | None = None) -> None:
    """Refuse a probe or tolerance that is invalid or absurdly large, naming the option and its limit."""
    if tolerance is not None:
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


def compare(a: Path, b: Path, *, tokens: int = 64, batch: int = 2, seed: int = 0,
            shared_vocab: bool = False) -> dict[str, Any]:
    """Run both checkpoints on one probe and return the statistics (see the module docstring)."""
    from upcycler.io import read_checkpoint

    check_options(tokens=tokens, batch=batch, seed=seed)
    return compare_checkpoints((a, read_checkpoint(a)), (b, read_checkpoint(b)), tokens=tokens, batch=batch,
                               seed=seed, shared_vocab=shared_vocab)


def compare_checkpoints(a: tuple[Path, Any], b: tuple[Path, Any], *, tokens: int, batch: int,
                        seed: int, shared_vocab: bool = False) -> dict[str, Any]:
    """`compare` for checkpoints already opened: (path, lazy `Checkpoint`) each. Refuses, before any weight
    is read, models it cannot run and vocabularies that differ (unless `shared_vocab`)."""
    from upcycler.train.evaluation.layerwise import hidden_trace
    from upcycler.train.model import unsupported

    (path_a, ckpt_a), (path_b, ckpt_b) = a, b
    for path, ckpt in (a, b):
        reasons = unsupported(ckpt.spec)
        if reasons:
            raise UpcyclerError(f"{shown_path(path)}: the JAX model cannot run this checkpoint: "
                                f"{'; '.join(reasons)}")
        limit = ckpt.spec.max_position_embeddings
        if tokens > limit:
            raise UpcyclerError(f"--tokens: {tokens:,} is more than the max_position_embeddings of "
                                f"{shown_path(path)} ({limit:,}); pass --tokens {limit} or less")
    spec_a, spec_b = ckpt_a.spec, ckpt_b.spec
    vocab = min(spec_a.vocab_size, spec_b.vocab_size)
    if spec_a.vocab_size != spec_b.vocab_size and not shared_vocab:
        raise UpcyclerError(f"the vocabularies differ: {shown_path(path_a)} has {spec_a.vocab_size:,} tokens and "
                            f"{shown_path(path_b)} has {spec_b.vocab_size:,}, so their logits cannot be "
                            f"compared as a whole; pass --shared-vocab to compare the first {vocab:,} (the "
                            "ids both have, e.g. after padding an embedding), or compare models of one tokenizer")
    widest = max(spec_a.vocab_size, spec_b.vocab_size)
    if batch * tokens * widest > MAX_LOGITS:
        raise UpcyclerError(f"--batch × --tokens: {batch:,} × {tokens:,} positions × a vocabulary of "
                            f"{widest:,} is more than {MAX_LOGITS:,} logits per model; pass a smaller "
                            f"--batch or --tokens (at most {MAX_LOGITS // widest:,} positions in all)")
    ids = probe_ids(vocab, batch=batch, tokens=tokens, seed=seed)
    trace_a, trace_b = hidden_trace(ckpt_a, ids, reordered=True), hidden_trace(ckpt_b, ids)
    layers = []
    shared = (..., slice(vocab))  # the logits of the ids both models have
    if (spec_a.num_layers, spec_a.hidden_size) == (spec_b.num_layers, spec_b.hidden_size):
        # lockstep: one layer of each model in memory; the last step of each trace is its logits
        for i, ((h_a, h_reordered), (h_b,)) in enumerate(zip(trace_a, trace_b)):
            if i == spec_a.num_layers:
                h_a, h_reordered, h_b = h_a[shared], h_reordered[shared], h_b[shared]
            if layers:  # keep only numbers for the layers, the arrays of the logits (the last)
                layers[-1] = {k: v for k, v in layers[-1].items() if k not in ("a", "b")}
            layers.append(_distances(h_a, h_reordered, h_b))
        logits = layers.pop()
    else:  # residual streams of different depths or widths: only the logits compare
        *_, (logits_a, logits_reordered) = trace_a
        *_, (logits_b,) = trace_b
        logits = _distances(logits_a[shared], logits_reordered[shared], logits_b[shared])
    ckpt_a.check_inputs()  # upcycler outputs: what was read matches their manifests
    ckpt_b.check_inputs()
    _require_finite([(path_a, ckpt_a, logits["a"]), (path_b, ckpt_b, logits["b"])])
    logits_a, logits_b = logits["a"], logits["b"]
    delta = np.abs(logits_a.astype(np.float64) - logits_b)
    logp_a, logp_b = _log_softmax(logits_a), _log_softmax(logits_b)
    kl = (np.exp(logp_a) * (logp_a - logp_b)).sum(axis=-1)
    return {
        "a": {"path": str(path_a), "family": spec_a.family, "params": spec_a.total_params()},
        "b": {"path": str(path_b), "family": spec_b.family, "params": spec_b.total_params()},
        "probe": {"batch": batch, "tokens": tokens, "seed": seed, "vocab": vocab},
        "vocab_compared": vocab if spec_a.vocab_size != spec_b.vocab_size else None,
        "max_abs_diff": float(delta.max()),
        "mean_abs_diff": float(delta.mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float((logits_a.argmax(-1) == logits_b.argmax(-1)).mean()),
        "logit_scale": logits["scale"],
        "noise_floor": logits["floor"],
        "layers": layers,
    }


def _distances(a: np.ndarray, reordered: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """max |b − a|, A's own floor max |reordered − a| and A's scale max |a| (the arrays are kept for logits)."""
    a64 = a.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite models are refused after the run
        return {"a": a, "b": b, "delta": float(np.abs(b - a64).max()),
                "floor": float(np.abs(reordered - a64).max()), "scale": float(np.abs(a64).max())}


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


def floor(distance: float, scale: float) -> float:
    """A measured noise floor, at least one fp32 ulp of the largest value."""
    return max(distance, FP32_ULP * scale)


def allowed(stats: dict[str, Any], tolerance: float | None = None) -> tuple[float, str]:
    """The largest max |Δlogits| that passes, and how it was set (printed with the verdict)."""
    if tolerance is not None:
        return tolerance, f"--tolerance {tolerance:.1e} (absolute)"
    noise = floor(stats["noise_floor"], stats["logit_scale"])
    return NOISE_FACTOR * noise, (f"{NOISE_FACTOR:g} × A's fp32 noise floor {noise:.1e} (A against itself with "
                                  f"its FFN neurons reordered; logits up to {stats['logit_scale']:.3g})")


def first_divergent_layer(stats: dict[str, Any]) -> int | None:
    """The first layer whose residual stream in B differs from A's by more than `NOISE_FACTOR` × its floor."""
    for i, layer in enumerate(stats.get("layers") or []):
        if not layer["delta"] <= NOISE_FACTOR * floor(layer["floor"], layer["scale"]):
            return i
    return None


def verdict(stats: dict[str, Any], tolerance: float | None = None) -> tuple[bool, str]:
    """(passed, one-line verdict that states its criterion); NaN anywhere fails."""
    worst = stats["max_abs_diff"]
    bound, how = allowed(stats, tolerance)
    tail = f"; KL {stats['kl_mean']:.1e}, top-1 agreement {stats['top1_agreement']:.1%}"
    if worst <= bound:
        return True, f"same function: max |Δlogits| {worst:.2e} ≤ {bound:.1e} = {how}{tail}"
    layer = first_divergent_layer(stats)
    where = f"; first layer over its noise floor: {layer}" if layer is not None else ""
    return False, f"different functions: max |Δlogits| {worst:.2e} > {bound:.1e} = {how}{tail}{where}"


def format_stats(stats: dict[str, Any]) -> str:
    a, b, probe = stats["a"], stats["b"], stats["probe"]
    lines = [
        f"A               {a['path']} ({a['family']}, {a['params']:,} params)",
        f"B               {b['path']} ({b['family']}, {b['params']:,} params)",
        f"probe           {probe['batch']} × {probe['tokens']} tokens, seed {probe['seed']}",
        f"max |Δlogits|   {stats['max_abs_diff']:.3e}",
        f"mean |Δlogits|  {stats['mean_abs_diff']:.3e}",
        f"KL(A‖B)         {stats['kl_mean']:.3e} mean, {stats['kl_max']:.3e} max over positions",
        f"top-1 agreement {stats['top1_agreement']:.2%}",
        f"noise floor     {stats['noise_floor']:.3e} (A reordered against A; largest logit {stats['logit_scale']:.3g})",
    ]
    if stats["vocab_compared"] is not None:
        lines.append(
            f"note            vocabularies differ; compared the first {stats['vocab_compared']} entries"
        )
    return "\n".join(lines)


def check_written(source: Path, written: Path, *, what: str, weights: str = "params") -> dict[str, Any]:
    """Probe `written` (a staged output) against `source`; the record for its manifest, or an error.

    Run by every write that claims to preserve the function (`what` names it; `weights` which weights of
    `source` were written); the error leaves nothing behind because the caller is still inside its
    staging directory.
    """
    from upcycler.io import read_checkpoint

    probe = dict(CHECK_PROBE)
    # the write has just hashed both what it read and what it wrote: no digest watches the second time
    written_ckpt = read_checkpoint(written).replace(watches=())
    probe["tokens"] = min(probe["tokens"], written_ckpt.spec.max_position_embeddings)
    source_ckpt = read_checkpoint(source, weights).replace(watches=())
    stats = compare_checkpoints((source, source_ckpt), (written, written_ckpt),
                                **probe)
    passed, line = verdict(stats)
    if not passed:
        raise UpcyclerError(f"{what} claims to preserve the function, but the written model does not: {line}; "
                            "nothing was written; report this, or pass --no-verify to keep such an output")
    bound, _ = allowed(stats)
    return {
        "against": Path(source).name, "probe": {**probe, "vocab": stats["probe"]["vocab"]},
        "max_abs_logit_diff": stats["max_abs_diff"], "allowed": bound, "noise_floor": stats["noise_floor"],
        "logit_scale": stats["logit_scale"], "kl_mean": stats["kl_mean"], "top1_agreement": stats["top1_agreement"],
        "passed": passed, "verdict": line,
    }


def shift(source: Path, written: Path, *, within: int) -> dict[str, Any]:
    """How far a write that changes the function on purpose (a new RoPE) moved the model: KL(source‖written)
    and top-1 agreement of `compare_checkpoints` on `SHIFT_PROBE`, its length at most `within` positions
    (the length the source was trained at) and `MAX_LOGITS` logits."""
    from upcycler.io import read_checkpoint

    source_ckpt, written_ckpt = read_checkpoint(source), read_checkpoint(written).replace(watches=())
    vocab = max(source_ckpt.spec.vocab_size, written_ckpt.spec.vocab_size)
    probe = {**SHIFT_PROBE, "tokens": max(1, min(SHIFT_PROBE["tokens"], within, MAX_LOGITS // vocab))}
    stats = compare_checkpoints((source, source_ckpt), (written, written_ckpt), **probe)
    return {"against": Path(source).name, "probe": {**probe, "vocab": stats["probe"]["vocab"]},
            "kl_mean": stats["kl_mean"], "kl_max": stats["kl_max"], "top1_agreement": stats["top1_agreement"],
            "max_abs_logit_diff": stats["max_abs_diff"]}
