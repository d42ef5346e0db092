"""One builder of the run (`upcycler.train.loop.run_build`): training and compile-only compile one program.

The trainer runs two steps of the tiny dense model and names the program it compiled by its optimised HLO
(`RunResult.programs`); `--compile-only` of the same config, through the same builder, names the same
program. A config that changes the step (another remat policy) names another program, so the equality is
not one the fingerprint gives to anything.
"""

from __future__ import annotations

import trainer_fixtures as F

from upcycler.train.aot.compile import compile_only
from upcycler.train.config import TrainConfig
from upcycler.train.loop.trainer import train


def test_compile_only_compiles_the_program_training_runs(ws, tmp_path):
    raw = F.config_dict(tmp_path, ws["dense"], ws["data"], steps=2, **{"checkpoint.every": 2, "checkpoint.async": False})
    config = TrainConfig.from_dict(raw)
    trained = train(config)
    assert trained.step == 2 and len(trained.programs) == 1  # one phase shape: one program
    report = compile_only(config)
    assert report.program == trained.programs[0]
    other = compile_only(TrainConfig.from_dict({**raw, "model": {**raw["model"], "remat": "full"}}))
    assert other.program not in (None, report.program)
