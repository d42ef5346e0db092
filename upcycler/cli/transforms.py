"""`upcycle <transform> SRC OUT [options]` for every registered transform, and `upcycle run recipe.yaml`.

The options of each transform command are generated from the fields of its config dataclass (type,
default, choices and help come from the field), plus the output options every writing command shares
(`--to`, `--family`, `--dtype`, `--shard-size`, `--overwrite`) and `--dry-run` / `--json`. A command is a
one-step recipe, so it runs exactly like `upcycle run` and records the same lineage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click

from upcycler.cli.options import echo_verification, function_check, output_options, verify_option
from upcycler.io.staging import check_output
from upcycler.schema import Option
from upcycler.transforms import TRANSFORMS
from upcycler.transforms.registry import Transform
from upcycler.units import parse_size

_CLICK_TYPES = {int: click.INT, float: click.FLOAT, str: click.STRING, Path: click.Path(path_type=Path)}
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
    kind = click.Choice(opt.choices) if opt.choices else _CLICK_TYPES[opt.type]
    default = None if override else opt.default
    return click.option(opt.flag, dest, type=kind, required=opt.required and not override, default=default,
                        show_default=default is not None, metavar=opt.metavar, help=opt.help)


def _option(opt: Option) -> Callable:
    if opt.name in _RESERVED:
        raise ValueError(f"transform option {opt.name!r} collides with a command option")
    return click_option(opt)


def finish(p, *, dry_run: bool, as_json: bool, overwrite: bool, no_verify: bool = False) -> None:
    """Print the plan (dry run), or write, then print the notes, how the output was checked and what was
    written.

    The notes follow the write so that a failed write says one thing only: its error.
    """
    from upcycler.transforms.pipeline import execute, unchecked_reason
    from upcycler.units import human_bytes, human_count

    if dry_run:
        click.echo(json.dumps(p.to_json(), indent=2) if as_json else p.describe())
        return
    if p.recipe.output.path is not None:  # refuse a bad OUT before anything is read
        check_output(p.recipe.output.path, overwrite=overwrite, sources=p.ckpt.inputs)
    skipped = "--no-verify" if no_verify else unchecked_reason(p)
    check = None if skipped else function_check(p.recipe.source, " + ".join(s.name for s in p.steps))
    out = execute(p, overwrite=overwrite, check=check)
    if not as_json:
        for step in p.steps:
            for note in step.notes:
                click.echo(f"{'note' if note.exact else 'warning'}: {step.name}: {note.text}", err=True)
        echo_verification(out, skipped)
    if as_json:
        from upcycler.io.manifest import read_manifest

        record = read_manifest(out).extra.get("verification")
        click.echo(json.dumps({**p.to_json(), "written": str(out), "verification": record or {"skipped": skipped}},
                              indent=2))
        return
    spec = p.ckpt.spec
    click.echo(f"wrote {out}: {spec.family}, {spec.num_layers} layers, {human_count(spec.total_params())} "
               f"params ({human_count(spec.active_params())} active), {human_bytes(p.output_bytes)}; "
               f"function {'preserved' if p.exact else 'NOT preserved'}")


def transform_command(t: Transform) -> click.Command:
    """The click command of transform `t`: SRC, OUT, its options, the output options and --dry-run."""

    def callback(src: Path, out: Path | None, dry_run: bool, as_json: bool, no_verify: bool, to: str,
                 family: str | None, dtype: str | None, shard_size: str, overwrite: bool, **values) -> None:
        from upcycler.transforms.pipeline import plan
        from upcycler.transforms.recipe import Output, single

        if out is None and not dry_run:
            raise click.UsageError("missing argument OUT (only --dry-run can do without it)")
        recipe = single(t.name, values, src, Output(out, to, family, dtype, parse_size(shard_size, "--shard-size")))
        finish(plan(recipe, allow_config_only=dry_run), dry_run=dry_run, as_json=as_json, overwrite=overwrite,
               no_verify=no_verify)

    fn: Callable = run_options(output_options(callback))
    for info in reversed(t.options()):
        fn = _option(info)(fn)
    fn = click.argument("out", required=False, type=click.Path(path_type=Path))(fn)
    fn = click.argument("src", type=click.Path(path_type=Path))(fn)
    return click.command(t.name, help=t.doc, short_help=t.summary)(fn)


@click.command("run")
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--overwrite", is_flag=True, help="Replace the output directory if it exists.")
@run_options
def run(recipe: Path, dry_run: bool, as_json: bool, no_verify: bool, overwrite: bool) -> None:
    """Apply the transforms of RECIPE (YAML) in one streaming pass and write its output."""
    from upcycler.transforms.pipeline import plan
    from upcycler.transforms.recipe import load_recipe

    finish(plan(load_recipe(recipe), allow_config_only=dry_run), dry_run=dry_run, as_json=as_json,
           overwrite=overwrite, no_verify=no_verify)


commands = [*(transform_command(t) for t in TRANSFORMS.values()), run]
