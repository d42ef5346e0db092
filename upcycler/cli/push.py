"""`upcycle push DIR REPO_ID`: check an output directory and publish it to the Hub with a model card.

The token comes from the usual places (`HF_TOKEN`, `hf auth login`); the endpoint from `--endpoint`
(default: the Hub, or `HF_ENDPOINT`). Progress goes to stderr, the commit URL to stdout.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("push")
@click.argument("directory", type=click.Path(path_type=Path))
@click.argument("repo_id")
@click.option(
    "--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility)."
)
@click.option("--revision", metavar="BRANCH", help="Branch to push to; created from main if missing.")
@click.option("--commit-message", metavar="MSG", help="Commit message (default names the directory).")
@click.option(
    "--endpoint", metavar="URL", help="Hub endpoint, e.g. a private Hub (default: HF_ENDPOINT or the Hub)."
)
def command(
    directory: Path,
    repo_id: str,
    private: bool,
    revision: str | None,
    commit_message: str | None,
    endpoint: str | None,
) -> None:
    """Verify DIR against its manifest and upload it to REPO_ID, adding a model card if it has no README.md."""
    from upcycler.hub import push

    url = push(
        directory,
        repo_id,
        private=private,
        revision=revision,
        commit_message=commit_message,
        endpoint=endpoint,
        echo=lambda line: click.echo(line, err=True),
    )
    click.echo(url)
