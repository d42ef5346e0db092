"""`upcycle <transform> SRC OUT [options]` for every registered transform, and `upcycle run recipe.yaml`.

The options of each transform command are generated from the fields of its config dataclass (type,
default, choices and help come from the field), plus the output options every writing command shares
(`--to`, `--family`, `--dtype`, `--shard-size`, `--overwrite`) and `--dry-run` / `--json`. A command is a
one-step recipe, so it runs exactly like `upcycle run` and records the same lineage. A `context` step that
changes the RoPE is measured after the write: KL and top-1 agreement against the source within the length
it was trained at (`rope_shift`).

Everything else a command does around a transform, the transform declares (`TransformHooks`): the paths
its options name besides the source (an output may overlap none), the check its write runs instead of
the full one, what it reports after the write, and the advisor its command carries. No transform is
named here.
"""

from __future__ import annotations

import importlib
import json
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import click

from upcycler.cli.options import echo_verification, function_check, output_options, verify_option
from upcycler.cli.path_type import BUCKET_OR_LOCAL, LOCAL_PATH, OUTPUT, SOURCE
from upcycler.cli.remote_locations import SOURCE_MAPPING
from upcycler.io.staging import check_output
from upcycler.locations import Location
from upcycler.schema import Option
from upcycler.transforms import TRANSFORMS
from upcycler.transforms.registry import (
    AfterWrite,
    AttentionFitService,
    RouterInputsService,
    Transform,
    TransformContext,
)
from upcycler.units import parse_size
from upcycler.untrusted import describe

if TYPE_CHECKING:
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
    (`--flag one=a/ two=b/`), as if the flag were repeated before each."""

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


def finish(p: Plan, *, dry_run: bool, as_json: bool, overwrite: bool, no_verify: bool = False) -> None:
    """Print the plan `p` (dry run), or write it, then print the notes, how the output was checked and what
    was written.

    The notes follow the write so that a failed write says one thing only: its error. What the steps'
    transforms declare (`TransformHooks`) decides which paths OUT may not overlap, which check the write
    runs and what is reported after it.
    """
    from upcycler.transforms.pipeline import execute, unchecked_reason
    from upcycler.units import human_bytes, human_count

    if dry_run:
        click.echo(json.dumps(p.to_json(), indent=2) if as_json else p.describe())
        return
    if p.recipe.output.path is not None:  # refuse a bad OUT before anything is read
        check_output(p.recipe.output.path, overwrite=overwrite, sources=[*p.ckpt.inputs, *step_inputs(p.recipe)])
    skipped = "--no-verify" if no_verify else unchecked_reason(p)
    check = None if skipped else (declared_check(p) or function_check(p.recipe.source,
                                                                      " + ".join(s.name for s in p.steps)))
    out = execute(p, overwrite=overwrite, check=check)
    said = after_write(p, out)
    moved = rope_shift(p, out, skipped="--no-verify" if no_verify else "")
    if not as_json:
        for step in p.steps:
            for note in step.notes:
                click.echo(f"{'note' if note.exact else 'warning'}: {step.name}: {note.text}", err=True)
        echo_verification(out, skipped)
        if moved:
            click.echo(format_shift(moved), err=True)
        for report in said:
            click.echo(report.text, err=True)
    if as_json:
        from upcycler.io.manifest import read_manifest

        record = read_manifest(out).extra.get("verification")
        extra = {key: value for report in said for key, value in report.fields.items()}
        extra.update({"shift": moved} if moved else {})
        click.echo(json.dumps({**p.to_json(), "written": str(out), "verification": record or {"skipped": skipped},
                               **extra}, indent=2))
        return
    spec = p.ckpt.spec
    click.echo(f"wrote {out}: {spec.family}, {spec.num_layers} layers, {human_count(spec.total_params())} "
               f"params ({human_count(spec.active_params())} active), {human_bytes(p.output_bytes)}; "
               f"function {'preserved' if p.exact else 'NOT preserved'}")


def declared_check(p: Plan) -> Callable[[Path], dict] | None:
    """The check a step's transform declares for the write of `p` (`TransformHooks.write_check`: e.g. one
    that works beside the write), or None: the full check."""
    return next((check for s in p.recipe.steps if (check := s.transform.hooks.write_check(p)) is not None), None)


def after_write(p: Plan, out: Path) -> list[AfterWrite]:
    """What the steps' transforms report once `p` is written to `out` (`TransformHooks.after_write`), each
    measured with the services this command lends the transforms."""
    lent = TransformContext(router_inputs=_router_inputs, attention_fit=_attention_fit(measures=True))
    said = (s.transform.hooks.after_write(p, k, out, lent) for k, s in enumerate(p.recipe.steps))
    return [report for report in said if report is not None]


def _router_inputs() -> RouterInputsService:
    """The JAX model's router inputs on prepared data, lent to the transforms; imported when a transform first
    asks, so that commands which never run the model do not start JAX."""
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
    overlaps an input (the source, or a path a step's options name: `TransformHooks.inputs`) or exists
    without `overwrite` is refused first: planning may read and fit for a while."""
    from upcycler.transforms.pipeline import plan

    if recipe.output.path is not None and not dry_run and not isinstance(recipe.output.path, str):
        check_output(recipe.output.path, overwrite=overwrite, sources=_named_inputs(recipe))
    return plan(recipe, allow_config_only=dry_run, router_inputs=_router_inputs,
                attention_fit=_attention_fit(measures=not dry_run))


def _named_inputs(recipe: Recipe) -> list[Path]:
    """The local paths a recipe reads: its source and what its steps' options name."""
    return [*([recipe.source] if isinstance(recipe.source, Path) else []), *step_inputs(recipe)]


def step_inputs(recipe: Recipe) -> list[Path]:
    """The local paths the options of a recipe's steps name besides its source (`TransformHooks.inputs`)."""
    return [path for step in recipe.steps for path in step.transform.hooks.inputs(step.config)]


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


def advisor_of(t: Transform) -> ModuleType | None:
    """The advisor transform `t` declares for its command (`TransformHooks.advisor`: a command-line module
    with `command_options(fn)` and `from_command(src, out, as_json, values) -> bool`), or None."""
    return None if t.hooks.advisor is None else importlib.import_module(t.hooks.advisor)


def transform_command(t: Transform) -> click.Command:
    """The click command of transform `t`: SRC, OUT, its options, the output options and --dry-run (and the
    options of the advisor it declares, which may advise instead of writing)."""
    advisor = advisor_of(t)

    def callback(src: Path, out: Path | None, dry_run: bool, as_json: bool, no_verify: bool, to: str,
                 family: str | None, dtype: str | None, shard_size: str, overwrite: bool, **values) -> None:
        from upcycler.transforms.recipe import Output, single

        if advisor is not None and advisor.from_command(src, out, as_json, values):
            return
        if out is None and not dry_run:
            raise click.UsageError("missing argument OUT (only --dry-run can do without it)")
        recipe = single(t.name, values, src, Output(out, to, family, dtype, parse_size(shard_size, "--shard-size")))
        finish(planned(recipe, dry_run=dry_run, overwrite=overwrite), dry_run=dry_run, as_json=as_json,
               overwrite=overwrite, no_verify=no_verify)

    fn: Callable = run_options(output_options(callback))
    if advisor is not None:
        fn = advisor.command_options(fn)
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
