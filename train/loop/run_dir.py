"""The run directory at start-up: created, its config written, and proven to be one directory for all.

Every process of a multi-host run writes its own shards of each checkpoint under run_dir, and the
primary process writes the rest (manifest, metrics, exports). That only makes one checkpoint when every
process sees the same directory: a run_dir on each host's own disk (a relative path, a local `/tmp`)
would scatter each checkpoint across disks that vanish with the VMs, and a restart would find a
different state on each host. So before anything is saved, process 0 writes a random token into run_dir
and every process reads it back there; if any process cannot, every process stops with the same line
naming the processes that cannot see it.

One run at a time per run_dir: before anything is written there, process 0 takes run_dir's lock
(`RUN_DIR/.upcycler-lock`: a file lock on a disk, a lease object in a bucket; `upcycler.io.write_lock`) and
holds it until the run's last checkpoint is saved. A second run on the same run_dir is refused on every
process, naming the first (host, pid, since when), so two runs never interleave their metrics or
checkpoints. The lock of a killed run is taken over by its restart: on a disk at once; in a bucket at once
on the same machine, else once its lease expires (the restart waits for that, one lease at most). A run that found no checkpoint when it started and finds one once it holds the lock (a run
that ended meanwhile wrote it) is refused as if it had seen it.

What this module preserves: a run_dir that every process sees is left as it was, plus `config.yaml`.
"""

from __future__ import annotations

import secrets
from contextlib import ExitStack

import jax
import numpy as np
import yaml

from upcycler.errors import UpcyclerError
from upcycler.io.write_lock import RUN_DIR_LOCK, locked
from upcycler.locations import is_remote
from upcycler.train.config import TrainConfig
from upcycler.train.loop.preflight import committed_steps
from upcycler.untrusted import shown_path

TOKEN_FILE = ".shared-run-dir-check"


def lock_run_dir(config: TrainConfig, *, resume: bool) -> ExitStack:
    """Create RUN_DIR and take its lock on process 0 (collective with several processes); returns what
    releases it (`close()`, once the run's checkpoints are saved). Refused on every process while another
    run holds it, or when this run (`resume` False) would now start over checkpoints that appeared."""
    held, refused = ExitStack(), None
    if jax.process_index() == 0:
        try:
            if not is_remote(config.run_dir):
                config.run_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(locked(config.run_dir / RUN_DIR_LOCK if not is_remote(config.run_dir)
                                      else f"{str(config.run_dir).rstrip('/')}/{RUN_DIR_LOCK}",
                                      f"{shown_path(config.run_dir)}: in use by another run",
                                      "wait for it to end or use another run_dir", wait_for_expiry=True))
            if not resume and committed_steps(config.run_dir):
                raise UpcyclerError(f"{shown_path(config.run_dir)}: holds checkpoints of an earlier run (written "
                                    "after this run started); continue it (--resume auto, the default) or use a "
                                    "new run_dir")
        except OSError as err:
            held.close()
            refused = UpcyclerError(f"{shown_path(config.run_dir)}: cannot write the run directory "
                                    f"({err.strerror}); choose a writable run_dir")
        except UpcyclerError as err:
            held.close()
            refused = err
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = bool(multihost_utils.broadcast_one_to_all(np.asarray(refused is None)))
        if not ok and refused is None:
            refused = UpcyclerError(f"{shown_path(config.run_dir)}: refused to process 0 (in use by another run, "
                                    "or not writable: process 0 says which); wait for it to end or use another "
                                    "run_dir")
    if refused is not None:
        raise refused
    return held


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
