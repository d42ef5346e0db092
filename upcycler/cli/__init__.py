"""The `upcycle` command line: a click group that collects one command per module of this package.

Each module in `upcycler/cli/` (other than this one) defines `command`, a `click.Command` (or
`commands`, a list of them, when the commands are generated); adding a command means adding a file.
Heavy imports (jax, torch) happen inside the commands, so `upcycle inspect` starts fast. Every command is
wrapped by `remote_locations.with_remote_locations`, so its `SOURCE`/`OUTPUT` paths may be remote.

Every `UpcyclerError` and every usage error (a bad option value, a missing argument) becomes one line
on stderr, `error: …`, with control characters escaped and the length bounded, and exit status 2, with
no traceback.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click

from upcycler.cli.remote_locations import with_remote_locations
from upcycler.errors import UpcyclerError
from upcycler.train.aot.topology import libtpu_defaults
from upcycler.untrusted import escape

_MAX_MESSAGE = 2000


def fail(message: str, status: int = 2) -> None:
    """Print `message` as the one `error:` line on stderr and exit with `status`."""
    line = escape(message)
    if len(line) > _MAX_MESSAGE:
        line = line[: _MAX_MESSAGE - 1] + "…"
    click.echo(f"error: {line}", err=True)
    sys.exit(status)


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
                    self.add_command(with_remote_locations(cmd))

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load()
        return sorted(self.commands)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        self._load()
        return self.commands.get(name)

    def main(self, *args, **kwargs):
        kwargs.pop("standalone_mode", None)
        libtpu_defaults()  # before any command starts JAX
        try:
            super().main(*args, standalone_mode=False, **kwargs)
            return
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.UsageError as err:
            where = f"; see `{err.ctx.command_path} --help`" if err.ctx is not None else ""
            fail(f"{err.format_message().rstrip('.')}{where}", err.exit_code)
        except click.ClickException as err:
            fail(err.format_message(), err.exit_code)
        except click.Abort:
            fail("aborted; no output was finished", 130)
        except UpcyclerError as err:
            fail(str(err))
        except KeyboardInterrupt:
            fail("interrupted; no output was finished", 130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="upcycler")
def main() -> None:
    """Checkpoint surgery and continued pretraining for LLMs: grow, sparsify, merge, train, publish."""
