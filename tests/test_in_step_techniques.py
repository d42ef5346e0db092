"""The in-step half of the technique protocol, and the loop's action that finishes a run cleanly.

A z-loss ramp (`loss.z_coef_ramp`, one file plus its config key) hands the forward the z-loss weight of
each step as a traced value: the logged weight follows the ramp, the loss the step minimised is the
cross-entropy plus the router losses at that step's weights, and one program serves every step of it.
Bias balancing and the weights' average moved onto the same protocol; their own tests (and the step's
check against torch) hold them to their previous results. A technique that returns `FINISH` ends the run
saved and finished, not preempted.
"""

from __future__ import annotations

import pytest
import trainer_fixtures as F

from upcycler.train.config import TrainConfig
from upcycler.train.loop import trainer as trainer_lib
from upcycler.train.loop.trainer import train
from upcycler.train.techniques import in_step, protocol
from upcycler.train.techniques.z_loss_ramp import ZLossRamp


def test_a_z_loss_ramp_weighs_each_step_as_scheduled(ws, tmp_path):
    raw = F.config_dict(tmp_path, ws["moe"], ws["data"], steps=4,
                        **{"loss.z_coef": 0.5, "loss.z_coef_ramp": 3, "checkpoint.every": 4})
    result = train(TrainConfig.from_dict(raw))
    records = [r for r in F.metrics(tmp_path / "run") if "technique/z_coef" in r]
    weights = [r["technique/z_coef"] for r in records]
    assert weights == pytest.approx([0.5 * min(1, (s + 1) / 3) for s in range(4)], rel=1e-6)
    for r, z_coef in zip(records, weights):  # the loss the step minimised weighs the z-loss by that weight
        assert r["total_loss"] == pytest.approx(r["loss"] + 0.01 * r["lb_loss"] + z_coef * r["z_loss"], rel=1e-5)
    assert len(result.programs) == 1  # a traced value: the same program every step of the ramp


def test_the_log_keeps_what_a_technique_names_for_it():
    from upcycler.train.reporting.metrics import NUMBER_PREFIXES, TECHNIQUE_PREFIX

    assert in_step.METRIC_PREFIX == TECHNIQUE_PREFIX and TECHNIQUE_PREFIX in NUMBER_PREFIXES


def test_a_value_the_forward_does_not_read_is_refused():
    class Stray(in_step.StepTechnique):
        name = "stray"

        def values(self, step):
            return {"router_temperature": step}

    with pytest.raises(ValueError, match="router_temperature"):
        in_step.step_values([ZLossRamp(0.1, 2), Stray()], 0, ("z_coef",))
    with pytest.raises(ValueError, match="set by another technique"):
        in_step.step_values([ZLossRamp(0.1, 2), ZLossRamp(0.2, 2)], 0, ("z_coef",))


def test_a_technique_can_finish_a_run_cleanly(ws, tmp_path, monkeypatch):
    """A technique returning FINISH after step 2 of 6: the run ends there, step 2 saved, not preempted."""

    class FinishAtTwo(protocol.Technique):
        def after_write(self, ctx):
            return protocol.FINISH if ctx.step + 1 == 2 else None

    monkeypatch.setattr(trainer_lib, "FinitenessCheck", FinishAtTwo)
    raw = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=6, **{"checkpoint.every": 100})
    result = train(TrainConfig.from_dict(raw))
    assert (result.step, result.preempted) == (2, False)
    assert result.last_checkpoint is not None and result.last_checkpoint.name == "2"
    assert [r["step"] for r in F.metrics(tmp_path / "run") if "loss" in r][-1] == 1  # steps 0 and 1 ran
