"""Run the `upcycle` CLI the way a user does (a process of its own) and check the error contract."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from cli_zygote import zygote


def run_cli(*args: Any, env: dict[str, str] | None = None, check: bool = True,
            timeout: int = 600) -> subprocess.CompletedProcess:
    """`upcycle ARGS…` in a process of its own, with `env` added to this process's environment: forked from
    this process's `cli_zygote` where it can be (`Zygote.serves`), else `python -m upcycler`; with
    `check`, fail the test on a non-zero exit."""
    argv, full_env = list(map(str, args)), {**os.environ, **(env or {})}
    if (cli := zygote()).serves(full_env):
        proc = cli.run(argv, full_env, timeout)
    else:
        proc = subprocess.run([sys.executable, "-m", "upcycler", *argv], capture_output=True, text=True,
                              timeout=timeout, env=full_env, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"upcycle {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


_RSS_SCRIPT = """
import sys
from upcycler.cli import main
main.main(sys.argv[1:], standalone_mode=False)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_rss(*args: str | Path) -> int:
    """Peak resident bytes of `upcycle ARGS…` in a process of its own (VmHWM, read by that process: the
    child's `ru_maxrss` would include the parent's memory it was forked from)."""
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, *map(str, args)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1]) * 1024


def assert_clean_failure(proc: subprocess.CompletedProcess, *, mentions: str) -> str:
    """Non-zero exit, exactly one `error:` line on stderr that mentions `mentions`, no traceback."""
    assert proc.returncode != 0, f"expected failure, got success:\n{proc.stdout}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert mentions in lines[0], f"{mentions!r} not in {lines[0]!r}"
    return lines[0]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` with its bytes (to prove an input was left untouched)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def leftovers(parent: Path, name: str) -> list[str]:
    """Entries in `parent` that look like an output named `name` or its temporary directory."""
    return [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


def prepare_demo_corpus(tokenizer: Path, out: Path) -> Path:
    """`upcycle prepare-data` of the bundled demo corpus with `tokenizer` (tokenizer.json) into `out`: every
    source NAME with its held-out split as NAME.heldout (the demo's own layout)."""
    from upcycler.cli.demo import DEMO_SOURCES, demo_assets

    corpus = demo_assets() / "corpus"
    run_cli("prepare-data", "--tokenizer", tokenizer, "--out", out,
            *[a for name in DEMO_SOURCES for split, source in (("train", name), ("heldout", f"{name}.heldout"))
              for a in ("--source", f"{source}={corpus / f'{name}.{split}.jsonl'}")])
    return out
