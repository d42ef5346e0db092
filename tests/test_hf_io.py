"""HF read → write round trips: bit-identical tensors, loadable by transformers, identical logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import run_cli
from safetensors.numpy import load_file
from tiny_models import FAMILIES, logits, make_tiny, random_ids

from upcycler.io import read_checkpoint, write_checkpoint


def stored_tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name, array in a.items():
        assert array.dtype == b[name].dtype and array.shape == b[name].shape, name
        assert array.tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_every_family(family, tiny_dir, tmp_path):
    src = tiny_dir(family)
    out = write_checkpoint(read_checkpoint(src), tmp_path / "out", progress=False)
    assert_bit_identical(stored_tensors(src), stored_tensors(out))
    ids = random_ids(batch=2, length=24)
    np.testing.assert_array_equal(logits(src, ids), logits(out, ids))


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_sharded_input_and_output(family, tmp_path):
    src = make_tiny(family, tmp_path / "src", max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").exists()
    out = tmp_path / "out"
    run_cli("convert", src, out, "--shard-size", "30KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).exists() for s in shards)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in stored_tensors(out).values())
    assert_bit_identical(stored_tensors(src), stored_tensors(out))
    ids = random_ids()
    np.testing.assert_array_equal(logits(src, ids), logits(out, ids))


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied, tmp_path):
    src = make_tiny("llama", tmp_path / "src", tie_word_embeddings=tied)
    out = write_checkpoint(read_checkpoint(src), tmp_path / "out", progress=False)
    assert ("lm_head.weight" in stored_tensors(out)) is (not tied)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tied
    ids = random_ids()
    np.testing.assert_array_equal(logits(src, ids), logits(out, ids))


def test_storage_only_config_fields_are_not_carried(tmp_path):
    """A dequantised save (GGUF → float) keeps quantization_config; our float output must not claim it."""
    src = make_tiny("llama", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf", "gguf_file": "model.gguf", "dequantize": False}
    config["bos_token_id"] = 7  # an ordinary uninterpreted field is still carried
    (src / "config.json").write_text(json.dumps(config))
    out = write_checkpoint(read_checkpoint(src), tmp_path / "out", progress=False)
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and written["bos_token_id"] == 7


def test_bf16_round_trip_and_dtype_cast(tmp_path):
    src = make_tiny("mistral", tmp_path / "src", dtype="bfloat16")
    out = tmp_path / "out"
    run_cli("convert", src, out)
    assert_bit_identical(stored_tensors(src), stored_tensors(out))
    as_fp32 = tmp_path / "fp32"
    run_cli("convert", src, as_fp32, "--dtype", "fp32")
    for name, value in stored_tensors(as_fp32).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, stored_tensors(src)[name].astype(np.float32))


def test_manifest_records_hashes_and_side_files(tiny_dir, tmp_path):
    import hashlib

    src = tiny_dir("qwen3")
    (src / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    out = write_checkpoint(read_checkpoint(src), tmp_path / "out", progress=False)
    manifest = json.loads((out / "upcycler.json").read_text())
    for name, record in manifest["files"].items():
        data = (out / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 256}'
    assert manifest["lineage"][0]["step"] == "read"


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_counts_match_transformers(family, tiny_dir):
    from tiny_models import load_model

    src = tiny_dir(family)
    info = json.loads(run_cli("inspect", src, "--json").stdout)
    model = load_model(src)
    assert info["total_params"] == sum(p.numel() for p in model.parameters())
    assert info["family"] == family and info["layers"] == model.config.num_hidden_layers


def test_inspect_config_only_directory(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_dir("mixtral") / "config.json").read_text())
    info = json.loads(run_cli("inspect", tmp_path, "--json").stdout)
    assert info["weights"].startswith("none")
    assert info["total_params"] == json.loads(run_cli("inspect", tiny_dir("mixtral"), "--json").stdout)["total_params"]
