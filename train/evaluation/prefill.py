"""Long prompts through the JAX model one at a time, one layer at a time, with dense or FlexPrefill attention.

`PrefillModel.run(prompt, answer)` is what a long-context check needs: the next-token logits after the
prompt and after each answer token, and what the sparse attention computed. Each layer is the model's own
code (`transformer.layer_qkv`, then attention, then `transformer.layer_output`), jitted per shape; between
the two halves the host chooses how the prompt attends:

- `attention: flexprefill` (`upcycler.train.model.flexprefill`): per head, the key blocks holding γ of the
  probe's attention, in a power-of-two bucket of blocks chosen per layer (one compile per bucket), dense
  when the prompt is short or the selection is dense anyway. Sliding-window layers run dense.
- anything else: dense causal attention, by chunks of queries over the keys they can see.

On a TPU (or with `device=True`), FlexPrefill runs instead as one compiled program per batch of prompts of
one length (`upcycler.train.evaluation.device_prefill`: selection, fallbacks and the splash attention
kernel on device, no host round-trip), `batch_size` prompts at a time (`run_batch`), fewer where the
program runs out of the chip's memory (the batch is halved until it fits).

Answer tokens (teacher-forced after the prompt) always attend densely to the prompt and to each other,
as a decode step would: FlexPrefill only changes how the prompt itself is computed. Logits are taken for
the rows asked for only, so a 32k prompt never holds [N, V] logits. Everything runs in the compute
dtype (fp32 by default) at the highest matmul precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from upcycler import hardware
from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train.config import ModelConfig
from upcycler.train.evaluation.config import PrefillConfig
from upcycler.train.model import layers as nn
from upcycler.train.model.flexprefill import causal_attention_jit, flexprefill_attention
from upcycler.train.model.flexprefill_cost import ChipRates
from upcycler.train.model.flexprefill_device import PLATFORMS, V5E, check_block
from upcycler.train.model.params import Params, layer_kind, layers_of_kind
from upcycler.train.model.transformer import layer_output, layer_qkv, layer_windows, unembed

if TYPE_CHECKING:
    from upcycler.train.evaluation.device_prefill import DevicePrefill

_LOGITS_ROWS = 1024  # rows of logits alive at a time when scoring every position
DEVICE_BATCH = 4  # prompts of one length prefilled together on a device (fewer where they do not fit)


class PrefillStats(NamedTuple):
    """Per layer and query head: the fraction of causal key blocks the prompt's attention computed (1 when
    dense) and whether FlexPrefill chose the head's blocks from pooled Q/K (query-aware); per layer, whether
    the prompt ran FlexPrefill's sparse attention (else dense: a short prompt, a dense selection, a
    sliding window, or a kernel choice that predicted dense faster)."""

    density: np.ndarray
    query_aware: np.ndarray
    sparse: np.ndarray


class PrefillResult(NamedTuple):
    """Logits [V] after the prompt's last token, logits [m, V] after each answer token, and the stats."""

    last_logits: np.ndarray
    answer_logits: np.ndarray
    stats: PrefillStats


class PrefillModel:
    """A checkpoint's weights held for prefills, with how to attend (`ModelConfig.attention`, and
    FlexPrefill's selection from `prefill`)."""

    def __init__(self, spec: ModelSpec, params: Params, cfg: ModelConfig = ModelConfig(), *,
                 prefill: PrefillConfig = PrefillConfig(), device: bool | None = None, interpret: bool = False,
                 platform: str | None = None):
        """`device`: prefill through `device_prefill` (default: when JAX's backend is a TPU or a GPU;
        `interpret` runs its kernels in the Pallas interpreter, for tests off the accelerator, as a TPU's
        unless the backend is a GPU; `platform` names the kernels' platform, tpu or gpu, instead)."""
        self.spec, self.params, self.cfg = spec, params, cfg
        self.options = prefill.options()
        backend = jax.default_backend()
        self.platform = platform or (backend if backend in PLATFORMS else "tpu")
        self.device = jax.default_backend() in PLATFORMS if device is None else device
        self.interpret = interpret
        self.batch_size = DEVICE_BATCH if self.device else 1
        self._fitting_batch: dict[tuple[int, int], int] = {}  # (prompt, answer length) → prompts that fit at once
        if self.device and cfg.attention == "flexprefill":
            try:
                check_block(self.options.block, spec.head_dim, self.platform)
            except ValueError as err:
                raise UpcyclerError(f"FlexPrefill on a {self.platform.upper()}: {err}") from None
        self._layer_cfg = replace(cfg, attention="einsum")  # the jitted halves of a layer: not how it attends

    @classmethod
    def load(cls, path: str | Path, cfg: ModelConfig = ModelConfig(), **kwargs) -> PrefillModel:
        """The checkpoint at `path` (HF or Orbax), its weights in the compute dtype."""
        from upcycler.io import read_checkpoint
        from upcycler.train.model.params import from_tensors

        ckpt = read_checkpoint(path)
        return cls(ckpt.spec, from_tensors(ckpt.spec, ckpt.tensors, dtype=np.dtype(cfg.compute_dtype)), cfg,
                   **kwargs)

    def run_batch(self, prompts: np.ndarray, answers: np.ndarray | None = None) -> list[PrefillResult]:
        """`run` of each prompt [B, N] with its answer [B, m] (one length each): on a device in one program
        per batch that fits the chip."""
        if not self.device:
            return [self.run(p, None if answers is None else a)
                    for p, a in zip(prompts, [None] * len(prompts) if answers is None else answers, strict=True)]
        prompts = np.asarray(prompts, np.int32)
        answers = np.zeros((len(prompts), 0), np.int32) if answers is None else np.asarray(answers, np.int32)
        m, N = answers.shape[1], prompts.shape[1]
        padded = np.resize(answers.T, (1 << (m - 1).bit_length(), len(prompts))).T if m else answers
        results = []
        for out in self._device_prefill(prompts, padded):
            logits = np.asarray(_batch_logits_jit(self.params, out.hidden_BLD[:, N - 1:N + m], self.spec))
            results += [PrefillResult(logits[b, 0], logits[b, 1:], self._stats(out, b)) for b in range(len(logits))]
        return results

    def next_token_logprobs_batch(self, ids: np.ndarray) -> list[tuple[np.ndarray, PrefillStats]]:
        """`next_token_logprobs` of each sequence [B, N] (one length): on a device in one program per batch
        that fits the chip."""
        if not self.device:
            return [self.next_token_logprobs(row) for row in ids]
        ids = np.asarray(ids, np.int32)
        outs = self._device_prefill(ids, np.zeros((len(ids), 0), np.int32))
        rows = [(out, b) for out in outs for b in range(out.hidden_BLD.shape[0])]
        return [(self._score(out.hidden_BLD[b], row), self._stats(out, b)) for (out, b), row in zip(rows, ids, strict=True)]

    def _device_prefill(self, prompts: np.ndarray, answers: np.ndarray) -> list[DevicePrefill]:
        """`device_prefill.prefill` of the prompts [B, N] and answers [B, m], in order, as few programs as
        fit the chip: a batch whose program runs out of the chip's memory is split in halves, and the size
        that fit is kept for later batches of that shape. A single prompt that does not fit is an error."""
        shape = prompts.shape[1], answers.shape[1]
        size = min(len(prompts), self._fitting_batch.get(shape, len(prompts)))
        outs, start = [], 0
        while start < len(prompts):
            try:
                outs.append(self._device_program(prompts[start:start + size], answers[start:start + size]))
            except jax.errors.JaxRuntimeError as err:
                if "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                if size == 1:
                    raise UpcyclerError(
                        f"a prompt of {shape[0]:,} tokens does not fit in the {jax.devices()[0].device_kind}'s memory "
                        "even alone; evaluate shorter --lengths or on a chip with more memory") from None
                size = self._fitting_batch[shape] = size // 2
                continue
            start += size
        return outs

    def _device_program(self, prompts: np.ndarray, answers: np.ndarray) -> DevicePrefill:
        from upcycler.train.evaluation.device_prefill import prefill

        with jax.default_matmul_precision("highest"):
            return prefill(self.params, jnp.asarray(prompts), jnp.asarray(answers), spec=self.spec,
                           cfg=self._device_cfg, opts=self.options, rates=self._rates, platform=self.platform,
                           interpret=self.interpret)

    @property
    def _rates(self) -> ChipRates:
        """The running chip's figures for the kernel choice (a v5e's when the chip is not known: interpreted)."""
        chip = hardware.for_devices(jax.devices()[:1])
        return ChipRates.of(chip) if chip is not None else V5E

    @property
    def _device_cfg(self) -> ModelConfig:
        """The layer config of the device program, attending as the user asked."""
        return replace(self._layer_cfg, attention=self.cfg.attention)

    @staticmethod
    def _stats(out, b: int) -> PrefillStats:
        return PrefillStats(np.asarray(out.density_LBH[:, b], np.float64), np.asarray(out.query_aware_LBH[:, b]),
                            np.asarray(out.sparse_L))

    def run(self, prompt_ids: np.ndarray, answer_ids: np.ndarray | None = None) -> PrefillResult:
        """Prefill `prompt_ids` [N], then `answer_ids` [m] teacher-forced: logits after the last prompt token
        and after every answer token."""
        answer = np.zeros(0, np.int32) if answer_ids is None else np.asarray(answer_ids, np.int32)
        m = len(answer)
        # answers of 5, 6 or 7 tokens share one compiled shape: repeats after the answer change nothing before
        # them (causal), and their logits are dropped
        padded = np.resize(answer, 1 << (m - 1).bit_length()) if m else answer
        hidden_LD, stats = self.hidden(np.asarray(prompt_ids, np.int32), padded)
        N = len(prompt_ids)
        logits = np.asarray(_logits_jit(self.params, hidden_LD[N - 1:N + m], self.spec))
        return PrefillResult(logits[0], logits[1:], stats)

    def next_token_logprobs(self, ids: np.ndarray) -> tuple[np.ndarray, PrefillStats]:
        """log p(ids[t+1] | ids[..t]) for t = 0..N−2 [N−1], with the whole sequence prefilled as one prompt."""
        ids = np.asarray(ids, np.int32)
        hidden_LD, stats = self.hidden(ids, np.zeros(0, np.int32))
        return self._score(hidden_LD, ids), stats

    def _score(self, hidden_LD: jax.Array, ids: np.ndarray) -> np.ndarray:
        """log p(ids[t+1] | ids[..t]) from the hidden states of the sequence, `_LOGITS_ROWS` rows at a time."""
        out = []
        for start in range(0, len(ids) - 1, _LOGITS_ROWS):
            end = min(len(ids) - 1, start + _LOGITS_ROWS)
            out.append(np.asarray(_target_logprobs_jit(self.params, hidden_LD[start:end], jnp.asarray(ids[start + 1:end + 1]),
                                                       self.spec)))
        return np.concatenate(out)

    def hidden(self, prompt_ids: np.ndarray, answer_ids: np.ndarray, *,
               observe: Callable[[int, jax.Array, jax.Array, jax.Array], None] | None = None,
               ) -> tuple[jax.Array, PrefillStats]:
        """Final-normed hidden states [N + m, D] of the prompt followed by the answer, and the prompt's stats.

        `observe(layer, q, k, v)`, if given, sees every layer's prompt attention inputs (benchmarks time the
        attention on them)."""
        spec, N = self.spec, len(prompt_ids)
        H, windows = spec.num_heads, layer_windows(spec)
        density, query_aware = np.ones((spec.num_layers, H)), np.zeros((spec.num_layers, H), bool)
        sparse = np.zeros(spec.num_layers, bool)
        ids = np.concatenate([prompt_ids, answer_ids]).astype(np.int32)
        dtype = jnp.dtype(self.cfg.compute_dtype)
        with jax.default_matmul_precision("highest"):
            x_LD = jnp.take(self.params["embed"], jnp.asarray(ids), axis=0).astype(dtype)
            for i in range(spec.num_layers):
                kind = layer_kind(spec, i)
                p = _layer_params(self.params, spec, i, kind)
                q, k, v = _qkv_jit(x_LD, p, spec, self._layer_cfg)
                if observe is not None:
                    observe(i, q[:N], k[:N], v[:N])
                if self.cfg.attention == "flexprefill" and not windows[i]:
                    result = flexprefill_attention(q[:N], k[:N], v[:N], self.options)
                    prompt_out, density[i], query_aware[i], sparse[i] = result
                else:
                    prompt_out = causal_attention_jit(q[:N], k[:N], v[:N], window=windows[i])
                out = prompt_out
                if len(answer_ids):
                    out = jnp.concatenate([prompt_out, _answer_attention_jit(q[N:], k, v, N, windows[i])])
                x_LD = _output_jit(x_LD, out, p, spec, self._layer_cfg, kind)
            hidden_LD = nn.rms_norm(x_LD, self.params["final_norm"], spec.rms_norm_eps)
        return hidden_LD, PrefillStats(density, query_aware, sparse)


def _layer_params(params: Params, spec: ModelSpec, i: int, kind: str) -> Params:
    j = layers_of_kind(spec, kind).index(i)
    return jax.tree.map(lambda a: a[j], params["layers"][kind])


@partial(jax.jit, static_argnames=("spec", "cfg"))
def _qkv_jit(x_LD, p, spec, cfg):
    q, k, v = layer_qkv(x_LD[None], p, spec, cfg)
    return q[0], k[0], v[0]


@partial(jax.jit, static_argnames=("spec", "cfg", "kind"))
def _output_jit(x_LD, out_LHh, p, spec, cfg, kind):
    return layer_output(x_LD[None], out_LHh[None], p, spec, cfg, kind=kind)[0]


@partial(jax.jit, static_argnames=("prompt_len", "window"))
def _answer_attention_jit(q_mHh, k_SKh, v_SKh, prompt_len: int, window: int):
    """Answer tokens (positions prompt_len…) attending densely to every earlier key and to themselves."""
    rows, cols = prompt_len + jnp.arange(q_mHh.shape[0])[:, None], jnp.arange(k_SKh.shape[0])[None, :]
    visible = (cols <= rows) & ((rows - cols < window) if window else True)
    return nn.attention(q_mHh[None], k_SKh[None], v_SKh[None], visible[None])[0]


@partial(jax.jit, static_argnames="spec")
def _logits_jit(params, hidden_LD, spec):
    return unembed(params, hidden_LD[None], spec)[0]


@partial(jax.jit, static_argnames="spec")
def _batch_logits_jit(params, hidden_BLD, spec):
    return unembed(params, hidden_BLD, spec)


@partial(jax.jit, static_argnames="spec")
def _target_logprobs_jit(params, hidden_LD, targets_L, spec):
    logits_LV = unembed(params, hidden_LD[None], spec)[0]
    picked = jnp.take_along_axis(logits_LV, targets_L[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits_LV, axis=-1)
