"""`upcycle eval MODEL [--vs OTHER] --task needle|perplexity|prompts [FILE]`: long-context checks.

Runs prompts of the requested lengths through the JAX model one at a time (`upcycler.train.prefill`,
fp32, dense or FlexPrefill attention) and prints a table by length: passkey retrieval accuracy (and by
needle depth), perplexity (and the NLL of the first and last tenth of the window), or the top-1 and
answers of the user's own prompts. `--vs OTHER` runs the same prompts on a second model with the same
tokenizer and adds the last-token KL(MODEL‖OTHER) and top-1 agreement. The tasks and their scoring live
in `upcycler.train.long_eval`, the result, table and plot in `upcycler.train.long_eval_report`.

Every option and file is checked before any weight is read; bad input is one `error:` line, exit 2.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from upcycler.cli.transforms import click_option
from upcycler.errors import UpcyclerError
from upcycler.schema import from_mapping, options
from upcycler.train.config import ModelConfig
from upcycler.train.long_eval import MAX_PROMPTS, TASKS, show_length
from upcycler.untrusted import integer, shown_path

_PREFILL = tuple(o for o in options(ModelConfig) if o.name.startswith("prefill_"))


def _prefill_options(fn):
    """The FlexPrefill options of `ModelConfig` as --prefill-* flags."""
    for opt in reversed(_PREFILL):
        fn = click_option(opt)(fn)
    return fn


@click.command("eval")
@click.argument("model", type=click.Path(path_type=Path))
@click.argument("file", required=False, type=click.Path(path_type=Path))
@click.option("--task", type=click.Choice(TASKS), required=True,
              help="needle (passkey retrieval in corpus text), perplexity (windows of --data) or prompts "
                   "(FILE: JSONL lines {\"prompt\": …, \"answer\": … (optional)}).")
@click.option("--vs", "other", type=click.Path(path_type=Path), default=None,
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
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Prepared data (`upcycle prepare-data` with MODEL's tokenizer) for --task perplexity.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Write a PNG of accuracy (needle) or NLL (perplexity) by length and depth.")
@_prefill_options
def command(model: Path, file: Path | None, task: str, other: Path | None, lengths: str | None,
            attention: str, vs_attention: str | None, per_length: int, seed: int, data: Path | None, as_json: bool, plot: Path | None,
            **prefill: Any) -> None:
    """Long-context checks of MODEL (and of --vs OTHER on the same prompts), on CPU or one accelerator."""
    from upcycler.train import long_eval as le
    from upcycler.train import long_eval_report as report

    cfg = _model_config(attention, prefill)
    if vs_attention is not None and other is None:
        other = model
    vs_cfg = cfg if vs_attention is None else _model_config(vs_attention, prefill)
    wanted = _check_options(task, file, lengths, per_length, seed, data)
    if plot is not None:
        report.check_plot_path(plot, task)
    spec, tokenizer, digest = _open_model(model)
    other_spec = None
    if other is not None:
        other_spec, _, other_digest = _open_model(other)
        if other_digest != digest:
            raise UpcyclerError(f"{shown_path(Path(other) / 'tokenizer.json')}: differs from "
                                f"{shown_path(Path(model) / 'tokenizer.json')}; --vs compares models that "
                                "share a tokenizer (byte for byte)")
    if task == "needle":
        from upcycler.cli.demo import demo_assets

        documents = le.corpus_documents(demo_assets() / "corpus")
        items = le.needle_items(tokenizer, documents, wanted, per_length, seed)
    elif task == "perplexity":
        items = le.perplexity_items(data, digest, spec.vocab_size, wanted, per_length, seed)
    else:
        items = le.read_prompts(file, tokenizer)
    _warn_beyond_positions(items, [(model, spec)] + ([(other, other_spec)] if other is not None else []))

    outs = _run(le, model, cfg, task, items, keep=other is not None)
    vs_outs = _run(le, other, vs_cfg, task, items, keep=True) if other is not None else None
    header = {"model_path": str(model), "vs_path": None if other is None else str(other),
              "attention": attention, "vs_attention": None if other is None else vs_attention or attention,
              "seed": seed,
              "prompts_per_length": None if task == "prompts" else per_length}
    if attention == "flexprefill":
        header["prefill"] = {o.name: getattr(cfg, o.name) for o in _PREFILL}
    result = report.summarize(task, items, outs, vs_outs, flex=attention == "flexprefill", header=header,
                          decode=lambda t: tokenizer.decode([t]))
    if as_json:
        click.echo(json.dumps(_finite(result), indent=2, ensure_ascii=False))
    else:
        click.echo(report.format_table(result))
    if plot is not None:
        click.echo(f"plot: {shown_path(report.plot(result, plot))}", err=as_json)


def _model_config(attention: str, prefill: dict[str, Any]) -> ModelConfig:
    """The run config: fp32, the attention asked for, and the --prefill-* options (checked by the schema)."""
    values = {"compute_dtype": "float32", "attention": "einsum" if attention == "dense" else "flexprefill",
              **{o.flag[2:]: prefill[o.name] for o in _PREFILL}}
    return from_mapping(ModelConfig, values, "upcycle eval", flags=True, fix="see `upcycle eval --help`")


def _check_options(task: str, file: Path | None, lengths: str | None, per_length: int, seed: int,
                   data: Path | None) -> list[int]:
    """The lengths asked for, after refusing options that do not fit the task."""
    from upcycler.train.long_eval import parse_lengths

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
    from upcycler.train.long_eval import load_tokenizer, tokenizer_file

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


def _run(le: Any, path: Path, cfg: ModelConfig, task: str, items: list, *,
         keep: bool) -> list[dict[str, Any]]:
    """Load one model and run every item through it, with a progress bar on a terminal."""
    from tqdm import tqdm

    from upcycler.train.prefill import PrefillModel

    model = PrefillModel.load(path, cfg)
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
