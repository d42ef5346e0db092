"""A run's model inputs in a bucket: `model.init` and `model.tokenizer` given as gs:// URLs.

(A gs:// `data.dir` is not copied: its shards are read in place by ranged reads, `data/token_store.py`.)
Each process mirrors the model inputs into its own host's upcycler cache (`upcycler.io.remote_sources.mirror`: object
by object, fetched again only when changed) before anything reads them, so hosts that share nothing but
the bucket each read a local copy; the run's `config.yaml` and the checkpoints' lineage still name the
bucket URLs. The run directory is checked against them first: it may not be, contain or lie inside one.

Before a run reads anything else, `check_buckets` sends one listing request to each bucket the config
names (the run directory's included), so a bucket that does not answer, does not exist or refuses the
credentials is refused in one line naming the config key, within the client's retry deadline
(`upcycler.bucket_client.RetryPolicy`), before JAX starts.

What this module preserves: a config whose inputs are local is returned unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePath
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io import object_store as store
from upcycler.io.remote_sources import mirror
from upcycler.locations import bucket_and_key, is_remote, remember_origin
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


def bucket_locations(config: Any, prefix: str = "") -> dict[str, str]:
    """Every gs:// location of the config dataclass `config`, by its dotted key (`run_dir`, `data.dir`, …)."""
    found = {}
    for item in dataclasses.fields(config):
        value, key = getattr(config, item.name), f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            found.update(bucket_locations(value, f"{key}."))
        elif isinstance(value, PurePath) and is_remote(value):
            found[key] = str(value)
    return found


def check_buckets(config: TrainConfig) -> None:
    """One listing request per bucket that `config` names (`object_store.probe`); the first that does not
    answer, does not exist or refuses the listing is refused in one line naming its key. Changes nothing."""
    probed = set()
    for key, url in bucket_locations(config).items():
        bucket = bucket_and_key(url, key)[0]
        if bucket not in probed:
            probed.add(bucket)
            try:
                store.probe(url)
            except UpcyclerError as err:
                raise UpcyclerError(f"{key}: {err}") from None
