"""The JAX model against transformers: same logits (≤ 1e-4, fp32) for every family and variant we read.

Each case is a tiny random model saved by transformers; we load it through `read_checkpoint` →
`params.from_tensors`, run `forward` on a batch of 2 × 64 tokens, and compare with the torch logits. Then
the model's own contracts: masks and packing, router outputs, compute dtypes and implementations that
must agree, gradients, the parameter tree's 1:1 map to canonical names, and sharding on 8 devices.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import load_model, logits, make_tiny, random_ids
from xla_flags import with_devices

from upcycler.io import read_checkpoint
from upcycler.layout import declare_params
from upcycler.train.loop.sharding import logical_to_spec
from upcycler.train.model import ModelConfig, forward, forward_jit
from upcycler.train.model import params as P

TOL = 1e-4
BATCH, LENGTH = 2, 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "glm4_moe": ("glm4_moe", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3-yarn-rope": ("qwen3", {"rope_parameters": YARN_ROPE}),
    "mistral-sliding": ("mistral", {"sliding_window": 16}),
    "qwen2-sliding-layer1": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    ),
    "qwen2_moe-renorm": ("qwen2_moe", {"norm_topk_prob": True}),
    "qwen3_moe-renorm": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe-interleaved": (
        "qwen3_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    "glm4_moe-rsf-bias": (
        "glm4_moe",
        {
            "routed_scaling_factor": 2.5,
            "n_shared_experts": 2,
            "use_qk_norm": True,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "router_bias": True,
        },
    ),
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """`model_dir(case)` -> a saved tiny model for one entry of CASES, built once per session."""
    cache: dict[str, Path] = {}

    def build(case: str) -> Path:
        if case not in cache:
            family, overrides = CASES[case]
            overrides = dict(overrides)
            router_bias = overrides.pop("router_bias", False)
            path = make_tiny(family, tmp_path_factory.mktemp(case), **overrides)
            if router_bias:
                path = _with_router_bias(path, tmp_path_factory.mktemp(case + "-biased"))
            cache[case] = path
        return cache[case]

    return build


def _with_router_bias(src: Path, out: Path) -> Path:
    """GLM's e_score_correction_bias is a buffer transformers leaves at 0: make it big enough to matter."""
    import torch

    model = load_model(src)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(
                    torch.randn(gate.e_score_correction_bias.shape, generator=gen) * 0.1
                )
    model.save_pretrained(out)
    return out


def load(path: Path, dtype=None):
    ckpt = read_checkpoint(path)
    return ckpt.spec, P.from_tensors(ckpt.spec, ckpt.tensors, dtype=dtype)


def ours(path: Path, ids: np.ndarray, cfg: ModelConfig | None = None, **kwargs) -> np.ndarray:
    spec, params = load(path)
    out, _ = forward_jit(params, jnp.asarray(ids), spec, cfg or ModelConfig(), **kwargs)
    return np.asarray(out)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, model_dir):
    path = model_dir(case)
    ids = random_ids(BATCH, LENGTH, seed=1)
    diff = np.abs(ours(path, ids) - logits(path, ids)).max()
    print(f"{case}: max |Δlogits| {diff:.2e}")
    assert diff <= TOL


def test_glm_router_bias_changes_selection(model_dir):
    """The nonzero selection bias must matter, or the GLM case above would not test it."""
    spec, params = load(model_dir("glm4_moe-rsf-bias"))
    assert np.abs(np.asarray(params["layers"]["moe"]["moe"]["router_bias"])).max() > 0.05
    zeroed = jax.tree.map(lambda a: a, params)
    zeroed["layers"]["moe"]["moe"]["router_bias"] = jnp.zeros_like(
        params["layers"]["moe"]["moe"]["router_bias"]
    )
    ids = jnp.asarray(random_ids(BATCH, LENGTH, seed=1))
    _, aux_a = forward_jit(params, ids, spec)
    _, aux_b = forward_jit(zeroed, ids, spec)
    assert not np.array_equal(np.asarray(aux_a.expert_ids), np.asarray(aux_b.expert_ids))
    np.testing.assert_array_equal(np.asarray(aux_a.router_logits), np.asarray(aux_b.router_logits))


def test_left_padding_matches_transformers_attention_mask(model_dir):
    import torch

    path = model_dir("qwen2")
    ids = random_ids(BATCH, LENGTH, seed=2)
    mask = np.ones_like(ids)
    mask[1, :10] = 0  # second row left-padded by 10
    with torch.no_grad():
        ref = load_model(path)(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    got = ours(path, ids, segment_ids_BL=jnp.asarray(mask))
    real = mask.astype(bool)
    assert np.abs(got[real] - ref[real]).max() <= TOL


def test_packed_segments_equal_separate_sequences(model_dir):
    path = model_dir("qwen3_moe")
    first, second = random_ids(1, 40, seed=3), random_ids(1, 24, seed=4)
    packed = np.concatenate([first, second], axis=1)
    segments = np.array([[1] * 40 + [2] * 24])
    positions = np.array([list(range(40)) + list(range(24))])
    got = ours(path, packed, segment_ids_BL=jnp.asarray(segments), positions_BL=jnp.asarray(positions))
    model = load_model(path)
    assert np.abs(got[:, :40] - logits(model, first)).max() <= TOL
    assert np.abs(got[:, 40:] - logits(model, second)).max() <= TOL


def test_router_logits_match_transformers(model_dir):
    """aux.router_logits are the per-layer router logits transformers reports (MoE layers only)."""
    import torch

    path = model_dir("qwen2_moe")
    spec, params = load(path)
    ids = random_ids(BATCH, LENGTH, seed=5)
    _, aux = forward_jit(params, jnp.asarray(ids), spec)
    with torch.no_grad():
        out = load_model(path)(torch.as_tensor(ids), output_router_logits=True)
    ref = np.stack([r.numpy().reshape(BATCH, LENGTH, -1) for r in out.router_logits])
    assert len(spec.moe_layers) == 1 and aux.router_logits.shape == (1, BATCH, LENGTH, spec.moe.num_experts)
    assert aux.expert_ids.shape == (1, BATCH, LENGTH, spec.moe.top_k) and aux.expert_ids.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(aux.router_logits), ref[-1:], atol=1e-5)
    top = np.argsort(-np.asarray(aux.router_logits), axis=-1)[..., : spec.moe.top_k]
    np.testing.assert_array_equal(np.sort(top, -1), np.sort(np.asarray(aux.expert_ids), -1))


def test_dense_model_has_no_router_outputs(model_dir):
    spec, params = load(model_dir("llama"))
    _, aux = forward_jit(params, jnp.zeros((1, 8), jnp.int32), spec)
    assert aux.router_logits is None and aux.expert_ids is None


@pytest.mark.parametrize("case", ["qwen3", "glm4_moe-rsf-bias"])
def test_implementations_agree(case, model_dir):
    """dot_product attention = einsum attention; one-hot reference MoE = dropless MoE."""
    path = model_dir(case)
    ids = random_ids(BATCH, LENGTH, seed=6)
    base = ours(path, ids)
    assert np.abs(ours(path, ids, ModelConfig(attention="dot_product")) - base).max() <= 1e-5
    segments = jnp.asarray(np.repeat([[1, 2]], BATCH, axis=0).repeat(LENGTH // 2, axis=1))
    masked = ours(path, ids, segment_ids_BL=segments)
    assert (
        np.abs(ours(path, ids, ModelConfig(attention="dot_product"), segment_ids_BL=segments) - masked).max()
        <= 1e-5
    )
    assert np.abs(ours(path, ids, ModelConfig(moe_impl="reference")) - base).max() <= 1e-5
    assert np.abs(ours(path, ids, ModelConfig(remat="full")) - base).max() == 0


def test_bf16_compute_keeps_params_and_stays_close(model_dir):
    path = model_dir("qwen2_moe")
    spec, params = load(path)
    ids = jnp.asarray(random_ids(BATCH, LENGTH, seed=7))
    ref, _ = forward_jit(params, ids, spec)
    low, _ = forward_jit(params, ids, spec, ModelConfig(compute_dtype="bfloat16"))
    assert low.dtype == jnp.float32 and params["embed"].dtype == jnp.float32
    assert np.abs(np.asarray(low) - np.asarray(ref)).max() < 5e-2
    spec16, params16 = load(path, dtype=jnp.bfloat16)
    assert params16["layers"]["moe"]["moe"]["experts"]["gate_proj"].dtype == jnp.bfloat16
    out16, _ = forward_jit(params16, ids, spec16, ModelConfig(compute_dtype="bfloat16"))
    assert np.isfinite(np.asarray(out16)).all()


def test_gradients_reach_every_trained_parameter(model_dir):
    spec, params = load(model_dir("glm4_moe-rsf-bias"))
    ids = jnp.asarray(random_ids(BATCH, 16, seed=8))

    def loss(p):
        out, _ = forward(p, ids[:, :-1], spec)
        logp = jax.nn.log_softmax(out)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    grads = jax.jit(jax.grad(loss))(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        name = jax.tree_util.keystr(path)
        assert np.isfinite(np.asarray(g)).all(), name
        if "router_bias" not in name:
            assert np.abs(np.asarray(g)).max() > 0, name


# --- the parameter tree ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["glm4_moe-rsf-bias", "qwen3_moe-interleaved", "llama-tied"])
def test_tree_is_one_to_one_with_canonical_names(case, model_dir):
    ckpt = read_checkpoint(model_dir(case))
    infos = jax.tree.leaves(P.declare_tree(ckpt.spec), is_leaf=lambda x: isinstance(x, P.ParamInfo))
    names = [n for info in infos for n in info.names]
    assert sorted(names) == sorted(d.name for d in declare_params(ckpt.spec))
    params = P.from_tensors(ckpt.spec, ckpt.tensors)
    back = P.to_tensors(ckpt.spec, params)
    assert list(back) == [d.name for d in declare_params(ckpt.spec)]
    for name, t in ckpt.tensors.items():
        np.testing.assert_array_equal(back[name].load(), t.load())
        assert back[name].dtype == t.dtype
        if len(t.shape) == 3:
            np.testing.assert_array_equal(back[name].part(1), t.part(1))


def test_layer_spans_follow_layer_order(model_dir):
    spec = read_checkpoint(model_dir("qwen3_moe-interleaved")).spec
    assert [(r.kind, r.start, r.length) for r in P.layer_spans(spec)] == [
        ("dense", 0, 1),
        ("moe", 0, 1),
        ("dense", 1, 1),
        ("moe", 1, 1),
    ]
    spec = read_checkpoint(model_dir("glm4_moe")).spec
    assert [(r.kind, r.length) for r in P.layer_spans(spec)] == [("dense", 1), ("moe", 1)]


def test_init_and_abstract_params_follow_the_declaration(model_dir):
    spec = read_checkpoint(model_dir("glm4_moe-rsf-bias")).spec
    params = P.init_params(spec, jax.random.key(0), dtype=jnp.bfloat16)
    abstract = P.abstract_params(spec, jnp.bfloat16)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert shapes == jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    moe = params["layers"]["moe"]
    assert moe["moe"]["router_bias"].dtype == jnp.float32 and not np.asarray(moe["moe"]["router_bias"]).any()
    assert (np.asarray(moe["attn_norm"], np.float32) == 1).all()
    assert abs(float(np.asarray(moe["moe"]["experts"]["gate_proj"], np.float32).std()) - 0.02) < 0.005
    out, _ = forward_jit(params, jnp.zeros((1, 8), jnp.int32), spec)
    assert np.isfinite(np.asarray(out)).all()


def test_wrong_tensors_are_refused(model_dir):
    ckpt = read_checkpoint(model_dir("llama"))
    with pytest.raises(ValueError, match="missing"):
        P.from_tensors(ckpt.spec, ckpt.tensors.without(["final_norm"]))


# --- sharding ---------------------------------------------------------------------------------------------
def test_rules_map_logical_axes_to_mesh_axes():
    from jax.sharding import PartitionSpec as PS

    assert logical_to_spec(("layers", "experts", "expert_mlp", "embed")) == PS(None, "expert", None,
                                                                               ("fsdp", "context"))
    assert logical_to_spec(("batch", None)) == PS(("data", "fsdp", "expert"))
    assert logical_to_spec(("batch", "seq", "act_embed")) == PS(("data", "fsdp", "expert"), "context")
    assert logical_to_spec(("batch", "kv_seq", None, None)) == PS(("data", "fsdp", "expert"))  # gathered whole
    assert logical_to_spec(("tokens", "act_embed")) == PS(("data", "fsdp", "expert", "context"))
    assert logical_to_spec(("norm",)) == PS()
    with pytest.raises(ValueError, match="two dimensions"):
        logical_to_spec(("embed", "embed"))
    with pytest.raises(KeyError, match="no sharding rule"):
        logical_to_spec(("heads",))


def test_fsdp_is_split_only_where_the_experts_are_fewer_than_its_devices():
    """Outer × inner FSDP: the outer part the largest size dividing the experts per expert group and FSDP."""
    from upcycler.train.loop.sharding import fsdp_split

    assert fsdp_split(64, 256) == 64  # the reference MoE on v5e-256: one expert per outer part, D over 4
    assert fsdp_split(8, 32) == 8  # 64 experts over expert 8 × fsdp 32
    assert fsdp_split(96, 256) == 32  # three experts per outer part: split, gathered dimension by dimension
    assert fsdp_split(4, 2) == fsdp_split(64, 64) == 1  # as many experts as FSDP devices or more: no split
    assert fsdp_split(0, 256) == fsdp_split(1, 2) == fsdp_split(3, 8) == 1  # dense; nothing to share


_SHARDED = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from upcycler.io import read_checkpoint
from upcycler.train.loop import sharding as S
from upcycler.train.model import params as P
from upcycler.train.model import forward_jit

ckpt = read_checkpoint(sys.argv[1])
ids = jnp.asarray(np.load(sys.argv[2]))
data, fsdp, expert = map(int, sys.argv[4].split("x"))
mesh = S.make_mesh(data=data, fsdp=fsdp, expert=expert, experts=ckpt.spec.moe.num_experts)
shardings = S.param_shardings(ckpt.spec, mesh)
params = P.from_tensors(ckpt.spec, ckpt.tensors, shardings=shardings)
gate = params["layers"]["moe"]["moe"]["experts"]["gate_proj"]
with jax.set_mesh(mesh):
    out, aux = forward_jit(params, jax.device_put(ids, S.batch_sharding(mesh)), ckpt.spec, placement=S.PLACEMENT)
np.save(sys.argv[3], np.asarray(out))
print(json.dumps({"gate": list(gate.sharding.spec), "shards": len(gate.addressable_shards),
                  "shard_shape": list(gate.addressable_shards[0].data.shape), "mesh": dict(mesh.shape)}))
"""


@pytest.mark.parametrize("mesh,gate_spec,block", [
    ("2x2x2", [None, "expert", None, "fsdp"], [1, 2, 32, 32]),
    # 4 experts over 8 FSDP devices: FSDP split 4 × 2, one expert per outer part, its width over the inner
    ("1x8x1", [None, "fsdp_outer", None, "fsdp"], [1, 1, 32, 32]),
], ids=["data-fsdp-expert", "fsdp-split-for-the-experts"])
def test_sharded_forward_on_8_devices_equals_single_device(model_dir, tmp_path, mesh, gate_spec, block):
    import json

    path = model_dir("glm4_moe-rsf-bias")
    ids = random_ids(8, 32, seed=9)
    np.save(tmp_path / "ids.npy", ids)
    script = tmp_path / "sharded.py"
    script.write_text(textwrap.dedent(_SHARDED))
    env = {
        **__import__("os").environ,
        "XLA_FLAGS": with_devices(8),
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(path), str(tmp_path / "ids.npy"), str(tmp_path / "out.npy"), mesh],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["gate"] == gate_spec and info["shard_shape"] == block
    assert ("fsdp_outer" in info["mesh"]) == (mesh == "1x8x1")
    single = ours(path, ids)
    assert np.abs(np.load(tmp_path / "out.npy") - single).max() <= 1e-5
