"""Tiny random Hugging Face models built by transformers itself, the reference every test compares with.

`make_tiny(family, path, **overrides)` builds a model of one supported family (hidden size 64, 2 layers
unless overridden), saves it with `save_pretrained` and returns the path. `logits(path, ids)` loads any
directory with `AutoModelForCausalLM` and returns fp32 logits as numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 256}
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                                     "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0]}),
    "qwen3_moe": ("Qwen3MoeConfig", {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "head_dim": 16, "mlp_only_layers": [0]}),
    "glm4_moe": ("Glm4MoeConfig", {"moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
                                   "num_experts_per_tok": 2, "head_dim": 16, "first_k_dense_replace": 1,
                                   "partial_rotary_factor": 1.0, "num_nextn_predict_layers": 0}),
}
FAMILIES = tuple(CONFIGS)


def make_config(family: str, **overrides):
    import transformers

    cls_name, defaults = CONFIGS[family]
    return getattr(transformers, cls_name)(**{**_BASE, **defaults, **overrides})


def make_tiny(family: str, path: Path, *, seed: int = 0, max_shard_size: str | None = None,
              dtype: str = "float32", **overrides) -> Path:
    """Save a random tiny `family` model to `path`; weights are perturbed so no tensor is trivially 0 or 1."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make_config(family, **overrides))
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and biases at 0: make every tensor informative
            p.add_(torch.randn_like(p) * 0.02)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)


def load_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def logits(path_or_model, ids: np.ndarray) -> np.ndarray:
    """fp32 logits [B, L, V] of a saved directory (or a loaded model) on token ids [B, L]."""
    import torch

    model = load_model(path_or_model) if isinstance(path_or_model, (str, Path)) else path_or_model
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def random_ids(batch: int = 2, length: int = 16, vocab: int = 128, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length))
