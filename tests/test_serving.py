"""Upcycler's outputs served by vLLM (its CPU build, `serving.py`) answer as the parent does.

Every output is built from the real SmolLM2-135M-Instruct (`real_model.py`) with the CLI, and the parent
and all outputs are served in one vLLM process (fp32, greedy, 24 tokens, top-5 logprobs). For each exact
recipe vLLM's text must be the parent's on every prompt, and the top-5 logprobs of the first 16 generated
tokens the parent's within `TOL`. vLLM itself is checked against transformers on the parent: the same
greedy tokens and text, and transformers' log-softmax at the same positions within `TOL`.

`TOL` = 2e-3 nats: fp32 summation order alone moves this model's logits by ~4e-4 (the noise floor of the
check every exact write runs), and a logprob moves by at most twice the largest change of the logits.

G = 8 with one shared expert (R = 7) scales down_proj by 7, which bfloat16 rounds: the write reports the
function as preserved but not verified, and its logprobs move by up to ~4e-2. Its text must still be the
parent's, and vLLM's logprobs must be transformers' own on that output within `TOL`.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
from cli_helpers import run_cli
from real_model import smollm2
from serving import completions_of, serve, threads

pytestmark = [pytest.mark.real_model, pytest.mark.serving]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
MAX_TOKENS = 24  # generated per prompt
COMPARED = 16  # generated tokens whose top-5 logprobs are compared
TOL = 2e-3
RECIPES = {  # name: (command, arguments, exact: the write checks it against the parent)
    "mixtral-8-top2": ("dense-to-moe", ["--experts", "8", "--topk", "2", "--target", "mixtral"], True),
    "qwen2_moe-g8-shared": ("dense-to-moe", ["--experts", "56", "--topk", "7", "--granularity", "8",
                                             "--shared-experts", "1", "--target", "qwen2_moe"], False),
    "glm4_moe-224-shared-dense1": ("dense-to-moe", ["--experts", "64", "--topk", "8", "--expert-width", "224",
                                                    "--shared-experts", "1", "--dense-layers", "1",
                                                    "--target", "glm4_moe"], True),
    "depth-36-identity": ("depth", ["--layers", "36", "--method", "identity"], True),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(parent directory, {name: output directory}, `serve`'s answer for all of them), served at once."""
    parent = smollm2()
    root = tmp_path_factory.mktemp("serving")
    outputs = {name: root / name for name in RECIPES}
    for name, (command, args, _) in RECIPES.items():
        run_cli(command, parent, outputs[name], *args)
    yield parent, outputs, serve([parent, *outputs.values()], PROMPTS, max_tokens=MAX_TOKENS)
    shutil.rmtree(root, ignore_errors=True)  # ~4 GB of checkpoints


def test_vllm_serves_the_parent_as_transformers_runs_it(served, record_property):
    import torch
    from tiny_models import load_model
    from transformers import AutoTokenizer

    parent, _, answer = served
    vllm = completions_of(answer, parent)
    model, tokenizer = load_model(parent), AutoTokenizer.from_pretrained(parent)
    for prompt, got in zip(PROMPTS, vllm, strict=True):
        assert got["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
    prompts = [got["prompt_token_ids"] for got in vllm]
    width, eos = max(map(len, prompts)), model.generation_config.eos_token_id
    ids = torch.as_tensor([[eos] * (width - len(p)) + p for p in prompts])  # left-padded, masked
    mask = torch.as_tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with _torch_threads(), torch.no_grad():
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=eos)
        tops = _transformers_tops(model, vllm)
    for prompt, got, row in zip(PROMPTS, vllm, greedy[:, width:].tolist(), strict=True):
        generated = row[:row.index(eos) + 1] if eos in row else row  # vLLM keeps the EOS it stops at
        assert generated == got["token_ids"], (prompt, generated, got["token_ids"])
        assert tokenizer.decode(generated, skip_special_tokens=True) == got["text"]
    record_property("max_logprob_diff", max(_assert_same_top(got["logprobs"], want, prompt)
                                            for prompt, got, want in zip(PROMPTS, vllm, tops, strict=True)))


@pytest.mark.parametrize("name", RECIPES)
def test_output_serves_as_the_parent(name, served, record_property):
    from tiny_models import load_model

    parent, outputs, answer = served
    verification = json.loads((outputs[name] / "upcycler.json").read_text()).get("verification")
    exact, worst = RECIPES[name][2], 0.0
    assert (verification is not None and verification["passed"]) == exact, verification
    mine = completions_of(answer, outputs[name])
    for prompt, want, got in zip(PROMPTS, completions_of(answer, parent), mine, strict=True):
        assert got["text"] == want["text"], (prompt, want["text"], got["text"])
        assert got["token_ids"] == want["token_ids"]
        if exact:
            worst = max(worst, _assert_same_top(got["logprobs"], want["logprobs"], prompt))
    if not exact:  # served as transformers runs this output, rounding and all
        with _torch_threads():
            tops = _transformers_tops(load_model(outputs[name]), mine)
        for prompt, got, want in zip(PROMPTS, mine, tops, strict=True):
            worst = max(worst, _assert_same_top(got["logprobs"], want, prompt))
    record_property("max_logprob_diff", worst)  # against the parent, or transformers on an inexact output


@contextlib.contextmanager
def _torch_threads():
    """transformers with `serving.threads()` threads, as vLLM runs (this process's torch setting restored)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _transformers_tops(model, completions: list[dict], k: int = 5) -> list[list[dict[int, float]]]:
    """transformers' top-k {token id: log-softmax} at each generated position of each completion, fed
    vLLM's own tokens: one forward of the sequences, right-padded (causal: no position sees its padding)."""
    import torch

    sequences = [c["prompt_token_ids"] + c["token_ids"][:-1] for c in completions]
    width = max(map(len, sequences))
    ids = torch.as_tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.as_tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.double(), -1)
    tops = []
    for row, c in zip(logprobs, completions, strict=True):
        start = len(c["prompt_token_ids"]) - 1
        values, top = row[start:start + len(c["token_ids"])].topk(k, -1)
        tops.append([dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(top, values, strict=True)])
    return tops


def _assert_same_top(got: list[dict[int, float]], want: list[dict[int, float]], prompt: str) -> float:
    """The first COMPARED steps' top-k agree within TOL: the same token ids with the same logprobs, except
    that a token at the edge of one top-k may trade places with one within TOL of that edge. Returns the
    largest difference."""
    worst = 0.0
    for step, (a, b) in enumerate(zip(got[:COMPARED], want[:COMPARED], strict=True)):
        for token in a.keys() & b.keys():
            worst = max(worst, abs(a[token] - b[token]))
        for mine, other in ((a, b), (b, a)):
            edge = min(other.values())
            for token in mine.keys() - other.keys():
                assert mine[token] <= edge + TOL, (prompt, step, token, a, b)
    assert worst <= TOL, (prompt, worst)
    return worst
