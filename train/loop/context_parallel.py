"""Context parallelism's one layout decision: which tokens of a sequence each context device holds.

With `mesh.context` = c > 1 every sequence of L tokens is split along its length over c devices. Causal
attention makes later tokens dearer (a token reads every earlier one), so c contiguous slices would leave
the first device idle most of the step. The sequence is instead cut into 2·c chunks and device i holds
chunks i and 2·c − 1 − i (c = 2: tokens of chunks 0, 3 | 1, 2), so every device holds one cheap and one
dear chunk and does the same attention work (the balancing MaxText and torchtitan use).

The reordering is a permutation of each sequence's positions, applied on the host to every per-token
array of a batch before it is put on the devices (`to_device_order`): inputs, targets and the loss mask
move together, so every sum over tokens (the cross-entropy, the router statistics) is unchanged. The
model is told each token's true position (`positions`), from which it takes RoPE and its causal and
sliding-window masks, so attention computes what it computes on the unpermuted sequence. Nothing else
changes: parameters and checkpoints do not depend on the context degree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError


def check_length(seq_len: int, degree: int) -> None:
    """Refuse a sequence length that does not split into 2 × `degree` equal chunks (one line)."""
    if degree > 1 and seq_len % (2 * degree):
        raise UpcyclerError(
            f"data.seq_len {seq_len} does not split into the {2 * degree} equal chunks mesh.context {degree} "
            f"balances the causal work over; make it a multiple of {2 * degree}"
        )


def balanced_order(length: int, degree: int) -> np.ndarray:
    """The position of each token as the devices hold it, int32 [length]: device i's block is chunks i and
    2·degree − 1 − i of the sequence, in that order. The identity for `degree` 1."""
    if degree <= 1:
        return np.arange(length, dtype=np.int32)
    check_length(length, degree)
    chunks = np.arange(length, dtype=np.int32).reshape(2 * degree, length // (2 * degree))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * degree - 1 - i]]) for i in range(degree)])


def to_device_order(arrays: Mapping[str, Any], degree: int) -> dict[str, Any]:
    """Every per-token array ([rows, length, ...]) of `arrays` permuted along its length into the
    balanced order; per-row arrays (one dimension) unchanged. The same values, only moved."""
    if degree <= 1:
        return dict(arrays)
    out = {}
    for key, value in arrays.items():
        value = np.asarray(value)
        out[key] = value[:, balanced_order(value.shape[1], degree)] if value.ndim >= 2 else value
    return out


def from_device_order(x: np.ndarray, degree: int, axis: int = 1) -> np.ndarray:
    """Undo `to_device_order` for one array: its `axis` back in sequence order."""
    if degree <= 1:
        return x
    inverse = np.argsort(balanced_order(x.shape[axis], degree))
    return np.take(x, inverse, axis=axis)
