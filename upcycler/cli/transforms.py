"""`upcycle <transform> SRC OUT [options]` for every registered transform, and `upcycle run recipe.yaml`.

The options of each transform command are generated from the fields of its config dataclass (type,
default, choices and help come from the field), plus the output options every writing command shares
(`--to`, `--family`, `--dtype`, `--shard-size`, `--overwrite`) and `--dry-run` / `--json`. A command is a
one-step recipe, so it runs exactly like `upcycle run` and records the same lineage. A `context` step that
changes the RoPE is measured after the write: KL and top-1 agreement against the source within the length
it was trained at (`rope_shift`).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import click

from upcycler.cli.options import echo_verification, function_check, output_options, verify_option
from upcycler.cli.path_type import BUCKET_OR_LOCAL, LOCAL_PATH, OUTPUT, SOURCE
from upcycler.cli.remote_locations import SOURCE_MAPPING
from upcycler.io.staging import check_output
from upcycler.locations import Location
from upcycler.schema import Option
from upcycler.transforms import TRANSFORMS
from upcycler.transforms.registry import AttentionFitService, RouterInputsService, Transform
from upcycler.units import parse_size
from upcycler.untrusted import describe

if TYPE_CHECKING:
    import numpy as np

    from upcycler.transforms.pipeline import Plan
    from upcycler.transforms.recipe import Recipe

_CLICK_TYPES = {int: click.INT, float: click.FLOAT, str: click.STRING, Path: SOURCE, Location: BUCKET_OR_LOCAL}
_RESERVED = {"src", "out", "to", "family", "dtype", "shard_size", "overwrite", "dry_run", "as_json", "no_verify"}


def run_options(fn: Callable) -> Callable:
    """--dry-run, --json and --no-verify, shared by every transform command and `run`."""
    fn = verify_option(fn)
    fn = click.option("--json", "as_json", is_flag=True,
                      help="Print the plan (with --dry-run) or the result as one JSON object.")(fn)
    return click.option("--dry-run", is_flag=True,
                        help="Print the plan, architecture, exact parameter counts and output bytes; "
                             "read no tensor bytes (a config-only source works).")(fn)


def click_option(opt: Option, dest: str | None = None, *, override: bool = False) -> Callable:
    """The click option of a config option: its flag, type, choices, default and help.

    `override=True` makes a flag that is None unless given (a bool becomes `--x/--no-x`), for commands
    whose config file holds the defaults.
    """
    dest = dest or opt.name
    if opt.type is bool:
        flag = f"{opt.flag}/--no-{opt.flag[2:]}" if override else opt.flag
        return click.option(flag, dest, is_flag=True, default=None if override else bool(opt.default),
                            help=opt.help)
    if typing.get_origin(opt.type) in (Mapping, dict):
        add = click.option(opt.flag, dest, multiple=True, metavar=opt.metavar or "NAME=VALUE",
                           callback=lambda ctx, param, given: _pairs(opt.flag, given), help=opt.help)
        return lambda fn: _mark_sources(add(fn), dest, typing.get_args(opt.type)[-1] is Path)
    if typing.get_origin(opt.type) is tuple:
        return click.option(opt.flag, dest, default=None, metavar=opt.metavar or "A,B,…",
                            callback=lambda ctx, param, given: _listed(given), help=opt.help)
    kind = click.Choice(opt.choices) if opt.choices else _CLICK_TYPES[opt.type]
    default = None if override else opt.default
    return click.option(opt.flag, dest, type=kind, required=opt.required and not override, default=default,
                        show_default=default is not None, metavar=opt.metavar, help=opt.help)


def _mark_sources(fn: Callable, dest: str, are_paths: bool) -> Callable:
    """Mark the mapping option `dest` just added to `fn` as one whose values are sources (paths)."""
    if are_paths:
        for param in getattr(fn, "__click_params__", ()):
            if param.name == dest:
                setattr(param, SOURCE_MAPPING, True)
    return fn


def _pairs(flag: str, given: tuple[str, ...]) -> dict[str, str] | None:
    """`NAME=VALUE` values of a mapping option as a dict (None when the flag was not given)."""
    out: dict[str, str] = {}
    for item in given:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise click.BadParameter(f"{describe(item)} is not NAME=VALUE", param_hint=flag)
        if name in out:
            raise click.BadParameter(f"{describe(name)} is given twice", param_hint=flag)
        out[name] = value
    return out or None


def _listed(given: str | None) -> list[str] | None:
    """A comma-separated list option as a list (None when not given)."""
    return None if given is None else [v.strip() for v in given.split(",")]


class _PairsCommand(click.Command):
    """A command whose mapping options take several `NAME=VALUE` words after one flag
    (`--experts-from code=a/ math=b/`), as if the flag were repeated before each."""

    def __init__(self, *args, pair_flags: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.pair_flags = pair_flags

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        flag = None
        for word in args:
            if word in self.pair_flags:
                flag = word
            elif flag is not None and not word.startswith("-") and "=" in word:
                if out[-1] != flag:
                    out.append(flag)
            else:
                flag = None
            out.append(word)
        return super().parse_args(ctx, out)


def _option(opt: Option) -> Callable:
    if opt.name in _RESERVED:
        raise ValueError(f"transform option {opt.name!r} collides with a command option")
    return click_option(opt)


ADVICE_OPTIONS = ("plan_for", "active_params", "total_params", "train_config", "plan_margin", "plan_seq_len")


def _advice_options(fn: Callable) -> Callable:
    """dense-to-moe's shape advisor (`upcycler.cli.moe_advice`)."""
    fn = click.option("--plan-margin", metavar="SIZE", default="1GiB", show_default=True,
                      help="With --plan-for: HBM per chip a proposal must leave free.")(fn)
    fn = click.option("--plan-seq-len", type=click.IntRange(128, 1 << 22), metavar="TOKENS",
                      help="With --plan-for (no --train-config): plan for sequences of this many tokens (default "
                           "4096), the rows per step scaled to keep the tokens per chip; a sequence that does not "
                           "fit one chip is split over several (mesh.context), the degree in each proposal.")(fn)
    fn = click.option("--train-config", type=LOCAL_PATH, metavar="YAML",
                      help="With --plan-for: the training run to plan for (its data, batch and sequence; "
                           "default 4096 tokens × 4 rows per chip).")(fn)
    fn = click.option("--total-params", metavar="N", help="With --plan-for: total parameters to aim at (e.g. 13B).")(fn)
    fn = click.option("--active-params", metavar="N",
                      help="With --plan-for: parameters per token to aim at (e.g. 2.3B; default the source's).")(fn)
    return click.option("--plan-for", metavar="TOPOLOGY",
                        help="Propose expert count, width and top-k for training on this TPU slice (e.g. v5e-256), "
                             "each with its best training configuration, fit and MFU bound (compiled from the "
                             "source's config.json); writes nothing.")(fn)


def _advise(src: Path, out: Path | None, as_json: bool, advice: dict, fixed: dict) -> None:
    from upcycler.cli.moe_advice import advise
    from upcycler.train.aot.topology import parse_slice
    from upcycler.units import parse_count

    if out is not None:
        raise click.UsageError("--plan-for writes nothing: drop OUT (the proposals print the command that writes)")
    parse_slice(advice["plan_for"], "--plan-for")
    if advice["plan_seq_len"] is not None and advice["train_config"] is not None:
        raise click.UsageError("--plan-seq-len plans the default run at another length; --train-config names its "
                               "own data.seq_len: drop one of them")
    advise(src, advice["plan_for"], as_json=as_json, train_config=advice["train_config"],
           seq_len=advice["plan_seq_len"],
           active=parse_count(advice["active_params"], "--active-params") if advice["active_params"] else None,
           total=parse_count(advice["total_params"], "--total-params") if advice["total_params"] else None,
           margin=parse_size(advice["plan_margin"], "--plan-margin"), fixed=fixed)


def finish(p: Plan, *, dry_run: bool, as_json: bool, overwrite: bool, no_verify: bool = False) -> None:
    """Print the plan `p` (dry run), or write it, then print the notes, how the output was checked and what
    was written.

    The notes follow the write so that a failed write says one thing only: its error.
    """
    from upcycler.transforms.moe_write_check import write_check_for
    from upcycler.transforms.pipeline import execute, unchecked_reason
    from upcycler.units import human_bytes, human_count

    if dry_run:
        click.echo(json.dumps(p.to_json(), indent=2) if as_json else p.describe())
        return
    if p.recipe.output.path is not None:  # refuse a bad OUT before anything is read
        calibration = [Path(s.config["calibration"]) for s in p.steps if s.config.get("calibration")]
        check_output(p.recipe.output.path, overwrite=overwrite, sources=[*p.ckpt.inputs, *calibration])
    skipped = "--no-verify" if no_verify else unchecked_reason(p)
    check = None if skipped else (write_check_for(p) or function_check(p.recipe.source,
                                                                      " + ".join(s.name for s in p.steps)))
    out = execute(p, overwrite=overwrite, check=check)
    routing = initial_routing(p, out)
    moved = rope_shift(p, out, skipped="--no-verify" if no_verify else "")
    if not as_json:
        for step in p.steps:
            for note in step.notes:
                click.echo(f"{'note' if note.exact else 'warning'}: {step.name}: {note.text}", err=True)
        echo_verification(out, skipped)
        if moved:
            click.echo(format_shift(moved), err=True)
        if routing:
            from upcycler.train.evaluation.calibration import format_shares

            click.echo("first forward on the calibration data: share of each source's tokens routed to the "
                       f"experts of each source (mean over MoE layers)\n{format_shares(*routing)}", err=True)
    if as_json:
        from upcycler.io.manifest import read_manifest

        record = read_manifest(out).extra.get("verification")
        extra = {"initial_routing": {"sources": list(routing[1]), "per_layer": routing[0].round(4).tolist()}} \
            if routing else {}
        extra.update({"shift": moved} if moved else {})
        click.echo(json.dumps({**p.to_json(), "written": str(out), "verification": record or {"skipped": skipped},
                               **extra}, indent=2))
        return
    spec = p.ckpt.spec
    click.echo(f"wrote {out}: {spec.family}, {spec.num_layers} layers, {human_count(spec.total_params())} "
               f"params ({human_count(spec.active_params())} active), {human_bytes(p.output_bytes)}; "
               f"function {'preserved' if p.exact else 'NOT preserved'}")


def _router_inputs() -> RouterInputsService:
    """The JAX model's router calibration (`--router-init centroids`), lent to the transforms; imported when a
    transform first asks, so that commands which never calibrate do not start JAX."""
    from upcycler.train.evaluation.calibration import RouterInputs

    return RouterInputs()


def _attention_fit(measures: bool) -> Callable[[], AttentionFitService]:
    """What makes the JAX model's fit and measurement of an attention changed under `--allow-approximate`,
    imported when a transform first asks; `measures` is False for --dry-run, which plans without computing."""

    def make() -> AttentionFitService:
        from upcycler.train.evaluation.attention_fit import AttentionFit

        return AttentionFit(measures)

    return make


def planned(recipe: Recipe, *, dry_run: bool, overwrite: bool = False) -> Plan:
    """`pipeline.plan` with the services a transform may borrow from the trainer. A local output that
    overlaps an input (the source, a step's calibration data or expert sources) or exists without
    `overwrite` is refused first: planning may read and fit for a while."""
    from upcycler.transforms.pipeline import plan

    if recipe.output.path is not None and not dry_run and not isinstance(recipe.output.path, str):
        check_output(recipe.output.path, overwrite=overwrite, sources=_named_inputs(recipe))
    return plan(recipe, allow_config_only=dry_run, router_inputs=_router_inputs,
                attention_fit=_attention_fit(measures=not dry_run))


def _named_inputs(recipe: Recipe) -> list[Path]:
    """The local paths a recipe reads: its source and what its steps name (calibration, expert sources)."""
    named = [recipe.source] if isinstance(recipe.source, Path) else []
    for step in recipe.steps:
        calibration = getattr(step.config, "calibration", None)
        experts_from = getattr(step.config, "experts_from", None) or {}
        named += [Path(path) for path in (calibration, *experts_from.values()) if path is not None]
    return named


def initial_routing(p: Plan, out: Path) -> tuple[np.ndarray, list[str]] | None:
    """(shares [M, S, S], source names) of the written MoE's first forward on the calibration data of a
    step that calibrated its router (`upcycler.train.evaluation.calibration.routing_shares`); None otherwise."""
    step = next((s for s in p.steps if s.config.get("router_init") == "centroids"), None)
    if step is None:
        return None
    from upcycler.io import read_checkpoint
    from upcycler.train.evaluation.calibration import routing_shares
    from upcycler.transforms.dense_to_moe import CENTROID_SEQUENCES

    c = step.config
    recorded = next(e for e in reversed(p.ckpt.lineage) if e.get("step") == step.name and "expert_sources" in e)
    names = list(c["experts_from"])
    shares = routing_shares(read_checkpoint(out), Path(c["calibration"]), names, recorded["expert_sources"],
                            c["calibration_sequences"] or CENTROID_SEQUENCES, c["calibration_length"])
    return shares, names


def rope_shift(p: Plan, out: Path, skipped: str = "") -> dict | None:
    """For a plan with a `context` step that changed the RoPE: how far the written model moved from the source
    within the length the source was trained at (`upcycler.verify.shift`), or why that was not measured
    (`skipped`, e.g. --no-verify); None for any other plan."""
    step = next((e for e in p.ckpt.lineage if e.get("step") == "context" and not e.get("function_preserving")),
                None)
    if step is None:
        return None
    from upcycler.errors import UpcyclerError
    from upcycler.verify import shift

    within = min(step["rope_before"]["max_position_embeddings"], p.ckpt.spec.max_position_embeddings)
    if skipped:
        return {"within": within, "not_measured": skipped}
    try:
        return {"within": within, **shift(p.recipe.source, out, within=within)}
    except UpcyclerError as err:  # the output is written: say why it could not be measured, do not fail
        return {"within": within, "not_measured": str(err)}


def format_shift(moved: dict) -> str:
    """The line `rope_shift` prints on stderr."""
    head = f"RoPE changed: not function-preserving at any length; within the original {moved['within']:,} positions"
    if "not_measured" in moved:
        return f"{head}, not measured: {moved['not_measured']}"
    probe = moved["probe"]
    return (f"{head}, against the source on {probe['batch']} × {probe['tokens']} probe tokens: "
            f"KL {moved['kl_mean']:.3e} mean ({moved['kl_max']:.3e} max), top-1 agreement "
            f"{moved['top1_agreement']:.2%}")


def transform_command(t: Transform) -> click.Command:
    """The click command of transform `t`: SRC, OUT, its options, the output options and --dry-run (and for
    dense-to-moe the shape advisor's `--plan-for`)."""
    advises = t.name == "dense-to-moe"

    def callback(src: Path, out: Path | None, dry_run: bool, as_json: bool, no_verify: bool, to: str,
                 family: str | None, dtype: str | None, shard_size: str, overwrite: bool, **values) -> None:
        from upcycler.transforms.recipe import Output, single

        if advises:
            advice = {k: values.pop(k) for k in ADVICE_OPTIONS}
            if advice["plan_for"] is not None:
                fixed = {"experts": values.get("experts"), "topk": values.get("topk"),
                         "width": values.get("expert_width")}
                _advise(src, out, as_json, advice, fixed)
                return
            stray = [k for k in ADVICE_OPTIONS if k != "plan_margin" and advice[k] is not None]
            if stray:
                raise click.UsageError(f"--{stray[0].replace('_', '-')} plans a shape: it needs --plan-for TOPOLOGY")
        if out is None and not dry_run:
            raise click.UsageError("missing argument OUT (only --dry-run can do without it)")
        recipe = single(t.name, values, src, Output(out, to, family, dtype, parse_size(shard_size, "--shard-size")))
        finish(planned(recipe, dry_run=dry_run, overwrite=overwrite), dry_run=dry_run, as_json=as_json,
               overwrite=overwrite, no_verify=no_verify)

    fn: Callable = run_options(output_options(callback))
    if advises:
        fn = _advice_options(fn)
    for info in reversed(t.options()):
        fn = _option(info)(fn)
    fn = click.argument("out", required=False, type=OUTPUT)(fn)
    fn = click.argument("src", type=SOURCE)(fn)
    pairs = tuple(o.flag for o in t.options() if typing.get_origin(o.type) in (Mapping, dict))
    return click.command(t.name, cls=_PairsCommand, pair_flags=pairs, help=t.doc, short_help=t.summary)(fn)


@click.command("run")
@click.argument("recipe", type=LOCAL_PATH)
@click.option("--overwrite", is_flag=True, help="Replace the output directory if it exists.")
@run_options
def run(recipe: Path, dry_run: bool, as_json: bool, no_verify: bool, overwrite: bool) -> None:
    """Apply the transforms of RECIPE (YAML) in one streaming pass and write its output (the recipe's source
    and output.path may be gs:// URLs, its source an hf://ORG/NAME Hub id)."""
    import dataclasses

    from upcycler.cli.remote_locations import remote_io
    from upcycler.transforms.recipe import load_recipe

    plan = load_recipe(recipe)
    remote_out = {"output": plan.output.path} if isinstance(plan.output.path, str) and not dry_run else {}
    with remote_io({"source": plan.source}, remote_out, overwrite=overwrite) as (sources, outputs):
        output = dataclasses.replace(plan.output, path=outputs.get("output", plan.output.path))
        plan = dataclasses.replace(plan, source=sources["source"], output=output)
        finish(planned(plan, dry_run=dry_run, overwrite=overwrite), dry_run=dry_run, as_json=as_json,
               overwrite=overwrite, no_verify=no_verify)


commands = [*(transform_command(t) for t in TRANSFORMS.values()), run]
