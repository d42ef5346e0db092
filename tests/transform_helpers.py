"""Helpers for the transform tests: run a transform in-process, compare logits, count HF parameters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tiny_models import load_model, logits, random_ids

from upcycler.transforms.pipeline import Plan, execute, plan
from upcycler.transforms.recipe import Output, single

TOLERANCE = 1e-5


def run_transform(name: str, src: Path, out: Path | None, *, to: str = "hf", family: str | None = None,
                  dtype: str | None = None, dry_run: bool = False, **values) -> Plan:
    """`upcycle NAME SRC OUT --options` in-process; with `dry_run`, only the plan."""
    p = plan(single(name, values, Path(src), Output(out, to, family, dtype)), allow_config_only=dry_run)
    if not dry_run:
        execute(p, progress=False)
    return p


def max_logit_diff(a: Path, b: Path, *, batches: int = 3) -> float:
    """max |Δlogits| of two saved models over a few random token batches."""
    ma, mb = load_model(a), load_model(b)
    worst = 0.0
    for seed in range(batches):
        ids = random_ids(batch=4, length=16, vocab=ma.config.vocab_size, seed=seed)
        worst = max(worst, float(np.abs(logits(ma, ids) - logits(mb, ids)).max()))
    return worst


def stored(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor in the safetensors files of `directory`, by HF name."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def hf_param_count(cfg: dict, tmp: Path) -> int:
    """Parameters of the transformers model built (randomly) from config dict `cfg`."""
    import transformers

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp))
    return sum(p.numel() for p in model.parameters())


def active_by_hand(cfg: dict, total: int) -> int:
    """Active parameters from an MoE config: the total minus the routed experts a token does not use."""
    D, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    if cfg["model_type"] == "mixtral":
        n, width, moe_layers = cfg["num_local_experts"], cfg["intermediate_size"], L
    elif cfg["model_type"] == "glm4_moe":
        n, width, moe_layers = cfg["n_routed_experts"], cfg["moe_intermediate_size"], L - cfg["first_k_dense_replace"]
    else:
        n, width, moe_layers = cfg["num_experts"], cfg["moe_intermediate_size"], L - len(cfg["mlp_only_layers"])
    return total - moe_layers * (n - cfg["num_experts_per_tok"]) * 3 * D * width
