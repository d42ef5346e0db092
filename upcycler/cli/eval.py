"""`upcycle eval MODEL [--vs OTHER] --task needle|perplexity|prompts [FILE]`: long-context checks;
`upcycle eval MODEL --task lm-eval:TASKS [--include DIR]`: lm-evaluation-harness tasks.

Runs prompts of the requested lengths through the JAX model one at a time (`upcycler.train.evaluation.prefill`,
fp32, dense or FlexPrefill attention) and prints a table by length: passkey retrieval accuracy (and by
needle depth), perplexity (and the NLL of the first and last tenth of the window), or the top-1 and
answers of the user's own prompts. `--vs OTHER` runs the same prompts on a second model with the same
tokenizer and adds the last-token KL(MODEL‖OTHER) and top-1 agreement. The tasks and their scoring live
in `upcycler.train.evaluation.long_eval`, the result, table and plot in `upcycler.train.evaluation.long_eval_report`.
`--task lm-eval:TASK1,TASK2` runs lm-evaluation-harness tasks (built-in, or YAML in an `--include`
directory) on the same fp32 JAX model (`upcycler.train.evaluation.harness`, imported only then: the
harness is the optional `eval` extra) and prints each task's metrics with their stderr.

Every option and file is checked before any weight is read; bad input is one `error:` line, exit 2.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import click

from upcycler.cli.path_type import LOCAL_PATH, SOURCE
from upcycler.cli.transforms import click_option
from upcycler.errors import UpcyclerError
from upcycler.schema import from_mapping, options
from upcycler.train.config import ModelConfig
from upcycler.train.evaluation.config import PrefillConfig
from upcycler.train.evaluation.long_eval import MAX_PROMPTS, TASKS, show_length
from upcycler.untrusted import escape, integer, shown_path

_PREFILL = options(PrefillConfig)


def _prefill_options(fn):
    """FlexPrefill's options (`PrefillConfig`) as --prefill-* flags."""
    for opt in reversed(_PREFILL):
        fn = click_option(opt)(fn)
    return fn


class _TaskChoice(click.Choice):
    """One of the long-context tasks, or `lm-eval:TASK1,TASK2` (checked by the lm-eval branch)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.startswith(LM_EVAL):
            return value
        return super().convert(value, param, ctx)


LM_EVAL = "lm-eval:"
MISSING_HARNESS = "--task lm-eval: needs lm-evaluation-harness; pip install 'upcycler[eval]'"
_LM_EVAL_ONLY = ("include", "num_fewshot", "limit", "batch_size", "samples")
# what the long-context tasks read and lm-eval does not, with the flag that names it
_LONG_CONTEXT_ONLY = {"lengths": "--lengths", "attention": "--attention", "vs_attention": "--vs-attention",
                      "per_length": "--prompts-per-length", "seed": "--seed", "data": "--data", "plot": "--plot",
                      **{o.name: o.flag for o in _PREFILL}}
MAX_BATCH = 4096


@click.command("eval")
@click.argument("model", type=SOURCE)
@click.argument("file", required=False, type=LOCAL_PATH)
@click.option("--task", type=_TaskChoice(TASKS), required=True, metavar="[needle|perplexity|prompts|lm-eval:TASKS]",
              help="needle (passkey retrieval in corpus text), perplexity (windows of --data), prompts "
                   "(FILE: JSONL lines {\"prompt\": …, \"answer\": … (optional)}), or lm-eval:TASK1,TASK2 "
                   "(lm-evaluation-harness tasks; needs `pip install 'upcycler[eval]'`).")
@click.option("--vs", "other", type=SOURCE, default=None,
              help="A second model with the same tokenizer (e.g. the dense parent), run on the same prompts.")
@click.option("--lengths", default=None, metavar="4k,8k,…",
              help="Prompt lengths in tokens (k = 1024); needle and perplexity.")
@click.option("--attention", type=click.Choice(["dense", "flexprefill"]), default="dense", show_default=True,
              help="How the prompt attends: dense, or FlexPrefill's sparse key blocks (--prefill-* options).")
@click.option("--vs-attention", type=click.Choice(["dense", "flexprefill"]), default=None,
              help="How the --vs side attends [default: as --attention]; without --vs, MODEL itself again: "
                   "e.g. --attention flexprefill --vs-attention dense measures what sparse prefill changes.")
@click.option("--prompts-per-length", "per_length", type=int, default=20, show_default=True,
              help="Needle prompts, or perplexity windows, per length.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the needles' keys and haystacks and of the perplexity windows.")
@click.option("--data", type=LOCAL_PATH, default=None,
              help="Prepared data (`upcycle prepare-data` with MODEL's tokenizer) for --task perplexity.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
@click.option("--plot", type=LOCAL_PATH, default=None,
              help="Write a PNG of accuracy (needle) or NLL (perplexity) by length and depth.")
@click.option("--include", type=LOCAL_PATH, default=None, metavar="DIR",
              help="lm-eval: a directory of task YAML files (the harness's include_path), searched first.")
@click.option("--num-fewshot", type=int, default=None, metavar="N",
              help="lm-eval: few-shot examples per prompt [default: each task's own, else 0].")
@click.option("--limit", type=float, default=None, metavar="N",
              help="lm-eval: at most this many documents per task (below 1: this fraction of them).")
@click.option("--batch-size", type=int, default=8, show_default=True, metavar="N",
              help="lm-eval: requests per forward pass (padded to power-of-two lengths).")
@click.option("--samples", type=LOCAL_PATH, default=None, metavar="FILE",
              help="lm-eval: write every document's responses and metrics as JSON lines.")
@_prefill_options
def command(model: Path, file: Path | None, task: str, other: Path | None, lengths: str | None,
            attention: str, vs_attention: str | None, per_length: int, seed: int, data: Path | None, as_json: bool, plot: Path | None,
            include: Path | None, num_fewshot: int | None, limit: float | None, batch_size: int,
            samples: Path | None, **prefill: Any) -> None:
    """Long-context checks of MODEL (and of --vs OTHER on the same prompts), on CPU or one accelerator;
    or lm-evaluation-harness tasks (--task lm-eval:TASKS)."""
    from upcycler.train.evaluation import long_eval as le
    from upcycler.train.evaluation import long_eval_report as report

    given = _given(click.get_current_context())
    _check_paths({"MODEL": model, "--vs": other, "FILE": file, "--data": data, "--plot": plot,
                  "--include": include, "--samples": samples})
    if task.startswith(LM_EVAL):
        _lm_eval(model, task, given, file, include, num_fewshot, limit, batch_size, samples, as_json)
        return
    for name in _LM_EVAL_ONLY:
        if name in given:
            flag = "--" + name.replace("_", "-")
            raise UpcyclerError(f"{flag}: only --task lm-eval:TASKS reads it; drop it for --task {task}")
    cfg, flex = _model_config(attention), _prefill_config(prefill)
    if vs_attention is not None and other is None:
        other = model
    vs_cfg = cfg if vs_attention is None else _model_config(vs_attention)
    _check_prefill(attention, vs_attention, flex, given)
    if task == "prompts":
        for name, flag in (("per_length", "--prompts-per-length"), ("seed", "--seed")):
            if name in given:
                raise UpcyclerError(f"{flag}: --task prompts runs FILE's prompts as they are; drop {flag}")
    wanted = _check_options(task, file, lengths, per_length, seed, data)
    inputs = [p for p in (model, other, data, file) if p is not None]
    if plot is not None:
        report.check_plot_path(plot, task, inputs)
    spec, tokenizer, digest = _open_model(model)
    other_spec = None
    if other is not None:
        other_spec, _, other_digest = _open_model(other)
        if other_digest != digest:
            raise UpcyclerError(f"{shown_path(Path(other) / 'tokenizer.json')}: differs from "
                                f"{shown_path(Path(model) / 'tokenizer.json')}; --vs compares models that "
                                "share a tokenizer (byte for byte)")
    models = [(model, spec)] + ([(other, other_spec)] if other is not None else [])
    if other is not None and task != "prompts":
        _check_kept(len(wanted) * per_length, models)
    where = shown_path(Path(model) / "tokenizer.json")
    try:
        if task == "needle":
            from upcycler.cli.demo import demo_assets

            documents = le.corpus_documents(demo_assets() / "corpus")
            items = le.needle_items(tokenizer, documents, wanted, per_length, seed, where)
        elif task == "perplexity":
            items = le.perplexity_items(data, digest, spec.vocab_size, wanted, per_length, seed)
        else:
            items = le.read_prompts(file, tokenizer)
    except Exception as err:  # tokenizers raises a bare Exception when it cannot encode: only that is caught
        if type(err) is not Exception:
            raise
        raise UpcyclerError(f"{where}: cannot encode the prompts ({escape(str(err))[:120]}); use the "
                            "model's own tokenizer.json") from None
    _check_vocabulary(items, models, f"{shown_path(data)}: holds" if task == "perplexity" else f"{where}: gives")
    if other is not None:
        _check_kept(len(items), models)
    _warn_beyond_positions(items, models)

    outs = _run(le, model, cfg, flex, task, items, keep=other is not None)
    vs_outs = _run(le, other, vs_cfg, flex, task, items, keep=True) if other is not None else None
    header = {"model_path": str(model), "vs_path": None if other is None else str(other),
              "attention": attention, "vs_attention": None if other is None else vs_attention or attention,
              "seed": seed,
              "prompts_per_length": None if task == "prompts" else per_length}
    if attention == "flexprefill":
        header["prefill"] = {o.name: getattr(flex, o.name) for o in _PREFILL}
    result = report.summarize(task, items, outs, vs_outs, flex=attention == "flexprefill", header=header,
                          decode=lambda t: tokenizer.decode([t]))
    written = None if plot is None else report.plot(result, plot, inputs)  # before stdout: a failed plot prints nothing
    _emit(json.dumps(_finite(result), indent=2, ensure_ascii=False) if as_json else report.format_table(result))
    if written is not None:
        click.echo(f"plot: {shown_path(written)}", err=as_json)


def _lm_eval(model: Path, task: str, given: set[str], file: Path | None, include: Path | None,
             num_fewshot: int | None, limit: float | None, batch_size: int, samples: Path | None,
             as_json: bool) -> None:
    """`--task lm-eval:TASKS`: the harness's tasks on MODEL, every input checked before a weight is read
    (the command line's before the harness is imported)."""
    if file is not None:
        raise UpcyclerError(f"{shown_path(file)}: FILE is for --task prompts; drop it for --task lm-eval")
    if "other" in given:
        raise UpcyclerError("--vs: --task lm-eval scores one model; run `upcycle eval` on each (with --samples "
                            "to compare document by document) or drop --vs")
    for name, flag in _LONG_CONTEXT_ONLY.items():
        if name in given:
            raise UpcyclerError(f"{flag}: the long-context tasks read it, not --task lm-eval (the harness's "
                                f"tasks bring their own prompts); drop {flag}")
    names = _harness_tasks(task)
    if include is not None and not include.is_dir():
        state = "is not a directory" if include.exists() else "does not exist"
        raise UpcyclerError(f"{shown_path(include)}: --include {state}; pass the directory that holds the "
                            "tasks' YAML files")
    if num_fewshot is not None:
        integer(num_fewshot, "the few-shot examples", "--num-fewshot", low=0, high=MAX_PROMPTS,
                fix="pass e.g. 0 or 5")
    integer(batch_size, "the batch size", "--batch-size", high=MAX_BATCH, fix="pass e.g. 8")
    if limit is not None and not (math.isfinite(limit) and limit > 0 and (limit < 1 or limit.is_integer())):
        raise UpcyclerError(f"--limit: {limit:g} is not a document count (a whole number) or a fraction "
                            "below 1; pass e.g. --limit 100 or --limit 0.1")
    if samples is not None:
        _check_samples_path(samples, model)
    try:
        from upcycler.train.evaluation import harness
    except ImportError as err:
        if (err.name or "").partition(".")[0] != "lm_eval":
            raise
        raise UpcyclerError(MISSING_HARNESS) from None
    progress = sys.stderr.isatty()
    harness.quiet_harness(progress)
    lm = harness.JaxLM(model, batch_size=batch_size, progress=progress)
    manager = harness.task_manager(names, include)
    loaded = harness.load_tasks(manager, names)
    limit = int(limit) if limit is not None and limit >= 1 else limit  # a count, or a fraction of the documents
    results = harness.evaluate_tasks(lm, loaded, num_fewshot=num_fewshot, limit=limit,
                                     log_samples=samples is not None)
    from importlib.metadata import version

    header = {"task": "lm-eval", "model_path": str(model), "lm_eval_version": version("lm_eval"),
              "include": None if include is None else str(include), "num_fewshot": num_fewshot, "limit": limit,
              "batch_size": batch_size}
    result = harness.summarize(results, header)
    if samples is not None:
        try:
            samples.write_text("".join(line + "\n" for line in harness.sample_lines(results)), encoding="utf-8")
        except OSError as err:
            raise UpcyclerError(f"{shown_path(samples)}: cannot write --samples ({err.strerror}); choose "
                                "another path") from None
    _emit(json.dumps(_finite(result), indent=2, ensure_ascii=False) if as_json else harness.format_table(result))
    if samples is not None:
        click.echo(f"samples: {shown_path(samples)}", err=as_json)


def _harness_tasks(task: str) -> list[str]:
    """`lm-eval:arc_easy,hellaswag` -> ["arc_easy", "hellaswag"] (order kept, repeats dropped)."""
    names: list[str] = []
    for part in task[len(LM_EVAL):].split(","):
        name = part.strip()
        if not name:
            raise UpcyclerError(f"--task {escape(task)[:80]}: names an empty task; pass harness task names "
                                "after the colon, e.g. --task lm-eval:arc_easy,hellaswag")
        if name not in names:
            names.append(name)
    return names


def _check_samples_path(path: Path, model: Path) -> None:
    """Refuse a --samples that cannot be written, is a directory or lands inside MODEL."""
    if path.is_dir():
        raise UpcyclerError(f"{shown_path(path)}: --samples is a directory; pass a file name such as samples.jsonl")
    if not path.parent.is_dir():
        raise UpcyclerError(f"{shown_path(path.parent)}: no such directory for --samples; create it or choose "
                            "another path")
    if path.exists() and not path.is_symlink() and not path.is_file():
        raise UpcyclerError(f"{shown_path(path)}: --samples exists and is not a regular file; choose another path")
    if Path(model).resolve() in (path.parent.resolve() / path.name).parents:
        raise UpcyclerError(f"{shown_path(path)}: --samples would write inside MODEL; choose a path outside it")


def _model_config(attention: str) -> ModelConfig:
    """How the model runs: fp32, with the attention asked for."""
    return ModelConfig(compute_dtype="float32", attention="einsum" if attention == "dense" else "flexprefill")


def _prefill_config(prefill: dict[str, Any]) -> PrefillConfig:
    """FlexPrefill's selection from the --prefill-* options (checked by the schema)."""
    values = {o.flag[2:]: prefill[o.name] for o in _PREFILL}
    return from_mapping(PrefillConfig, values, "upcycle eval", flags=True, fix="see `upcycle eval --help`")


def _given(ctx: click.Context) -> set[str]:
    """The parameters the user gave on the command line (not defaults)."""
    return {name for name in ctx.params
            if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)}


def _check_paths(paths: dict[str, Path | None]) -> None:
    """Refuse a path the system cannot even look up (a name longer than the filesystem allows, a
    component that cannot be searched); missing paths and symlink loops are left to the readers' messages."""
    import errno

    for what, path in paths.items():
        if path is None:
            continue
        try:
            os.stat(path)
        except OSError as err:
            if err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise UpcyclerError(f"{shown_path(path)}: {what} cannot be looked up ({err.strerror}); pass "
                                    "a shorter or accessible path") from None


def _check_prefill(attention: str, vs_attention: str | None, cfg: PrefillConfig, given: set[str]) -> None:
    """Refuse --prefill-* options that nothing uses (dense attention on both sides) or that contradict."""
    if "flexprefill" not in (attention, vs_attention):
        for opt in _PREFILL:
            if opt.name in given:
                raise UpcyclerError(f"{opt.flag}: only FlexPrefill attention reads it; add --attention "
                                    f"flexprefill (or --vs-attention flexprefill) or drop {opt.flag}")
    if 0 < cfg.prefill_max_budget < cfg.prefill_min_budget:
        raise UpcyclerError(f"--prefill-max-budget: {cfg.prefill_max_budget:,} tokens is below "
                            f"--prefill-min-budget ({cfg.prefill_min_budget:,}); raise it, lower "
                            "--prefill-min-budget, or pass 0 for no limit")


def _check_vocabulary(items: list, models: list[tuple[Path, Any]], source: str) -> None:
    """Refuse token ids that a model has no embedding for (a tokenizer larger than the model's vocabulary);
    `source` starts the message ("DIR: holds", "TOKENIZER: gives")."""
    top = max(max(int(it.ids.max()), -1 if it.answer is None or not len(it.answer) else int(it.answer.max()))
              for it in items)
    for path, spec in models:
        if top >= spec.vocab_size:
            raise UpcyclerError(f"{source} token id {top:,}, beyond the vocabulary of "
                                f"{shown_path(path)} ({spec.vocab_size:,} tokens, its vocab_size); "
                                "use the model's own tokenizer or remove the prompts with added tokens")


MAX_KEPT_BYTES = 2 * 1024**3  # last-token distributions held to compare two models (--vs)


def _check_kept(count: int, models: list[tuple[Path, Any]]) -> None:
    """Refuse a --vs run whose last-token distributions (both models', float32) would exceed `MAX_KEPT_BYTES`."""
    from upcycler.spec import LIMITS_ENV, limits_on

    size = count * sum(spec.vocab_size for _, spec in models) * 4
    if size > MAX_KEPT_BYTES and limits_on():
        raise UpcyclerError(f"--vs: comparing {count:,} prompts keeps their last-token distributions "
                            f"({size / 1024**3:,.1f} GiB), more than the limit of {MAX_KEPT_BYTES / 1024**3:g} "
                            f"GiB; pass fewer prompts (or set {LIMITS_ENV}=off)")


def _emit(text: str) -> None:
    """`text` on stdout; a stdout that cannot take it (a full disk, /dev/full) is one error line."""
    try:
        click.echo(text)
        sys.stdout.flush()
    except OSError as err:
        try:  # what is still buffered would fail again at exit, with a traceback-like warning
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass
        raise UpcyclerError(f"stdout: cannot write the result ({err.strerror or err}); redirect it to a "
                            "file on a disk with room") from None


def _check_options(task: str, file: Path | None, lengths: str | None, per_length: int, seed: int,
                   data: Path | None) -> list[int]:
    """The lengths asked for, after refusing options that do not fit the task."""
    from upcycler.train.evaluation.long_eval import parse_lengths

    integer(per_length, "the prompts per length", "--prompts-per-length", high=MAX_PROMPTS,
            fix="pass e.g. 20")
    integer(seed, "the seed", "--seed", low=0, fix="pass a non-negative integer")
    if task == "prompts":
        if file is None:
            raise UpcyclerError("--task prompts: needs FILE, a JSONL file of {\"prompt\": …, \"answer\": …} "
                                "lines; pass `upcycle eval MODEL --task prompts FILE`")
        if lengths is not None:
            raise UpcyclerError("--lengths: --task prompts takes its lengths from FILE's prompts; drop "
                                "--lengths")
        return []
    if file is not None:
        raise UpcyclerError(f"{shown_path(file)}: FILE is for --task prompts; drop it for --task {task}")
    if lengths is None:
        raise UpcyclerError(f"--lengths: required for --task {task}; pass e.g. --lengths 4k,8k,16k")
    if task == "perplexity" and data is None:
        raise UpcyclerError("--data: required for --task perplexity; pass a directory written by "
                            "`upcycle prepare-data --tokenizer MODEL …`")
    if task != "perplexity" and data is not None:
        raise UpcyclerError(f"--data: only --task perplexity reads prepared data; drop it for --task {task}")
    return parse_lengths(lengths)


def _open_model(path: Path) -> tuple[Any, Any, str]:
    """The model's spec (no tensor bytes read), its tokenizer and the tokenizer file's sha256."""
    from upcycler.io import read_checkpoint
    from upcycler.train.evaluation.long_eval import load_tokenizer, tokenizer_file

    spec = read_checkpoint(path).spec
    tokenizer, raw = load_tokenizer(tokenizer_file(path))
    return spec, tokenizer, hashlib.sha256(raw).hexdigest()


def _warn_beyond_positions(items: list, models: list[tuple[Path, Any]]) -> None:
    """A warning (not an error) for prompts longer than a model's max_position_embeddings."""
    longest = max(it.length for it in items)
    for path, spec in models:
        if longest > spec.max_position_embeddings:
            click.echo(f"warning: {shown_path(path)}: prompts of up to {show_length(longest)} tokens are "
                       f"longer than its max_position_embeddings ({spec.max_position_embeddings}); results "
                       "there measure extrapolation", err=True)


def _run(le: Any, path: Path, cfg: ModelConfig, prefill: PrefillConfig, task: str, items: list, *,
         keep: bool) -> list[dict[str, Any]]:
    """Load one model and run every item through it, with a progress bar on a terminal."""
    from tqdm import tqdm

    from upcycler.train.evaluation.prefill import PrefillModel

    model = PrefillModel.load(path, cfg, prefill=prefill)
    with tqdm(total=len(items), desc=Path(path).name or str(path), unit="prompt", file=sys.stderr,
              disable=not sys.stderr.isatty(), leave=False) as bar:
        return le.evaluate(model, task, items, name=shown_path(path), keep_distribution=keep,
                           advance=lambda: bar.update(1))


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as null, so the JSON is strict."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
