"""A run's model inputs in a bucket: `model.init` and `model.tokenizer` given as gs:// URLs.

(A gs:// `data.dir` is not copied: its shards are read in place by ranged reads, `data/token_store.py`.)
Each process mirrors the model inputs into its own host's upcycler cache (`upcycler.io.remote_sources.mirror`: object
by object, fetched again only when changed) before anything reads them, so hosts that share nothing but
the bucket each read a local copy; the run's `config.yaml` and the checkpoints' lineage still name the
bucket URLs. The run directory is checked against them first: it may not be, contain or lie inside one.

What this module preserves: a config whose inputs are local is returned unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from upcycler.io.remote_sources import mirror
from upcycler.locations import is_remote, remember_origin
from upcycler.train.config import TrainConfig
from upcycler.train.loop.preflight import refuse_overlap


def localized(config: TrainConfig) -> TrainConfig:
    """`config` with its gs:// model inputs replaced by this host's up-to-date local copies; a gs://
    `data.dir` is only checked not to overlap the run directory (it is read in place)."""
    if is_remote(config.data.dir):
        refuse_overlap(config.run_dir, config.data.dir, "data.dir")
    inputs = {"model.init": config.model.init, "model.tokenizer": config.model.tokenizer}
    remote = {key: value for key, value in inputs.items() if value is not None and is_remote(value)}
    if not remote:
        return config
    for key, value in remote.items():
        refuse_overlap(config.run_dir, value, key)
    local = {key: _local_copy(str(value)) for key, value in remote.items()}
    model = dataclasses.replace(config.model, **{k.split(".")[1]: v for k, v in local.items()})
    return dataclasses.replace(config, model=model)


def _local_copy(url: str) -> Path:
    path = mirror(url)
    remember_origin(path, url)
    return path
