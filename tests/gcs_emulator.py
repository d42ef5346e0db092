"""A loopback Cloud Storage for the tests: `gcp-storage-emulator`, in memory, on a free port of 127.0.0.1.

The process that starts the test run starts one emulator and sets `STORAGE_EMULATOR_HOST` (the standard
variable of Google's clients) before any worker or `upcycle` subprocess starts, so every gs:// URL of
every test reaches it and nothing reaches a real bucket. Tests share it: each writes under its own
prefix (`unique_prefix`). It is stopped by its pid when the run ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

BUCKET = "upcycler-tests"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start() -> tuple[subprocess.Popen, str]:
    """Start the emulator with the bucket `BUCKET`; returns the process and its URL, once it answers."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
         "--in-memory", "--default-bucket", BUCKET],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the storage emulator exited at start")
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the storage emulator did not start within 60 s")


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


def unique_prefix(name: str) -> str:
    """A gs:// prefix no other test uses."""
    return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def is_running() -> bool:
    return bool(os.environ.get("STORAGE_EMULATOR_HOST"))
