"""Router calibration for an MoE built from several dense models: what each source's data looks like to a router.

`dense-to-moe --experts-from … --router-init centroids --calibration DATA` points each virtual group's router
row at its source's domain. It needs, per source and per MoE layer, the mean of the hidden state the router
reads (the FFN's normalised input) when the source's own model runs on the source's own data. This
module computes that with the JAX model, one layer in memory at a time (`layerwise.ffn_inputs`), and
measures how an upcycled model routes each source's tokens (`routing_shares`), which `dense-to-moe` reports
after the write (`transforms.dense_to_moe_hooks`).

Calibration data is a prepared-data directory (`upcycle prepare-data`) holding one source per
`--experts-from` name; `sequences` windows of `length` tokens are taken evenly spaced over each stream,
so the result depends only on the data, not on a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.hashing import sha256_file
from upcycler.layout import layer_prefix
from upcycler.spec import LIMITS_ENV, ModelSpec, limits_on
from upcycler.train.data.sources import TokenSource, open_source
from upcycler.train.evaluation.layerwise import ffn_inputs
from upcycler.train.model import moe
from upcycler.untrusted import shown_path

MAX_CALIBRATION_BYTES = 8 * 1024**3
"""Bound on each of the two large buffers calibration holds (unless UPCYCLER_LIMITS=off): the fp32 residual
stream and FFN input of every calibration sequence of one source (`ffn_inputs` keeps all of them), and the
attention scores of one chunk of sequences (`layers.attention`: heads × L² fp32, about three copies)."""
CHUNK = 16  # sequences per forward when their attention scores fit the bound


@dataclass(frozen=True)
class RouterInputs:
    """The service `dense-to-moe --router-init centroids` borrows (a `transforms.registry.TransformContext` field)."""

    def check(self, data: Path, names: Sequence[str], base: Checkpoint, length: int, sequences: int = 1) -> None:
        """Refuse calibration data that is missing, too short or of another tokenizer, and a request whose
        buffers would exceed `MAX_CALIBRATION_BYTES`, before any write."""
        data = Path(data)
        if not data.is_dir():
            kind = "not a directory" if data.exists() else "no such directory"
            raise UpcyclerError(f"--calibration {shown_path(data)}: {kind}; pass the directory `upcycle "
                                "prepare-data --out` wrote, with one source per --experts-from name")
        spec = base.spec
        if length > spec.max_position_embeddings:
            raise UpcyclerError(f"--calibration-length {length} is longer than the model's context "
                                f"(max_position_embeddings {spec.max_position_embeddings:,}); use at most "
                                f"{spec.max_position_embeddings:,}")
        if limits_on() and attention_bytes(spec, length) > MAX_CALIBRATION_BYTES:
            longest = int((MAX_CALIBRATION_BYTES / attention_bytes(spec, 1)) ** 0.5)
            raise UpcyclerError(f"--calibration-length {length}: the attention scores of one sequence take "
                                f"{attention_bytes(spec, length):,} bytes, over the limit of "
                                f"{MAX_CALIBRATION_BYTES:,}; use --calibration-length {longest} or less "
                                f"(or set {LIMITS_ENV}=off)")
        for name in names:
            count = min(sequences, len(checked_tokens(data, name, length, base).tokens) // length)
            if limits_on() and count * length * stream_bytes(spec) > MAX_CALIBRATION_BYTES:
                most = max(1, MAX_CALIBRATION_BYTES // (length * stream_bytes(spec)))
                raise UpcyclerError(f"--calibration-sequences {sequences} × --calibration-length {length}: the "
                                    f"hidden states of {count:,} sequences of {name} take "
                                    f"{count * length * stream_bytes(spec):,} bytes, over the limit of "
                                    f"{MAX_CALIBRATION_BYTES:,}; use --calibration-sequences {most} or less "
                                    f"(or set {LIMITS_ENV}=off)")
            calibration_tokens(data, name, 1, length, base)

    def shares(self, ckpt: Checkpoint, data: Path, names: Sequence[str], expert_sources: Sequence[str],
               sequences: int, length: int) -> np.ndarray:
        """[M, S, S]: how `ckpt` routes each source's tokens of `data` to the experts of each source
        (`routing_shares`), which `dense-to-moe` reports after a write with centroid routers."""
        return routing_shares(ckpt, data, names, expert_sources, sequences, length)

    def mean(self, ckpt: Checkpoint, data: Path, name: str, sequences: int, length: int,
             layers: Sequence[int]) -> np.ndarray:
        """[len(layers), D] float64: the mean FFN input of `ckpt` at `layers` on source `name` of `data`."""
        ids = calibration_tokens(data, name, sequences, length, ckpt)
        wanted = {layer: k for k, layer in enumerate(layers)}
        out = np.zeros((len(layers), ckpt.spec.hidden_size))
        for layer, h in ffn_inputs(ckpt, ids, chunk=chunk_for(ckpt.spec, length)):
            if layer in wanted:
                out[wanted[layer]] = h.reshape(-1, h.shape[-1]).astype(np.float64).mean(0)
            if layer >= max(layers):
                break
        return out


def attention_bytes(spec: ModelSpec, length: int) -> int:
    """Bytes of the attention scores of one sequence of `length` tokens (heads × L² fp32, three copies)."""
    return 3 * 4 * spec.num_heads * length * length


def stream_bytes(spec: ModelSpec) -> int:
    """Bytes `ffn_inputs` holds per calibration token: its fp32 residual stream and FFN input."""
    return 2 * 4 * spec.hidden_size


def chunk_for(spec: ModelSpec, length: int) -> int:
    """Sequences per forward: `CHUNK`, fewer when their attention scores would exceed the bound."""
    return max(1, min(CHUNK, MAX_CALIBRATION_BYTES // attention_bytes(spec, length)))


def calibration_tokens(data: Path, name: str, sequences: int, length: int, model: Checkpoint) -> np.ndarray:
    """[n, length] int32: up to `sequences` evenly spaced windows of source `name`, checked against the
    model's vocabulary and tokenizer."""
    source = checked_tokens(data, name, length, model)
    tokens, where = source.tokens, shown_path(source.path) if source.path else name
    count = min(sequences, len(tokens) // length)
    starts = np.linspace(0, len(tokens) - length, count).astype(np.int64)
    ids = np.stack([np.asarray(tokens[s:s + length]) for s in starts]).astype(np.int32)
    if int(ids.max()) >= model.spec.vocab_size:
        raise UpcyclerError(f"{where}: token id {int(ids.max())} is outside the model's vocabulary of "
                            f"{model.spec.vocab_size}; prepare the data with the model's tokenizer")
    return ids


def checked_tokens(data: Path, name: str, length: int, model: Checkpoint) -> TokenSource:
    """Source `name` of `data` (its token stream memory-mapped), refused when prepared with another tokenizer than
    the model's or shorter than one sequence of `length`."""
    source = open_source(Path(data), name)
    where = shown_path(source.path) if source.path else name
    tokenizer = next((p for p in model.side_files if p.name == "tokenizer.json"), None)
    if tokenizer is not None and sha256_file(tokenizer) != source.tokenizer_sha256:
        raise UpcyclerError(f"{where}: calibration data was prepared with another tokenizer than "
                            f"{shown_path(tokenizer)}; prepare it with the model's tokenizer.json")
    tokens = source.tokens
    if len(tokens) < length:
        raise UpcyclerError(f"{where}: {len(tokens)} tokens, fewer than one calibration sequence of {length}; "
                            "prepare more data or lower --calibration-length")
    return source


def routing_shares(ckpt: Checkpoint, data: Path, names: Sequence[str], expert_sources: Sequence[str],
                   sequences: int, length: int) -> np.ndarray:
    """[M, S, S]: per MoE layer of `ckpt`, the share of data source s's routed token copies that go to
    experts cut from source t (rows sum to 1), measured by the model's own first forward."""
    spec = ckpt.spec
    assert spec.moe is not None
    to_source = np.array([list(names).index(n) for n in expert_sources])
    layers = spec.moe_layers
    out = np.zeros((len(layers), len(names), len(names)))
    for s, name in enumerate(names):
        ids = calibration_tokens(data, name, sequences, length, ckpt)
        for layer, h in ffn_inputs(ckpt, ids, chunk=chunk_for(spec, length)):
            if layer not in layers:
                continue
            p = layer_prefix(layer)
            bias = ckpt.tensors[p + "moe.router_bias"].load() if spec.moe.router_bias else None
            logits = moe.router_logits(jnp.asarray(h.reshape(-1, h.shape[-1])),
                                       jnp.asarray(ckpt.tensors[p + "moe.router"].load()))
            routing = moe.route(logits, spec.moe.top_k, spec.moe.router, spec.moe.routed_scaling_factor,
                                None if bias is None else jnp.asarray(bias))
            chosen = to_source[np.asarray(routing.expert_Tk).ravel()]
            out[layers.index(layer), s] = np.bincount(chosen, minlength=len(names)) / chosen.size
    return out
