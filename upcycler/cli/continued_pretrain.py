"""`upcycle continued-pretrain --config train.yaml`: train a checkpoint on, with flags overriding the file.

Besides `--config`, `--resume` and `--set KEY=VALUE` (any key), the flags are generated from the config's
own fields (`upcycler.train.config`), like the options of the transform commands: every option at the
top level and in the `model`, `distributed` and `metrics` sections is a flag named after it (`--steps`,
`--init`, `--gmm-backend`, `--peak-flops`, `--process-id`, …) with the field's type, choices and help.
A flag left out keeps the file's value.

The config and every file it names are checked (`upcycler.train.config.load_config`, then
`upcycler.train.preflight.prepare`) before the trainer, and with it JAX, is imported, so a bad config,
flag, checkpoint or data directory fails in about a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from upcycler.cli.transforms import click_option
from upcycler.schema import options
from upcycler.train.config import DistributedConfig, MetricsConfig, ModelSection, TrainConfig, load_config

FLAG_SECTIONS = {"": TrainConfig, "model": ModelSection, "distributed": DistributedConfig, "metrics": MetricsConfig}


def _flags() -> dict[str, str]:
    """{flag's parameter name: dotted config key} for every scalar option of the flagged sections."""
    out: dict[str, str] = {}
    for section, cls in FLAG_SECTIONS.items():
        for opt in options(cls):
            if opt.type in (bool, int, float, str, Path):
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


@click.command("continued-pretrain")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Training config (YAML); see upcycler.train.config for the schema.",
)
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in run_dir.")
@config_options
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any config key, e.g. --set optimizer.lr=1e-4 (value parsed as YAML); repeatable.",
)
def command(config_path: Path, resume: bool, sets: tuple[str, ...], **flags: Any) -> None:
    """Continue pretraining a dense or upcycled MoE checkpoint on prepared data; checkpoints go to run_dir."""
    keys = _flags()
    config = load_config(config_path, {keys[name]: value for name, value in flags.items()}, sets)
    from upcycler.train.preflight import prepare

    checked = prepare(config, resume)
    from upcycler.train.trainer import train

    result = train(config, resume=resume, checked=checked)
    how = "stopped by SIGTERM" if result.preempted else "finished"
    click.echo(f"{how} at step {result.step}; last checkpoint: {result.last_checkpoint}")
