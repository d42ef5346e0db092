"""The registry of Hugging Face families, and fitting a model to a target family without changing its function.

Adding a family = building a `Family` (with keyword arguments, in `dense.py` or `moe.py`) and listing it
in `FAMILIES` below; every fact a transform needs is a field of the `Family`, so transforms never change.
A family defined elsewhere (a plugin, a test) is added with `register_family(family)` and removed with
`unregister_family(name)`, or for a block with `with registered(family): ...`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.families.base import Family
from upcycler.families.dense import LLAMA, MISTRAL, QWEN2, QWEN3
from upcycler.families.moe import GLM4_MOE, MIXTRAL, QWEN2_MOE, QWEN3_MOE
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.tensors import TensorMap, zeros
from upcycler.untrusted import describe

FAMILIES: dict[str, Family] = {
    f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, GLM4_MOE)
}
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}


def register_family(family: Family) -> None:
    """Make `family` known to readers, writers and transforms (by its name and its architecture)."""
    for taken, known in ((family.name, FAMILIES), (family.architecture, _BY_ARCHITECTURE)):
        if taken in known:
            raise UpcyclerError(f"a family named or built as {describe(taken)} is already registered")
    FAMILIES[family.name] = family
    _BY_ARCHITECTURE[family.architecture] = family


def unregister_family(name: str) -> None:
    """Forget the family registered as `name` (the inverse of `register_family`)."""
    family = FAMILIES.pop(name)
    del _BY_ARCHITECTURE[family.architecture]


@contextmanager
def registered(family: Family) -> Iterator[Family]:
    """`family` registered for the duration of a `with` block, and unregistered after it."""
    register_family(family)
    try:
        yield family
    finally:
        unregister_family(family.name)


def auto_order() -> tuple[str, ...]:
    """The MoE families `--target auto` tries, in order of their `auto_rank` (lowest first)."""
    ranked = [f for f in FAMILIES.values() if f.is_moe and f.auto_rank is not None]
    return tuple(f.name for f in sorted(ranked, key=lambda f: f.auto_rank))


def moe_families() -> tuple[str, ...]:
    """The registered MoE families: those of `auto_order()`, then those `auto` never picks."""
    ranked = auto_order()
    return ranked + tuple(name for name, f in FAMILIES.items() if f.is_moe and name not in ranked)


def supported_architectures() -> str:
    return ", ".join(sorted(_BY_ARCHITECTURE))


def family_named(name: str) -> Family:
    """The family registered as `name` (e.g. "mixtral"), or a clear error listing the choices."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UpcyclerError(f"unknown family {describe(name)}; choose one of {', '.join(FAMILIES)}") from None


def family_for_config(cfg: dict, where: str) -> Family:
    """The family of a config.json, by `architectures[0]` (or `model_type` when that is missing)."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UpcyclerError(f"{where}: architectures must be a list of class names such as "
                            f"[\"LlamaForCausalLM\"], not {describe(archs)}; fix the config")
    model_type = cfg.get("model_type")
    if archs and archs[0] in _BY_ARCHITECTURE:
        return _BY_ARCHITECTURE[archs[0]]
    if not archs and isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES[model_type]
    found = archs[0] if archs else "none" if model_type is None else model_type
    raise UpcyclerError(
        f"{where}: architecture {describe(found)} is not supported; supported: {supported_architectures()}"
    )


def conform_spec(spec: ModelSpec, family: Family) -> ModelSpec:
    """`spec` as `family` stores it: the function-neutral additions of `conform`, without tensors."""
    if family.neutral_qkv_bias and not spec.qkv_bias and not spec.o_bias:
        spec = spec.replace(qkv_bias=True)
    if family.neutral_router_bias and spec.moe is not None and not spec.moe.router_bias:
        spec = spec.replace(moe=dataclasses.replace(spec.moe, router_bias=True))
    if not family.ties_embeddings and spec.tie_embeddings:
        spec = spec.replace(tie_embeddings=False)
    return spec.replace(family=family.name)


def conform(spec: ModelSpec, tensors: TensorMap, family: Family) -> tuple[ModelSpec, TensorMap]:
    """Fit (spec, tensors) to `family`, adding only tensors that leave the function unchanged.

    Zero q/k/v biases for families with `neutral_qkv_bias` (transformers v4 always builds them for
    Qwen2-style attention), a zero selection bias for `neutral_router_bias` (sigmoid routers), and for a
    family whose serving implementations never tie (`ties_embeddings` False) the tied embedding also as
    `lm_head` (the same lazy tensor: streamed from the source, no copy in memory). Anything the family
    cannot hold exactly is refused with the reasons.
    """
    added: dict = {}
    if spec.tie_embeddings and not family.ties_embeddings and "lm_head" not in tensors:
        added["lm_head"] = tensors["embed"]
    spec = conform_spec(spec, family)
    reasons = family.cannot_hold(spec)
    if reasons:
        raise UpcyclerError(
            f"{family.architecture} cannot hold this model exactly: {'; '.join(reasons)}; choose another --family"
        )
    dtype = tensors["embed"].dtype
    for decl in declare_params(spec):
        if decl.name not in tensors and decl.name.endswith("_bias"):
            added[decl.name] = zeros(decl.shape, np.float32 if decl.is_buffer else dtype)
    return spec, tensors.updated(added) if added else tensors
