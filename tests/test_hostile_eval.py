"""Hostile input to `upcycle eval`: every option, the prompts JSONL, the tokenizer, --data, --vs and --plot.

Each case is refused with exactly one `error:` line naming the option or file and the fix, exit 2, no
traceback, every input byte-identical afterwards and no plot (or its staging file) left behind, within a
stated time (and, for the resource bounds, memory) limit. Most cases run in-process through click's
`CliRunner` (the same `main` the console script runs); three go through a real subprocess: a tokenizer
that used to hang the needle builder, a stdout on /dev/full, and a 4M-token × 10,000-prompt request.
The parsers (`--lengths`, prompts JSONL lines) are fuzzed: any input is a value or one `UpcyclerError`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli, snapshot
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from upcycler.cli import main
from upcycler.cli.demo import demo_assets
from upcycler.errors import UpcyclerError
from upcycler.train.evaluation import long_eval as le

DEMO = demo_assets() / "model"
SECONDS = 20  # every in-process refusal, including its JAX-free checks; most take well under a second


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Path:
    """Copies of the demo model (the originals ship with the package and must never be touched), models
    with hostile tokenizers, a smaller-vocabulary model sharing the tokenizer, prompts files and data."""
    root = tmp_path_factory.mktemp("hostile-eval")
    model = shutil.copytree(DEMO, root / "model")

    def variant(name: str, change) -> None:
        change(shutil.copytree(model, root / name) / "tokenizer.json")

    def rewrite(normalizer=None, add=None):
        def change(path: Path) -> None:
            tok = Tokenizer.from_file(str(path))
            if normalizer is not None:
                tok.normalizer = normalizer
            if add:
                tok.add_tokens(add)
            tok.save(str(path))
        return change

    def replace(make):
        def change(path: Path) -> None:
            path.unlink()
            make(path)
        return change

    variant("tok-empty", rewrite(normalizers.Replace(Regex(r"[\s\S]"), "")))  # encodes every text to nothing
    variant("tok-nodigits", rewrite(normalizers.Replace(Regex(r"[0-9]"), "")))
    variant("tok-added", rewrite(add=["zzqq"]))  # id 2048: one past the model's vocabulary
    variant("tok-fifo", replace(os.mkfifo))
    variant("tok-dir", replace(os.mkdir))
    variant("tok-binary", lambda p: p.write_bytes(b"\xff\x00" * 64))
    variant("tok-json", lambda p: p.write_text('{"version": 1}'))
    variant("tok-missing", lambda p: p.unlink())
    no_unk = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token=None))  # raises on any other word
    no_unk.pre_tokenizer = pre_tokenizers.Whitespace()
    variant("tok-nounk", lambda p: no_unk.save(str(p)))
    os.mkfifo(root / "fifo")
    os.mkfifo(root / "fifo.png")
    (root / "dir").mkdir()
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    prompts = {
        "ok": '{"prompt": "hello there"}\n',
        "binary": b"\xff\xfe\x00garbage\n",
        "bom": '\ufeff{"prompt": "hi"}\n',
        "array": "[1, 2]\n",
        "number": '{"prompt": 3}\n',
        "empty-prompt": '{"prompt": ""}\n',
        "answer-number": '{"prompt": "a", "answer": 3}\n',
        "nan": '{"prompt": "a", "answer": NaN}\n',
        "deep": "[" * 10_000 + "]" * 10_000 + "\n",
        "surrogate": '{"prompt": "hello \\ud800 there"}\n',
        "blank": "\n\n   \n",
        "empty": "",
        "added": '{"prompt": "hello zzqq"}\n',
        "long-line": json.dumps({"prompt": "ab" * (le.MAX_PROMPT_CHARS // 2 + 1)}) + "\n",
        "many": '{"prompt": "a"}\n' * (le.MAX_PROMPTS + 1),
    }
    for name, text in prompts.items():
        path = root / f"{name}.jsonl"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    invoke(["prepare-data", "--tokenizer", str(model / "tokenizer.json"), "--out", str(root / "data"),
            "--source", f"prose={demo_assets() / 'corpus' / 'prose.heldout.jsonl'}"], expect=0)
    invoke(["prepare-data", "--tokenizer", str(root / "tok-added" / "tokenizer.json"), "--out",
            str(root / "other-data"), "--source", f"prose={demo_assets() / 'corpus' / 'prose.heldout.jsonl'}"],
           expect=0)
    return root


@pytest.fixture(scope="module")
def small_vocab(env) -> Path:
    """A tiny Llama of 128 tokens that carries the demo model's tokenizer byte for byte."""
    from tiny_models import make_tiny

    path = make_tiny("llama", env / "small-vocab")
    shutil.copy(env / "model" / "tokenizer.json", path / "tokenizer.json")
    return path


def invoke(args: list[str], expect: int | None = None):
    result = CliRunner().invoke(main, args)
    if expect is not None:
        assert result.exit_code == expect, (result.stderr, result.exception)
    return result


def refused(args: list[str], mentions: str, *, inputs: list[Path], plot: Path | None = None,
            seconds: float = SECONDS) -> str:
    """Run `upcycle eval ARGS` in-process and check the contract; returns the error line."""
    before = {p: snapshot(p) if p.is_dir() else p.read_bytes() for p in inputs}
    existed = plot is not None and os.path.lexists(plot)  # os.path: no OSError for a name too long
    start = time.monotonic()
    result = invoke(["eval", *map(str, args)])
    elapsed = time.monotonic() - start
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (
        result.exit_code, result.stderr, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert mentions in lines[0], f"{mentions!r} not in {lines[0]!r}"
    assert result.stdout == "", "a refused run printed a result"
    assert elapsed < seconds, f"took {elapsed:.1f} s, the bound is {seconds} s"
    for p, data in before.items():
        assert (snapshot(p) if p.is_dir() else p.read_bytes()) == data, f"{p} was modified"
    if plot is not None:
        assert leftovers(plot.parent, plot.name) == ([plot.name] if existed else []), "a plot was left behind"
    return lines[0]


def needle(model: str | Path = "{env}/model", *extra: str) -> list[str]:
    return [str(model), "--task", "needle", "--lengths", "512", "--prompts-per-length", "1", *extra]


def fill(args: list[str], env: Path) -> list[str]:
    return [a.replace("{env}", str(env)) for a in args]


# --- options ---------------------------------------------------------------------------------------------

OPTIONS = [
    # --lengths: syntax, range, count, and total work
    (["--lengths", "4q"], "--lengths: '4q' is not a length"),
    (["--lengths", ""], "--lengths: '' is not a length"),
    (["--lengths", "4k,"], "--lengths: '' is not a length"),
    (["--lengths", "nan"], "--lengths: 'nan' is not a length"),
    (["--lengths", "inf"], "--lengths: 'inf' is not a length"),
    (["--lengths", "-4k"], "--lengths: '-4k' is not a length"),
    (["--lengths", "1.5k"], "--lengths: '1.5k' is not a length"),
    (["--lengths", "0x10"], "--lengths: '0x10' is not a length"),
    (["--lengths", "0"], "between 2 and 4,194,304 tokens"),
    (["--lengths", "1000000000"], "--lengths: '1000000000' must be between 2 and 4,194,304 tokens"),
    (["--lengths", "9" * 5000], "must be between 2 and 4,194,304 tokens"),
    (["--lengths", ",".join(map(str, range(100, 100_000)))], "--lengths: more than 64 lengths, the limit"),
    (["--lengths", "4096k", "--prompts-per-length", "10000"], "more than the limit of 67,108,864"),
    (["--lengths", "64"], "--lengths: 64 tokens is too short for the needle task"),
    # --prompts-per-length and --seed
    (["--lengths", "512", "--prompts-per-length", "0"], "--prompts-per-length"),
    (["--lengths", "512", "--prompts-per-length", "-1"], "--prompts-per-length"),
    (["--lengths", "512", "--prompts-per-length", "10001"], "between 1 and 10,000"),
    (["--lengths", "512", "--prompts-per-length", "1" + "0" * 30], "between 1 and 10,000"),
    (["--lengths", "512", "--prompts-per-length", "many"], "--prompts-per-length"),
    (["--lengths", "512", "--seed", "-1"], "--seed"),
    (["--lengths", "512", "--seed", "1e3"], "--seed"),
    # --attention and the --prefill-* options
    (["--lengths", "512", "--attention", "sparse"], "--attention"),
    (["--lengths", "512", "--vs-attention", ""], "--vs-attention"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-gamma", "nan"], "--prefill-gamma must be a finite number"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-gamma", "inf"], "--prefill-gamma must be a finite number"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-gamma", "0"], "--prefill-gamma 0"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-gamma", "1.5"], "--prefill-gamma"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-gamma", "x"], "--prefill-gamma"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-tau", "-0.1"], "--prefill-tau"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-block", "0"], "--prefill-block 0"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-block", "15"], "--prefill-block 15"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-block", "1" + "0" * 30], "--prefill-block"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-min-budget", "-1"], "--prefill-min-budget"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-max-budget", "99999999999"], "--prefill-max-budget"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-budget-rule", "most"], "--prefill-budget-rule"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-dense-above", "2"], "--prefill-dense-above"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-dense-above=-inf"], "--prefill-dense-above"),
    (["--lengths", "512", "--attention", "flexprefill", "--prefill-min-budget", "1024", "--prefill-max-budget",
      "128"], "--prefill-max-budget: 128 tokens is below --prefill-min-budget (1,024)"),
    (["--lengths", "512", "--prefill-gamma", "0.5"], "--prefill-gamma: only FlexPrefill attention reads it"),
    (["--lengths", "512", "--attention", "dense", "--vs-attention", "dense", "--prefill-block", "64"],
     "--prefill-block: only FlexPrefill attention reads it"),
    # combinations that cannot work together
    (["--lengths", "512", "--data", "{env}/data"], "--data: only --task perplexity"),
    (["{env}/ok.jsonl", "--lengths", "512"], "ok.jsonl: FILE is for --task prompts"),
    ([], "--lengths: required for --task needle"),
]


@pytest.mark.parametrize("extra, mentions", OPTIONS, ids=[f"options-{i}" for i in range(len(OPTIONS))])
def test_bad_options(env, extra, mentions):
    args = fill(["{env}/model", "--task", "needle", *extra], env)
    refused(args, mentions, inputs=[env / "model", env / "data"])


COMBINATIONS = [
    (["--task", "prompts"], "--task prompts: needs FILE"),
    (["--task", "prompts", "{env}/ok.jsonl", "--lengths", "512"], "--lengths: --task prompts takes"),
    (["--task", "prompts", "{env}/ok.jsonl", "--prompts-per-length", "3"], "--prompts-per-length: --task prompts"),
    (["--task", "prompts", "{env}/ok.jsonl", "--seed", "4"], "--seed: --task prompts"),
    (["--task", "prompts", "{env}/ok.jsonl", "--plot", "{env}/p.png"], "--plot: draws the needle and perplexity"),
    (["--task", "perplexity", "--lengths", "512"], "--data: required for --task perplexity"),
    (["--task", "summarise", "--lengths", "512"], "--task"),
    ([], "--task"),
]


@pytest.mark.parametrize("extra, mentions", COMBINATIONS, ids=[f"combination-{i}" for i in range(len(COMBINATIONS))])
def test_options_that_do_not_go_together(env, extra, mentions):
    refused(fill(["{env}/model", *extra], env), mentions, inputs=[env / "model", env / "ok.jsonl"])


# --- models and their tokenizers -------------------------------------------------------------------------

MODELS = [
    (needle("{env}/missing"), "missing"),
    (needle("{env}/ok.jsonl"), "not a directory"),
    (needle("{env}/fifo"), "not a directory"),
    (needle("{env}/dir"), "no config.json"),
    (needle("{env}/loop1"), "loop1"),
    (needle("{env}/dangling"), "dangling"),
    (needle("{env}/tok-missing"), "tok-missing/tokenizer.json: missing"),
    (needle("{env}/tok-fifo"), "tok-fifo/tokenizer.json: not a regular file"),
    (needle("{env}/tok-dir"), "tok-dir/tokenizer.json: is a directory"),
    (needle("{env}/tok-binary"), "tok-binary/tokenizer.json: not a readable tokenizer.json"),
    (needle("{env}/tok-json"), "tok-json/tokenizer.json: not a readable tokenizer.json"),
    (needle("{env}/tok-empty"), "tok-empty/tokenizer.json: does not spell the pass key"),  # used to hang
    (needle("{env}/tok-nodigits"), "tok-nodigits/tokenizer.json: does not spell the pass key"),
    (needle("{env}/tok-nounk"), "tok-nounk/tokenizer.json: cannot encode the prompts"),
    (["{env}/tok-added", "--task", "prompts", "{env}/added.jsonl"],
     "tok-added/tokenizer.json: gives token id 2,048, beyond the vocabulary of"),
    (["{env}/tok-empty", "--task", "prompts", "{env}/ok.jsonl"], "ok.jsonl:1: the tokenizer gives no tokens"),
    (needle("{env}/model", "--vs", "{env}/tok-added"), "tok-added/tokenizer.json: differs"),
    (needle("{env}/model", "--vs", "{env}/missing"), "missing"),
    (needle("{env}/" + "m" * 300), "MODEL cannot be looked up (File name too long)"),
    (needle("{env}/model", "--vs", "{env}/" + "m" * 300), "--vs cannot be looked up (File name too long)"),
    (["{env}/model", "--task", "perplexity", "--lengths", "512", "--data", "{env}/" + "d" * 300],
     "--data cannot be looked up (File name too long)"),
    (["{env}/model", "--task", "prompts", "{env}/" + "p" * 300 + ".jsonl"], "FILE cannot be looked up"),
    (needle("{env}/model", "--vs", "{env}/tok-missing"), "tok-missing/tokenizer.json: missing"),
]


@pytest.mark.parametrize("args, mentions", MODELS, ids=[f"models-{i}" for i in range(len(MODELS))])
def test_bad_models_and_tokenizers(env, args, mentions):
    args = fill(args, env)
    models = [Path(a) for a in args if a.startswith(str(env)) and os.path.isdir(a)]
    refused(args, mentions, inputs=models, seconds=SECONDS)


def test_a_smaller_vocabulary_on_the_vs_side(env, small_vocab):
    refused(needle(env / "model", "--vs", small_vocab), "beyond the vocabulary of " + str(small_vocab),
            inputs=[env / "model", small_vocab])


def test_data_beyond_the_vocabulary_of_the_vs_side(env, small_vocab):
    refused([env / "model", "--vs", small_vocab, "--task", "perplexity", "--lengths", "512", "--data", env / "data"],
            f"{env / 'data'}: holds token id", inputs=[env / "model", small_vocab, env / "data"])


def test_kept_distributions_are_bounded_before_any_prompt(env, monkeypatch):
    import upcycler.cli.eval as cli_eval

    monkeypatch.setattr(cli_eval, "MAX_KEPT_BYTES", 1024**2)  # 2 × 2048 × 4 bytes per prompt: 64 prompts fit
    line = refused(fill(["{env}/model", "--vs", "{env}/model", "--task", "needle", "--lengths", "512,1k",
                         "--prompts-per-length", "100"], env), "--vs: comparing 200 prompts",
                   inputs=[env / "model"], seconds=5)
    assert "the limit of 0.000976562 GiB" in line


# --- the prompts file ------------------------------------------------------------------------------------

PROMPTS = [
    ("missing.jsonl", "missing.jsonl: missing"),
    ("dangling", "dangling: missing"),
    ("loop1", "loop1: cannot open"),
    ("fifo", "fifo: not a regular file"),
    ("dir", "dir: is a directory"),
    ("binary.jsonl", "binary.jsonl: not UTF-8"),
    ("bom.jsonl", "bom.jsonl:1: unreadable JSON"),
    ("array.jsonl", "array.jsonl:1: not a JSON object"),
    ("number.jsonl", "number.jsonl:1: no non-empty \"prompt\""),
    ("empty-prompt.jsonl", "empty-prompt.jsonl:1: no non-empty \"prompt\""),
    ("answer-number.jsonl", "answer-number.jsonl:1: \"answer\" must be"),
    ("nan.jsonl", "nan.jsonl:1: unreadable JSON (NaN is not a JSON number)"),
    ("deep.jsonl", "deep.jsonl:1: JSON nested"),
    ("surrogate.jsonl", "surrogate.jsonl:1: a lone UTF-16 surrogate"),
    ("blank.jsonl", "blank.jsonl: no prompts"),
    ("empty.jsonl", "empty.jsonl: no prompts"),
    ("many.jsonl", "many.jsonl:10001: more than 10,000 prompts"),
    ("model/config.json", "config.json:1: unreadable JSON"),  # the model's own file as FILE: read, untouched
]


@pytest.mark.parametrize("name, mentions", PROMPTS, ids=[f"prompts-{n}" for n, _ in PROMPTS])
def test_bad_prompt_files(env, name, mentions):
    path = env / name
    inputs = [env / "model"] + ([path] if path.is_file() and not path.is_symlink() else [])
    refused([env / "model", "--task", "prompts", path], mentions, inputs=inputs)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(env):
    """4M characters would take ~2 GB to tokenize: refused by length, with a bounded Python heap."""
    tracemalloc.start()
    try:
        refused([env / "model", "--task", "prompts", env / "long-line.jsonl"],
                "long-line.jsonl:1: a prompt of 4,194,306 characters, more than the limit of 4,194,304",
                inputs=[env / "model", env / "long-line.jsonl"], seconds=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024**2, f"peak Python heap {peak / 1024**2:.0f} MB"


# --- --data ----------------------------------------------------------------------------------------------

DATA = [
    ("ok.jsonl", "ok.jsonl: --data is not a directory"),
    ("fifo", "fifo: --data is not a directory"),
    ("loop1", "loop1: --data is not a directory"),
    ("dir", "dir: no prepared source"),
    ("model", "model: no prepared source"),
    ("other-data", "other-data: source 'prose' was prepared with another tokenizer"),
]


@pytest.mark.parametrize("name, mentions", DATA, ids=[f"data-{n}" for n, _ in DATA])
def test_bad_data(env, name, mentions):
    refused([env / "model", "--task", "perplexity", "--lengths", "512", "--data", env / name], mentions,
            inputs=[env / "model", env / "data", env / "other-data"])


def test_windows_longer_than_the_data(env):
    refused([env / "model", "--task", "perplexity", "--lengths", "512k", "--data", env / "data"],
            "--lengths: 524288 tokens is longer than every source", inputs=[env / "model", env / "data"])


def test_total_prompt_tokens_are_bounded_before_anything_is_built(env):
    """4M tokens × 10,000 prompts (160 GB of int32) is refused by arithmetic: tiny Python heap, no wait."""
    tracemalloc.start()
    try:
        for task in (["--task", "needle"], ["--task", "perplexity", "--data", str(env / "data")]):
            refused([env / "model", *task, "--lengths", "4096k,2048k", "--prompts-per-length", "10000"],
                    "--lengths × --prompts-per-length: 62,914,560,000 prompt tokens in all, more than the limit",
                    inputs=[env / "model", env / "data"], seconds=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024**2, f"peak Python heap {peak / 1024**2:.0f} MB"


# --- --plot ----------------------------------------------------------------------------------------------

PLOTS = [
    ("dir", "dir: --plot is a directory"),
    ("plot.pdf", "plot.pdf: --plot writes a PNG"),
    ("plot", "plot: --plot writes a PNG"),
    ("nowhere/plot.png", "nowhere: no such directory for --plot"),
    ("ok.jsonl/plot.png", "no such directory for --plot"),
    ("fifo.png", "fifo.png: --plot exists and is not a regular file"),
    ("model/eval.png", "--plot is inside an input"),
    ("model/../model/eval.png", "--plot is inside an input"),
    ("data/eval.png", "--plot is inside an input"),
    ("/dev/full", "--plot writes a PNG"),
    ("/proc/eval.png", "cannot write --plot there"),
    ("x" * 300 + ".png", "--plot cannot be looked up (File name too long)"),
]


@pytest.mark.parametrize("name, mentions", PLOTS, ids=[f"plot-{n}" for n, _ in PLOTS])
def test_bad_plot_paths(env, name, mentions):
    plot = env / name if not name.startswith("/") else Path(name)
    refused([env / "model", "--task", "perplexity", "--lengths", "512", "--data", env / "data", "--plot", plot],
            mentions, inputs=[env / "model", env / "data"], plot=plot if os.path.isdir(plot.parent) else None)
    assert Path("/dev/full").is_char_device()  # as root, the old code replaced the device with a PNG


def test_a_plot_through_a_symlink_replaces_the_link_not_its_target(env, tmp_path):
    """The one real run of this file (a 512-token needle, dense, one prompt): the PNG replaces a symlink
    that points into the model; the model and the FILE-like inputs stay byte-identical."""
    link = tmp_path / "eval.png"
    link.symlink_to(env / "model" / "config.json")
    before = snapshot(env / "model")
    start = time.monotonic()
    result = invoke(["eval", *map(str, needle(env / "model", "--plot", str(link), "--json"))], expect=0)
    assert time.monotonic() - start < 60
    assert json.loads(result.stdout)["lengths"][0]["prompts"] == 1
    assert not link.is_symlink() and link.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert snapshot(env / "model") == before and sorted(p.name for p in tmp_path.iterdir()) == ["eval.png"]


_RESULT = {"task": "perplexity", "model_path": "m", "vs_path": None,
           "lengths": [{"length": 512, "model": {"nll": 1.0, "nll_by_decile": [1.0] * 10}}]}


@pytest.mark.parametrize("failure, raised, mentions", [
    (OSError(28, "No space left on device"), UpcyclerError, "cannot write (No space left on device)"),
    (KeyboardInterrupt(), KeyboardInterrupt, None),
])
def test_a_plot_that_fails_mid_write_leaves_nothing(tmp_path, monkeypatch, failure, raised, mentions):
    """A full disk or Ctrl-C while the PNG is written: no staging file and no plot stay behind."""
    from matplotlib.figure import Figure

    from upcycler.train.evaluation import long_eval_report as report

    def half_written(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise failure

    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(raised, match=None if mentions is None else re.escape(mentions)):
        report.plot(_RESULT, tmp_path / "eval.png")
    assert list(tmp_path.iterdir()) == []


# --- through a real process ------------------------------------------------------------------------------


def test_a_tokenizer_that_encodes_nothing_no_longer_hangs(env):
    before = snapshot(env / "tok-empty")
    start = time.monotonic()
    proc = run_cli("eval", env / "tok-empty", "--task", "needle", "--lengths", "512", check=False, timeout=60)
    assert time.monotonic() - start < 60
    assert_clean_failure(proc, mentions="tok-empty/tokenizer.json: does not spell the pass key")
    assert snapshot(env / "tok-empty") == before


def test_a_full_stdout_is_one_line(env):
    with open("/dev/full", "w") as full:
        import subprocess
        import sys

        proc = subprocess.run([sys.executable, "-m", "upcycler", "eval", str(env / "model"), "--task", "prompts",
                               str(env / "ok.jsonl")], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                              check=False)
    assert_clean_failure(proc, mentions="stdout: cannot write the result (No space left on device)")


def test_huge_lengths_in_a_real_process(env):
    proc = run_cli("eval", env / "model", "--task", "needle", "--lengths", "4096k", "--prompts-per-length", "10000",
                   check=False, timeout=60)
    assert_clean_failure(proc, mentions="41,943,040,000 prompt tokens in all, more than the limit of 67,108,864")


# --- fuzzing the parsers ---------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(st.one_of(st.integers(-5, 10**13).map(str),
                                                          st.sampled_from(["k", "K", "4k", " 8k ", "", "1e3"])),
                                                max_size=80).map(",".join)))
def test_fuzz_lengths(text):
    try:
        lengths = le.parse_lengths(text)
    except UpcyclerError as err:
        assert str(err).startswith("--lengths: ") and "\n" not in str(err)
        return
    assert lengths and len(set(lengths)) == len(lengths) <= le.MAX_LENGTHS
    assert all(2 <= n <= le.MAX_LENGTH for n in lengths)


_JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                  st.text(max_size=20)),
                        lambda kids: st.one_of(st.lists(kids, max_size=4),
                                               st.dictionaries(st.sampled_from(["prompt", "answer", "x"]), kids,
                                                               max_size=3)), max_leaves=10)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(_JSONISH.map(json.dumps),
                                st.fixed_dictionaries({"prompt": st.text(max_size=30)},
                                                      optional={"answer": st.text(max_size=10)}).map(json.dumps),
                                st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
                                st.text(max_size=30)), max_size=6))
def test_fuzz_prompt_files(tmp_path, tokenizer, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    try:
        items = le.read_prompts(path, tokenizer)
    except UpcyclerError as err:
        assert str(err).startswith(str(path)) and "\n" not in le.escape(str(err))
        return
    assert items and all(it.length == len(it.ids) > 0 for it in items)
    assert all(it.answer is None or len(it.answer) > 0 for it in items)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO / "tokenizer.json"))


_NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-2**70, 2**70).map(str),
                     st.sampled_from(["", "x", "1e999", "-0", "0x10", "nan", "1_000"]))
_PREFILL_FLAGS = ["--prefill-gamma", "--prefill-tau", "--prefill-block", "--prefill-min-budget",
                  "--prefill-max-budget", "--prefill-dense-above", "--prefill-budget-rule"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.dictionaries(st.sampled_from(_PREFILL_FLAGS), _NUMBERS, max_size=4),
       attention=st.sampled_from(["dense", "flexprefill"]))
def test_fuzz_prefill_options(env, flags, attention):
    """Any values of the --prefill-* flags: one error line (the 64-token needle is always too short, so a
    valid set of options still ends in a refusal, and no model runs)."""
    args = [f"{k}={v}" for k, v in flags.items()]
    refused([env / "model", "--task", "needle", "--lengths", "64", "--attention", attention, *args], "",
            inputs=[], seconds=SECONDS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.tuples(st.text(st.characters(blacklist_characters="/\0"), min_size=1, max_size=300),
                      st.sampled_from(["", ".png", ".PNG"])).map("".join))
@example(name="\udd00.png")  # a lone surrogate: os.lstat raises UnicodeEncodeError
def test_fuzz_plot_names(tmp_path, name):
    """Any file name for --plot: a path or one `UpcyclerError`, and the directory stays empty."""
    from upcycler.train.evaluation import long_eval_report as report

    folder = tmp_path / "plots"
    folder.mkdir(exist_ok=True)
    try:
        report.check_plot_path(folder / name, "needle", [tmp_path / "model"])
    except UpcyclerError as err:
        assert "--plot" in str(err)
    assert list(folder.iterdir()) == []
