"""`upcycle eval`: long-context checks of a checkpoint (passkey retrieval, perplexity, the user's prompts).

The task builders (`upcycler.train.evaluation.long_eval`) are tested without a model: exact prompt lengths, where
the needle lands, seeded determinism, the answer being exactly the tokens that follow the question. The
command runs end to end on the bundled demo model: against itself (KL 0), against its function-preserving
MoE upcycle (KL ~0, same top-1), perplexity against transformers' own logits on the same windows, the
user's prompts against transformers' greedy decoding, and every bad input refused in one line.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from upcycler.cli.demo import demo_assets
from upcycler.errors import UpcyclerError
from upcycler.train.evaluation import long_eval as le
from upcycler.train.evaluation import long_eval_report as report

MODEL = demo_assets() / "model"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return le.corpus_documents(demo_assets() / "corpus")


# --- the task builders, without a model -------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("4k,8k,16k", [4096, 8192, 16384]), ("4096, 32K", [4096, 32768]),
                                            ("512,512,1k", [512, 1024])])
def test_lengths_parse(text, expected):
    assert le.parse_lengths(text) == expected


@pytest.mark.parametrize("text", ["4q", "", "4k,", "0", "1.5k", "-4k", "k", "9999999k"])
def test_bad_lengths_are_refused(text):
    with pytest.raises(UpcyclerError, match="--lengths"):
        le.parse_lengths(text)


def _is_boundary(tokenizer: Tokenizer, ids, j: int) -> bool:
    return j == 0 or tokenizer.decode([int(ids[j - 1])]).rstrip(" \t").endswith((".", "!", "?", "\n"))


def test_needle_prompts_have_exact_lengths_and_placed_needles(tokenizer, documents):
    lengths, n = [300, 512, 1000, 2048], 7
    items = le.needle_items(tokenizer, documents, lengths, n, seed=3)
    assert [it.length for it in items] == [L for L in lengths for _ in range(n)]
    assert all(len(it.ids) == it.length and it.ids.dtype == np.int32 for it in items)
    for it in items:
        key, start, width = it.info["key"], it.info["needle_start"], it.info["needle_tokens"]
        assert 5 <= len(key) <= 7 and key.isdigit() and not key.startswith("0")
        needle = tokenizer.encode(f" {le.NEEDLE.format(key=key)}\n", add_special_tokens=False).ids
        assert width == len(needle) and it.ids[start:start + width].tolist() == needle
        question, _ = le.question_and_answer(tokenizer, key)
        assert it.ids[-len(question):].tolist() == question
        # the answer is exactly the tokenization that follows the question, and the JSON shows it
        assert tokenizer.encode(le.QUESTION + " " + key).ids == question + it.answer.tolist()
        assert tokenizer.decode(it.answer.tolist()) == " " + key
        assert it.info["answer_ids"] == it.answer.tolist()
        # the needle starts at the intended depth, moved to the nearest sentence end (at most one sentence)
        target = round(it.info["target_depth"] * it.length)
        assert abs(start - target) <= le.MAX_SHIFT and it.info["depth"] == start / it.length
        hay = np.concatenate([it.ids[:start], it.ids[start + width:len(it.ids) - len(question)]])
        assert _is_boundary(tokenizer, hay, start)
        shift = abs(start - target)
        closer = range(max(1, target - shift + 1), min(len(hay), target + shift))
        assert not any(_is_boundary(tokenizer, hay, j) for j in closer)
    depths = [it.info["target_depth"] for it in items[:n]]
    np.testing.assert_allclose(depths, np.linspace(0.1, 0.9, n))


def test_needle_prompts_are_seeded(tokenizer, documents):
    def build(lengths, seed):
        return {(it.length, it.info["index"]): (it.ids.tolist(), it.answer.tolist())
                for it in le.needle_items(tokenizer, documents, lengths, 4, seed)}

    first = build([512, 1024], 0)
    assert first == build([512, 1024], 0)
    assert {k: v for k, v in build([1024], 0).items()} == {k: v for k, v in first.items() if k[0] == 1024}
    assert all(first[k] != v for k, v in build([512, 1024], 1).items())
    keys = {it.info["key"] for it in le.needle_items(tokenizer, documents, [512], 20, 0)}
    assert len(keys) == 20 and {len(k) for k in keys} == {5, 6, 7}


def test_needle_prompts_keep_the_tokenizers_bos(documents):
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    assert le.special_prefix(tok) == [0]
    items = le.needle_items(tok, documents, [512], 3, seed=0)
    assert all(it.ids[0] == 0 and len(it.ids) == 512 and (it.ids[1:] != 0).all() for it in items)


def test_too_short_for_a_needle(tokenizer, documents):
    with pytest.raises(UpcyclerError, match="--lengths: 64 tokens is too short for the needle task"):
        le.needle_items(tokenizer, documents, [64], 1, seed=0)


def test_greedy_retrieval_by_teacher_forcing():
    V, answer = 6, np.array([3, 1, 4])

    def onehot(*tops):
        out = np.zeros((len(tops), V), np.float32)
        out[np.arange(len(tops)), tops] = 1.0
        return out

    last = onehot(3)[0]
    assert le.greedy_retrieves(last, onehot(1, 4, 0), answer)  # the row after the last answer token is unused
    assert not le.greedy_retrieves(onehot(2)[0], onehot(1, 4, 0), answer)
    assert not le.greedy_retrieves(last, onehot(1, 5, 0), answer)
    assert le.greedy_retrieves(last, np.zeros((0, V)), answer[:1])


def test_prompt_files(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "The answer is", "answer": " 136"}\n\n{"prompt": "def f(", "extra": 1}\n')
    first, second = le.read_prompts(path, tokenizer)
    assert first.ids.tolist() + first.answer.tolist() == tokenizer.encode("The answer is 136").ids
    assert second.answer is None and second.length == len(tokenizer.encode("def f(").ids)
    for line, why in [("[1]", "prompt"), ('{"prompt": ""}', "prompt"), ("{nope", "unreadable JSON"),
                      ('{"prompt": "a", "answer": 3}', "answer")]:
        path.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(UpcyclerError, match=f"prompts.jsonl:2: .*{why}"):
            le.read_prompts(path, tokenizer)


def test_nll_by_tenth_of_the_window():
    values = np.arange(1.0, 20.0)  # NLL of tokens 1..19 of a 20-token window
    expected = [1.0, 2.5, 4.5, 6.5, 8.5, 10.5, 12.5, 14.5, 16.5, 18.5]
    np.testing.assert_allclose(le.decile_means(values, 20), expected)


# --- end to end on the demo model -------------------------------------------------------------------------


def _json(*args) -> dict:
    return json.loads(run_cli("eval", *args, "--json").stdout)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The demo model's function-preserving MoE upcycle and demo prose as prepared data."""
    root = tmp_path_factory.mktemp("eval")
    run_cli("dense-to-moe", MODEL, root / "moe", "--experts", "4", "--topk", "2", "--granularity", "2",
            "--no-verify")
    run_cli("prepare-data", "--tokenizer", MODEL / "tokenizer.json", "--out", root / "data",
            "--source", f"prose={demo_assets() / 'corpus' / 'prose.train.jsonl'}")
    return root


@pytest.fixture(scope="module")
def against_itself(work):
    """Needle prompts on the demo model against itself, with FlexPrefill sparse enough to skip blocks."""
    plot = work / "needle.png"
    result = _json(MODEL, "--vs", MODEL, "--task", "needle", "--lengths", "512,1k", "--prompts-per-length",
                   "3", "--attention", "flexprefill", "--prefill-block", "64", "--prefill-min-budget", "128",
                   "--prefill-gamma", "0.5", "--prefill-dense-above", "1", "--plot", plot)
    return result, plot


def test_needle_against_itself(against_itself):
    result, plot = against_itself
    assert (result["task"], result["attention"], result["prompts_per_length"]) == ("needle", "flexprefill", 3)
    assert [e["length"] for e in result["lengths"]] == [512, 1024]
    for e in result["lengths"]:
        assert e["prompts"] == 3 and e["kl_mean"] == e["kl_max"] == 0.0 and e["top1_agreement"] == 1.0
        assert e["model"]["accuracy"] == e["vs"]["accuracy"] and e["model"]["accuracy_by_depth"].keys() == {
            "10%", "50%", "90%"}
        density = e["model"]["density_by_layer"]
        assert len(density) == 4 and all(0 < d <= 1 for d in density) and 0 < e["model"]["density"] < 1
        assert e["model"]["density"] == pytest.approx(np.mean(density))
        # which layers ran sparse, per layer over the prompts: exactly those that computed fewer blocks
        assert [s > 0 for s in e["model"]["sparse_by_layer"]] == [d < 1 for d in density]
    assert len(result["items"]) == 6
    for item in result["items"]:  # a prompt ran some layer sparse exactly when it computed fewer blocks
        assert 0 <= item["model"]["sparse_layers"] <= 4
        assert (item["model"]["sparse_layers"] > 0) == (item["model"]["density"] < 1)
    for item in result["items"]:
        assert {"length", "key", "depth", "target_depth", "needle_start", "answer_ids", "model", "vs", "kl",
                "top1_agree"} <= item.keys()
        assert item["model"]["top1"] == item["vs"]["top1"] and isinstance(item["model"]["retrieved"], bool)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert leftovers(plot.parent, plot.name) == [plot.name]


def test_needle_table(against_itself):
    table = report.format_table(against_itself[0])
    lines = table.splitlines()
    assert lines[0].startswith("needle retrieval:") and "flexprefill attention" in lines[0]
    assert lines[1].split()[:3] == ["length", "prompts", "accuracy"] and "key blocks computed" in lines[1]
    assert lines[2].split()[:2] == ["512", "3"] and lines[3].split()[:2] == ["1k", "3"]
    assert any(line.startswith("accuracy by needle depth") for line in lines)


def test_needle_against_the_upcycled_moe(work):
    result = _json(MODEL, "--vs", work / "moe", "--task", "needle", "--lengths", "512,1k",
                   "--prompts-per-length", "2")
    for e in result["lengths"]:
        assert e["kl_max"] < 1e-5 and e["top1_agreement"] == 1.0
        assert e["model"]["accuracy"] == e["vs"]["accuracy"] and "density" not in e["model"]
    assert result["accuracy"]["model"] == result["accuracy"]["vs"]


@pytest.fixture(scope="module")
def hf_model():
    """The demo model in transformers, on one thread (a tiny model; the tests share 2 cores)."""
    import torch
    from tiny_models import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(MODEL)
    torch.set_num_threads(threads)


def test_perplexity_equals_transformers(work, hf_model):
    import torch

    result = _json(MODEL, "--task", "perplexity", "--data", work / "data", "--lengths", "512,1k",
                   "--prompts-per-length", "2")
    from upcycler.train.data.sources import open_source

    tokens = open_source(work / "data", "prose").tokens
    by_length: dict[int, list[float]] = {}
    for item in result["items"]:
        window = tokens[item["start"]:item["start"] + item["length"]]
        ids = torch.as_tensor(np.asarray(window, dtype=np.int64))
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(ids[None]).logits[0].double(), dim=-1)
        nll = float(-logp[torch.arange(len(ids) - 1), ids[1:]].mean())
        assert item["source"] == "prose" and item["model"]["nll"] == pytest.approx(nll, abs=1e-4)
        by_length.setdefault(item["length"], []).append(nll)
    for e in result["lengths"]:
        m = e["model"]
        assert m["nll"] == pytest.approx(np.mean(by_length[e["length"]]), abs=1e-4)
        assert m["ppl"] == pytest.approx(np.exp(m["nll"])) and len(m["nll_by_decile"]) == 10
        assert (m["nll_first10"], m["nll_last10"]) == (m["nll_by_decile"][0], m["nll_by_decile"][-1])


def test_prompts_match_transformers_greedy(work, tokenizer, hf_model):
    import torch

    prompts = [("Question: What is 34 * 4?\nAnswer: 34 * 4 = 136. The answer is", " 136."),
               ("Question: What is 866 + 51?\nAnswer: 866 + 51 = 917. The answer is", " 917."),
               ("def __init__(self", None)]
    path = work / "prompts.jsonl"
    lines = [json.dumps({"prompt": p} | ({"answer": a} if a else {})) for p, a in prompts]
    path.write_text("\n".join(lines) + "\n")
    result = _json(MODEL, "--vs", work / "moe", "--task", "prompts", path)
    for item, (prompt, answer) in zip(result["items"], prompts, strict=True):
        ids = torch.as_tensor([tokenizer.encode(prompt).ids])
        want = tokenizer.encode(prompt + (answer or "")).ids[ids.shape[1]:]
        with torch.no_grad():
            greedy = hf_model.generate(ids, max_new_tokens=max(1, len(want)), do_sample=False)
        greedy = greedy[0, ids.shape[1]:].tolist()
        assert item["length"] == ids.shape[1] and item["model"]["top1"] == greedy[0]
        assert item["model"]["retrieved"] == (None if answer is None else greedy == want)
        assert item["kl"] < 1e-5 and item["top1_agree"]
    assert [i["model"]["retrieved"] for i in result["items"]] == [True, False, None]
    assert result["accuracy"] == {"model": 0.5, "vs": 0.5}
    table = run_cli("eval", MODEL, "--task", "prompts", path).stdout.splitlines()
    assert table[1].split()[:3] == ["#", "tokens", "top-1"] and table[-1] == "accuracy: 50.0%"


def test_lengths_beyond_the_model_warn(work):
    proc = run_cli("eval", MODEL, "--task", "needle", "--lengths", "1040", "--prompts-per-length", "1",
                   "--json")
    assert "max_position_embeddings (1024)" in proc.stderr and proc.stderr.startswith("warning: ")
    assert json.loads(proc.stdout)["lengths"][0]["length"] == 1040


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    bare = shutil.copytree(MODEL, root / "no-tokenizer")
    (bare / "tokenizer.json").unlink()
    other = shutil.copytree(MODEL, root / "other-tokenizer")
    (other / "tokenizer.json").write_bytes((MODEL / "tokenizer.json").read_bytes() + b"\n")
    (root / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    return root


@pytest.mark.parametrize("args, mentions", [
    (["{root}/missing", "--task", "needle", "--lengths", "512"], "missing"),
    (["{root}/no-tokenizer", "--task", "needle", "--lengths", "512"], "no-tokenizer/tokenizer.json"),
    (["{model}", "--vs", "{root}/other-tokenizer", "--task", "needle", "--lengths", "512"],
     "other-tokenizer/tokenizer.json: differs"),
    (["{model}", "--task", "prompts", "{root}/bad.jsonl"], "bad.jsonl:2"),
    (["{model}", "--task", "needle", "--lengths", "4q"], "--lengths: '4q'"),
    (["{model}", "--task", "needle"], "--lengths"),
    (["{model}", "--task", "perplexity", "--lengths", "512"], "--data"),
    (["{model}", "--task", "perplexity", "--lengths", "512", "--data", "{root}"], "no prepared source"),
    (["{model}", "--task", "prompts"], "FILE"),
    (["{model}", "--task", "needle", "--lengths", "512", "--plot", "{root}/nowhere/x.png"], "--plot"),
    (["{model}", "--task", "needle", "--lengths", "512", "--prompts-per-length", "0"],
     "--prompts-per-length"),
    (["{model}", "--task", "needle", "--lengths", "512", "--attention", "flexprefill",
      "--prefill-gamma", "0"], "--prefill-gamma"),
])
def test_bad_input_is_one_line(odd_models, args, mentions):
    args = [a.format(root=odd_models, model=MODEL) for a in args]
    assert_clean_failure(run_cli("eval", *args, check=False), mentions=mentions)
    assert not (odd_models / "nowhere").exists()
