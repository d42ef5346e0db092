"""`upcycle prepare-data`: tokenise text sources once, with the checkpoint's tokenizer, into sharded token files.

Inputs must be regular files (a FIFO or device is refused, never read); a bad JSONL line stops the run
naming the file and line; a compressed file that expands more than `--max-expansion` times (100: real
text stays under ~20) is refused as a compression bomb within its first few MiB. The work runs on Apache
Beam (the DirectRunner by default; `--workers N` processes, or another runner with `--runner` /
`--beam-option`, both checked before anything is written). A line before the work says how much disk the
output needs. Output appears in --out only when every source is complete; a failed run leaves --out as
it was (see `upcycler.train.data.prepare`). The same command run again after an interruption (even one
while publishing) finishes what was started, keeping finished shards and the checkpoints of shards under
way, and its summary says why each shard it tokenised was not reused. Sources may be gs:// globs (each
object is fetched into the upcycler cache) and --out a gs:// directory (prepared in the upcycler cache,
then uploaded, each source's index last).

`--heldout FRACTION` also writes each source NAME's held-out split as the source `NAME.heldout`, chosen
by a hash of each document's tokens (see `upcycler.train.data.format`); a source too small to give both
sides a document is refused, naming the source and a fraction that would do.
"""

from __future__ import annotations

from pathlib import Path

import click

from upcycler.cli.path_type import BUCKET_OR_LOCAL, LOCAL_PATH
from upcycler.cli.termination import kept_for_rerun
from upcycler.train.data.engine import DEFAULT_RUNNER
from upcycler.train.data.readers import FORMATS, MAX_EXPANSION, TEXT_UNITS
from upcycler.untrusted import real, shown_path


@click.command("prepare-data")
@click.option(
    "--tokenizer",
    "tokenizer_path",
    required=True,
    type=LOCAL_PATH,
    help="tokenizer.json, or the model directory holding it.",
)
@click.option(
    "--source",
    "sources",
    required=True,
    multiple=True,
    metavar="NAME=GLOB_OR_FILE",
    help="A named source and its files; repeat for more sources or more files of one source.",
)
@click.option(
    "--out", "out_dir", required=True, type=BUCKET_OR_LOCAL,
    help="Directory to write to (a local path or gs://bucket/path).",
)
@click.option(
    "--format", "fmt", type=click.Choice(FORMATS), default=None, help="Input format [default: by extension]."
)
@click.option(
    "--text-field", default="text", show_default=True, help="The text field of JSONL / Parquet records."
)
@click.option(
    "--text-unit",
    type=click.Choice(TEXT_UNITS),
    default="file",
    show_default=True,
    help="What one document of a plain text file is.",
)
@click.option(
    "--eos", default=None, help="EOS token or id [default: from the tokenizer's configs / special tokens]."
)
@click.option("--overwrite", is_flag=True,
              help="Replace sources already prepared in --out, with all they wrote (a held-out split too).")
@click.option("--workers", type=click.IntRange(1, 4096), default=1, show_default=True,
              help="Worker processes of the local runner (the output is the same for any number).")
@click.option("--runner", default=DEFAULT_RUNNER, show_default=True,
              help="The Apache Beam runner (e.g. DataflowRunner, FlinkRunner, SparkRunner).")
@click.option("--beam-option", "beam_options", multiple=True, metavar="KEY=VALUE",
              help="A Beam pipeline option for the runner (repeat), e.g. project=my-project.")
@click.option("--shard-size", default="64MiB", show_default=True,
              help="Input bytes per shard: the unit of work and of resume.")
@click.option("--heldout", "heldout_fraction", type=float, default=0.0, show_default=True, metavar="FRACTION",
              help="Hold out this fraction (0 <= FRACTION < 1) of each source's documents, picked by a hash of "
                   "each document's tokens, as the source NAME.heldout for evaluation; NAME keeps the rest. A "
                   "source that would leave either side without a document is refused. 0: no split.")
@click.option("--max-expansion", "max_expansion", default=str(int(MAX_EXPANSION)), show_default=True,
              metavar="RATIO",
              help="Refuse a .gz/.zst input that decompresses to more than RATIO times the compressed bytes read "
                   "(a compression bomb; real text stays under ~20). Raise it for a file you trust.")
def command(
    tokenizer_path: Path,
    sources: tuple[str, ...],
    out_dir: Path | str,
    fmt: str | None,
    text_field: str,
    text_unit: str,
    eos: str | None,
    overwrite: bool,
    workers: int,
    runner: str,
    beam_options: tuple[str, ...],
    shard_size: str,
    heldout_fraction: float,
    max_expansion: str,
) -> None:
    """Tokenise sources into OUT/NAME.shards/ + OUT/NAME.index.json, each document followed by EOS
    (with --heldout, also OUT/NAME.heldout.shards/ + OUT/NAME.heldout.index.json).

    A malformed JSONL line is an error naming the file and line (nothing is skipped silently), and
    nothing is written to OUT unless every source is prepared. Rerun the same command after an
    interruption: finished shards, and the checkpoints of those under way, are kept.
    """
    from upcycler.train.data.plan import check_heldout_fraction
    from upcycler.train.data.prepare import parse_sources, prepare_into_bucket, prepare_sources
    from upcycler.train.data.tokenizer import load_tokenizer
    from upcycler.units import parse_size

    unit_bytes = parse_size(shard_size, "--shard-size")
    check_heldout_fraction(heldout_fraction)  # before any input is fetched or read
    expansion = _expansion(max_expansion)
    tokenizer = load_tokenizer(tokenizer_path, eos)
    files = parse_sources(sources)
    options = {"fmt": fmt, "text_field": text_field, "text_unit": text_unit, "overwrite": overwrite,
               "runner": runner, "workers": workers, "beam_options": beam_options, "unit_bytes": unit_bytes,
               "eos": eos, "heldout_fraction": heldout_fraction, "max_expansion": expansion,
               "announce": click.echo}
    with kept_for_rerun("the finished shards are kept: rerun the same command to resume"):
        if isinstance(out_dir, str):
            indexes = prepare_into_bucket(tokenizer, files, out_dir, **options)
        else:
            indexes = prepare_sources(tokenizer, files, out_dir, **options)
    for index in indexes:
        written = f"{out_dir}/{index['name']}.shards/"
        click.echo(
            f"{index['name']}: {index['num_documents']} documents, {index['num_tokens']} tokens "
            f"({index['dtype']}) from {len(index['files'])} files in {len(index['shards'])} shards "
            f"({index['shards_tokenised']} tokenised, {index['shards_reused']} reused) -> {shown_path(written)}"
        )
        if index["shards_redone"] and index.get("split") != "heldout":
            click.echo(f"{index['name']}: resumed; tokenised {', '.join(index['shards_redone'])}")


def _expansion(text: str) -> float:
    """--max-expansion as a ratio of at least 1 (one line naming the option otherwise)."""
    try:
        value: object = float(text)
    except ValueError:
        value = text
    return real(value, "the ratio", "--max-expansion", low=1,
                fix="pass a ratio such as 100 (or more for a file you trust)")
