"""A family added in one place needs no other edit: a toy MoE family, registered here, is an upcycling target.

`TOY` is Mixtral under another name: its own architecture, model_type and on-disk tensor names
(`toy_moe.` for `block_sparse_moe.`), and an `auto_rank` that puts it first in `--target auto`. Upcycling
a tiny Llama into it must store exactly the tensors the same upcycle into Mixtral stores, so the
function is preserved, and nothing outside this file knows it exists.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from transform_helpers import config, run_transform, stored

from upcycler.families import FAMILIES, auto_order, registered
from upcycler.families.moe import MIXTRAL
from upcycler.io import read_checkpoint, write_checkpoint
from upcycler.transforms import transform_named
from upcycler.transforms.dense_to_moe import DenseToMoE

TOY = dataclasses.replace(
    MIXTRAL, name="toy_moe", architecture="ToyMoeForCausalLM", model_type="toy_moe",
    moe_names={k: v.replace("block_sparse_moe.", "toy_moe.") for k, v in MIXTRAL.moe_names.items()},
    auto_rank=-1,
)
REQUEST = {"experts": 8, "topk": 4, "granularity": 2}


def _same_tensors(a, b) -> None:
    """The two checkpoints hold the same canonical tensors, bit for bit, and the same spec but the family."""
    assert a.spec.replace(family=b.spec.family) == b.spec
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name].load(), b.tensors[name].load(), err_msg=name)


@pytest.fixture(scope="module")
def mixtral_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixtral") / "out"
    run_transform("dense-to-moe", tiny_dir("llama"), out, target="mixtral", **REQUEST)
    return out


def test_auto_picks_the_toy_family_and_preserves_the_function(tiny_dir, mixtral_dir, tmp_path):
    out = tmp_path / "toy"
    with registered(TOY):
        assert auto_order()[0] == "toy_moe"
        p = run_transform("dense-to-moe", tiny_dir("llama"), out, target="auto", **REQUEST)
        why = " ".join(n.text for n in p.steps[0].notes)
        assert "target toy_moe (auto: the first of toy_moe, mixtral" in why
        toy = read_checkpoint(out)
        assert toy.spec.family == "toy_moe"
        _same_tensors(toy, read_checkpoint(mixtral_dir))
    assert "toy_moe" not in FAMILIES and "toy_moe" not in auto_order()

    cfg = config(out)
    assert (cfg["architectures"], cfg["model_type"]) == (["ToyMoeForCausalLM"], "toy_moe")
    names = stored(out)
    assert "model.layers.0.toy_moe.experts.7.w1.weight" in names
    assert not any("block_sparse_moe" in n for n in names)
    renamed = {n.replace("block_sparse_moe.", "toy_moe."): t for n, t in stored(mixtral_dir).items()}
    assert sorted(renamed) == sorted(names)


def test_explicit_toy_target_through_the_transform_and_writer(tiny_dir, mixtral_dir, tmp_path):
    src = read_checkpoint(tiny_dir("llama"))
    with registered(TOY):
        applied = transform_named("dense-to-moe").apply(DenseToMoE(target="toy_moe", **REQUEST), src.spec,
                                                        src.tensors)
        assert applied.exact and applied.spec.family == "toy_moe"
        write_checkpoint(src.replace(spec=applied.spec, tensors=applied.tensors), tmp_path / "toy")
        _same_tensors(read_checkpoint(tmp_path / "toy"), read_checkpoint(mixtral_dir))
