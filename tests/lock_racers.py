"""Races between writers of one output (or one run_dir), run in processes of their own.

`race(action, rounds, writers, **args)` runs `python lock_racers.py`: that process forks `writers`
children per round, which wait on one pipe until all are forked and then run `action` at the same moment;
it returns, per round, each writer's outcome: `["ok", detail]` or `["refused", the error's one line]`.
Forking from a process of our own (no threads, no JAX backend started) keeps a round to milliseconds plus
what the action does, where starting interpreters would take seconds.

Actions (each writer `i` of a round):
- `staged`: `staging.staged_directory(out, overwrite=…)`, writing a manifest naming `i`, held `hold` s;
- `bucket`: `bucket_output.locked(url)`, `check_output`, `publish` of a one-file output naming `i`;
- `run_dir`: `run_dir.lock_run_dir` on `run_dir` (a local path or a gs:// URL), held `hold` s (a bucket
  lease lasting `lease` s: the loser watches it until it sees it renewed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def race(action: str, rounds: int, writers: int = 2, timeout: float = 300, **args) -> list[list[list[str]]]:
    """The outcomes of `rounds` races of `writers` processes doing `action` with `args` (see the docstring)."""
    request = json.dumps({"action": action, "rounds": rounds, "writers": writers, "args": args})
    done = subprocess.run([sys.executable, __file__, request], capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode != 0:
        raise AssertionError(f"the racers failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _staged(i: int, round_: int, out: str, overwrite: bool = False, hold: float = 0.2) -> str:
    from upcycler.io.staging import staged_directory

    target = Path(out.format(round=round_))
    with staged_directory(target, overwrite=overwrite) as tmp:
        (tmp / "upcycler.json").write_text(json.dumps({"writer": i}))
        time.sleep(hold)
    return str(i)


def _bucket(i: int, round_: int, url: str, overwrite: bool = False, hold: float = 0.2) -> str:
    from upcycler.io import bucket_output

    target = url.format(round=round_)
    with tempfile.TemporaryDirectory() as tmp, bucket_output.locked(target) as lock:
        bucket_output.check_output(target, overwrite=overwrite)
        (Path(tmp) / "weights.bin").write_bytes(str(i).encode() * 100)
        (Path(tmp) / "upcycler.json").write_text(json.dumps({"writer": i}))
        time.sleep(hold)
        bucket_output.check_output(target, overwrite=overwrite)
        bucket_output.publish(Path(tmp), target, lock=lock)
    return str(i)


def _run_dir(i: int, round_: int, run_dir: str, hold: float = 0.2, lease: float | None = None) -> str:
    from types import SimpleNamespace

    from upcycler.io import bucket_lease
    from upcycler.locations import location
    from upcycler.train.loop.run_dir import lock_run_dir

    if lease is not None:
        bucket_lease.LEASE_SECONDS = lease

    held = lock_run_dir(SimpleNamespace(run_dir=location(run_dir.format(round=round_), "run_dir")), resume=False)
    try:
        time.sleep(hold)
    finally:
        held.close()
    return str(i)


def _bucket_client() -> None:
    from upcycler.io import object_store

    object_store.filesystem()


def _jax_backend() -> None:
    import jax

    jax.process_index()


ACTIONS = {"staged": _staged, "bucket": _bucket, "run_dir": _run_dir}
WARM_UP = {"bucket": _bucket_client, "run_dir": _jax_backend}
"""What a writer does before the start, so that every writer starts the action itself at once."""


def _main(request: dict) -> None:
    import upcycler.io.bucket_output  # imported once, before forking
    import upcycler.io.staging
    import upcycler.train.loop.run_dir  # noqa: F401
    from upcycler.bucket_client import configure
    from upcycler.errors import UpcyclerError

    configure()  # the bucket clients' imports, once (no thread is started before the forks)

    action, results = ACTIONS[request["action"]], []
    for round_ in range(request["rounds"]):
        go_read, go_write = os.pipe()
        children = []
        for i in range(request["writers"]):
            answer_read, answer_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(go_write)
                WARM_UP.get(request["action"], lambda: None)()
                os.read(go_read, 1)  # returns when the parent closes its end: every writer at once
                try:
                    outcome = ["ok", action(i, round_, **request["args"])]
                except UpcyclerError as err:
                    outcome = ["refused", str(err)]
                except BaseException as err:  # noqa: BLE001  (reported, not raised: the round is the result)
                    outcome = ["crashed", f"{type(err).__name__}: {err}"]
                os.write(answer_write, json.dumps(outcome).encode())
                os._exit(0)
            os.close(answer_write)
            children.append((pid, answer_read))
        os.close(go_read)
        os.close(go_write)
        outcomes = []
        for pid, answer_read in children:
            with os.fdopen(answer_read, "rb") as answer:
                outcomes.append(json.loads(answer.read() or b'["crashed", "no answer"]'))
            os.waitpid(pid, 0)
        results.append(outcomes)
    print(json.dumps(results))


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
