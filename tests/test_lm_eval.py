"""`upcycle eval MODEL --task lm-eval:TASKS`: lm-evaluation-harness tasks on the JAX model.

A tiny random llama (the trainer fixtures' tokenizer, with a BOS added by tokenizer.json's post-processor
as Llama's is) and a task directory written here (20 multiple-choice questions, five greedy generations,
three texts for rolling log-likelihood, datasets read from local JSONL) give through `upcycle eval` what
`lm_eval --model hf` gives on the same checkpoint: the same metrics and, document by document, the same
log-likelihoods (within 1e-4), greedy flags, generated texts and rolling log-likelihoods. The model's
function-preserving MoE upcycle (`dense-to-moe`) scores the same as its parent. Bad input is one line.

Every harness run works offline with a private Hugging Face cache. The runs that take longest (the
reference `lm_eval`, and an unknown task name, which makes the harness index its built-in tasks) start
together in processes of their own while the others run.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import trainer_fixtures as F
from cli_helpers import assert_clean_failure, run_cli
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

TASKS = ("tiny_mc", "tiny_gen", "tiny_ppl")
QUESTIONS = 20
LOGLIKELIHOOD_TOLERANCE = 1e-4


def _write_tasks(directory: Path) -> Path:
    """Three harness tasks over JSONL files in `directory`: multiple choice, generation, rolling."""
    directory.mkdir()
    rng = random.Random(0)
    stdlib = Path(sysconfig.get_paths()["stdlib"])  # text the tokenizer was not trained on
    long = (stdlib / "textwrap.py").read_text()[:400].replace("\n", " ")  # beyond the model's 64 positions
    mc = []
    for i in range(QUESTIONS):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        choices = [str(x) for x in rng.sample([x for x in range(2, 101) if x != a + b], 3)]
        answer = rng.randrange(4)
        choices.insert(answer, str(a + b))
        mc.append({"question": f"{long if i < 2 else ''}What is {a} + {b}?", "choices": choices, "answer": answer})
    gen = [{"prompt": prompt, "answer": answer} for prompt, answer in (
        ("def loads(s, *, cls=None", ", object_hook=None"), ("import", " json"), ("class JSONDecodeError(", "ValueError"),
        ("    return self.", "encode"), (long + "\nfrom email.message import", " Message"))]
    ppl = [{"text": (stdlib / name).read_text()[:size]} for name, size in
           (("textwrap.py", 300), ("textwrap.py", 1500), ("string.py", 2500))]
    yaml = {  # after each task's name and JSONL dataset
        "tiny_mc": """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}, {metric: acc_norm}]
""",
        "tiny_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n", "return"], max_gen_toks: 12, do_sample: false}
metric_list: [{metric: exact_match}]
""",
        "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
""",
    }
    for name, rows in (("tiny_mc", mc), ("tiny_gen", gen), ("tiny_ppl", ppl)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\n"
            f"test_split: test\n{yaml[name]}")
    return directory


def _write_model(root: Path) -> Path:
    """The tiny dense llama (64 positions: long texts are truncated from the left or rolled) as a Hugging Face
    directory with the files a harness reads: tokenizer.json (BOS added), tokenizer_config.json and
    generation_config.json."""
    tok_file = F.train_tokenizer(root / "tokenizer")
    tok = Tokenizer.from_file(str(tok_file))
    eos = tok.token_to_id(F.EOS)
    tok.post_processor = TemplateProcessing(single=f"{F.EOS} $A", special_tokens=[(F.EOS, eos)])
    tok.save(str(tok_file))
    model = F.write_model(root / "dense", F.tiny_spec(max_position_embeddings=64), tok_file)
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": F.EOS, "eos_token": F.EOS, "pad_token": F.EOS}))
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}))
    return model


def _offline(root: Path) -> dict[str, str]:
    cache = root / "hf-home"
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache),
            "HF_DATASETS_CACHE": str(cache / "datasets")}


def _start(argv: list, env: dict[str, str], logs: Path) -> tuple[subprocess.Popen, Path]:
    """A process of its own, its stdout and stderr in files (a full pipe would stall it)."""
    logs.mkdir(exist_ok=True)
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        return subprocess.Popen([str(a) for a in argv], stdout=out, stderr=err, env=env), logs


def _finish(started: tuple[subprocess.Popen, Path], timeout: int = 600) -> subprocess.CompletedProcess:
    proc, logs = started
    proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, (logs / "stdout").read_text(),
                                       (logs / "stderr").read_text())


def _upcycle_eval(*args) -> list:
    return [sys.executable, "-m", "upcycler", "eval", *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The dense model, its MoE upcycle and the task directory; the reference `lm_eval --model hf` run and
    `upcycle eval` on both models (JSON and per-document samples), all started at once."""
    root = tmp_path_factory.mktemp("lm_eval")
    model, tasks = _write_model(root), _write_tasks(root / "tasks")
    moe = root / "moe"
    run_cli("dense-to-moe", model, moe, "--experts", "4", "--topk", "2", "--granularity", "2", "--no-verify")
    env = _offline(root)
    names = ",".join(TASKS)
    procs = {
        "hf": _start([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                      f"pretrained={model},dtype=float32", "--tasks", names, "--include_path", tasks,
                      "--log_samples", "--output_path", root / "hf-out", "--device", "cpu"], env, root / "hf-logs"),
        "unknown": _start(_upcycle_eval(model, "--task", "lm-eval:tiny_mc,no_such_task", "--include", tasks), env,
                          root / "unknown-logs"),
    }
    for name, path in (("dense", model), ("moe", moe)):
        procs[name] = _start(_upcycle_eval(path, "--task", f"lm-eval:{names}", "--include", tasks, "--json",
                                           "--samples", root / f"{name}.jsonl"), env, root / f"{name}-logs")
    done = {name: _finish(proc) for name, proc in procs.items()}
    for name in ("hf", "dense", "moe"):
        assert done[name].returncode == 0, f"{name}:\n{done[name].stderr[-4000:]}"
    hf_samples = {}
    for path in glob.glob(str(root / "hf-out" / "*" / "samples_*.jsonl")):
        task = next(t for t in TASKS if Path(path).name.startswith(f"samples_{t}_"))
        hf_samples[task] = {r["doc_id"]: r for r in map(json.loads, Path(path).read_text().splitlines())}
    (hf_results,) = glob.glob(str(root / "hf-out" / "*" / "results_*.json"))
    return {"root": root, "model": model, "moe": moe, "tasks": tasks, "done": done,
            "hf": json.loads(Path(hf_results).read_text())["results"], "hf_samples": hf_samples,
            **{name: json.loads(done[name].stdout) for name in ("dense", "moe")},
            **{f"{name}_samples": _samples(root / f"{name}.jsonl") for name in ("dense", "moe")}}


def _samples(path: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for record in map(json.loads, path.read_text().splitlines()):
        out.setdefault(record["task"], {})[record["doc_id"]] = record
    return out


def _resps(record: dict) -> list:
    """A document's filtered responses: `resps` in our samples, `filtered_resps` in the harness's log."""
    return record["filtered_resps"] if "filtered_resps" in record else record["resps"]


def _choice_scores(record: dict) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) per choice: ours as numbers, the harness's log as strings."""
    return [(float(ll), greedy in (True, "True")) for ll, greedy in _resps(record)]


def _assert_same_documents(ours: dict, theirs: dict) -> None:
    """Document by document: log-likelihoods within the tolerance with the same greedy flags (multiple
    choice), the same text (generation), the same rolling log-likelihood (to float32 rounding)."""
    assert ours.keys() == theirs.keys() == set(TASKS)
    for task in TASKS:
        assert ours[task].keys() == theirs[task].keys()
        for doc_id, mine in ours[task].items():
            other = theirs[task][doc_id]
            if task == "tiny_mc":
                a, b = _choice_scores(mine), _choice_scores(other)
                assert [g for _, g in a] == [g for _, g in b]
                assert [ll for ll, _ in a] == pytest.approx([ll for ll, _ in b], abs=LOGLIKELIHOOD_TOLERANCE)
            elif task == "tiny_gen":
                assert _resps(mine) == _resps(other)
            else:
                (a,), (b,) = _resps(mine), _resps(other)
                assert float(a) == pytest.approx(float(b), rel=1e-6, abs=LOGLIKELIHOOD_TOLERANCE)
            for metric in ("acc", "acc_norm", "exact_match"):
                if metric in other:
                    assert mine[metric] == other[metric], (task, doc_id, metric)


def _metrics(result: dict, task: str) -> dict[str, float]:
    return {name: m["value"] for name, m in result["tasks"][task]["metrics"].items()}


def test_scores_equal_lm_eval_hf(runs):
    ours, hf = runs["dense"], runs["hf"]
    assert ours["task"] == "lm-eval" and list(ours["tasks"]) == list(TASKS)
    for task in TASKS:
        want = {key.split(",")[0]: value for key, value in hf[task].items()
                if key.endswith(",none") and "_stderr" not in key}
        got = _metrics(ours, task)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-5), (task, name)
    mc = ours["tasks"]["tiny_mc"]
    assert mc["samples"] == QUESTIONS and mc["num_fewshot"] == 0
    assert mc["metrics"]["acc"]["stderr"] == pytest.approx(hf["tiny_mc"]["acc_stderr,none"])
    _assert_same_documents(runs["dense_samples"], runs["hf_samples"])


def test_the_comparison_can_fail(runs):
    """The random model is neither always right nor always wrong, its picks and the answers vary."""
    records = runs["dense_samples"]["tiny_mc"].values()
    picks = [max(range(4), key=lambda i, r=r: _choice_scores(r)[i][0]) for r in records]
    targets = [int(r["target"]) for r in records]
    assert 0 < _metrics(runs["dense"], "tiny_mc")["acc"] < 1
    assert len(set(picks)) > 1 and len(set(targets)) > 1
    assert len({r["resps"][0] for r in runs["dense_samples"]["tiny_gen"].values()}) > 1


def test_function_preserving_upcycle_scores_as_its_parent(runs):
    assert runs["moe"]["tasks"].keys() == runs["dense"]["tasks"].keys()
    for task in TASKS:
        dense, moe = _metrics(runs["dense"], task), _metrics(runs["moe"], task)
        assert moe == pytest.approx(dense, rel=1e-5)
    assert _metrics(runs["moe"], "tiny_mc") == _metrics(runs["dense"], "tiny_mc")
    _assert_same_documents(runs["moe_samples"], runs["dense_samples"])


def test_table(runs):
    from upcycler.train.evaluation import harness

    lines = harness.format_table(runs["dense"]).splitlines()
    assert lines[0].startswith(f"lm-eval tasks on {runs['model']}")
    assert "tiny_mc  (20 documents, 0-shot)" in lines
    acc = next(line.split() for line in lines if line.split()[:1] == ["acc"])
    assert float(acc[1]) == pytest.approx(_metrics(runs["dense"], "tiny_mc")["acc"], abs=1e-4) and len(acc) == 3


def test_unknown_task_is_one_line(runs):
    line = assert_clean_failure(runs["done"]["unknown"], mentions="--task lm-eval:'no_such_task': no such task")
    assert str(runs["tasks"]) in line


@pytest.mark.parametrize("args, mentions", [
    (["{model}", "--task", "lm-eval:tiny_mc", "--include", "{model}/config.json"], "--include is not a directory"),
    (["{model}", "--task", "lm-eval:tiny_mc", "--include", "{root}/nowhere"], "--include does not exist"),
    (["{tasks}", "--task", "lm-eval:tiny_mc", "--include", "{tasks}"], "tasks: no config.json"),
    (["{model}", "--task", "lm-eval:tiny_mc", "--lengths", "4k"], "--lengths: the long-context tasks read it"),
    (["{model}", "--task", "lm-eval:tiny_mc,", "--include", "{tasks}"], "names an empty task"),
    (["{model}", "--task", "needle", "--lengths", "512", "--include", "{tasks}"], "--include: only --task lm-eval"),
])
def test_bad_input_is_one_line(runs, args, mentions):
    args = [a.format(**{k: runs[k] for k in ("model", "root", "tasks")}) for a in args]
    assert_clean_failure(run_cli("eval", *args, check=False), mentions=mentions)


def test_a_task_whose_yaml_does_not_parse_names_the_file(runs, tmp_path):
    """The harness skips a YAML it cannot parse and then finds no such task: the file is named instead."""
    tasks = tmp_path / "tasks"
    shutil.copytree(runs["tasks"], tasks)
    (tasks / "broken_task.yaml").write_text("task: broken_task\ndataset_path: [unclosed\noutput_type: x\n")
    line = assert_clean_failure(run_cli("eval", runs["model"], "--task", "lm-eval:broken_task", "--include", tasks,
                                        check=False), mentions="broken_task.yaml does not parse as YAML at line")
    assert "--task lm-eval:'broken_task'" in line and "fix the file" in line


def test_missing_harness_is_one_line(runs):
    script = ("import sys; sys.modules['lm_eval'] = None; from upcycler.cli import main; "
              "main(['eval', sys.argv[1], '--task', 'lm-eval:tiny_mc'], prog_name='upcycle')")
    proc = subprocess.run([sys.executable, "-c", script, str(runs["model"])], capture_output=True, text=True,
                          timeout=120, check=False)
    line = assert_clean_failure(proc, mentions="needs lm-evaluation-harness")
    assert line == "error: --task lm-eval: needs lm-evaluation-harness; pip install 'upcycler[eval]'"
    assert proc.returncode == 2
