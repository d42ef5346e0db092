"""A plain summary of a checkpoint for people and scripts: architecture, sizes, parameter counts."""

from __future__ import annotations

from collections import Counter
from typing import Any

from upcycler.families import FAMILIES
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.manifest import expert_sources
from upcycler.spec import ModelSpec
from upcycler.tensors import dtype_name
from upcycler.units import human_bytes, human_count


def spec_summary(spec: ModelSpec) -> dict[str, Any]:
    """Architecture fields and exact total/active parameter counts of `spec`."""
    out: dict[str, Any] = {
        "family": spec.family,
        "architecture": FAMILIES[spec.family].architecture,
        "layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "tied_embeddings": spec.tie_embeddings,
        "total_params": spec.total_params(),
        "active_params": spec.active_params(),
    }
    if spec.moe is not None:
        moe = spec.moe
        out["moe"] = {
            "experts": moe.num_experts,
            "top_k": moe.top_k,
            "expert_width": moe.expert_width,
            "router": moe.router,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "shared_width": moe.shared_width,
            "dense_layers": list(spec.dense_layers),
        }
    return out


def checkpoint_summary(ckpt: Checkpoint) -> dict[str, Any]:
    """`spec_summary` plus path, stored dtypes and bytes of the tensors."""
    dtypes = Counter()
    for t in ckpt.tensors.values():
        dtypes[dtype_name(t.dtype)] += t.numel
    out = {
        "path": str(ckpt.source) if ckpt.source else None,
        **spec_summary(ckpt.spec),
        "dtype": dtypes.most_common(1)[0][0] if dtypes else None,
        "dtypes": dict(dtypes),
        "bytes": ckpt.tensors.nbytes,
    }
    names = expert_sources(ckpt.lineage, ckpt.spec.moe.num_experts) if ckpt.spec.moe else None
    if names is not None:
        out["moe"]["expert_sources"] = {n: [e for e, m in enumerate(names) if m == n] for n in dict.fromkeys(names)}
    return out


def expert_runs(sources: dict[str, list[int]]) -> str:
    """`code: experts 0–3; math: experts 4–7`: each source's experts as runs of consecutive indices."""
    parts = []
    for name, experts in sources.items():
        runs: list[list[int]] = []
        for e in experts:
            if runs and runs[-1][1] == e - 1:
                runs[-1][1] = e
            else:
                runs.append([e, e])
        shown = ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)
        parts.append(f"{name}: expert{'s' if len(experts) > 1 else ''} {shown}")
    return "; ".join(parts)


def format_summary(info: dict[str, Any]) -> str:
    """Human-readable lines for `info` from `checkpoint_summary` or `spec_summary`."""
    lines = []
    if info.get("path"):
        lines.append(f"path            {info['path']}")
    lines += [
        f"architecture    {info['architecture']} ({info['family']})",
        f"layers          {info['layers']}",
        (f"hidden          {info['hidden_size']}  heads {info['heads']}  kv heads {info['kv_heads']}  "
         f"head dim {info['head_dim']}"),
        f"mlp width       {info['intermediate_size']}",
        f"vocab           {info['vocab_size']}  (embeddings {'tied' if info['tied_embeddings'] else 'untied'})",
    ]
    if "moe" in info:
        m = info["moe"]
        shared = f", shared width {m['shared_width']}" if m["shared_width"] else ""
        dense = f", dense layers {m['dense_layers']}" if m["dense_layers"] else ""
        lines.append(f"experts         {m['experts']} × width {m['expert_width']}, top-{m['top_k']}, "
                     f"router {m['router']}{shared}{dense}")
        if m.get("expert_sources"):
            lines.append(f"expert sources  {expert_runs(m['expert_sources'])}")
    lines.append(f"parameters      {info['total_params']:,} total ({human_count(info['total_params'])}), "
                 f"{info['active_params']:,} active ({human_count(info['active_params'])})")
    if info.get("bytes") is not None and "dtype" in info:
        lines.append(f"tensors         {info['dtype']}, {human_bytes(info['bytes'])}")
    return "\n".join(lines)
