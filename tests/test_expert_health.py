"""Expert-health statistics (`upcycler.train.techniques.expert_health`) against hand-computed values, and their
plot in `upcycle report`. Fast: numpy and matplotlib only, no model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec, MoESpec
from upcycler.train.reporting.plots import make_report
from upcycler.train.techniques.expert_health import (
    collapsed_layers,
    layer_health,
    moe_layer_numbers,
    summary,
    worst_layer,
)

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_router_that_always_picks_the_same_experts_has_collapsed():
    # E = 8, top_k = 2, 100 tokens all routed to experts 3 and 5; fair share 200 / 8 = 25
    counts = np.array([[0, 0, 0, 100, 0, 100, 0, 0]], dtype=np.float32)
    health = layer_health(counts, top_k=2, dead_below=0.1)
    assert health["dead"] == [6]  # E − k
    assert health["load_min"] == [0.0] and health["load_max"] == [0.5]
    assert health["overload"] == [4.0]  # 100 / 25 = E / k
    # mean 25; deviations 75, 75 and six of −25: var (2·5625 + 6·625) / 8 = 1875; std / mean = √3
    assert health["load_cv"] == [pytest.approx(1.7320508)]
    assert collapsed_layers(health, num_experts=8) == [0]


def test_balanced_counts_are_healthy():
    health = layer_health(np.array([[5.0, 5.0, 5.0, 5.0], [7.0, 7.0, 7.0, 7.0]]), top_k=2, dead_below=0.5)
    assert health == {
        "load_min": [0.25, 0.25], "load_max": [0.25, 0.25], "load_cv": [0.0, 0.0],
        "dead": [0, 0], "overload": [1.0, 1.0],
    }
    assert collapsed_layers(health, num_experts=4) == []


def test_hand_computed_small_example():
    # counts 1, 3, 0, 4: total 8, fair share 2; deviations −1, 1, −2, 2 → var 10/4, std √2.5 = 1.5811388
    health = layer_health(np.array([[1, 3, 0, 4]]), top_k=2, dead_below=0.1)
    assert health["load_min"] == [0.0]
    assert health["load_max"] == [0.5]  # 4 / 8
    assert health["load_cv"] == [pytest.approx(0.7905694)]  # 1.5811388 / 2
    assert health["overload"] == [2.0]  # 4 / 2
    assert health["dead"] == [1]  # below 0.1 · 2 = 0.2: only the 0
    assert layer_health(np.array([[1, 3, 0, 4]]), top_k=2, dead_below=0.6)["dead"] == [2]  # below 1.2
    assert layer_health(np.array([[1, 3, 0, 4]]), top_k=2, dead_below=1.0)["dead"] == [2]  # 2 is not < 2


def test_uniform_random_routing_is_balanced():
    rng = np.random.default_rng(0)
    tokens, experts, top_k = 65536, 64, 8
    logits = rng.standard_normal((tokens, experts))
    chosen = np.argsort(-logits, axis=1)[:, :top_k]
    counts = np.bincount(chosen.ravel(), minlength=experts)[None, :]
    health = layer_health(counts, top_k=top_k, dead_below=0.1)
    assert health["load_cv"][0] < 0.05  # ≈ 0.01 for 8192 copies per expert
    assert health["dead"] == [0]
    assert collapsed_layers(health, num_experts=experts) == []


def test_a_layer_without_tokens_has_zeros_not_nans():
    health = layer_health(np.array([[0.0, 0.0, 0.0], [0.0, 2.0, 4.0]]), top_k=1, dead_below=0.1)
    assert health["load_min"] == [0.0, 0.0] and health["load_max"] == [0.0, 4 / 6]
    assert health["load_cv"][0] == 0.0 and health["overload"] == [0.0, 2.0]  # 4 / (6 / 3)
    assert health["dead"] == [0, 1]
    assert collapsed_layers(health, num_experts=3) == []


def test_entropy_and_bias_norm():
    health = layer_health(np.array([[1, 1], [2, 2]]), top_k=1, dead_below=0.1,
                          entropy_M=np.array([0.25, 0.5], dtype=np.float32),
                          bias_ME=np.array([[3.0, 4.0], [0.0, -2.0]]))
    assert health["entropy"] == [0.25, 0.5]
    assert health["bias_norm"] == [5.0, 2.0]
    assert all(type(v) is float for key in ("entropy", "bias_norm", "load_cv") for v in health[key])
    assert all(type(v) is int for v in health["dead"])
    with pytest.raises(ValueError, match="bias_ME"):
        layer_health(np.array([[1, 1]]), top_k=1, dead_below=0.1, bias_ME=np.zeros((1, 3)))


def test_dead_below_zero_declares_nothing_dead():
    health = layer_health(np.array([[0, 0, 0, 9], [0, 0, 0, 0]]), top_k=1, dead_below=0.0)
    assert health["dead"] == [0, 0]
    assert collapsed_layers(health, num_experts=4) == []


def test_collapse_is_half_the_experts_dead():
    assert collapsed_layers({"dead": [1, 2, 3, 0]}, num_experts=4) == [1, 2]
    assert collapsed_layers({"dead": [2, 3]}, num_experts=5) == [1]  # 2.5 needs 3


@pytest.mark.parametrize("counts,top_k,dead_below", [
    (np.zeros(4), 1, 0.1), (np.zeros((2, 0)), 1, 0.1), (np.array([[1.0, -1.0]]), 1, 0.1),
    (np.array([[1.0, np.nan]]), 1, 0.1), (np.ones((1, 4)), 5, 0.1), (np.ones((1, 4)), 0, 0.1),
    (np.ones((1, 4)), 1, -0.5),
])
def test_bad_arguments_are_value_errors(counts, top_k, dead_below):
    with pytest.raises(ValueError):
        layer_health(counts, top_k=top_k, dead_below=dead_below)


def test_worst_layer_and_summary_name_the_decoder_layer():
    # layer 0 balanced, layer 1 all on one of 4 experts (cv √3, overload 4, 3 dead), layer 2 mild
    health = layer_health(np.array([[4, 4, 4, 4], [0, 16, 0, 0], [2, 6, 4, 4]]), top_k=1, dead_below=0.1)
    assert worst_layer(health) == 1
    assert summary(health, [1, 3, 5]) == "experts: cv 1.73 max×4.0 dead 3 @ layer 3"
    assert worst_layer({"load_cv": [None, 0.5, 0.5]}) == 1  # a null never wins; ties go to the first


def _spec(**changes) -> ModelSpec:
    fields = {"family": "qwen3_moe", "vocab_size": 64, "hidden_size": 16, "num_layers": 6, "num_heads": 2,
              "num_kv_heads": 1, "head_dim": 8, "intermediate_size": 32,
              "moe": MoESpec(num_experts=4, top_k=2, expert_width=8)}
    return ModelSpec(**{**fields, **changes})


def test_moe_layer_numbers_skip_dense_layers():
    assert moe_layer_numbers(_spec()) == [0, 1, 2, 3, 4, 5]
    assert moe_layer_numbers(_spec(dense_layers=(0, 3))) == [1, 2, 4, 5]
    assert moe_layer_numbers(_spec(moe=None)) == []


# --- upcycle report -----------------------------------------------------------------------------------

def _run(tmp_path, records):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def _step(step, **extra):
    return {"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0,
            "expert_load": [[0.5, 0.5], [0.25, 0.75]], **extra}


HEALTH = {"load_min": [0.5, 0.25], "load_max": [0.5, 0.75], "load_cv": [0.0, 0.5], "dead": [0, 0],
          "overload": [1.0, 1.5], "entropy": [0.69, None], "bias_norm": [0.0, 0.1]}


def test_report_plots_expert_health(tmp_path):
    # health logged on steps 0 and 2 only (expert_load_every = 2); a null entropy is drawn as a gap
    run = _run(tmp_path, [_step(0, expert_health=HEALTH), _step(1), _step(2, expert_health=HEALTH)])
    result = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["expert_health.png", "expert_load_layer0.png", "expert_load_layer1.png", "loss.png",
                     "training.png"]
    assert all((tmp_path / "plots" / n).read_bytes()[:8] == PNG for n in names)


def test_report_without_expert_health_has_no_health_plot(tmp_path):
    run = _run(tmp_path, [_step(0), _step(1)])
    names = sorted(p.name for p in make_report(run, tmp_path / "plots"))
    assert "expert_health.png" not in names and "loss.png" in names


def test_report_plots_many_layers_with_only_cv_and_dead(tmp_path):
    layers = 12
    health = [{"load_cv": [0.1 * i + s for i in range(layers)], "dead": [i % 3 for i in range(layers)]}
              for s in range(3)]
    run = _run(tmp_path, [_step(s, expert_health=h) for s, h in enumerate(health)])
    paths = make_report(run, tmp_path / "plots")
    assert (tmp_path / "plots" / "expert_health.png") in paths
    assert (tmp_path / "plots" / "expert_health.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("bad,mentions,where", [  # the log reader names the line, the report the step
    ("lots", "expert_health must be a mapping", r"metrics\.jsonl:2: "),
    ({"load_cv": "high"}, "expert_health.load_cv must be a non-empty list", r"metrics\.jsonl:2: "),
    ({"load_cv": [0.1, "x"]}, "expert_health.load_cv must be a number", r"metrics\.jsonl:2: "),
    ({"load_cv": [0.1, 0.2], "dead": [1]}, "different lengths", r"metrics\.jsonl:2: "),
    ({"load_cv": [0.1]}, "covers 1 layers, but step 0 covers 2", r"metrics\.jsonl: step 1: "),
])
def test_bad_expert_health_is_an_error_naming_where(tmp_path, bad, mentions, where):
    run = _run(tmp_path, [_step(0, expert_health=HEALTH), _step(1, expert_health=bad)])
    with pytest.raises(UpcyclerError, match=where) as err:
        make_report(run, tmp_path / "plots")
    assert mentions in str(err.value)
    assert not (tmp_path / "plots").exists()


def test_huge_counts_stay_finite():
    health = layer_health(np.array([[1e30, 3e30]]), top_k=1, dead_below=0.1)
    assert health["load_max"] == [pytest.approx(0.75)] and health["overload"] == [pytest.approx(1.5)]
    assert health["load_cv"] == [pytest.approx(0.5)]  # counts 1, 3 (×1e30): std 1, mean 2
