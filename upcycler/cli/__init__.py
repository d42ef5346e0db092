"""The `upcycle` command line: a click group that collects one command per module of this package.

Each module in `upcycler/cli/` (other than this one) defines `command`, a `click.Command` (or
`commands`, a list of them, when the commands are generated); adding a command means adding a file.
Heavy imports (jax, torch) happen inside the commands, so `upcycle inspect` starts fast. Every command is
wrapped by `remote_locations.with_remote_locations`, so its `SOURCE`/`OUTPUT` paths may be remote.

Every `UpcyclerError` and every usage error (a bad option value, a missing argument) becomes one line
on stderr, `error: …`, with control characters escaped and the length bounded, and exit status 2, with
no traceback. Ctrl-C and SIGTERM (`termination`) clean up as an error does and end with one line too
(exit status 130 and 143).
"""

from __future__ import annotations

import errno
import importlib
import io
import os
import pkgutil
import sys
from pathlib import Path

import click

from upcycler.cli.remote_locations import with_remote_locations
from upcycler.cli.termination import (
    TERMINATED_EXIT_STATUS,
    Terminated,
    interrupt_line,
    terminating_like_interrupts,
)
from upcycler.errors import UpcyclerError
from upcycler.train.aot.topology import libtpu_defaults
from upcycler.untrusted import escape, shown_path

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
            with terminating_like_interrupts():
                super().main(*args, standalone_mode=False, **kwargs)
            return
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.UsageError as err:
            where = f"; see `{err.ctx.command_path} --help`" if err.ctx is not None else ""
            fail(f"{err.format_message().rstrip('.')}{where}", err.exit_code)
        except click.ClickException as err:
            fail(err.format_message(), err.exit_code)
        except click.Abort as err:  # click's form of KeyboardInterrupt (and of Terminated)
            if isinstance(err.__cause__, KeyboardInterrupt):
                _interrupted(err.__cause__)
            fail("aborted; no output was finished", 130)
        except UpcyclerError as err:
            fail(str(err))
        except KeyboardInterrupt as err:
            _interrupted(err)
        except OSError as err:  # what a command did not turn into its own words: a path, or stdout itself
            fail(_os_error_line(err))


def _interrupted(err: KeyboardInterrupt) -> None:
    """The one line and exit status of Ctrl-C (130) or SIGTERM (143)."""
    fail(interrupt_line(err), TERMINATED_EXIT_STATUS if isinstance(err, Terminated) else 130)


# what to do about an OSError the system raised, by errno
_OS_FIXES = {errno.ENAMETOOLONG: "pass a shorter path", errno.EACCES: "check its permissions",
             errno.EPERM: "check its permissions", errno.ENOSPC: "free some space or write elsewhere",
             errno.EROFS: "write to a writable file system", errno.ELOOP: "break the symlink loop"}


def _os_error_line(err: OSError) -> str:
    """One line for an OSError: the path it names and what to do, or for a write to stdout that failed (a
    full disk, /dev/full, a closed pipe) that stdout cannot take the result. Stdout is pointed at
    /dev/null first, so what it still buffers cannot fail again at exit."""
    fix = _OS_FIXES.get(err.errno, "check the path")
    if err.filename is not None:
        return f"{shown_path(Path(os.fsdecode(err.filename)))}: {err.strerror or err}; {fix}"
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
    return f"stdout: cannot write the result ({err.strerror or err}); redirect it to a file on a disk with room"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="upcycler")
def main() -> None:
    """Checkpoint surgery and continued pretraining for LLMs: grow, sparsify, merge, train, publish."""
