"""Rematerialisation: which of a layer's activations the backward pass keeps, and which it recomputes.

The model names its activations with `jax.ad_checkpoint.checkpoint_name` (the names below, tagged where
they are computed); a policy is a set of names to keep (on the device, or offloaded to host memory where
the platform has it), everything else inside the layer being recomputed from the layer's input, which
the layer scan always keeps. From most memory to least:

- `none`: keep everything (no rematerialisation);
- `dots`: keep every matmul output without batch dimensions (JAX's `dots_with_no_batch_dims_saveable`);
- `all_but_ffn_hidden`: keep every named activation except the FFN's hidden [tokens, F] (the gate and up
  outputs, the largest of a layer): the backward redoes the gate/up matmuls;
- `attention_and_ffn_input`: keep the attention's q, k, v and context, its output projection, the FFN's
  normalised input, the router's logits and the MoE's dispatched rows: the backward redoes the FFN
  (experts) only;
- `attention`: keep q, k, v and the attention's context: the backward redoes the projections around the
  attention and the FFN, never the attention itself;
- `qkv`: keep q, k and v: the attention is recomputed too;
- `full`: keep nothing but the layer's input: the whole forward pass is recomputed;
- `offload_attention`, `offload_attention_and_ffn_input`: the same sets, held in host memory
  (`pinned_host`) between the forward and the backward pass instead of on the device.

Every policy but `none` also keeps the MoE's dispatch plan (`MOE_ROUTING`: rows per expert and the two
maps between token copies and rows, a few int32 per token copy), so the recomputed forward pass does not
sort the copies again. Every policy computes the same loss and gradients; only what is alive at once, and
the recomputation, differ.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from upcycler.train.config import REMAT_POLICIES  # the names, declared without JAX

QUERY, KEY, VALUE = "query", "key", "value"  # after RoPE (and q/k norms)
CONTEXT = "context"  # the attention's output, before o_proj
ATTENTION_OUT = "attention_out"  # o_proj's output
FFN_INPUT = "ffn_input"  # the normalised residual stream the FFN and the router read
FFN_HIDDEN = "ffn_hidden"  # gate and up outputs, dense or per expert (before the activation)
ROUTER_LOGITS = "router_logits"
MOE_DISPATCHED = "moe_dispatched"  # the token rows sorted by expert, the grouped matmul's input
EXPERT_OUT = "expert_out"  # the experts' down_proj outputs before they are combined per token
MOE_ROUTING = "moe_routing"  # the dispatch plan: rows per expert, each copy's row, each row's copy (int32)
FFN_OUT = "ffn_out"  # the FFN's (or MoE block's) output, before the residual add

ATTENTION = (QUERY, KEY, VALUE, CONTEXT)
ATTENTION_AND_FFN_INPUT = (*ATTENTION, ATTENTION_OUT, FFN_INPUT, ROUTER_LOGITS, MOE_DISPATCHED)
ALL_NAMES = (*ATTENTION_AND_FFN_INPUT, FFN_HIDDEN, EXPERT_OUT, FFN_OUT)

# name: names kept on the device, names offloaded to host memory (None: JAX's own policy, below)
_NAMED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_but_ffn_hidden": (tuple(n for n in ALL_NAMES if n != FFN_HIDDEN), ()),
    "attention_and_ffn_input": (ATTENTION_AND_FFN_INPUT, ()),
    "attention": (ATTENTION, ()),
    "qkv": ((QUERY, KEY, VALUE), ()),
    "offload_attention": ((), ATTENTION),
    "offload_attention_and_ffn_input": ((), ATTENTION_AND_FFN_INPUT),
}


def policy(name: str) -> Callable | None:
    """The `jax.checkpoint` policy of `ModelConfig.remat` = `name` ("none" is not one: no checkpoint).
    `full` keeps only the MoE's dispatch plan."""
    policies = jax.checkpoint_policies
    if name == "full":
        return policies.save_only_these_names(MOE_ROUTING)
    if name == "dots":
        return policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                                policies.save_only_these_names(MOE_ROUTING))
    if name not in _NAMED:
        raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, not {name!r}")
    kept, offloaded = _NAMED[name]
    if offloaded:
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[*kept, MOE_ROUTING], names_which_can_be_offloaded=list(offloaded),
            offload_src="device", offload_dst="pinned_host")
    return policies.save_only_these_names(*kept, MOE_ROUTING)


# per policy, the forward work of a layer the backward pass does again, by part: "projections" (q, k, v),
# "attention" (scores and their weighted sum), "out_projection" (o_proj) and "ffn" (the MLP or the experts
# with their router; 2/3 of it is the gate and up matmuls). The analytic count the compile report's
# roofline adds to the model's FLOPs (the compiler may recompute less).
RECOMPUTED: dict[str, dict[str, float]] = {
    "none": {},
    "dots": {"attention": 1.0},  # its matmuls carry batch axes, so they are not saved
    "all_but_ffn_hidden": {"ffn": 2 / 3},
    "attention_and_ffn_input": {"ffn": 1.0},  # the experts' outputs too: the router's gradient reads them
    "attention": {"out_projection": 1.0, "ffn": 1.0},
    "qkv": {"attention": 1.0, "out_projection": 1.0, "ffn": 1.0},
    "full": {"projections": 1.0, "attention": 1.0, "out_projection": 1.0, "ffn": 1.0},
}
RECOMPUTED["offload_attention"] = RECOMPUTED["attention"]
RECOMPUTED["offload_attention_and_ffn_input"] = RECOMPUTED["attention_and_ffn_input"]
