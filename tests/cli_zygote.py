"""`upcycle` commands in fresh processes forked from one that has already imported the tool.

A CLI test needs what a process gives: its own memory, pid, file descriptors, exit status and stderr, and
a clean interpreter exit (atexit handlers, flushed streams). It does not need Python and JAX imported
again, which is most of what a failing command costs. So each pytest process starts one zygote: a Python
process that imports `upcycler.cli` and the libraries the commands use (no JAX backend is started, no
thread beyond the main one exists), then forks a child per command. The child takes the command's
working directory, argv (as `python -m upcycler` sets it), stdin from /dev/null and stdout/stderr into
files, runs `upcycler.__main__` as `python -m` does, and leaves through the interpreter's normal exit with
the command's status; the zygote reports the child's pid and then its exit code.

The child takes the caller's environment as it is at the call. What the preloaded libraries read from the
environment when imported (`XLA_FLAGS`, JAX's and Hugging Face's options, `HOME`, temporary directories,
thread counts: `IMPORT_TIME_ENV`) cannot change after the fork, so a command whose environment differs
from the zygote's there runs as a plain subprocess instead (`Zygote.serves`). `python cli_zygote.py` is the zygote itself: requests and replies are JSON
lines on its stdin and stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE_ENV = dict(os.environ)  # the environment when the tests start (the zygote's: see `Zygote.serves`)
IMPORT_TIME_ENV = ("JAX_", "XLA_", "TPU_", "LIBTPU", "TF_", "HF_", "HUGGINGFACE_", "TOKENIZERS_", "TRANSFORMERS_",
                   "PYTHON", "OMP_", "MKL_", "OPENBLAS_", "GRAIN_", "TENSORSTORE_", "HOME", "TMP", "TEMP",
                   "XDG_", "LD_", "PATH")  # prefixes of variables the preloaded imports may have read
PRELOAD = ("upcycler.cli", "tqdm", "jax", "jax.numpy", "upcycler.train.loop.trainer",
           "upcycler.train.evaluation.evaluate", "orbax.checkpoint", "tensorstore", "tokenizers")


class Zygote:
    """The client end: one zygote process, started on first use, ended with this process."""

    def __init__(self) -> None:
        self.env = BASE_ENV
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, bufsize=0)  # unbuffered: select() sees every reply
        atexit.register(self.close)
        ready = self.proc.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError(f"the CLI zygote did not start: {ready!r}")

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command with environment `env` can be forked from this zygote."""
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return self.proc.poll() is None and not any(k.startswith(IMPORT_TIME_ENV) for k in changed)

    def run(self, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """`upcycle ARGS…` in a forked child with environment `env` (one this zygote `serves`): its exit
        status and its stdout/stderr as text."""
        with tempfile.TemporaryDirectory(prefix="upcycler-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": args, "cwd": os.getcwd(), "env": env, "stdout": str(out),
                       "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
            status = self._status(pid, timeout)
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if status is None:
            raise subprocess.TimeoutExpired(["upcycle", *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["upcycle", *args], status, stdout, stderr)

    def _status(self, pid: int, timeout: float) -> int | None:
        """The child's exit code (negative: killed by that signal), or None after killing it at `timeout`."""
        deadline = time.monotonic() + timeout
        while not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.kill(pid, signal.SIGKILL)
            self.proc.stdout.readline()
            return None
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


_ZYGOTE: list[Zygote] = []


def zygote() -> Zygote:
    """This process's zygote (started on the first call)."""
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote())
    return _ZYGOTE[0]


def _serve() -> None:
    """The zygote: import, then fork one child per request line until stdin closes."""
    requests, replies = os.fdopen(os.dup(0), "rb"), os.dup(1)
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 0)
    os.dup2(quiet, 1)  # nothing printed while importing can reach the replies
    import gc
    import importlib
    import pkgutil
    import runpy

    for name in PRELOAD:
        importlib.import_module(name)
    cli = sys.modules["upcycler.cli"]
    for info in pkgutil.iter_modules(cli.__path__):  # every command's module, as `upcycle --help` loads them
        importlib.import_module(f"upcycler.cli.{info.name}")
    gc.freeze()  # what the imports made is never collected: a child's exit does not touch (and copy) it
    os.write(replies, b"ready\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            os.close(replies)
            _become_the_command(request)
            runpy.run_module("upcycler", run_name="__main__", alter_sys=True)
            return  # the interpreter ends as `python -m upcycler` would: status 0, or SystemExit's
        os.write(replies, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _become_the_command(request: dict) -> None:
    """In the child: the command's working directory, environment, argv, sys.path and standard streams."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["upcycler", *request["argv"]]  # runpy puts upcycler/__main__.py's path first, as `-m` does
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)


if __name__ == "__main__":
    _serve()
