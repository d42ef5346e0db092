"""`upcycle prepare-data`: tokenise text sources once, with the checkpoint's tokenizer, for training.

Inputs must be regular files (a FIFO or device is refused, never read); a bad JSONL line stops the run
naming the file and line. Output appears in --out only when every source is complete; a failed run
leaves --out as it was (see `upcycler.train.data.prepare`). Sources may be gs:// globs (each object is
fetched into the upcycler cache) and --out a gs:// directory (prepared locally, then uploaded, each
source's metadata last).
"""

from __future__ import annotations

from pathlib import Path

import click

from upcycler.cli.path_type import BUCKET_OR_LOCAL, LOCAL_PATH
from upcycler.train.data.readers import FORMATS, TEXT_UNITS
from upcycler.untrusted import shown_path


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
@click.option("--overwrite", is_flag=True, help="Replace sources already prepared in --out.")
def command(
    tokenizer_path: Path,
    sources: tuple[str, ...],
    out_dir: Path | str,
    fmt: str | None,
    text_field: str,
    text_unit: str,
    eos: str | None,
    overwrite: bool,
) -> None:
    """Tokenise sources into OUT/NAME.tokens.npy + OUT/NAME.meta.json, each document followed by EOS.

    A malformed JSONL line is an error naming the file and line (nothing is skipped silently), and
    nothing is written to OUT unless every source is prepared.
    """
    from upcycler.train.data.prepare import parse_sources, prepare_sources
    from upcycler.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path, eos)
    files = parse_sources(sources)
    options = {"fmt": fmt, "text_field": text_field, "text_unit": text_unit}
    if isinstance(out_dir, str):  # a bucket: prepared in a local staging directory, then uploaded
        metas = _prepare_into_bucket(tokenizer, files, out_dir, overwrite, options)
    else:
        metas = prepare_sources(tokenizer, files, out_dir, overwrite=overwrite, **options)
    for meta in metas:
        written = f"{out_dir}/{meta['tokens_file']}"
        click.echo(
            f"{meta['name']}: {meta['num_documents']} documents, {meta['num_tokens']} tokens "
            f"({meta['dtype']}) from {len(meta['files'])} files -> {shown_path(written)}"
        )


def _prepare_into_bucket(tokenizer, files, out: str, overwrite: bool, options: dict) -> list[dict]:
    """Prepare the sources into a local staging directory, then add them to the bucket directory `out`,
    each source's metadata after its token file (`upcycler.io.bucket_output.add_files`)."""
    import shutil
    import tempfile

    from upcycler.io import bucket_output
    from upcycler.io.remote_sources import cache_root
    from upcycler.train.data.format import META_SUFFIX, TOKENS_SUFFIX
    from upcycler.train.data.prepare import prepare_sources

    names = [f"{name}{suffix}" for name in files for suffix in (TOKENS_SUFFIX, META_SUFFIX)]
    bucket_output.refuse_existing(out, names, overwrite=overwrite)
    (cache_root() / "staging").mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix="prepared-", dir=cache_root() / "staging"))
    try:
        metas = prepare_sources(tokenizer, files, stage / "out", **options)
        bucket_output.add_files(stage / "out", out, is_marker=lambda n: n.endswith(META_SUFFIX))
        return metas
    finally:
        shutil.rmtree(stage, ignore_errors=True)
