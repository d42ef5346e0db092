"""The run directory at start-up: created, its config written, and proven to be one directory for all.

Every process of a multi-host run writes its own shards of each checkpoint under run_dir, and the
primary process writes the rest (manifest, metrics, exports). That only makes one checkpoint when every
process sees the same directory: a run_dir on each host's own disk (a relative path, a local `/tmp`)
would scatter each checkpoint across disks that vanish with the VMs, and a restart would find a
different state on each host. So before anything is saved, process 0 writes a random token into run_dir
and every process reads it back there; if any process cannot, every process stops with the same line
naming the processes that cannot see it.

What this module preserves: a run_dir that every process sees is left as it was, plus `config.yaml`.
"""

from __future__ import annotations

import secrets

import jax
import numpy as np
import yaml

from upcycler.errors import UpcyclerError
from upcycler.train.config import TrainConfig
from upcycler.untrusted import shown_path

TOKEN_FILE = ".shared-run-dir-check"


def make_run_dir(config: TrainConfig) -> None:
    """Create RUN_DIR; the primary process writes RUN_DIR/config.yaml (the config the run uses); with
    several processes, refuse a run_dir that they do not all share."""
    try:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (config.run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    except OSError as err:
        raise UpcyclerError(
            f"{shown_path(config.run_dir)}: cannot write the run directory ({err.strerror}); "
            "choose a writable run_dir"
        ) from None
    if jax.process_count() > 1:
        refuse_unshared(config)


def refuse_unshared(config: TrainConfig) -> None:
    """Raise on every process unless every process reads process 0's token in run_dir (collective)."""
    from jax.experimental import multihost_utils

    path = config.run_dir / TOKEN_FILE
    token = np.frombuffer(secrets.token_bytes(16), np.uint8) if jax.process_index() == 0 else np.zeros(16, np.uint8)
    token = np.asarray(multihost_utils.broadcast_one_to_all(token))
    if jax.process_index() == 0:
        path.write_bytes(token.tobytes())
    multihost_utils.sync_global_devices("upcycler: run_dir token written")
    try:
        seen = path.read_bytes() == token.tobytes()
    except OSError:
        seen = False
    every = np.asarray(multihost_utils.process_allgather(np.asarray(seen))).reshape(-1)
    multihost_utils.sync_global_devices("upcycler: run_dir token read")
    if jax.process_index() == 0:
        path.unlink()
    blind = [str(i) for i, ok in enumerate(every) if not ok]
    if blind:
        raise UpcyclerError(
            f"{shown_path(config.run_dir)}: run_dir is not shared by the run's {len(every)} processes: "
            f"process{'es' if len(blind) > 1 else ''} {', '.join(blind)} cannot see what process 0 wrote "
            "there (each host's own disk?); put run_dir on a filesystem every host mounts at the same path")
