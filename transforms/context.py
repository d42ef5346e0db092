"""`context`: prepare a model for a longer context by rewriting its RoPE config; every tensor is the source's.

Only three config fields change, in the form transformers and vLLM load (`rope_theta`, `rope_scaling` with
its `rope_type`, `max_position_embeddings`); the tensors are carried as they are, so a write streams each
one's stored bytes unchanged. The methods users apply before a long-context stage:

    --rope-theta B              a larger RoPE base (Code Llama raised it to 1e6); combines with a scaling
    --rope-scaling linear       position interpolation: every frequency divided by --factor
    --rope-scaling yarn         YaRN: --factor, --original-max-position, --beta-fast (32) / --beta-slow (1)
    --rope-scaling llama3       Llama 3.1: --factor, --low-freq-factor (1), --high-freq-factor (4),
                                --original-max-position

--factor defaults to N / --original-max-position, which defaults to the source's max_position_embeddings.
A new base or a scaling changes the function at every position (llama3 and yarn leave the fastest
frequencies alone, linear none), so the step is reported as not function-preserving and the command
measures how far it moved the model within the original length; raising `max_position_embeddings` alone
changes nothing a model computes and is checked as function-preserving. The lineage step records the RoPE
fields before the change (`rope_before`).

Refused, each in one line: an N not above the source's (unless `--force-shorter`), a factor ≤ 1, a base
≤ 0, an option of another method, an original length above N, a scaling over a source that already has
one (unless `--replace-scaling`), and a scaling the family's loaders cannot read (`Family.rope_scalings`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.families import family_named
from upcycler.spec import POSITIVE_REALS, ModelSpec, freeze_mapping, within_limit
from upcycler.tensors import TensorMap
from upcycler.transforms.registry import TransformContext, option, record, register, report

METHODS = ("linear", "yarn", "llama3")
# the options of each method beyond --factor and (yarn, llama3) --original-max-position, with HF's defaults
_METHOD_OPTIONS = {"linear": {}, "yarn": {"beta_fast": 32.0, "beta_slow": 1.0},
                   "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0}}
_KEEPS_ORIGINAL = ("yarn", "llama3")  # the methods whose config names the original length (linear's does not)


@dataclass(frozen=True)
class Context:
    """Options of `context`."""

    max_position: int = option(help="max_position_embeddings of the result: the longest context it is for.",
                               metavar="N")
    rope_theta: float | None = option(None, help="A new RoPE base (e.g. 1e6); default: the source's.",
                                      metavar="B")
    rope_scaling: str | None = option(None, choices=METHODS,
                                      help="linear: position interpolation; yarn: YaRN; llama3: Llama 3.1's "
                                           "scaling (default: none, or the source's).")
    factor: float | None = option(None, help="Scaling factor, > 1 (default: N / --original-max-position).",
                                  metavar="F")
    original_max_position: int | None = option(
        None, help="The length the model was trained at (default: the source's max_position_embeddings, or "
                   "the original length of the scaling --replace-scaling replaces).", metavar="N0")
    beta_fast: float | None = option(None, help="yarn: rotations below which a dimension is extrapolated "
                                                "(default 32, as transformers).")
    beta_slow: float | None = option(None, help="yarn: rotations above which a dimension is interpolated "
                                                "(default 1, as transformers).")
    low_freq_factor: float | None = option(None, help="llama3: low_freq_factor (default 1).")
    high_freq_factor: float | None = option(None, help="llama3: high_freq_factor (default 4).")
    replace_scaling: bool = option(False, help="Replace the source's own rope_scaling (scalings do not stack).")
    force_shorter: bool = option(False, help="Allow N at or below the source's max_position_embeddings.")


@register("context", Context)
def extend_context(cfg: Context, spec: ModelSpec, tensors: TensorMap,
                   context: TransformContext) -> tuple[ModelSpec, TensorMap]:
    """Extend the context window: a larger RoPE base, linear interpolation, YaRN or Llama 3's scaling.

    Writes only rope_theta, rope_scaling and max_position_embeddings; every tensor is the source's, bit for
    bit. A new base or a scaling is NOT function-preserving at any length (the command measures KL and
    top-1 agreement against the source within the original length); a larger N alone is.
    """
    within_limit(cfg.max_position, "max_position_embeddings", "--max-position")
    current = spec.max_position_embeddings
    if cfg.max_position <= current and not cfg.force_shorter:
        raise UpcyclerError(f"--max-position {cfg.max_position:,} is not above the source's "
                            f"max_position_embeddings {current:,}; pass a larger N, or --force-shorter to "
                            "shorten it")
    if cfg.rope_theta is not None and not cfg.rope_theta > 0:
        raise UpcyclerError(f"--rope-theta {cfg.rope_theta:g} is not a RoPE base; pass a positive base such "
                            "as 1e6")
    _refuse_stray_options(cfg)
    scaling = _scaling(cfg, spec)
    theta = spec.rope_theta if cfg.rope_theta is None else float(cfg.rope_theta)
    new = spec.replace(rope_theta=theta, rope_scaling=freeze_mapping(scaling) if scaling else None,
                       max_position_embeddings=cfg.max_position)
    record(rope_before={"rope_theta": spec.rope_theta, "rope_scaling": spec.rope_scaling_dict,
                        "max_position_embeddings": current})
    _report(spec, new)
    return new, tensors


def _refuse_stray_options(cfg: Context) -> None:
    """Refuse scaling options without --rope-scaling, or of another method, and --replace-scaling alone."""
    given = [name for name in ("factor", "original_max_position", *_METHOD_OPTIONS["yarn"],
                               *_METHOD_OPTIONS["llama3"]) if getattr(cfg, name) is not None]
    allowed = {"factor", "original_max_position", *_METHOD_OPTIONS.get(cfg.rope_scaling or "", {})}
    stray = [name for name in given if name not in allowed]
    if cfg.rope_scaling is None and (given or cfg.replace_scaling):
        flags = ", ".join(_flag(n) for n in given) or "--replace-scaling"
        raise UpcyclerError(f"{flags} needs --rope-scaling {'|'.join(METHODS)}; add it")
    if stray:
        raise UpcyclerError(f"{_flag(stray[0])} is not an option of --rope-scaling {cfg.rope_scaling}; drop it")


def _scaling(cfg: Context, spec: ModelSpec) -> dict[str, Any] | None:
    """The rope_scaling of the result: the new method's fields, or the source's own when none is asked."""
    before = spec.rope_scaling_dict
    if cfg.rope_scaling is None:
        return before
    kind = (before or {}).get("rope_type", (before or {}).get("type"))
    if before and not cfg.replace_scaling:
        factor = f" with factor {before['factor']:g}" if isinstance(before.get("factor"), (int, float)) else ""
        raise UpcyclerError(f"the source already has rope_scaling {kind}{factor}; pass --replace-scaling to "
                            f"replace it with {cfg.rope_scaling} (scalings do not stack), or start from the "
                            "unscaled model")
    family = family_named(spec.family)
    if cfg.rope_scaling not in family.rope_scalings:
        raise UpcyclerError(f"{family.architecture} is not loaded with rope_scaling {cfg.rope_scaling} by "
                            f"transformers and vLLM; use one of {', '.join(m for m in METHODS if m in family.rope_scalings)}")
    original = cfg.original_max_position
    if original is None:
        pretrained = (before or {}).get("original_max_position_embeddings")
        original = pretrained if isinstance(pretrained, int) else spec.max_position_embeddings
    if original > cfg.max_position:
        raise UpcyclerError(f"--original-max-position {original:,} is above --max-position "
                            f"{cfg.max_position:,}; a scaling extends the context the model was trained at")
    factor = cfg.factor if cfg.factor is not None else cfg.max_position / original
    if not factor > 1:
        which = f"--factor {factor:g}" if cfg.factor is not None else \
            f"--max-position {cfg.max_position:,} / the original {original:,} = {factor:g}"
        raise UpcyclerError(f"{which} is not a scaling factor above 1; pass --factor above 1 or a larger "
                            "--max-position")
    largest = POSITIVE_REALS["rope_scaling.factor"][1]
    if factor > largest:  # what a model's config may hold (upcycler.spec); said here, of the option
        raise UpcyclerError(f"--factor {factor:g} is above {largest:g}, the largest scaling a config may hold; "
                            "pass a smaller --factor")
    out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": float(factor)}
    if cfg.rope_scaling in _KEEPS_ORIGINAL:
        out["original_max_position_embeddings"] = original
    for name, default in _METHOD_OPTIONS[cfg.rope_scaling].items():
        value = getattr(cfg, name)
        out[name] = float(default if value is None else value)
    _check_method(out)
    if cfg.rope_scaling == "yarn" and factor != cfg.max_position / original:
        report(f"yarn's factor {factor:g} is not --max-position / original length = "
               f"{cfg.max_position / original:g}; transformers warns about that and uses {factor:g}")
    return out


def _check_method(s: dict[str, Any]) -> None:
    """Refuse method fields the rotary embeddings would compute nonsense from."""
    if s["rope_type"] == "yarn" and not 0 < s["beta_slow"] < s["beta_fast"]:
        raise UpcyclerError(f"--beta-slow {s['beta_slow']:g} and --beta-fast {s['beta_fast']:g}: yarn needs "
                            "0 < beta_slow < beta_fast (default 1 and 32)")
    if s["rope_type"] == "llama3" and not 0 < s["low_freq_factor"] < s["high_freq_factor"]:
        raise UpcyclerError(f"--low-freq-factor {s['low_freq_factor']:g} and --high-freq-factor "
                            f"{s['high_freq_factor']:g}: llama3 needs 0 < low_freq_factor < high_freq_factor "
                            "(default 1 and 4)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _describe(spec: ModelSpec) -> str:
    """The three RoPE fields of `spec` as config.json has them (rope_type first)."""
    scaling = spec.rope_scaling_dict
    if scaling:
        scaling = {"rope_type": scaling.pop("rope_type", scaling.pop("type", None)), **scaling}
    return (f"max_position_embeddings {spec.max_position_embeddings}, rope_theta {spec.rope_theta!r}, "
            f"rope_scaling {json.dumps(scaling)}")


def _report(before: ModelSpec, after: ModelSpec) -> None:
    text = f"{_describe(before)} → {_describe(after)}; every tensor is the source's, bit for bit"
    if (before.rope_theta, before.rope_scaling) == (after.rope_theta, after.rope_scaling):
        report(f"{text}; the RoPE is unchanged, so is the function")
    else:
        report(f"NOT function-preserving at any length (RoPE changed; measured against the source within the "
               f"original length after the write): {text}", exact=False)
