"""The registry of Hugging Face families, and fitting a model to a target family without changing its function.

Adding a family = adding a `Family` in `dense.py` or `moe.py` and listing it here; transforms never
change.
"""

from __future__ import annotations

import dataclasses

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
    if family.name in ("qwen2", "qwen2_moe") and not spec.qkv_bias and not spec.o_bias:
        spec = spec.replace(qkv_bias=True)
    if family.name == "glm4_moe" and spec.moe is not None and not spec.moe.router_bias:
        spec = spec.replace(moe=dataclasses.replace(spec.moe, router_bias=True))
    return spec.replace(family=family.name)


def conform(spec: ModelSpec, tensors: TensorMap, family: Family) -> tuple[ModelSpec, TensorMap]:
    """Fit (spec, tensors) to `family`, adding only tensors that leave the function unchanged.

    Zero q/k/v biases for Qwen2-style families (transformers v4 always builds them) and a zero selection
    bias for sigmoid routers. Anything the family cannot hold exactly is refused with the reasons.
    """
    added: dict = {}
    spec = conform_spec(spec, family)
    reasons = family.cannot_hold(spec)
    if reasons:
        raise UpcyclerError(
            f"{family.architecture} cannot hold this model exactly: {'; '.join(reasons)}; choose another --family"
        )
    dtype = tensors["embed"].dtype
    for decl in declare_params(spec):
        if decl.name not in tensors:
            if decl.name.endswith("_bias"):
                added[decl.name] = zeros(decl.shape, np.float32 if "router" in decl.name else dtype)
    return spec, tensors.updated(added) if added else tensors
