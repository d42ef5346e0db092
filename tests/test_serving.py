"""Upcycler's outputs served by vLLM (its CPU build, `serving.py`) answer as the parent does.

Every output is built from the real SmolLM2-135M-Instruct (`real_model.py`) with the CLI, and the parent
and all outputs are served in one vLLM process (fp32, greedy, 24 tokens, top-5 logprobs). Each output is
compared in one of three ways (`CASES`):

- `exact`: vLLM's text must be its parent's on every prompt, and the top-5 logprobs of the first 16
  generated tokens the parent's within `TOL` (every exact MoE family, identity depth, BTX from copies, and
  Qwen3-MoE and GLM-4-MoE from a Qwen3 parent, itself built from the real model's weights with fitted q/k
  norms);
- `text`: the parent's text, and vLLM's logprobs transformers' own on that output within `TOL`;
- `own`: vLLM's greedy tokens and logprobs are transformers' own on that output (up to a tie within
  `TOL`) — for outputs that are not the parent's function: the Qwen3-MoE with fitted q/k norms, a
  trained MoE exported by the trainer (`checkpoint.hf_every`), and the parent's context extended to 32k by
  `context` with YaRN (Llama 3's scaling, which changes only other fields of the same config, is checked
  against transformers on the real model by `test_context_real.py`).

vLLM itself is checked against transformers on the parent the same way.

`TOL` = 2e-3 nats: fp32 summation order alone moves this model's logits by ~4e-4 (the noise floor of the
check every exact write runs), and a logprob moves by at most twice the largest change of the logits.

G = 8 with one shared expert (R = 7) scales down_proj by 7, which bfloat16 rounds: the write reports the
function as preserved but not verified, and its logprobs move by up to ~4e-2 (`text`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import prepare_demo_corpus, run_cli
from real_model import smollm2
from serving import completions_of, serve, threads
from trainer_fixtures import config_dict, write_config

from upcycler.cli.demo import DEMO_SOURCES, demo_assets

pytestmark = [pytest.mark.real_model, pytest.mark.serving]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
MAX_TOKENS = 24  # generated per prompt
COMPARED = 16  # generated tokens whose top-5 logprobs are compared
TOL = 2e-3
CALIBRATION = ["--calibration-sequences", "8", "--calibration-length", "128"]  # 1,024 tokens, as many held out
CASES = {  # name: (source, command, arguments, comparison); the source is "parent" or an earlier case
    "mixtral-8-top2": ("parent", "dense-to-moe", ["--experts", "8", "--topk", "2", "--target", "mixtral"],
                       "exact"),
    "qwen2_moe-g8-shared": ("parent", "dense-to-moe", ["--experts", "56", "--topk", "7", "--granularity", "8",
                                                       "--shared-experts", "1", "--target", "qwen2_moe"], "text"),
    "glm4_moe-224-shared-dense1": ("parent", "dense-to-moe", ["--experts", "64", "--topk", "8", "--expert-width",
                                                              "224", "--shared-experts", "1", "--dense-layers",
                                                              "1", "--target", "glm4_moe"], "exact"),
    "depth-36-identity": ("parent", "depth", ["--layers", "36", "--method", "identity"], "exact"),
    "btx-copies": ("parent", "dense-to-moe", ["--experts", "4", "--topk", "2", "--granularity", "2", "--target",
                                              "mixtral", "--experts-from", "a={parent}", "b={parent}"], "exact"),
    "qwen3_moe-fitted-norms": ("parent", "dense-to-moe", ["--experts", "8", "--topk", "4", "--granularity", "4",
                                                          "--target", "qwen3_moe", "--allow-approximate",
                                                          "--calibration", "{data}", *CALIBRATION], "own"),
    "qwen3": ("qwen3_moe-fitted-norms", "build", [], "own"),  # a Qwen3 parent: `qwen3_parent`
    "qwen3_moe-from-qwen3": ("qwen3", "dense-to-moe", ["--experts", "8", "--topk", "4", "--granularity", "4",
                                                       "--target", "qwen3_moe"], "exact"),
    # a Qwen3 parent (its config writes layer_types) into GLM-4-MoE (a shared expert: vLLM needs one)
    "glm4_moe-from-qwen3": ("qwen3", "dense-to-moe", ["--experts", "8", "--topk", "2", "--granularity", "2",
                                                      "--shared-experts", "1", "--target", "glm4_moe"], "exact"),
    "trained-btx": ("btx-copies", "train", [], "own"),  # 2 steps, exported by `checkpoint.hf_every`
    # RoPE surgery for a longer context: the config alone changes, served at the original length
    "context-yarn-32k": ("parent", "context", ["--max-position", "32768", "--rope-scaling", "yarn"], "own"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(parent directory, {name: output directory}, `serve`'s answer for all of them), served at once."""
    parent = smollm2()
    root = tmp_path_factory.mktemp("serving")
    data = prepare_demo_corpus(parent / "tokenizer.json", root / "data")
    outputs = {"parent": parent}
    for name, (source, command, args, _) in CASES.items():
        outputs[name] = root / name
        if command == "build":
            qwen3_parent(parent, outputs[source], outputs[name])
        elif command == "train":
            outputs[name] = trained(outputs[source], data, root / name)
        else:
            run_cli(command, outputs[source], outputs[name],
                    *[a.format(parent=parent, data=data) for a in args])
    yield parent, outputs, serve(list(outputs.values()), PROMPTS, max_tokens=MAX_TOKENS)
    shutil.rmtree(root, ignore_errors=True)  # ~4 GB of checkpoints


def test_vllm_serves_the_parent_as_transformers_runs_it(served, record_property):
    parent, _, answer = served
    record_property("max_logprob_diff", _assert_served_as_transformers(parent, completions_of(answer, parent)))


@pytest.mark.parametrize("name", CASES)
def test_output_serves_as_its_parent(name, served, record_property):
    """exact: the parent's text and logprobs; text: the parent's text, transformers' logprobs; own: transformers'
    greedy tokens and logprobs on this output."""
    from tiny_models import load_model

    _, outputs, answer = served
    source, _, _, comparison = CASES[name]
    out, mine = outputs[name], completions_of(answer, outputs[name])
    manifest = out / "upcycler.json"
    verification = json.loads(manifest.read_text()).get("verification") if manifest.is_file() else None
    assert (verification is not None and verification["passed"]) == (comparison == "exact"), verification
    if comparison == "own":
        record_property("max_logprob_diff", _assert_served_as_transformers(out, mine))
        return
    worst = 0.0
    for prompt, want, got in zip(PROMPTS, completions_of(answer, outputs[source]), mine, strict=True):
        assert got["text"] == want["text"], (prompt, want["text"], got["text"])
        assert got["token_ids"] == want["token_ids"]
        if comparison == "exact":
            worst = max(worst, _assert_same_top(got["logprobs"], want["logprobs"], prompt))
    if comparison == "text":  # served as transformers runs this output, rounding and all
        with _torch_threads():
            tops = _transformers_tops(load_model(out), mine)
        for prompt, got, want in zip(PROMPTS, mine, tops, strict=True):
            worst = max(worst, _assert_same_top(got["logprobs"], want, prompt))
    record_property("max_logprob_diff", worst)  # against the parent, or transformers on an inexact output


def test_fitted_norms_are_far_closer_to_the_parent_than_unit_norms(served, record_property):
    """Qwen3-MoE from the Llama parent: on 1,024 held-out tokens of the bundled corpus, transformers' top-1
    agreement with the parent and KL, fitted norms against the same model with weight-1 norms (fitted on
    1,024 tokens: 69.9% and KL 0.39 against 22.8% and 2.36)."""
    import torch
    from tiny_models import load_model
    from tokenizers import Tokenizer

    parent, outputs, _ = served
    out = outputs["qwen3_moe-fitted-norms"]
    tokenizer = Tokenizer.from_file(str(parent / "tokenizer.json"))
    ids = []
    for name in DEMO_SOURCES:
        path = demo_assets() / "corpus" / f"{name}.heldout.jsonl"
        ids += [tokenizer.encode(json.loads(line)["text"]).ids for line in path.open()]
    stream = np.concatenate(ids)
    windows = stream[np.linspace(0, len(stream) - 128, 8).astype(int)[:, None] + np.arange(128)]
    reference, model = load_model(parent), load_model(out)
    with _torch_threads():
        fitted = _agreement(reference, model, windows)
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.ones_(norm.weight)
        unit = _agreement(reference, model, windows)
    recorded = next(s["approximate_attention"] for s in json.loads((out / "upcycler.json").read_text())["lineage"]
                    if "approximate_attention" in s)
    record_property("agreement", {"fitted": fitted, "unit": unit, "recorded": recorded})
    assert fitted[1] >= unit[1] + 0.3 and fitted[0] <= unit[0] / 3, (fitted, unit)


def _agreement(reference, model, ids: np.ndarray) -> tuple[float, float]:
    """(mean KL(reference ‖ model) per token, top-1 agreement) by transformers, 4 sequences at a time."""
    import torch

    kl, same = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(ids), 4):
            batch = torch.as_tensor(ids[lo:lo + 4])
            want = torch.log_softmax(reference(batch).logits.double(), -1)
            got = torch.log_softmax(model(batch).logits.double(), -1)
            kl += float((want.exp() * (want - got)).sum())
            same += int((want.argmax(-1) == got.argmax(-1)).sum())
    return kl / ids.size, same / ids.size


def _assert_served_as_transformers(model_dir, vllm: list[dict]) -> float:
    """vLLM's completions are transformers' on `model_dir`: the same prompt tokens, the same greedy tokens
    (until a step whose two best tokens are within `TOL`, where either may win) and text, and top-5 logprobs
    within `TOL`. Returns the largest logprob difference."""
    import torch
    from tiny_models import load_model
    from transformers import AutoTokenizer

    model, tokenizer = load_model(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for prompt, got in zip(PROMPTS, vllm, strict=True):
        assert got["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
    prompts = [got["prompt_token_ids"] for got in vllm]
    width, eos = max(map(len, prompts)), model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    ids = torch.as_tensor([[eos] * (width - len(p)) + p for p in prompts])  # left-padded, masked
    mask = torch.as_tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with _torch_threads(), torch.no_grad():
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=eos)
        tops = _transformers_tops(model, vllm)
    for prompt, got, row, top in zip(PROMPTS, vllm, greedy[:, width:].tolist(), tops, strict=True):
        generated = row[:row.index(eos) + 1] if eos in row else row  # vLLM keeps the EOS it stops at
        same = next((i for i, (a, b) in enumerate(zip(generated, got["token_ids"])) if a != b), None)
        if same is None:
            assert generated == got["token_ids"], (prompt, generated, got["token_ids"])
            assert tokenizer.decode(generated, skip_special_tokens=True) == got["text"]
        else:  # a tie within fp32 noise: both tokens are the best within TOL there
            best = sorted(top[same].values(), reverse=True)
            assert best[0] - best[1] <= TOL, (prompt, same, generated, got["token_ids"], top[same])
    return max(_assert_same_top(got["logprobs"], want, prompt) for prompt, got, want in zip(PROMPTS, vllm, tops,
                                                                                            strict=True))


def qwen3_parent(parent: Path, fitted: Path, out: Path) -> None:
    """A dense Qwen3 made of the Llama parent's weights and the q/k norms fitted for `fitted` (a Qwen3-MoE made
    from it): a real-weights stand-in for a Qwen3 checkpoint, saved by transformers with the parent's tokenizer."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    llama = LlamaForCausalLM.from_pretrained(parent, dtype=torch.bfloat16)
    fields = {k: v for k, v in llama.config.to_dict().items() if k not in ("architectures", "model_type", "mlp_bias")}
    model = Qwen3ForCausalLM(Qwen3Config(**{**fields, "attention_bias": False})).to(torch.bfloat16)
    norms = {}
    for shard in fitted.glob("*.safetensors"):
        norms.update({k: v for k, v in load_file(shard).items() if k.endswith(("q_norm.weight", "k_norm.weight"))})
    missing, unexpected = model.load_state_dict({**llama.state_dict(), **norms}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(out)
    for side in parent.iterdir():
        if side.name not in ("config.json", "model.safetensors") and side.is_file():
            shutil.copy(side, out / side.name)


def trained(init: Path, data: Path, root: Path) -> Path:
    """`init` trained 2 steps by `upcycle continued-pretrain` and exported at its last step
    (`checkpoint.hf_every`): the run's own Hugging Face output."""
    root.mkdir(parents=True)
    cfg = config_dict(root, init, data, steps=2, **{
        "data.seq_len": 64, "data.global_batch_size": 2,
        "data.phases": [{"weights": {n: 1 / len(DEMO_SOURCES) for n in DEMO_SOURCES}}],
        "optimizer.lr": 1e-3, "optimizer.schedule": [],
        "checkpoint.every": 2, "checkpoint.hf_every": 2, "checkpoint.async": False, "metrics.peak_flops": None,
        "metrics.writers": ["jsonl"]})
    run_cli("continued-pretrain", "--config", write_config(root / "train.yaml", cfg))
    return root / "run" / "2" / "hf"


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
