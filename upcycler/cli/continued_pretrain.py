"""`upcycle continued-pretrain --config train.yaml`: train a checkpoint on, with flags overriding the file.

Besides `--config`, `--resume` and `--set KEY=VALUE` (any key), the flags are generated from the config's
own fields (`upcycler.train.config`), like the options of the transform commands: every option at the
top level and in the `model`, `distributed` and `metrics` sections is a flag named after it (`--steps`,
`--init`, `--gmm-backend`, `--peak-flops`, `--process-id`, …) with the field's type, choices and help.
A flag left out keeps the file's value.

The config and every file it names are checked (`upcycler.train.config.load_config`, then
`upcycler.train.loop.preflight.prepare`) before the trainer, and with it JAX, is imported, so a bad config,
flag, checkpoint or data directory fails in about a second; each bucket the config names gets one
request first (`upcycler.train.loop.remote_inputs.check_buckets`), so a bucket that does not answer fails
within the client's retry deadline, not after JAX has started.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from upcycler.cli.path_type import LOCAL_PATH
from upcycler.cli.plan_lists import listed
from upcycler.cli.transforms import click_option
from upcycler.errors import UpcyclerError
from upcycler.locations import Location
from upcycler.schema import options
from upcycler.train.aot.topology import parse_slice
from upcycler.train.config import (
    CONTEXT_EXCHANGES,
    MOE_DISPATCHES,
    REMAT_POLICIES,
    RESUME_MODES,
    DistributedConfig,
    MetricsConfig,
    ModelSection,
    TrainConfig,
    load_config,
)
from upcycler.units import parse_size
from upcycler.untrusted import shown_path

MAX_HBM_BUDGET = 1 << 50  # --hbm-budget: 1 PiB per device, far beyond any accelerator
FLAG_SECTIONS = {"": TrainConfig, "model": ModelSection, "distributed": DistributedConfig, "metrics": MetricsConfig}


def _flags() -> dict[str, str]:
    """{flag's parameter name: dotted config key} for every scalar option of the flagged sections."""
    out: dict[str, str] = {}
    for section, cls in FLAG_SECTIONS.items():
        for opt in options(cls):
            if opt.type in (bool, int, float, str, Path, Location):
                name = opt.name
                if name in out or name in ("config_path", "resume", "sets"):
                    raise ValueError(f"config option {name!r} would give two flags the same name")
                out[name] = f"{section}.{opt.key}" if section else opt.key
    return out


def config_options(fn: Callable) -> Callable:
    """A click option per flagged config option, None unless given."""
    keys = _flags()
    for section, cls in reversed(FLAG_SECTIONS.items()):
        for opt in reversed(options(cls)):
            if opt.name in keys:
                fn = click_option(replace(opt, help=f"{opt.help} ({keys[opt.name]})"), override=True)(fn)
    return fn


PREEMPTED_EXIT_STATUS = 75
"""The exit status of a run stopped by SIGTERM after saving (EX_TEMPFAIL: retry later), on every process,
so a scheduler can restart it (a JobSet/Kubernetes podFailurePolicy on exit code 75, Slurm's requeue)."""

@click.command("continued-pretrain")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=LOCAL_PATH,
    help="Training config (YAML); see upcycler.train.config for the schema.",
)
@click.option("--resume", "resume_mode", type=click.Choice(RESUME_MODES), default="auto", show_default=True,
              is_flag=False, flag_value="always",
              help="auto: continue from the newest checkpoint in run_dir if it holds one, else start (the same "
                   "command starts a run and restarts it after a preemption); always (a bare --resume): there "
                   "must be a checkpoint; never: run_dir must hold none.")
@config_options
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any config key, e.g. --set optimizer.lr=1e-4 (value parsed as YAML); repeatable.",
)
@click.option("--compile-only", is_flag=True,
              help="Compile the train step and report per-device memory, FLOPs, collectives and a roofline; "
                   "train nothing (needs only model.init's config.json, no data). Exit 1 if it does not fit.")
@click.option("--topology", metavar="SLICE",
              help="With --compile-only: compile for a TPU slice (v5e-256, v5p-128, v6e-256, v5e:16x16) "
                   "instead of the local devices; needs the [tpu] extra.")
@click.option("--slices", type=click.IntRange(1, 64), default=None,
              help="With --topology: that many slices joined by the data-center network (multislice); the "
                   "mesh's data axis spans them (a multiple of the slices; a one-slice mesh.data 1 becomes the "
                   "slice count), and the report splits ICI and DCN traffic.")
@click.option("--hbm-budget", metavar="SIZE", help="With --compile-only: the memory one device has (e.g. 16GiB), "
                                                   "instead of the chip's usable HBM.")
@click.option("--save-bandwidth", metavar="SIZE",
              help="With --compile-only: bytes per second one host writes to the run_dir's storage (e.g. 2GB), "
                   "for the checkpoint save's time bound (default 1GB).")
@click.option("--json", "as_json", is_flag=True, help="With --compile-only: print the report as one JSON line.")
@click.option("--plan", "plan_out", metavar="YAML", type=LOCAL_PATH,
              help="With --compile-only --topology: search remat policies, microbatches, expert dispatch and "
                   "attention for the best roofline bound that fits, print the ranked table, and write the "
                   "winning config to YAML (compiled figures are cached in ~/.cache/upcycler/plan).")
@click.option("--plan-margin", metavar="SIZE", default="1GiB", show_default=True,
              help="With --plan: HBM per chip the winner must leave free.")
@click.option("--plan-remat", metavar="P1,P2,...", help="With --plan: only these remat policies.")
@click.option("--plan-microbatches", metavar="N1,N2,...", help="With --plan: only these microbatch counts.")
@click.option("--plan-dispatch", metavar="D1,D2,...",
              help="With --plan: only these MoE dispatches (default gspmd,all_gather; all_to_all on request).")
@click.option("--plan-context", metavar="C1,C2,...",
              help="With --plan: only these context degrees (mesh.context; default 1,2,4,8,16 from the "
                   "config's up, the smallest that fits first).")
@click.option("--plan-exchange", metavar="E1,E2",
              help="With --plan: only these exchanges of a split sequence's keys and values under splash "
                   "(model.context_exchange; default gather,ring).")
def command(config_path: Path, resume_mode: str, sets: tuple[str, ...], compile_only: bool, topology: str | None,
            slices: int | None, hbm_budget: str | None, save_bandwidth: str | None, as_json: bool,
            plan_out: Path | None, plan_margin: str, plan_remat: str | None, plan_microbatches: str | None,
            plan_dispatch: str | None, plan_context: str | None, plan_exchange: str | None, **flags: Any) -> None:
    """Continue pretraining a dense or upcycled MoE checkpoint on prepared data; checkpoints go to run_dir."""
    keys = _flags()
    config = load_config(config_path, {keys[name]: value for name, value in flags.items()}, sets)
    if plan_out is not None:
        _plan_file(plan_out)  # before any input is fetched or compiled
    from upcycler.train.loop.remote_inputs import localized

    config = localized(config)  # gs:// model inputs: this host's copies
    if plan_out is not None:
        narrow = {"policies": listed(plan_remat, "--plan-remat", REMAT_POLICIES),
                  "microbatches": listed(plan_microbatches, "--plan-microbatches", None),
                  "dispatch": listed(plan_dispatch, "--plan-dispatch", MOE_DISPATCHES),
                  "contexts": listed(plan_context, "--plan-context", None),
                  "exchange": listed(plan_exchange, "--plan-exchange", CONTEXT_EXCHANGES)}
        _plan(config, compile_only, topology, plan_out, plan_margin, as_json,
              {k: v for k, v in narrow.items() if v is not None})
        return
    if compile_only or topology or hbm_budget or as_json or slices or save_bandwidth:
        if slices and not topology:
            raise UpcyclerError("--slices needs --topology (the slice to repeat), e.g. --topology v5e-256 --slices 2")
        _compile_only(config, compile_only, topology, hbm_budget, as_json, slices or 1, save_bandwidth)
        return
    from upcycler.train.loop.preflight import prepare, resumes
    from upcycler.train.loop.remote_inputs import check_buckets

    check_buckets(config)  # each bucket answers, before run_dir is read and JAX starts
    resume = resumes(config, resume_mode)
    checked = prepare(config, resume)
    from upcycler.train.loop.memory_check import StepTooLarge
    from upcycler.train.loop.trainer import train

    try:
        result = train(config, resume=resume, checked=checked)
    except StepTooLarge as err:  # the file the shape came from, then the figures and the fix
        raise UpcyclerError(f"{shown_path(config_path)}: {err}") from None
    how = "stopped by SIGTERM" if result.preempted else "finished"
    click.echo(f"{how} at step {result.step}; last checkpoint: {result.last_checkpoint}")
    if result.preempted:
        click.echo(f"preempted: exit status {PREEMPTED_EXIT_STATUS}; run the same command to continue", err=True)
        sys.exit(PREEMPTED_EXIT_STATUS)


def _plan(config: TrainConfig, compile_only: bool, topology: str | None, out: Path, margin: str,
          as_json: bool, narrow: dict[str, tuple]) -> None:
    """Print the plan's table (or JSON) and write the best configuration to `destination`; exit 1 when
    nothing fits. Everything the plan needs is checked before the first compile (`out`: `_plan_file`)."""
    if not compile_only or topology is None:
        raise UpcyclerError("--plan searches compiled configurations for a TPU slice: add --compile-only and "
                            "--topology (e.g. --topology v5e-256)")
    parse_slice(topology)
    margin_bytes = parse_size(margin, "--plan-margin", most=MAX_HBM_BUDGET)
    from upcycler.train.aot.plan import configured, plan
    from upcycler.train.loop.phases import at_longest

    found = plan(at_longest(config), topology, margin=margin_bytes, cache=Path.home() / ".cache" / "upcycler" / "plan",
                 log=lambda line: click.echo(line, err=True), **narrow)
    click.echo(found.to_json() if as_json else found.to_text())
    if found.best is None:
        sys.exit(1)
    import yaml

    partial = out.with_name(f".{out.name}.partial")  # no half-written config where the user looks
    partial.write_text(yaml.safe_dump(configured(config, found.best.choice).to_dict(), sort_keys=False))
    partial.replace(out)
    click.echo(f"wrote {out}: run it with upcycle continued-pretrain --config {out}", err=True)


def _plan_file(out: Path) -> None:
    """The local file `--plan` writes (a URL is refused by its type), refused in one line before any
    compile: a directory, or a file in a directory that does not exist or cannot be written."""
    destination, parent = str(out), out.parent
    fix = "name a YAML file in an existing directory, e.g. --plan best.yaml"
    if out.is_dir():
        raise UpcyclerError(f"--plan {destination}: a directory, not a file; {fix}")
    if not parent.is_dir():
        raise UpcyclerError(f"--plan {destination}: the directory {parent} does not exist"
                            f"; create it or {fix}")
    if not os.access(parent, os.W_OK):
        raise UpcyclerError(f"--plan {destination}: the directory {parent} is not writable"
                            f"; {fix}")


def _compile_only(config: TrainConfig, compile_only: bool, topology: str | None, hbm_budget: str | None,
                  as_json: bool, slices: int = 1, save_bandwidth: str | None = None) -> None:
    """Print the compile-only report; exit 1 when the step does not fit the device's memory."""
    if not compile_only:
        raise UpcyclerError("--topology, --slices, --hbm-budget, --save-bandwidth and --json belong to "
                            "--compile-only; add --compile-only")
    budget = parse_size(hbm_budget, "--hbm-budget", most=MAX_HBM_BUDGET) if hbm_budget is not None else None
    bandwidth = (parse_size(save_bandwidth, "--save-bandwidth", most=MAX_HBM_BUDGET)
                 if save_bandwidth is not None else None)
    if topology is not None:
        parse_slice(topology)  # a bad name fails here, before JAX starts
    from upcycler.train.aot.compile import compile_only as run

    report = run(config, topology=topology, hbm_budget=budget, slices=slices, save_bandwidth=bandwidth)
    click.echo(report.to_json() if as_json else report.to_text())
    if report.fits is False:
        sys.exit(1)
