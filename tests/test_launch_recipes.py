"""The launch recipes of `examples/launch/` (TPU VM pod, XPK, JobSet, Slurm) are runnable as written.

Each recipe's `upcycle` command line is extracted, must run `continued-pretrain --coordinator auto` on the
recipe's config, and is run here through `--compile-only` on that config (its model and batch shrunk to
the tiny test model; the bucket paths pointed at the run's emulator): the flags parse and the config is
valid. The JobSet manifest is parsed and its restart policy checked (exit status 75, the preemption
status, does not count as a failure; the set restarts); the Slurm script requeues on 75.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import gcs_emulator
import pytest
import trainer_fixtures as F
import yaml

LAUNCH = Path(__file__).parents[1] / "examples" / "launch"
RECIPES = ("tpu-vm.sh", "xpk.sh", "jobset.yaml", "slurm.sbatch")


def upcycle_command(recipe: str) -> list[str]:
    """The one `upcycle …` command line of `recipe`, as argv."""
    text = (LAUNCH / recipe).read_text()
    if recipe.endswith(".yaml"):
        (document,) = yaml.safe_load_all(text)
        pod = document["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        text = " ".join(pod["containers"][0]["args"])
    found = re.findall(r"upcycle [^\n\"&;]*", text)
    assert len(found) == 1, found
    return shlex.split(found[0])


def trainer_args(recipe: str) -> tuple[str, ...]:
    """The recipe's `continued-pretrain` arguments after `--config FILE`, checked on the way."""
    argv = upcycle_command(recipe)
    assert argv[:2] == ["upcycle", "continued-pretrain"] and argv[argv.index("--coordinator") + 1] == "auto"
    at = argv.index("--config")
    assert Path(argv[at + 1]).name in ("train.yaml", "train-pod.yaml")  # a copy of train-pod.yaml
    return tuple(argv[2:at] + argv[at + 2:])


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_runs_the_trainer_on_every_host_with_its_config(recipe):
    assert trainer_args(recipe) == ("--coordinator", "auto")


def test_the_recipes_command_compiles_on_their_config(ws):
    """Each distinct command line of the recipes, through `--compile-only` on train-pod.yaml."""
    bucket = gcs_emulator.unique_prefix("launch")
    shrink = {"run_dir": f"{bucket}/run", "model.init": str(ws["moe"]), "data.dir": f"{bucket}/data",
              "data.seq_len": 32, "data.global_batch_size": 8, "data.phases": "[{weights: {json: 1.0}}]",
              "loss.ce_chunk": 8, "model.compute_dtype": "float32", "model.weights_dtype": "float32"}
    sets = [item for key, value in shrink.items() for item in ("--set", f"{key}={value}")]
    for args in sorted({trainer_args(recipe) for recipe in RECIPES}):
        out = F.run_cli("continued-pretrain", "--config", LAUNCH / "train-pod.yaml", *args, *sets, "--compile-only",
                        "--json", timeout=600).stdout
        assert '"fits"' in out


def test_the_jobset_restarts_after_a_preemption_and_asks_for_the_whole_slice():
    (document,) = yaml.safe_load_all((LAUNCH / "jobset.yaml").read_text())
    assert document["kind"] == "JobSet" and document["spec"]["failurePolicy"]["maxRestarts"] > 0
    job = document["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [75]}} in rules
    pod = job["template"]["spec"]
    chips = job["parallelism"] * pod["containers"][0]["resources"]["limits"]["google.com/tpu"]
    x, y = map(int, pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"))
    assert job["parallelism"] == job["completions"] and chips == x * y == 256


def test_the_slurm_script_requeues_a_preempted_run():
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in text and re.search(r"#SBATCH --signal=TERM@\d+", text)
    assert re.search(r'if \[ "\$status" -eq 75 \]; then\s+scontrol requeue', text)
