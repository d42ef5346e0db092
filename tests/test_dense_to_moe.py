"""dense-to-moe: function preservation judged by transformers, virtual-group structure, counts, refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli
from transform_helpers import (
    TOLERANCE,
    active_by_hand,
    config,
    hf_param_count,
    max_logit_diff,
    run_transform,
    stored,
)

from upcycler.cli.demo import demo_assets
from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.spec import MoESpec
from upcycler.tensors import LazyTensor, TensorMap
from upcycler.transforms import transform_named
from upcycler.transforms.moe_write_check import write_check_for

# name: (source family, source overrides, dense-to-moe options, expected family)
CASES = {
    "mixtral-coarse": ("llama", {}, {"experts": 8, "topk": 2}, "mixtral"),
    "mixtral-fine": ("llama", {}, {"experts": 64, "topk": 8, "granularity": 8}, "mixtral"),
    "qwen2_moe-shared": ("llama", {"num_hidden_layers": 3},
                         {"experts": 12, "topk": 6, "granularity": 4, "shared_experts": 1, "dense_layers": 1},
                         "qwen2_moe"),
    "qwen3_moe-dense-first": ("qwen3", {"num_hidden_layers": 3},
                              {"experts": 16, "topk": 4, "granularity": 4, "dense_layers": 2}, "qwen3_moe"),
    "glm4_moe-shared": ("llama", {"num_hidden_layers": 3},
                        {"experts": 8, "topk": 4, "granularity": 4, "shared_experts": 2, "dense_layers": 1,
                         "target": "glm4_moe", "routed_scaling_factor": 2.5}, "glm4_moe"),
    # a tied parent: GLM-4-MoE's serving implementations never tie, so the head is written out
    "glm4_moe-tied": ("llama", {"num_hidden_layers": 3, "tie_word_embeddings": True},
                      {"experts": 8, "topk": 2, "granularity": 2, "shared_experts": 1, "target": "glm4_moe"},
                      "glm4_moe"),
    # any expert width: overlapping windows (F = 112, 8 experts of width 16 = F/7 per virtual group)
    "mixtral-overlap": ("llama", {"intermediate_size": 112}, {"experts": 64, "topk": 8, "expert_width": 16},
                        "mixtral"),
    "qwen3_moe-overlap-dense-first": ("qwen3", {"intermediate_size": 112, "num_hidden_layers": 3},
                                      {"experts": 16, "topk": 8, "expert_width": 24, "dense_layers": 1},
                                      "qwen3_moe"),
    "qwen2_moe-overlap-shared": ("llama", {"intermediate_size": 112},
                                 {"experts": 16, "topk": 8, "expert_width": 24, "shared_experts": 1,
                                  "target": "qwen2_moe"}, "qwen2_moe"),
    "glm4_moe-overlap-shared": ("llama", {"intermediate_size": 112, "num_hidden_layers": 3},
                                {"experts": 16, "topk": 8, "expert_width": 16, "shared_experts": 1,
                                 "dense_layers": 1, "target": "glm4_moe", "routed_scaling_factor": 2.5},
                                "glm4_moe"),
}


@pytest.fixture(scope="module")
def upcycled(tiny_dir, tmp_path_factory):
    """`upcycled(case)` -> (source dir, output dir, plan), built once per case."""
    cache: dict = {}

    def build(case: str):
        if case not in cache:
            family, overrides, options, _ = CASES[case]
            src = tiny_dir(family, **overrides)
            out = tmp_path_factory.mktemp(case) / "out"
            cache[case] = (src, out, run_transform("dense-to-moe", src, out, **options))
        return cache[case]

    return build


@pytest.mark.parametrize("case", CASES)
def test_function_preserved(case, upcycled):
    src, out, p = upcycled(case)
    assert config(out)["model_type"] == CASES[case][3]
    assert p.exact and json.loads((out / "upcycler.json").read_text())["lineage"][-1]["function_preserving"]
    assert max_logit_diff(src, out) <= TOLERANCE



# every dense family the library saves, into every MoE target: True where the target holds the parent
# exactly (checked in transformers), else the target's own refusal names what it cannot hold
PARENT_INTO_TARGET = {
    "llama": {"mixtral": True, "qwen2_moe": True, "qwen3_moe": "q/k norms", "glm4_moe": True},
    "mistral": {"mixtral": True, "qwen2_moe": True, "qwen3_moe": "q/k norms", "glm4_moe": True},
    "qwen2": {"mixtral": "attention biases", "qwen2_moe": True, "qwen3_moe": "q/k norms", "glm4_moe": True},
    "qwen3": {"mixtral": "q/k norms", "qwen2_moe": "q/k norms", "qwen3_moe": True, "glm4_moe": True},
}


def test_glm4_moe_without_a_shared_expert_says_vllm_cannot_serve_it(tiny_dir, tmp_path):
    """vLLM's GLM-4-MoE builds its shared MLP n_shared_experts wide and dies serving 0 (SIGFPE, vLLM 0.32):
    the write goes on (transformers and the trainer run it) and says so, and what would be servable."""
    planned = run_transform("dense-to-moe", tiny_dir("llama"), tmp_path / "out", experts=8, topk=2,
                            granularity=2, target="glm4_moe")
    notes = [n for step in planned.steps for n in step.notes if "vLLM cannot serve" in n.text]
    assert len(notes) == 1 and notes[0].exact and "--shared-experts 1" in notes[0].text
    assert config(tmp_path / "out")["n_shared_experts"] == 0 and planned.exact
    shared = run_transform("dense-to-moe", tiny_dir("llama"), tmp_path / "shared", experts=8, topk=2,
                           granularity=2, shared_experts=1, target="glm4_moe", dry_run=True)
    assert not any("vLLM" in n.text for step in shared.steps for n in step.notes)


@pytest.mark.parametrize("parent", PARENT_INTO_TARGET)
def test_every_parent_family_into_every_target(parent, tiny_dir, tmp_path):
    """A parent saved by today's transformers (Qwen2 and Qwen3 write `layer_types`, all full attention)
    written as each target: the write check accepts a config that spells the same attention another way
    (GLM-4-MoE writes no `layer_types`) and the output equals its parent in transformers."""
    src = tiny_dir(parent)
    for target, expected in PARENT_INTO_TARGET[parent].items():
        options = {"experts": 8, "topk": 2, "granularity": 2, "target": target,
                   "shared_experts": 1 if target in ("qwen2_moe", "glm4_moe") else 0}
        out = tmp_path / target
        if expected is True:
            planned = run_transform("dense-to-moe", src, out, **options)
            assert config(out)["model_type"] == target
            assert write_check_for(planned)(out)["passed"]
            assert max_logit_diff(src, out) <= TOLERANCE, (parent, target)
        else:
            with pytest.raises(UpcyclerError, match=f"cannot hold this request exactly: .*{expected}"):
                run_transform("dense-to-moe", src, out, **options)
            assert not out.exists()


def test_configs_that_spell_the_same_attention_differently_are_the_same_model(tiny_dir):
    """`differences` compares the window each layer attends through, not how the config spells it."""
    from upcycler.io.hf_read import read_spec

    plain = read_spec(tiny_dir("llama"))  # 2 layers, no window
    full = ("full_attention", "full_attention")
    assert plain.differences(plain.replace(layer_types=full)) == []
    assert plain.differences(plain.replace(layer_types=full, sliding_window=64)) == []
    windowed = plain.replace(sliding_window=64)  # no layer_types: every layer slides (Mistral)
    assert windowed.attention_windows() == (64, 64)
    assert windowed.differences(windowed.replace(layer_types=("sliding_attention",) * 2)) == []
    assert plain.differences(windowed) == ["sliding_window"]
    mixed = windowed.replace(layer_types=("sliding_attention", "full_attention"))
    assert mixed.attention_windows() == (64, None)
    assert windowed.differences(mixed) == ["layer_types"]
    assert plain.differences(plain.replace(rope_theta=5e5)) == ["rope_theta"]

def test_virtual_groups(upcycled):
    """64 experts, G=8: router rows repeat per group bitwise; expert e = shard e mod 8, down_proj × 8."""
    src, out, _ = upcycled("mixtral-fine")
    dense, moe = stored(src), stored(out)
    for layer in range(2):
        p, q = f"model.layers.{layer}.", f"model.layers.{layer}.block_sparse_moe."
        router = moe[q + "gate.weight"]
        assert router.shape == (64, 64)
        groups = router.reshape(8, 8, 64)
        assert (groups == groups[:, :1]).all() and len({g[0].tobytes() for g in groups}) == 8
        for e in (0, 5, 13, 63):
            rows = slice(16 * (e % 8), 16 * (e % 8 + 1))
            assert np.array_equal(moe[q + f"experts.{e}.w1.weight"], dense[p + "mlp.gate_proj.weight"][rows])
            assert np.array_equal(moe[q + f"experts.{e}.w3.weight"], dense[p + "mlp.up_proj.weight"][rows])
            assert np.array_equal(moe[q + f"experts.{e}.w2.weight"], dense[p + "mlp.down_proj.weight"][:, rows] * 8)


def window(start: int, width: int, shared: int, routed: int) -> np.ndarray:
    """Neurons of a window, written out by hand: `width` routed neurons from `start`, wrapping around."""
    return np.array([shared + (start + i) % routed for i in range(width)])


def test_overlapping_windows_reference_pattern(upcycled):
    """F = 112 → 64 experts of width 16, top-8: groups of 8 start every 14 neurons, the last wraps around;
    every neuron is held once or twice and its down_proj column is × 8 / (times held)."""
    src, out, p = upcycled("mixtral-overlap")
    assert any("overlapping windows of 16 of the 112" in n.text for n in p.steps[0].notes)
    assert not any("float rounding" in n.text for n in p.steps[0].notes)  # scales 4 and 8: exact
    dense, moe = stored(src), stored(out)
    starts = [0, 14, 28, 42, 56, 70, 84, 98]
    held = np.zeros(112, int)
    for s in starts:
        held[window(s, 16, 0, 112)] += 1
    assert set(held) == {1, 2} and (held == 2).sum() == 8 * 16 - 112
    for layer in range(2):
        d, q = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe."
        router = moe[q + "gate.weight"].reshape(8, 8, 64)
        assert (router == router[:, :1]).all() and len({g[0].tobytes() for g in router}) == 8
        for e in (0, 7, 15, 63):
            neurons = window(starts[e % 8], 16, 0, 112)
            assert np.array_equal(moe[q + f"experts.{e}.w1.weight"], dense[d + "gate_proj.weight"][neurons])
            assert np.array_equal(moe[q + f"experts.{e}.w3.weight"], dense[d + "up_proj.weight"][neurons])
            scale = (8 / held[neurons]).astype(np.float32)
            assert np.array_equal(moe[q + f"experts.{e}.w2.weight"], dense[d + "down_proj.weight"][:, neurons] * scale)


def test_overlapping_windows_after_the_shared_expert(upcycled):
    """GLM-4-MoE, one shared expert of width 16 takes neurons 0..15; 8 routed windows cover the other 96."""
    src, out, _ = upcycled("glm4_moe-overlap-shared")
    dense, moe = stored(src), stored(out)
    d, q = "model.layers.1.mlp.", "model.layers.1.mlp."
    assert np.array_equal(moe[q + "shared_experts.gate_proj.weight"], dense[d + "gate_proj.weight"][:16])
    held = np.zeros(112, int)
    for s in range(0, 96, 12):
        held[window(s, 16, 16, 96)] += 1
    assert held[:16].sum() == 0 and set(held[16:]) == {1, 2}
    neurons = window(84, 16, 16, 96)  # member 7: neurons 100..111, then 16..19
    assert list(neurons[-4:]) == [16, 17, 18, 19]
    assert np.array_equal(moe[q + "experts.15.up_proj.weight"], dense[d + "up_proj.weight"][neurons])
    scale = (8 / 2.5 / held[neurons]).astype(np.float32)
    expected = (dense[d + "down_proj.weight"][:, neurons] * scale).astype(np.float32)
    assert np.array_equal(moe[q + "experts.15.down_proj.weight"], expected)


@pytest.mark.parametrize(("F", "width", "shared", "experts", "topk"),
                         [(8064, 1152, 0, 64, 8), (1536, 224, 0, 64, 8), (112, 16, 0, 64, 8), (100, 15, 1, 12, 6),
                          (97, 40, 0, 12, 6), (64, 64, 0, 8, 2), (130, 11, 2, 24, 12)])
def test_cover_is_even_and_uses_the_smallest_group(F, width, shared, experts, topk):
    """Every routed neuron held at least once, the counts differ by at most one, and no smaller group
    dividing N and K would reach every neuron."""
    from upcycler.transforms.expert_cover import overlapping

    cover = overlapping(F, width, shared, experts, topk)
    R, routed = cover.group, F - shared * width
    assert experts % R == 0 and topk % R == 0 and R * width >= routed
    assert not any(experts % r == 0 and topk % r == 0 and r * width >= routed for r in range(1, R))
    held = np.zeros(F, int)
    for j in range(R):
        held[cover.window(j)] += 1
    assert (held[:shared * width] == 0).all()
    assert held[shared * width:].min() >= 1 and held[shared * width:].max() - held[shared * width:].min() <= 1
    assert held[shared * width:].sum() == R * width


def test_dry_run_of_the_reference_2b_shape(tmp_path):
    """The 2.1B dense shape → 64 experts of width 1152, top-8, from config.json alone: counted by hand."""
    src = tmp_path / "dense-2b"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1792,
        "intermediate_size": 8064, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    proc = run_cli("dense-to-moe", src, tmp_path / "out", "--experts", "64", "--topk", "8", "--expert-width",
                   "1152", "--dry-run")
    D, L, V = 1792, 32, 128256
    attention = D * 24 * 128 * 2 + D * 8 * 128 * 2
    expert = 3 * D * 1152
    per_layer = attention + 2 * D + 64 * D  # + norms + router
    total = V * D + D + L * (per_layer + 64 * expert)
    active = V * D + D + L * (per_layer + 8 * expert)
    assert (total, active) == (13_386_958_592, 2_288_830_208)
    assert f"{total:,} total (13.39B), {active:,} active (2.29B)" in proc.stdout
    assert "function        preserved" in proc.stdout and "scaled by 4, 8" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_non_power_of_two_scales_are_reported(tiny_dir, tmp_path):
    src = tiny_dir("llama", intermediate_size=112)
    p = run_transform("dense-to-moe", src, tmp_path / "out", experts=12, topk=6, expert_width=20, target="mixtral")
    notes = [n.text for n in p.steps[0].notes]
    assert any("exact up to float rounding" in n and "not a power of two" in n for n in notes), notes
    assert max_logit_diff(src, tmp_path / "out") <= TOLERANCE


def test_top1_renormalising_router_needs_an_explicit_allowance(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    proc = run_cli("dense-to-moe", src, tmp_path / "out", "--experts", "8", "--topk", "1", "--target", "mixtral",
                   check=False)
    assert_clean_failure(proc, mentions="--allow-untrainable-router")
    assert "never learns" in proc.stderr and leftovers(tmp_path, "out") == []
    p = run_transform("dense-to-moe", src, tmp_path / "allowed", experts=8, topk=1, target="mixtral",
                      allow_untrainable_router=True)
    assert p.exact and config(tmp_path / "allowed")["num_experts_per_tok"] == 1


def test_qwen2_moe_shared_expert_and_dense_layer(upcycled):
    src, out, _ = upcycled("qwen2_moe-shared")
    dense, moe, cfg = stored(src), stored(out), config(out)
    assert cfg["mlp_only_layers"] == [0] and cfg["norm_topk_prob"] is True
    assert cfg["shared_expert_intermediate_size"] == 32 and cfg["moe_intermediate_size"] == 32
    for name in ("gate_proj", "up_proj", "down_proj"):  # the dense first layer is untouched
        assert np.array_equal(moe[f"model.layers.0.mlp.{name}.weight"], dense[f"model.layers.0.mlp.{name}.weight"])
    p = "model.layers.1.mlp."
    assert not moe[p + "shared_expert_gate.weight"].any()
    assert np.array_equal(moe[p + "shared_expert.gate_proj.weight"], dense["model.layers.1.mlp.gate_proj.weight"][:32])
    assert np.array_equal(moe[p + "shared_expert.down_proj.weight"],
                          dense["model.layers.1.mlp.down_proj.weight"][:, :32] * 2)
    # routed expert e holds shard 1 + e mod 3, scaled by R = 3
    assert np.array_equal(moe[p + "experts.4.up_proj.weight"], dense["model.layers.1.mlp.up_proj.weight"][64:96])


def test_a_tied_parent_is_written_to_glm4_moe_with_its_head_as_a_copy(upcycled):
    """vLLM's Glm4MoeForCausalLM always builds its own lm_head: a tied parent's output carries the head as
    a copy of the embedding and says it is untied; transformers computes the same logits
    (`test_function_preserved`) and the manifest records the untied spec."""
    src, out, _ = upcycled("glm4_moe-tied")
    assert config(src)["tie_word_embeddings"] is True and config(out)["tie_word_embeddings"] is False
    moe = stored(out)
    assert np.array_equal(moe["lm_head.weight"], moe["model.embed_tokens.weight"])
    assert np.array_equal(moe["lm_head.weight"], stored(src)["model.embed_tokens.weight"])
    assert json.loads((out / "upcycler.json").read_text())["spec"]["tie_embeddings"] is False


def test_glm4_moe_ungated_shared_experts(upcycled):
    src, out, _ = upcycled("glm4_moe-shared")
    dense, moe, cfg = stored(src), stored(out), config(out)
    assert (cfg["n_shared_experts"], cfg["moe_intermediate_size"], cfg["first_k_dense_replace"]) == (2, 32, 1)
    assert cfg["routed_scaling_factor"] == 2.5 and cfg["partial_rotary_factor"] == 1.0
    p = "model.layers.2.mlp."
    assert np.array_equal(moe[p + "shared_experts.down_proj.weight"], dense[p + "down_proj.weight"][:, :64])
    assert not moe[p + "gate.e_score_correction_bias"].any()


def test_auto_target_says_which_and_why(tiny_dir, tmp_path):
    proc = run_cli("dense-to-moe", tiny_dir("llama", num_hidden_layers=3), tmp_path / "out", "--experts", "12",
                   "--topk", "6", "--granularity", "4", "--shared-experts", "1", "--dense-layers", "1")
    assert "target qwen2_moe (auto" in proc.stderr and "Mixtral has no shared experts" in proc.stderr
    assert "function preserved" in proc.stdout


def test_same_seed_same_bytes(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    options = {"experts": 16, "topk": 4, "granularity": 4, "seed": 7, "reinit_ratio": 0.25}
    a, b, c = (tmp_path / n for n in "abc")
    run_transform("dense-to-moe", src, a, **options)
    run_transform("dense-to-moe", src, b, **options)
    run_transform("dense-to-moe", src, c, **{**options, "seed": 8})
    names = sorted(f.name for f in a.iterdir())
    assert names == sorted(f.name for f in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_unnormalized_router_is_reported_approximate(tiny_dir, tmp_path):
    src = tiny_dir("qwen3")
    p = run_transform("dense-to-moe", src, tmp_path / "out", experts=16, topk=4, granularity=4,
                      target="qwen3_moe", router="unnormalized", router_std=0.5)
    assert not p.exact and any("APPROXIMATE" in n.text for s in p.steps for n in s.notes)
    assert config(tmp_path / "out")["norm_topk_prob"] is False
    lineage = json.loads((tmp_path / "out" / "upcycler.json").read_text())["lineage"]
    assert lineage[-1]["function_preserving"] is False
    assert max_logit_diff(src, tmp_path / "out") > TOLERANCE


def test_unnormalized_uniform_coarse_router_is_exact(tiny_dir, tmp_path):
    src = tiny_dir("qwen3")
    p = run_transform("dense-to-moe", src, tmp_path / "out", experts=8, topk=2, target="qwen3_moe",
                      router="unnormalized", router_std=0.0)
    assert p.exact and max_logit_diff(src, tmp_path / "out") <= TOLERANCE


def test_drop_upcycling_reinitialises_the_same_neurons(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    p = run_transform("dense-to-moe", src, tmp_path / "out", experts=4, topk=2, reinit_ratio=0.25)
    assert not p.exact and any("NOT function-preserving: Drop-Upcycling" in n.text for n in p.steps[0].notes)
    dense, moe = stored(src), stored(tmp_path / "out")
    q = "model.layers.1.block_sparse_moe.experts."
    changed = {}
    for w, name, axis in (("w1", "gate_proj", 1), ("w3", "up_proj", 1), ("w2", "down_proj", 0)):
        diff = moe[q + f"2.{w}.weight"] != dense[f"model.layers.1.mlp.{name}.weight"]
        changed[w] = set(np.flatnonzero(diff.any(axis=axis)))
    assert len(changed["w1"]) == 32 and changed["w1"] == changed["w3"] == changed["w2"]


def test_experts_cut_lazily_reading_each_dense_tensor_once(tiny_dir):
    """Producing all 64 experts part by part loads every dense tensor once, never the whole stack."""
    from upcycler.io import read_checkpoint

    ckpt = read_checkpoint(tiny_dir("llama"))
    loads: dict[str, int] = {}

    def counted(name: str, t: LazyTensor) -> LazyTensor:
        def load():
            loads[name] = loads.get(name, 0) + 1
            return t.load()
        return LazyTensor(t.shape, t.dtype, load)

    tensors = TensorMap({n: counted(n, t) for n, t in ckpt.tensors.items()})
    t = transform_named("dense-to-moe")
    applied = t.apply(t.make_config({"experts": 64, "topk": 8, "granularity": 8}), ckpt.spec, tensors)
    assert loads == {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked = applied.tensors[f"layers.0.moe.experts.{name}"]
        parts = [stacked.part(e) for e in range(64)]
        assert len(parts) == 64
    assert loads == {f"layers.0.mlp.{n}": 1 for n in ("gate_proj", "up_proj", "down_proj")}


# (options, which experts' weights are their source's bytes unchanged): G=1 copies all three whole; a
# finer cut keeps gate/up rows contiguous but takes (and scales) down_proj columns; overlapping windows
# scale too; re-initialised neurons are new values
STREAMED = [
    ({"experts": 8, "topk": 2}, {"gate_proj", "up_proj", "down_proj"}),
    ({"experts": 16, "topk": 4, "granularity": 4}, {"gate_proj", "up_proj"}),
    ({"experts": 16, "topk": 8, "expert_width": 24}, None),  # gate/up windows that wrap are not contiguous
    ({"experts": 8, "topk": 2, "reinit_ratio": 0.5}, set()),
]


@pytest.mark.parametrize(("options", "streamed"), STREAMED)
def test_unchanged_slices_say_where_their_bytes_are_stored(options, streamed, tiny_dir):
    """Each expert slice that is its source's bytes unchanged names the file range holding exactly the
    bytes `part(e)` computes, so the writer can stream it; every other slice names none."""
    from upcycler.io import read_checkpoint

    ckpt = read_checkpoint(tiny_dir("llama", intermediate_size=112) if "expert_width" in options
                           else tiny_dir("llama"))
    t = transform_named("dense-to-moe")
    applied = t.apply(t.make_config(options), ckpt.spec, ckpt.tensors)
    found = set()
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked = applied.tensors[f"layers.1.moe.experts.{name}"]
        for e in range(stacked.shape[0]):
            where = stacked.stored_part(e)
            if where is None:
                continue
            found.add(name)
            with open(where.path, "rb") as f:
                f.seek(where.offset)
                assert f.read(where.nbytes) == stacked.part(e).tobytes(), (name, e)
    if streamed is None:  # wrapping windows: some members contiguous, some not; whichever are must match
        assert "down_proj" not in found
    else:
        assert found == streamed


@pytest.mark.parametrize("case", CASES)
def test_dry_run_counts_match_transformers(case, tiny_dir, tmp_path):
    """From config.json alone: the planned config builds a transformers model with exactly the counted params."""
    family, overrides, options, _ = CASES[case]
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_dir(family, **overrides) / "config.json", config_only)
    p = run_transform("dense-to-moe", config_only, None, dry_run=True, **options).to_json()
    total = hf_param_count(p["config"], tmp_path / "built")
    assert p["total_params"] == total
    assert p["active_params"] == active_by_hand(p["config"], total)


def test_dry_run_bytes_match_the_written_files(upcycled):
    _, out, p = upcycled("qwen2_moe-shared")
    assert p.output_bytes == sum(f.stat().st_size for f in out.glob("*.safetensors"))


def test_dry_run_cli_writes_nothing(tiny_dir, tmp_path):
    proc = run_cli("dense-to-moe", tiny_dir("llama"), tmp_path / "out", "--experts", "8", "--topk", "2",
                   "--dry-run", "--json")
    info = json.loads(proc.stdout)
    assert info["config"]["num_local_experts"] == 8 and info["function_preserving"]
    assert not list(tmp_path.iterdir())


REFUSALS = {
    "topk-not-multiple": (["--experts", "8", "--topk", "3", "--granularity", "2"], "multiple of the routed group"),
    "granularity-divides": (["--experts", "6", "--topk", "3", "--granularity", "3"], "does not divide"),
    "shared-ge-granularity": (["--experts", "8", "--topk", "2", "--granularity", "2", "--shared-experts", "2"],
                              "must be smaller than --granularity"),
    "dense-ge-layers": (["--experts", "8", "--topk", "2", "--dense-layers", "2"], "leaves no MoE layer"),
    "family-cannot-hold": (["--experts", "4", "--topk", "2", "--granularity", "2", "--shared-experts", "1",
                            "--target", "mixtral"], "Mixtral has no shared experts"),
    "too-large": (["--experts", "2048", "--topk", "2"], "--allow-large"),
    "reinit-ratio": (["--experts", "8", "--topk", "2", "--reinit-ratio", "1.5"], "--reinit-ratio"),
    "width-too-narrow": (["--experts", "64", "--topk", "8", "--expert-width", "15"],
                         "choose --expert-width 16 or more"),
    "width-and-granularity": (["--experts", "64", "--topk", "8", "--expert-width", "16", "--granularity", "8"],
                              "pass one"),
    "width-too-wide": (["--experts", "8", "--topk", "2", "--expert-width", "129"], "choose at most 128"),
    "width-zero": (["--experts", "8", "--topk", "2", "--expert-width", "0"], "--expert-width must be ≥ 1"),
    "shared-takes-all": (["--experts", "8", "--topk", "2", "--expert-width", "64", "--shared-experts", "2"],
                         "leave none"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals(case, tiny_dir, tmp_path):
    args, mentions = REFUSALS[case]
    proc = run_cli("dense-to-moe", tiny_dir("llama"), tmp_path / "out", *args, check=False)
    assert_clean_failure(proc, mentions=mentions)
    assert leftovers(tmp_path, "out") == []


def test_refuses_an_moe_source(tiny_dir, tmp_path):
    proc = run_cli("dense-to-moe", tiny_dir("mixtral"), tmp_path / "out", "--experts", "8", "--topk", "2",
                   check=False)
    assert_clean_failure(proc, mentions="already MoE")
    assert leftovers(tmp_path, "out") == []


def test_expert_width_in_a_recipe_equals_the_flag(tiny_dir, tmp_path):
    src = tiny_dir("llama", intermediate_size=112)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"source: {src}\ntransforms:\n  - dense-to-moe: {{experts: 64, topk: 8, expert_width: 16}}\n"
                      f"output: {{path: {tmp_path / 'from-recipe'}}}\n")
    run_cli("run", recipe)
    run_cli("dense-to-moe", src, tmp_path / "from-flags", "--experts", "64", "--topk", "8", "--expert-width", "16")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "from-recipe" / name).read_bytes() == (tmp_path / "from-flags" / name).read_bytes()


@pytest.mark.parametrize("source, target, says", [
    # vLLM's Qwen2-MoE computes head_dim as hidden_size / heads: a wider head would be read as another model
    (("llama", {"head_dim": 32}), "qwen2_moe", "vLLM's Qwen2-MoE takes head_dim"),
    # transformers' Qwen3 biases o_proj with attention_bias, vLLM's does not
    (("llama", {"attention_bias": True}), "qwen3_moe", "biases o_proj in transformers and not in vLLM"),
])
def test_targets_their_serving_engines_would_misread_are_refused(tiny_dir, tmp_path, source, target, says):
    family, overrides = source
    src = tiny_dir(family, **overrides)
    proc = run_cli("dense-to-moe", src, tmp_path / "out", "--experts", "4", "--topk", "2", "--target", target,
                   check=False)
    assert_clean_failure(proc, mentions=says)
    assert not (tmp_path / "out").exists()


def test_partial_rotary_is_written_only_where_the_config_can_say_it(tmp_path):
    from upcycler.families import family_named

    spec = read_checkpoint(demo_assets() / "model").spec.replace(partial_rotary_factor=0.5)
    assert any("partial_rotary_factor is 0.5" in r for r in family_named("llama").cannot_hold(spec))
    moe = spec.replace(family="glm4_moe", moe=MoESpec(4, 2, spec.intermediate_size, "sigmoid", router_bias=True))
    assert not any("partial_rotary" in r for r in family_named("glm4_moe").cannot_hold(moe))


def test_a_wider_output_dtype_scales_in_it_and_is_verified(tiny_dir, tmp_path):
    """bf16 source, --dtype fp32, R = 7: down_proj × 7 computed and stored in fp32 (exact for bf16 values),
    so the write checks itself and passes, where scaling in bf16 first would round and fail the check."""
    src = tiny_dir("llama", dtype="bfloat16")
    proc = run_cli("dense-to-moe", src, tmp_path / "out", "--experts", "56", "--topk", "7", "--granularity", "8",
                   "--shared-experts", "1", "--target", "qwen2_moe", "--dtype", "fp32")
    assert "verified: same function" in proc.stderr, proc.stderr
    dense, moe = stored(src), stored(tmp_path / "out")
    p = "model.layers.1.mlp."
    want = dense[p + "down_proj.weight"].astype(np.float32)[:, 16:32] * 7  # routed expert 0: the second shard
    got = moe[p + "experts.0.down_proj.weight"]
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_a_wider_output_dtype_with_unscaled_experts_streams_no_narrow_bytes(tiny_dir, tmp_path):
    """Mixtral G = 1 (no scale) from a bf16 source with --dtype fp32: every expert is the source's MLP widened,
    never its bf16 bytes streamed under an fp32 header."""
    src = tiny_dir("llama", dtype="bfloat16")
    run_cli("dense-to-moe", src, tmp_path / "out", "--experts", "4", "--topk", "2", "--target", "mixtral",
            "--dtype", "fp32")
    dense, moe = stored(src), stored(tmp_path / "out")
    p = "model.layers.1."
    for e in range(4):
        got = moe[p + f"block_sparse_moe.experts.{e}.w2.weight"]
        assert got.dtype == np.float32 and np.array_equal(got, dense[p + "mlp.down_proj.weight"].astype(np.float32))


@pytest.mark.parametrize("case", CASES)
def test_the_write_check_passes_every_exact_case(case, upcycled, monkeypatch):
    """Passes, and gives the same record when the MLP is streamed a few rows at a time (a tiny model's
    tensors are otherwise one chunk: this runs the chunk seams, and wrapped windows across them)."""
    from upcycler.transforms import moe_block_stream
    from upcycler.transforms.moe_write_check import write_check_for

    _, out, p = upcycled(case)
    record = write_check_for(p)(out)
    assert record["passed"] and record["verdict"].startswith("same function")
    assert record["worst_floor_ratio"] <= 10 and record["tensors_by_digest"] > p.ckpt.spec.moe.num_experts
    monkeypatch.setattr(moe_block_stream, "CHUNK_BYTES", 3 * 64)
    streamed = write_check_for(p)(out)  # passes: every digest computed across the seams is the written one
    for noise in ("worst_floor_ratio", "verdict"):  # fp32 noise, summed by other BLAS kernels, and its line
        record.pop(noise)
    assert streamed.pop("worst_floor_ratio") <= 10 and streamed.pop("verdict").startswith("same function")
    assert streamed == record
