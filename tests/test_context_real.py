"""context on the real 30-layer model (SmolLM2-135M-Instruct, `real_model.py`, trained for 8,192 positions).

Each method extends it to 32,768 positions: every tensor's bytes are the parent's, transformers loads the
config with the RoPE asked for and generates from it, the JAX model's logits are transformers' on the
new config, and the command prints how far the RoPE moved the model within the original length (KL and
top-1 agreement against the parent on its probe). vLLM serving these outputs as transformers runs them is in
`test_serving.py` (`context-*` cases).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from cli_helpers import run_cli
from real_model import smollm2

from upcycler.io import read_checkpoint

pytestmark = pytest.mark.real_model

EXTENDED = 32768
METHODS = {
    "yarn": ["--rope-scaling", "yarn"],
    "llama3": ["--rope-scaling", "llama3", "--rope-theta", "5e5"],
    "linear": ["--rope-scaling", "linear"],
}
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
SHIFT = re.compile(r"KL (\S+) mean .*top-1 agreement (\S+)%")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(parent, {method: (output, the command's stderr)})."""
    parent, root = smollm2(), tmp_path_factory.mktemp("context-real")
    return parent, {name: (root / name, run_cli("context", parent, root / name, "--max-position", EXTENDED,
                                                *args).stderr) for name, args in METHODS.items()}


@pytest.mark.parametrize("method", METHODS)
def test_real_model_context(method, written, record_property):
    import torch
    from tiny_models import load_model
    from transformers import AutoConfig, AutoTokenizer

    parent, outputs = written
    out, stderr = outputs[method]
    source, result = read_checkpoint(parent), read_checkpoint(out)
    for name, tensor in source.tensors.items():
        assert result.tensors[name].load().tobytes() == tensor.load().tobytes(), name
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.max_position_embeddings == EXTENDED and cfg.rope_parameters["rope_type"] == method
    assert cfg.rope_parameters["factor"] == EXTENDED / 8192
    model, tokenizer = load_model(out), AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = torch.as_tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        answer = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    record_property("answer", tokenizer.decode(answer, skip_special_tokens=True))  # not the parent's function
    probe = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 256))
    with torch.no_grad():
        reference = model(torch.as_tensor(probe)).logits.float().numpy()
    assert np.abs(_jax_logits(out, probe) - reference).max() <= 2e-3  # fp32 summation order, 30 layers
    line = next(line for line in stderr.splitlines() if line.startswith("RoPE changed"))
    kl, top1 = map(float, SHIFT.search(line).groups())
    assert "within the original 8,192 positions" in line and 0 < kl < np.inf and 0 <= top1 <= 100, line
    record_property("shift", line)
    print(f"{method}: {line}; answer {tokenizer.decode(answer, skip_special_tokens=True)!r}")
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == method


def _jax_logits(directory, ids: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    from upcycler.train.model import ModelConfig, forward_jit
    from upcycler.train.model import params as P

    ckpt = read_checkpoint(directory)
    out, _ = forward_jit(P.from_tensors(ckpt.spec, ckpt.tensors, dtype=jnp.float32),
                         jnp.asarray(ids), ckpt.spec, ModelConfig())
    return np.asarray(out)
