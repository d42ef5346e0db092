"""The JAX model: a decoder-only transformer as pure functions over a declared parameter tree.

The face of the package is the forward pass and how to run it (`ModelConfig`, `forward`, `forward_jit`,
`Aux`, `unsupported`), and its parts the train step uses (`weights_for_compute`, `hidden_states`, `unembed`). Inside:

- `transformer.py`: the decoder (attention block, dense or MoE block, scans over runs of layers). Named
  `transformer` rather than `model` so the package and the module inside it do not share a name;
- `layers.py`: RMSNorm, RoPE, masks, grouped-query attention, gated MLP;
- `moe.py`: router, dropless dispatch, one-hot reference, router losses; `gmm.py`: its grouped matmul;
- `flexprefill.py`: FlexPrefill's per-prompt block selection and block-sparse attention (prefill only);
- `params.py`: the parameter tree declared from `upcycler.layout` (shapes, logical axes, init, loading).
- `placement.py`: what the model asks of whoever places it on devices (`Placement`); the model names
  logical axes and never imports the mesh code (`upcycler.train.loop.sharding` answers for the trainer).

Dimension key. Array names end in `_` plus one letter per axis; a letter means the same thing in every
file of the trainer (`upcycler.train`):

    B batch (rows)                     L sequence (query) positions       S key positions
    D model width                      V vocabulary                       T tokens (B·L flattened)
    H query heads                      K key/value heads                  G query heads per kv head (H = K·G)
    N heads of either kind (H or K)    h head dim                         R rotary dims (≤ h), r = R/2
    F MLP width (one expert's in MoE)  U gate and up stacked (2F)         O, I a linear layer's out, in width
    E routed experts                   k experts per token (top-k)        M MoE layers
    C token copies (T·k; c = t·k + j)  X rows of the expert-sorted buffer (one per copy)

`gmm.py` states its contract for any grouped matmul in its own words (rows M, groups G); the MoE layer
calls it with rows X and groups E.
"""

from upcycler.train.model.transformer import (
    Aux,
    ModelConfig,
    forward,
    forward_jit,
    hidden_states,
    unembed,
    unsupported,
    weights_for_compute,
)

__all__ = ["Aux", "ModelConfig", "forward", "forward_jit", "hidden_states", "unembed", "unsupported",
           "weights_for_compute"]
