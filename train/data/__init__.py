"""Training data: sources tokenised once into sharded token files, then blended by phase into deterministic batches.

The face of the package: `DataConfig`/`Phase` (the `data:` section of a training config),
`prepare_sources`/`parse_sources`/`load_tokenizer` (what `upcycle prepare-data` runs) and
`make_data_iterator`/`DataIterator` (what the trainer reads). Inside, one module per step:

    readers.py      documents out of text, JSONL, Parquet, Arrow (HF datasets), ArrayRecord and Megatron
                    files, plain, gzip or zstd: the face (formats, file patterns, dispatch) over
      text_readers.py      plain text and JSON Lines (lines, byte ranges, paragraphs)
      columnar_readers.py  Parquet, Arrow and the `Dataset.save_to_disk` directory
      record_readers.py    ArrayRecord and Megatron indexed datasets
      decompression.py     gzip/zstd decompressed on the fly, with the compression-bomb guard
      source_files.py      what the readers share: `Document`, opening and mapping a source file
    tokenizer.py    the tokenizer file, its EOS id and its sha256
    format.py       the prepared-data layout on disk (shared by writer and reader)
    plan.py         the writer's units of work (one shard each) and their checkpoint steps, by size alone
    shard_writer.py one unit: documents -> tokens -> `NAME.shards/NNNNN.tokens`, resumable step by step
    engine.py       the units on Apache Beam (its DirectRunner by default; any runner by option)
    prepare.py      the writer: plan, run, then shards and `NAME.index.json` (last) into OUT
    resume.py       what an interrupted preparation left: units reused or why redone, the publish journal
    token_store.py  a source's token stream across its shards, local or gs://, bounded open files
    sources.py      the reader: one prepared source as an endless, reshuffled stream of examples
    mix.py        the blend of sources, phase by phase, into global batches
    config.py     the `data:` schema

`DataConfig` and `Phase` are imported at once (the config is checked before JAX is loaded); the rest is
imported on first use, because the iterator brings in Grain and with it JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

from upcycler.train.data.config import DataConfig, Phase

_LAZY = {
    "DataIterator": "mix",
    "make_data_iterator": "mix",
    "parse_sources": "prepare",
    "prepare_sources": "prepare",
    "load_tokenizer": "tokenizer",
    "open_source": "sources",
}

__all__ = ["DataConfig", "DataIterator", "Phase", "load_tokenizer", "make_data_iterator", "open_source",
           "parse_sources", "prepare_sources"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
