"""Shared pytest fixtures, and one JAX compilation cache for the whole run.

The cache: JAX's persistent compilation cache in a directory made for this run (so no run depends on an
earlier one) and removed at its end, set in the environment before JAX is imported, so the test process,
its pytest-xdist workers and every `upcycle` subprocess they start share compiled programs. The process
that starts the run makes the directory; workers (`PYTEST_XDIST_WORKER`) inherit its path. Identical
programs give identical executables: it saves compile time and changes no result.

Bytecode: written, as Python does by default, even where the environment says not to
(PYTHONDONTWRITEBYTECODE), so the workers and the `upcycle` processes tests start compile the checkout's
modules once, not each on its own start (`__pycache__` is git-ignored).

Remote locations: the process that starts the run starts one loopback Cloud Storage emulator
(`gcs_emulator.py`) and points `STORAGE_EMULATOR_HOST` at it, and points `HF_ENDPOINT` at a closed
loopback port unless a test names its own Hub server, and W&B runs offline: no gs:// URL, no Hub id and
no W&B run of any test, forgotten or not, can reach the network.

Two tiers: the tests of `HEAVY_FILES` (the real model, vLLM, TPU compiles, multi-process pods) and every
`real_model` or `serving` test are marked `heavy`; `pytest -m "not heavy"` runs the rest, the developers'
loop, and the README's test command runs everything.

Fixtures: `tiny_dir` (tiny Hugging Face models per family, built once per argument set), `ws` (the
trainer's workspace: tokenizer, prepared data, tiny dense and MoE checkpoints, built once) and `cache`
(the run's compilation cache directory, for tests that name it).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
IS_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if IS_WORKER and os.environ.get("UPCYCLER_TEST_JAX_CACHE"):
    JAX_CACHE = Path(os.environ["UPCYCLER_TEST_JAX_CACHE"])  # the run's, made by the process that started it
else:
    JAX_CACHE = Path(tempfile.mkdtemp(prefix="upcycler-tests-jax-cache-"))
os.environ.update(UPCYCLER_TEST_JAX_CACHE=str(JAX_CACHE), JAX_COMPILATION_CACHE_DIR=str(JAX_CACHE),
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")



def _checkout_is_installed() -> str | None:
    """Why the `upcycler` this Python imports is not this checkout's (None when it is): the tests, their
    workers and every `upcycle` they start must run the code under test, not another install."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    for name, folder in (("upcycler", "upcycler"), ("upcycler.train", "train"), ("upcycler.transforms", "transforms")):
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            spec = None
        origin = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
        if origin != root / folder:
            found = f"from {origin}" if origin else "nowhere"
            return f"this Python ({sys.executable}) imports {name} {found}, not from this checkout ({root})"
    return None


if (_wrong := _checkout_is_installed()) is not None:  # one line, before any test is collected
    sys.stderr.write(f"error: {_wrong}: install the checkout first, as the README's test command does: "
                     "pip install torch==2.13.0 -e '.[test]'\n")
    raise SystemExit(4)

import gcs_emulator  # after the checkout is known to be the one installed

if not IS_WORKER:
    EMULATOR, os.environ["STORAGE_EMULATOR_HOST"] = gcs_emulator.start()
    os.environ["UPCYCLER_CACHE"] = tempfile.mkdtemp(prefix="upcycler-tests-cache-")  # bucket mirrors, staging
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens, refused at once
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")  # a run with the wandb writer never reaches W&B's servers

import trainer_fixtures  # after the cache is set: it imports JAX
from tiny_models import make_tiny

# The files that take longest (a real model's 8k prefills, multi-process training runs), started first:
# with `--dist loadfile --no-loadscope-reorder` (pyproject's addopts) the two workers take files in this
# order, so the longest ones run side by side from the start instead of one of them ending the run alone.
LONGEST_FIRST = ("test_long_prefill_real.py", "test_serving.py", "test_trainer_distributed.py", "test_real_model.py",
                 "test_guides.py", "test_memory_options.py", "test_bias_balancing.py", "test_expert_parallel.py",
                 "test_bucket_runs.py", "test_compile_only.py", "test_plan.py", "test_flexprefill_splash.py",
                 "test_training_guards.py", "test_notebooks.py",
                 "test_remote_locations.py", "test_launch_recipes.py", "test_observability.py", "test_lm_eval.py")


# The heavy tier (`heavy`): what `pytest -m "not heavy"`, the developers' loop, leaves to the whole suite (the
# README's test command, what CI runs). Every test of these files, and every `real_model` or `serving` test.
HEAVY_FILES = {
    "test_long_prefill_real.py": "the real 30-layer model's long prefills",
    "test_real_model.py": "the real 30-layer model",
    "test_serving.py": "vLLM serving the real model's outputs",
    "test_aot_collectives.py": "TPU compiles",
    "test_aot_hardware.py": "TPU compiles",
    "test_aot_hbm_traffic.py": "TPU compiles",
    "test_compile_only.py": "TPU compiles",
    "test_plan.py": "TPU compiles",
    "test_flexprefill_splash.py": "TPU compiles and interpreted kernels",
    "test_flexprefill_tpu.py": "interpreted TPU kernels",
    "test_flexprefill_gpu.py": "interpreted Triton kernels",
    "test_flexprefill_accuracy.py": "an fp64 reference attention, and the real model's selections",
    "test_gmm_megablox.py": "TPU compiles and interpreted kernels",
    "test_trainer_distributed.py": "multi-process pods",
    "test_bucket_runs.py": "multi-process pods in a bucket",
    "test_bias_balancing.py": "multi-process training runs",
    "test_expert_parallel.py": "sharded programs on 8 devices",
    "test_context_parallel.py": "sharded programs on 8 devices",
    "test_memory_options.py": "a train step compiled per memory option",
    "test_storage_faults.py": "every bucket command through a faulty proxy, training runs among them",
    "test_launch_recipes.py": "pod launch recipes run as processes",
    "test_notebooks.py": "notebooks executed end to end",
    "test_demo.py": "the demo end to end (surgery, data, a training run, a report)",
    "test_run_build.py": "a training run and two compiles of its step",
    "test_in_step_techniques.py": "training runs with techniques inside the step",
    "test_source_expert_usage.py": "training runs on 8 devices beside one, and resumed",
    "test_splash_attention.py": "interpreted TPU kernels in the train step",
    "test_lm_eval.py": "lm-evaluation-harness running the same model beside ours",
    "test_remote_locations.py": "every command against the bucket emulator and a Hub server",
}


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        if item.path.name in HEAVY_FILES or item.get_closest_marker("real_model") or item.get_closest_marker("serving"):
            item.add_marker(pytest.mark.heavy)


def pytest_sessionfinish(session, exitstatus) -> None:
    if not IS_WORKER:  # the workers' sessions end before the run's
        shutil.rmtree(JAX_CACHE, ignore_errors=True)
        gcs_emulator.stop(EMULATOR)
        shutil.rmtree(os.environ["UPCYCLER_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """`tiny_dir(family, **overrides)` -> path of a saved tiny model, built once per argument set."""
    cache: dict = {}

    def build(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny(family, tmp_path_factory.mktemp(family), **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def ws(tmp_path_factory) -> dict[str, Path]:
    """The trainer's workspace (`trainer_fixtures.workspace`), built once for the run."""
    return trainer_fixtures.workspace(tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="session")
def cache() -> Path:
    """The run's JAX compilation cache (set for this process and inherited by every subprocess)."""
    return JAX_CACHE
