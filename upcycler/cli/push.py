"""`upcycle push DIR REPO_ID`: check an output directory and publish it to the Hub with a model card.

The token comes from the usual places (`HF_TOKEN`, `hf auth login`); the endpoint from `--endpoint`
(default: `HF_ENDPOINT`, else the Hub). The commit URL goes to stdout. Progress (ours and the Hub
client's) goes to stderr only on a terminal, so a failure in a log is exactly one `error:` line.

Only regular files inside DIR are uploaded: a symlink leaving DIR, a dangling symlink, a symlinked
subdirectory, a pipe, device or socket is refused, naming the entry, before any request is made (copy the
file into DIR instead). A symlink to a file inside DIR uploads that file's bytes; hidden entries are
skipped (see `upcycler.hub`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from upcycler.cli.path_type import SOURCE


@click.command("push")
@click.argument("directory", metavar="DIR", type=SOURCE)
@click.argument("repo_id")
@click.option(
    "--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility)."
)
@click.option("--revision", metavar="BRANCH", help="Branch to push to; created from main if missing.")
@click.option("--commit-message", metavar="MSG", help="Commit message (default names the directory).")
@click.option("--endpoint", metavar="URL", help="Hub endpoint (default: HF_ENDPOINT, else the Hub).")
def command(
    directory: Path,
    repo_id: str,
    private: bool,
    revision: str | None,
    commit_message: str | None,
    endpoint: str | None,
) -> None:
    """Verify DIR against its manifest and upload it to REPO_ID, with a model card if DIR has no README.md.

    Only regular files inside DIR are uploaded; symlinks that leave DIR are refused.
    """
    from huggingface_hub.utils import disable_progress_bars, logging

    from upcycler.hub import push

    interactive = sys.stderr.isatty()
    if not interactive:
        disable_progress_bars()
        logging.set_verbosity_error()
    url = push(
        directory,
        repo_id,
        private=private,
        revision=revision,
        commit_message=commit_message,
        endpoint=endpoint,
        echo=(lambda line: click.echo(line, err=True)) if interactive else None,
    )
    click.echo(url)
