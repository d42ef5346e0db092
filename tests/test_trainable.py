"""optimizer.trainable: which rows train (regex, new_layers from the depth lineage), frozen rows without
optimiser state and unchanged to the bit, and a depth-grown model trained on its new blocks only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import trainer_fixtures as F
from click.testing import CliRunner

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.io.manifest import new_layers, read_manifest
from upcycler.spec import MoESpec
from upcycler.train.config import OptimizerConfig
from upcycler.train.loop import sharding
from upcycler.train.loop.optim import keep_trainable, make_optimizer, trainable_rows
from upcycler.train.loop.train_step import state_layout
from upcycler.train.model.params import init_params

# tiny_spec(moe=True): layer 0 dense, layers 1 and 2 MoE (the "moe" stack holds them as rows 0 and 1)
DENSE_LEAVES = ("attn.k_norm", "attn.k_proj", "attn.o_proj", "attn.q_norm", "attn.q_proj", "attn.v_proj",
                "attn_norm", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "mlp_norm")
MOE_LEAVES = ("attn.k_norm", "attn.k_proj", "attn.o_proj", "attn.q_norm", "attn.q_proj", "attn.v_proj",
              "attn_norm", "mlp_norm", "moe.experts.down_proj", "moe.experts.gate_proj", "moe.experts.up_proj",
              "moe.router")
LLAMA_LEAVES = tuple(leaf for leaf in DENSE_LEAVES if leaf not in ("attn.q_norm", "attn.k_norm"))  # tiny_spec()


def flat(tree) -> dict[str, object]:
    """{"layers.moe.moe.router": leaf, …}: a params-like tree by dotted path."""
    return {".".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def rows_of(o: OptimizerConfig, spec, lineage=()) -> dict[str, list[bool]]:
    return {k: np.atleast_1d(v).tolist() for k, v in flat(trainable_rows(o, spec, lineage)).items()}


def depth_step(layer_map: list[int], added: list[int]) -> dict:
    return {"step": "depth", "config": {"layers": len(layer_map), "method": "identity", "layer_map": None},
            "function_preserving": True, "notes": [], "layer_map": layer_map, "new_layers": added}


READ = {"step": "read", "source": "somewhere", "format": "hf"}


# --- which rows train ---------------------------------------------------------------------------------

def test_all_trains_everything():
    assert trainable_rows(OptimizerConfig(), F.tiny_spec(moe=True)) is None


def test_a_regex_selects_tensors_row_by_row():
    spec = F.tiny_spec(moe=True)
    rows = rows_of(OptimizerConfig(trainable="experts|router"), spec)
    expected = {"embed": [False], "final_norm": [False], "lm_head": [False]}
    expected.update({f"layers.dense.{leaf}": [False] for leaf in DENSE_LEAVES})
    expected.update({f"layers.moe.{leaf}": [leaf.startswith("moe."), leaf.startswith("moe.")] for leaf in MOE_LEAVES})
    assert rows == expected

    rows = rows_of(OptimizerConfig(trainable=r"^layers\.2\.|final_norm"), spec)
    assert rows["final_norm"] == [True] and rows["embed"] == rows["lm_head"] == [False]
    assert all(rows[f"layers.dense.{leaf}"] == [False] for leaf in DENSE_LEAVES)
    assert all(rows[f"layers.moe.{leaf}"] == [False, True] for leaf in MOE_LEAVES)


def test_buffers_never_train():
    spec = dataclasses.replace(F.tiny_spec(moe=True),
                               moe=MoESpec(num_experts=4, top_k=2, expert_width=16, router_bias=True))
    rows = rows_of(OptimizerConfig(trainable="moe"), spec)
    assert rows["layers.moe.moe.router_bias"] == [False, False]
    assert rows["layers.moe.moe.router"] == [True, True]


def test_a_regex_that_trains_nothing_is_one_line():
    with pytest.raises(UpcyclerError, match="matches no trainable tensor") as err:
        trainable_rows(OptimizerConfig(trainable="no_such_tensor"), F.tiny_spec())
    assert "\n" not in str(err.value)


def test_new_layers_from_a_depth_step():
    spec = F.tiny_spec(num_layers=6)  # 4 → 6 by identity: layer map 0,1,1,2,3,3; copies 2 and 5
    lineage = [READ, depth_step([0, 1, 1, 2, 3, 3], [2, 5])]
    assert new_layers(lineage) == (2, 5)
    rows = rows_of(OptimizerConfig(trainable="new_layers"), spec, lineage)
    assert rows.pop("embed") == rows.pop("final_norm") == rows.pop("lm_head") == [False]
    assert rows == {f"layers.dense.{leaf}": [False, False, True, False, False, True] for leaf in LLAMA_LEAVES}


def test_new_layers_compose_over_two_depth_steps():
    # 2 → 3: map 0,1,1 (new: 2); then 3 → 5: map 0,1,1,2,2 (repeats: 2, 4; output 3's source 2 was new)
    lineage = [READ, depth_step([0, 1, 1], [2]), {"step": "continued-pretrain"}, depth_step([0, 1, 1, 2, 2], [2, 4])]
    assert new_layers(lineage) == (2, 3, 4)
    rows = rows_of(OptimizerConfig(trainable="new_layers"), F.tiny_spec(num_layers=5), lineage)
    assert rows["layers.dense.attn.q_proj"] == [False, False, True, True, True]


def test_new_layers_unknown_without_a_recorded_depth_step():
    assert new_layers([]) is None and new_layers([READ, {"step": "dense-to-moe"}]) is None
    old = {"step": "depth", "config": {"layers": 6}, "function_preserving": True, "notes": []}
    assert new_layers([READ, old]) is None
    assert new_layers([READ, depth_step([0, 0, 1], [1]), old]) is None  # the later growth is unknown
    with pytest.raises(UpcyclerError, match="lineage step 1 .*malformed"):
        new_layers([READ, depth_step([0, 1, 1], [3])])
    for lineage in ([], [READ], [READ, old]):
        with pytest.raises(UpcyclerError, match="records no depth growth.*upcycle depth") as err:
            trainable_rows(OptimizerConfig(trainable="new_layers"), F.tiny_spec(), lineage)
        assert "\n" not in str(err.value)
        with pytest.raises(UpcyclerError, match="records no depth growth"):
            make_optimizer(OptimizerConfig(trainable="new_layers"), F.tiny_spec(), lineage)


def test_keep_trainable_zeroes_the_frozen_rows():
    spec = F.tiny_spec(moe=True)
    rows = trainable_rows(OptimizerConfig(trainable=r"^layers\.2\."), spec)
    grads = jax.tree.map(jnp.ones_like, init_params(spec, jax.random.key(0)))
    kept = flat(keep_trainable(grads, rows))
    assert not np.asarray(kept["embed"]).any() and not np.asarray(kept["layers.dense.attn.q_proj"]).any()
    router = np.asarray(kept["layers.moe.moe.router"])
    assert not router[0].any() and (router[1] == 1).all()
    assert keep_trainable(grads, None) is grads


# --- the optimiser ------------------------------------------------------------------------------------

def state_bytes(state) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))


def test_frozen_tensors_have_no_optimiser_state():
    spec = F.tiny_spec(moe=True)
    params = init_params(spec, jax.random.key(0))
    # Parameters by hand (D 32, V 384, 4 heads of 8, 2 kv heads, dense F 64, 4 experts of width 16):
    #   embed, lm_head 384·32 each = 24576; final_norm 32
    #   per layer: norms 32 + 32, q_norm/k_norm 8 + 8, q 32·32, k 16·32, v 16·32, o 32·32 = 3152; × 3 = 9456
    #   dense MLP (layer 0) 3·64·32 = 6144; MoE layers 1, 2: router 4·32 + experts 3·4·16·32 = 6272 each
    #   total 24576 + 32 + 9456 + 6144 + 12544 = 52752; experts alone 2·6144 = 12288
    # State: two fp32 moments per trained parameter and two int32 step counts (Adam's, the schedule's).
    full = state_bytes(make_optimizer(OptimizerConfig(), spec)[0].init(params))
    experts = state_bytes(make_optimizer(OptimizerConfig(trainable="experts"), spec)[0].init(params))
    assert full == 2 * 4 * 52752 + 8 == 422024
    assert experts == 2 * 4 * 12288 + 8 == 98312
    assert (experts - 8) / (full - 8) == 12288 / 52752

    # the sharded layout: a fully frozen leaf carries no state (and no sharding), counters replicated
    mesh = sharding.make_mesh()
    layout = state_layout(spec, OptimizerConfig(trainable="experts"), mesh)
    abstract = layout.abstract.opt_state
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)) == 98312
    assert jax.tree.structure(layout.shardings.opt_state) == jax.tree.structure(abstract)
    mu = abstract.inner_state[1][0].mu
    assert isinstance(mu["embed"], optax.MaskedNode) and mu["layers"]["moe"]["moe"]["experts"]["up_proj"].shape == (2, 4, 16, 32)
    state = jax.jit(layout.tx.init, out_shardings=layout.shardings.opt_state)(params)
    assert state_bytes(state) == 98312


def noise(tree, seed: int):
    """Standard normal gradients for every leaf of `tree` (non-zero everywhere)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def test_frozen_rows_stay_bit_identical_and_clipping_counts_trainable_rows_only():
    spec = F.tiny_spec(moe=True)
    o = OptimizerConfig(trainable=r"^layers\.2\.|final_norm", lr=1e-2, weight_decay=0.5, clip_norm=1.0)
    tx, _ = make_optimizer(o, spec)
    params = init_params(spec, jax.random.key(0))
    params["layers"]["moe"]["attn"]["q_proj"] = params["layers"]["moe"]["attn"]["q_proj"].at[0, 0, 0].set(-0.0)
    start = jax.tree.map(np.asarray, params)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(5):
        grads = noise(params, step)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    before, after = flat(start), flat(params)
    for name in ("embed", "lm_head", *(f"layers.dense.{leaf}" for leaf in DENSE_LEAVES)):
        assert np.asarray(after[name]).tobytes() == before[name].tobytes(), name
    assert np.asarray(after["final_norm"]).tobytes() != before["final_norm"].tobytes()
    for leaf in MOE_LEAVES:
        a, b = np.asarray(after[f"layers.moe.{leaf}"]), before[f"layers.moe.{leaf}"]
        assert a[0].tobytes() == b[0].tobytes(), leaf  # layer 1: frozen
        assert (a[1] != b[1]).any(), leaf  # layer 2: trained
    assert np.signbit(np.asarray(after["layers.moe.attn.q_proj"])[0, 0, 0])

    # clipping: huge gradients in frozen rows change nothing about the trainable rows' update
    params = init_params(spec, jax.random.key(1))
    rows = trainable_rows(o, spec)
    small = jax.tree.map(lambda p: jnp.full(p.shape, 0.01), params)
    huge = jax.tree.map(lambda g, r: jnp.where(jnp.asarray(r).reshape(-1, *(1,) * (g.ndim - 1)), g, 1e6),
                        small, rows)
    a, _ = tx.update(small, tx.init(params), params)
    b, _ = tx.update(huge, tx.init(params), params)
    assert jax.tree.all(jax.tree.map(lambda x, y: np.asarray(x).tobytes() == np.asarray(y).tobytes(), a, b))


def test_depth_records_its_layer_map_and_new_layers(tiny_dir, tmp_path):
    src = tiny_dir("llama", num_hidden_layers=4)

    def grow(source, out, *options):
        result = CliRunner().invoke(main, ["depth", str(source), str(out), *options])
        assert result.exit_code == 0, result.output
        return list(read_manifest(out).lineage)

    lineage = grow(src, tmp_path / "identity", "--layers", "6", "--method", "identity")
    step = next(s for s in lineage if s["step"] == "depth")
    assert step["layer_map"] == [0, 1, 1, 2, 3, 3] and step["new_layers"] == [2, 5]
    assert new_layers(lineage) == (2, 5)
    # SOLAR 4 → 6: layers 0..2 then 1..3; the second 1 and 2 are new, 3 is its source's first occurrence
    solar = grow(src, tmp_path / "solar", "--layers", "6", "--method", "solar")
    assert new_layers(solar) == (3, 4)
    # growing the grown model again: 6 → 7 copies layer 5 (new itself): 2, 5 and the copy 6
    assert new_layers(grow(tmp_path / "identity", tmp_path / "again", "--layers", "7")) == (2, 5, 6)


# --- end to end ---------------------------------------------------------------------------------------

def test_training_new_layers_changes_only_the_inserted_blocks(ws, cache, tmp_path):
    grown = tmp_path / "grown"
    result = CliRunner().invoke(main, ["depth", str(ws["dense"]), str(grown), "--layers", "4"])
    assert result.exit_code == 0, result.output  # 2 → 4 layers: map 0,0,1,1, the copies 1 and 3 are new
    cfg = F.config_dict(tmp_path, grown, ws["data"], steps=50, **{
        "optimizer.trainable": "new_layers", "checkpoint.every": 50, "data.seq_len": 16,
        "data.global_batch_size": 4})
    config = F.write_config(tmp_path / "train.yaml", cfg)
    result = CliRunner().invoke(main, ["continued-pretrain", "--config", str(config)])
    assert result.exit_code == 0, result.output
    before, after = F.step_params(grown), F.step_params(tmp_path / "run" / "50")
    assert before.keys() == after.keys()
    new = {1, 3}
    for name, array in before.items():
        if not any(name.startswith(f"layers.{j}.") for j in new):
            assert after[name].dtype == array.dtype and after[name].tobytes() == array.tobytes(), name
    for j in new:
        assert any(after[n].tobytes() != a.tobytes() for n, a in before.items() if n.startswith(f"layers.{j}.")), j
