"""The `upcycle` command line: a click group that collects one command per module of this package.

Each module in `upcycler/cli/` (other than this one) defines `command`, a `click.Command` (or
`commands`, a list of them, when the commands are generated); adding a command means adding a file.
Heavy imports (jax, torch) happen inside the commands, so `upcycle inspect` starts fast. Every `UpcyclerError` becomes one line on stderr and exit status 2, with no traceback.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click

from upcycler.errors import UpcyclerError


class _Group(click.Group):
    """Discovers the commands lazily and turns user errors into one clean line."""

    def _load(self) -> None:
        if self.commands:
            return
        for info in pkgutil.iter_modules(__path__):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            for cmd in (getattr(module, "command", None), *getattr(module, "commands", ())):
                if isinstance(cmd, click.Command):
                    self.add_command(cmd)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load()
        return sorted(self.commands)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        self._load()
        return self.commands.get(name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UpcyclerError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("error: interrupted; no output was finished", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="upcycler")
def main() -> None:
    """Checkpoint surgery and continued pretraining for LLMs: grow, sparsify, merge, train, publish."""
