"""Orbax output: HF -> Orbax -> HF is bit-identical, reads are lazy, and damage gives one-line errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from tiny_models import logits, random_ids

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint, write_checkpoint
from upcycler.io.orbax_read import read_orbax
from upcycler.tensors import BF16, TensorMap, constant

ROUND_TRIPS = [
    ("llama", {}),
    ("qwen3", {"dtype": "bfloat16"}),
    ("mixtral", {}),
    ("qwen2_moe", {"dtype": "bfloat16"}),
    ("glm4_moe", {}),
]


def _tensors(directory: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of an HF directory as (dtype, shape, raw bytes)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            for name in sorted(f.keys()):
                array = f.get_tensor(name)
                out[name] = (str(array.dtype), list(array.shape), array.tobytes())
    return out


def _rchar() -> int:
    """Bytes this process has read through read(2)/pread(2) so far (page cache hits included)."""
    stats = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(stats["rchar"])


@pytest.fixture(scope="module")
def orbax_mixtral(tiny_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(HF source, its Orbax output) for a small Mixtral whose tensors are large enough to measure reads."""
    src = tiny_dir("mixtral", intermediate_size=1024, vocab_size=8192)
    out = tmp_path_factory.mktemp("orbax") / "out"
    write_checkpoint(read_checkpoint(src), out, to="orbax", progress=False)
    return src, out


@pytest.mark.parametrize("family,overrides", ROUND_TRIPS, ids=[f for f, _ in ROUND_TRIPS])
def test_hf_orbax_hf_is_bit_identical(tiny_dir, tmp_path, family, overrides):
    src = tiny_dir(family, **overrides)
    write_checkpoint(read_checkpoint(src), tmp_path / "orbax", to="orbax", progress=False)
    back = write_checkpoint(read_checkpoint(tmp_path / "orbax"), tmp_path / "hf", to="hf", progress=False)

    expected, got = _tensors(src), _tensors(back)
    assert sorted(got) == sorted(expected)
    for name, (dtype, shape, data) in expected.items():
        assert got[name][:2] == (dtype, shape), name
        assert got[name][2] == data, f"{name}: bytes differ"
    if overrides.get("dtype") == "bfloat16":
        assert {d for d, _, _ in got.values()} == {"bfloat16"}
    ids = random_ids()
    np.testing.assert_array_equal(logits(back, ids), logits(src, ids))


def test_tree_is_canonical_and_loads_in_orbax(orbax_mixtral):
    import jax
    import orbax.checkpoint.experimental.v1 as ocp

    src, out = orbax_mixtral
    ckpt = read_checkpoint(src)
    meta = ocp.metadata(out / "params").metadata
    assert set(meta) == {"embed", "layers", "final_norm", "lm_head"}
    assert set(meta["layers"]) == {"0", "1"}
    assert set(meta["layers"]["0"]["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    experts = meta["layers"]["1"]["moe"]["experts"]["down_proj"]
    assert tuple(experts.shape) == ckpt.tensors["layers.1.moe.experts.down_proj"].shape == (4, 64, 1024)
    assert experts.storage_metadata.chunk_shape[0] == 1  # one expert per chunk

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    leaf = jax.ShapeDtypeStruct((4, 64, 1024), np.float32, sharding=sharding)
    abstract = {"layers": {"1": {"moe": {"experts": {"down_proj": leaf}}}}}
    with ocp.Context(pytree_options=ocp.options.PyTreeOptions(
            loading=ocp.options.PyTreeOptions.Loading(partial_load=True))):
        loaded = ocp.load(out / "params", abstract)
    np.testing.assert_array_equal(np.asarray(loaded["layers"]["1"]["moe"]["experts"]["down_proj"]),
                                  ckpt.tensors["layers.1.moe.experts.down_proj"].load())


def test_bf16_round_trips_bit_exactly(tmp_path, tiny_dir):
    ckpt = read_checkpoint(tiny_dir("llama"))
    raw = np.random.default_rng(0).integers(0, 2**16, size=ckpt.tensors["embed"].shape, dtype=np.uint16)
    raw[:4, :4] = [0x7FC0, 0xFF80, 0x0001, 0x8000]  # NaN, -inf, a subnormal, -0: every pattern survives
    tensors = TensorMap({**ckpt.tensors.astype(BF16), "embed": constant(raw.view(ml_dtypes.bfloat16))})
    write_checkpoint(ckpt.replace(tensors=tensors), tmp_path / "o", to="orbax", progress=False)
    back = read_orbax(tmp_path / "o").tensors
    assert back["embed"].dtype == BF16
    assert back["embed"].load().view(np.uint16).tobytes() == raw.tobytes()
    assert back["embed"].part(2).view(np.uint16).tobytes() == raw[2].tobytes()
    for name, tensor in tensors.items():
        assert back[name].load().tobytes() == tensor.load().tobytes(), name


def test_metadata_read_reads_no_array_bytes(orbax_mixtral):
    _, out = orbax_mixtral
    before = _rchar()
    ckpt = read_orbax(out)
    shapes = {name: (t.shape, t.dtype) for name, t in ckpt.tensors.items()}
    metadata_bytes = _rchar() - before
    assert len(shapes) == len(ckpt.tensors) and ckpt.tensors.nbytes > 10_000_000
    assert metadata_bytes < 100_000, metadata_bytes

    experts = ckpt.tensors["layers.0.moe.experts.up_proj"]
    before = _rchar()
    part = experts.part(3)
    part_bytes = _rchar() - before
    assert part.nbytes <= part_bytes < 2 * part.nbytes, "part(e) should read one expert, not all of them"
    np.testing.assert_array_equal(part, experts.load()[3])


def test_manifest_carries_spec_lineage_hashes_and_side_files(orbax_mixtral):
    src, out = orbax_mixtral
    source = read_checkpoint(src)
    manifest = json.loads((out / "upcycler.json").read_text())
    assert manifest["format"] == 1
    assert manifest["spec"] == json.loads(source.spec.to_json())
    back = read_orbax(out)
    assert back.spec == source.spec
    assert back.lineage[:-1] == source.lineage
    assert back.lineage[-1] == {"step": "read", "source": str(out), "format": "orbax"}
    assert [p.name for p in back.side_files] == [p.name for p in source.side_files]
    assert sorted(manifest["files"]) == sorted(p.name for p in source.side_files)
    for name, record in manifest["files"].items():
        data = (out / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert list(manifest["tensors"]) == list(source.tensors)
    for name, tensor in source.tensors.items():
        data = tensor.load()
        assert manifest["tensors"][name] == {"dtype": "float32", "shape": list(data.shape),
                                             "sha256": hashlib.sha256(data.tobytes()).hexdigest()}, name
    assert not list(out.parent.glob(".*partial*")), "the staging directory was left behind"


def _damaged_copy(out: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(out, copy)
    return copy


def _edit_tensor_dtype(path: Path, name: str, dtype: str) -> None:
    manifest = json.loads((path / "upcycler.json").read_text())
    manifest["tensors"][name]["dtype"] = dtype
    (path / "upcycler.json").write_text(json.dumps(manifest))


def _edit_spec(path: Path, **changes) -> None:
    manifest = json.loads((path / "upcycler.json").read_text())
    manifest["spec"].update(changes)
    (path / "upcycler.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage,message", [
    (lambda p: shutil.rmtree(p / "params"), "params: missing"),
    (lambda p: (p / "params/state/_METADATA").unlink(), "no Orbax _METADATA"),
    (lambda p: (p / "params/state/_METADATA").write_text("{"), "_METADATA: unreadable JSON"),
    (lambda p: (p / "upcycler.json").unlink(), "upcycler.json: missing"),
    (lambda p: (p / "upcycler.json").write_text("{\"format\": 1, "), "upcycler.json: unreadable JSON"),
    (lambda p: (p / "upcycler.json").write_text("{\"format\": 1}"), "no 'spec'"),
    (lambda p: _edit_spec(p, num_heads="many", moe=None, bogus=1), "not a valid model spec"),
    (lambda p: _edit_spec(p, num_layers=3), "tensor 'layers.2.attn_norm' is missing"),
    (lambda p: _edit_spec(p, num_layers=1), "tensor 'layers.1.attn.k_proj' is not part of the model"),
    (lambda p: _edit_spec(p, vocab_size=8000), "tensor 'embed' has shape [8192, 64]"),
    (lambda p: _edit_tensor_dtype(p, "final_norm", "bfloat16"), "stored as float32 but upcycler.json"),
], ids=["no-params", "no-metadata", "bad-metadata", "no-manifest", "bad-manifest", "no-spec", "bad-spec",
        "more-layers", "fewer-layers", "other-shape", "other-dtype"])
def test_damage_gives_one_line_error(orbax_mixtral, tmp_path, damage, message):
    path = _damaged_copy(orbax_mixtral[1], tmp_path)
    damage(path)
    with pytest.raises(UpcyclerError) as err:
        read_orbax(path)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(path) in str(err.value)


def test_missing_array_data_fails_cleanly_on_load(orbax_mixtral, tmp_path):
    path = _damaged_copy(orbax_mixtral[1], tmp_path)
    for data in (path / "params/state").glob("ocdbt.process_*"):
        shutil.rmtree(data)
    with pytest.raises(UpcyclerError, match="cannot (open|read) tensor .* the checkpoint is damaged") as err:
        read_orbax(path).tensors["embed"].load()
    assert "\n" not in str(err.value)


def test_read_checkpoint_detects_orbax_and_errors_without_params(orbax_mixtral, tmp_path):
    assert read_checkpoint(orbax_mixtral[1]).spec.family == "mixtral"
    path = _damaged_copy(orbax_mixtral[1], tmp_path)
    shutil.rmtree(path / "params")
    with pytest.raises(UpcyclerError, match="params/"):
        read_checkpoint(path)


def test_failed_write_leaves_no_output(tiny_dir, tmp_path):
    ckpt = read_checkpoint(tiny_dir("llama"))
    broken = ckpt.tensors["layers.1.mlp.up_proj"]

    def fail() -> np.ndarray:
        raise OSError(28, "No space left on device")

    from upcycler.tensors import LazyTensor

    tensors = ckpt.tensors.updated({"layers.1.mlp.up_proj": LazyTensor(broken.shape, broken.dtype, fail)})
    with pytest.raises(UpcyclerError, match="disk full"):
        write_checkpoint(ckpt.replace(tensors=tensors), tmp_path / "out", to="orbax", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused_unless_overwrite(orbax_mixtral, tmp_path):
    src, _ = orbax_mixtral
    ckpt = read_checkpoint(src)
    (tmp_path / "out").mkdir()
    with pytest.raises(UpcyclerError, match="already exists"):
        write_checkpoint(ckpt, tmp_path / "out", to="orbax", progress=False)
    write_checkpoint(ckpt, tmp_path / "out", to="orbax", progress=False, overwrite=True)
    assert read_orbax(tmp_path / "out").spec == ckpt.spec


def test_orbax_write_failure_is_one_clean_error(tiny_dir, tmp_path, monkeypatch):
    import orbax.checkpoint.experimental.v1 as ocp

    class Failed:
        def result(self):
            raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device")

    monkeypatch.setattr(ocp.partial, "save_async", lambda path, tree: Failed())
    with pytest.raises(UpcyclerError, match="disk full while writing") as err:
        write_checkpoint(read_checkpoint(tiny_dir("llama")), tmp_path / "out", to="orbax", progress=False)
    assert "\n" not in str(err.value) and str(err.value).startswith(str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


def test_relative_output_path_works_from_the_cli(tiny_dir, tmp_path, monkeypatch):
    from cli_helpers import run_cli

    src = tiny_dir("llama")
    monkeypatch.chdir(tmp_path)
    run_cli("convert", src, "rel-orbax", "--to", "orbax")
    run_cli("convert", "rel-orbax", "rel-hf", "--to", "hf")
    ids = random_ids()
    np.testing.assert_array_equal(logits(src, ids), logits(tmp_path / "rel-hf", ids))


def test_a_failed_save_waits_for_writes_still_running_before_its_output_is_removed(tmp_path):
    """A failed Orbax save reports its error while other writes of it still create files (and their parent
    directories) on tensorstore's threads; `_settle` returns only once nothing under the save has changed
    for a moment, so the staged output removed after it stays removed."""
    import threading
    import time

    from upcycler.io.orbax_write import _settle

    path = tmp_path / "params"
    path.mkdir()
    writing_until = time.monotonic() + 0.6

    def late_writes():
        i = 0
        while time.monotonic() < writing_until:
            (path / f"chunk-{i // 5}").mkdir(exist_ok=True)
            (path / f"chunk-{i // 5}" / f"{i}").write_bytes(b"x")
            i += 1
            time.sleep(0.02)

    writer = threading.Thread(target=late_writes)
    writer.start()
    _settle(path, quiet=0.2)
    returned = time.monotonic()
    writer.join()
    assert returned >= writing_until  # not before the last write
    shutil.rmtree(path)
    time.sleep(0.1)
    assert not path.exists()
