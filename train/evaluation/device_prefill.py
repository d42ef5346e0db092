"""A batch of long prompts through the whole model in one compiled program: FlexPrefill on a TPU or GPU.

`prefill.PrefillModel` on a CPU runs a prompt one layer at a time, choosing FlexPrefill's buckets on the
host between layers. On an accelerator that would recompile per bucket and wait on the host at every
layer. Here the prompt's layers run in one jit (`prefill`): a `lax.scan` over each span of layers of one
kind, the attention of each layer through `flexprefill_device` (selection, fallbacks, the choice of kernel
and the kernel, on device), layers with a sliding window through the platform's dense attention with their
window, chosen per layer at run time. The
prompts of a batch share one length; one compile per (batch, length, answer length).

What it preserves: the layers are the model's own (`transformer.layer_qkv`, `transformer.layer_output`),
the selection is `flexprefill.select_blocks`, and the answer tokens attend densely to the prompt and to
each other, as in `prefill.PrefillModel`; the two agree within float rounding (tested in the interpreter).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from upcycler.spec import ModelSpec
from upcycler.train.config import ModelConfig
from upcycler.train.model import flexprefill_device as kernel
from upcycler.train.model import layers as nn
from upcycler.train.model.flexprefill import FlexPrefillOptions
from upcycler.train.model.flexprefill_cost import ChipRates
from upcycler.train.model.params import Params, layer_spans, layers_of_kind
from upcycler.train.model.transformer import layer_output, layer_qkv, layer_windows


class DevicePrefill(NamedTuple):
    """Final-normed hidden states [B, N + m, D] of the prompts followed by their answers; per layer, prompt
    and query head the fraction of causal key blocks computed [layers, B, H] and the query-aware heads; per
    layer whether the sparse kernel ran for the batch [layers] (else dense)."""

    hidden_BLD: jax.Array
    density_LBH: jax.Array
    query_aware_LBH: jax.Array
    sparse_L: jax.Array


@partial(jax.jit, static_argnames=("spec", "cfg", "opts", "rates", "platform", "interpret"))
def prefill(params: Params, prompt_BN: jax.Array, answer_Bm: jax.Array, *, spec: ModelSpec, cfg: ModelConfig,
            opts: FlexPrefillOptions, rates: ChipRates = kernel.V5E, platform: str = "tpu",
            interpret: bool = False) -> DevicePrefill:
    """Prefill `prompt_BN` (every prompt N tokens) then `answer_Bm` teacher-forced, FlexPrefill on every
    full-attention layer when `cfg.attention` is flexprefill (else dense), in `cfg.compute_dtype`; the
    sparse kernel runs where the cost model predicts it beats dense on a chip of `rates`."""
    N, windows = prompt_BN.shape[1], layer_windows(spec)
    sparse = cfg.attention == "flexprefill"
    ids_BL = jnp.concatenate([prompt_BN, answer_Bm], axis=1)
    x_BLD = jnp.take(params["embed"], ids_BL, axis=0).astype(cfg.compute_dtype)
    density, query_aware, sparse_layers = [], [], []
    for span in layer_spans(spec):
        layer_ids = layers_of_kind(spec, span.kind)[span.start:span.start + span.length]
        stack = jax.tree.map(lambda a, span=span: a[span.start:span.start + span.length], params["layers"][span.kind])
        distinct = tuple(sorted({windows[i] for i in layer_ids}))
        index_l = jnp.asarray([distinct.index(windows[i]) for i in layer_ids], jnp.int32)
        body = partial(_layer, spec=spec, cfg=cfg, opts=opts, kind=span.kind, windows=distinct, prompt_len=N,
                       sparse=sparse, rates=rates, platform=platform, interpret=interpret)
        x_BLD, (dens, qa, ran_sparse) = jax.lax.scan(body, x_BLD, (stack, index_l))
        density.append(dens)
        query_aware.append(qa)
        sparse_layers.append(ran_sparse)
    hidden_BLD = nn.rms_norm(x_BLD, params["final_norm"], spec.rms_norm_eps)
    return DevicePrefill(hidden_BLD, jnp.concatenate(density), jnp.concatenate(query_aware),
                         jnp.concatenate(sparse_layers))


def _layer(x_BLD, layer, *, spec: ModelSpec, cfg: ModelConfig, opts: FlexPrefillOptions, kind: str,
           windows: tuple[int, ...], prompt_len: int, sparse: bool, rates: ChipRates, platform: str,
           interpret: bool):
    p, window_index = layer
    N = prompt_len
    q, k, v = layer_qkv(x_BLD, p, spec, cfg)
    B, H = q.shape[0], q.shape[2]

    def attend(window: int):
        def run(q_BNHh, k_BNKh, v_BNKh):
            if window == 0 and sparse:
                return tuple(kernel.flexprefill_attention(q_BNHh, k_BNKh, v_BNKh, opts, rates=rates,
                                                          platform=platform, interpret=interpret))
            out = kernel.dense_attention(q_BNHh, k_BNKh, v_BNKh, window=window, block=opts.block, platform=platform,
                                         interpret=interpret)
            return out, jnp.ones((B, H), jnp.float32), jnp.zeros((B, H), bool), jnp.asarray(False)
        return run

    branches = [attend(w) for w in windows]
    prompt = (q[:, :N], k[:, :N], v[:, :N])
    out, density_BH, query_aware_BH, ran_sparse = (branches[0](*prompt) if len(branches) == 1
                                                   else jax.lax.switch(window_index, branches, *prompt))
    if x_BLD.shape[1] > N:
        window = jnp.asarray(windows, jnp.int32)[window_index]
        out = jnp.concatenate([out, _answer_attention(q[:, N:], k, v, N, window)], axis=1)
    return layer_output(x_BLD, out, p, spec, cfg, kind=kind), (density_BH.astype(jnp.float32), query_aware_BH,
                                                               ran_sparse)


def _answer_attention(q_BmHh, k_BSKh, v_BSKh, prompt_len: int, window: jax.Array) -> jax.Array:
    """Answer tokens (positions prompt_len…) attending densely to every earlier key and to themselves."""
    rows, cols = prompt_len + jnp.arange(q_BmHh.shape[1])[:, None], jnp.arange(k_BSKh.shape[1])[None, :]
    visible = (cols <= rows) & ((window == 0) | (rows - cols < window))
    return nn.attention(q_BmHh, k_BSKh, v_BSKh, jnp.broadcast_to(visible, (q_BmHh.shape[0], *visible.shape)))
