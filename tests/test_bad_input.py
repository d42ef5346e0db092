"""Bad input: one clear `error:` line naming the file, exit ≠ 0, no traceback, input untouched, no output."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli, snapshot
from tiny_models import make_tiny


@pytest.fixture
def src(tmp_path):
    return make_tiny("llama", tmp_path / "src", max_shard_size="60KB")


def convert_fails(src, tmp_path, mentions, *extra):
    before = snapshot(src) if src.exists() else {}
    proc = run_cli("convert", src, tmp_path / "out", *extra, check=False)
    line = assert_clean_failure(proc, mentions=mentions)
    assert (snapshot(src) if src.exists() else {}) == before, "input was modified"
    assert leftovers(tmp_path, "out") == [], "something that looks like an output was left behind"
    return line


def first_shard(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return src / min(index["weight_map"].values())


def test_missing_directory(tmp_path):
    convert_fails(tmp_path / "nope", tmp_path, "nope")


def test_no_config(src, tmp_path):
    (src / "config.json").unlink()
    convert_fails(src, tmp_path, "config.json")


def test_corrupt_config(src, tmp_path):
    (src / "config.json").write_text("{not json")
    convert_fails(src, tmp_path, "config.json")


def test_corrupt_safetensors_header(src, tmp_path):
    shard = first_shard(src)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"\xff" * 12
    shard.write_bytes(bytes(data))
    convert_fails(src, tmp_path, shard.name)


def test_header_length_beyond_file(src, tmp_path):
    shard = first_shard(src)
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    shard.write_bytes(bytes(data))
    convert_fails(src, tmp_path, shard.name)


def test_truncated_shard(src, tmp_path):
    shard = first_shard(src)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    line = convert_fails(src, tmp_path, shard.name)
    assert "truncated" in line


def test_index_names_missing_shard(src, tmp_path):
    first_shard(src).unlink()
    convert_fails(src, tmp_path, "missing")


def test_index_name_escaping_directory(src, tmp_path):
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    shutil.copy(src / index["weight_map"][name], tmp_path / "x.safetensors")
    index["weight_map"][name] = "../x.safetensors"
    index_path.write_text(json.dumps(index))
    convert_fails(src, tmp_path, "escapes")  # a plain-name check stops it before any read outside the directory


def test_shape_mismatch_with_config(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(cfg))
    line = convert_fails(src, tmp_path, "shape")
    assert "mlp" in line


def test_unsupported_architecture(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    line = convert_fails(src, tmp_path, "GPT2LMHeadModel")
    assert "LlamaForCausalLM" in line  # lists what is supported


def test_output_exists_is_refused_unless_overwrite(src, tmp_path):
    out = tmp_path / "out"
    run_cli("convert", src, out)
    (out / "stale.txt").write_text("from the earlier write")
    proc = run_cli("convert", src, out, check=False)
    assert_clean_failure(proc, mentions="--overwrite")
    assert (out / "stale.txt").exists()
    run_cli("convert", src, out, "--overwrite")  # an earlier upcycler output (it has upcycler.json) is replaced
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert leftovers(tmp_path, "out") == ["out"]


def test_unwritable_output(src, tmp_path):
    if os.geteuid() == 0:  # root ignores permission bits; /proc refuses new directories even to root
        proc = run_cli("convert", src, "/proc/upcycler-out", check=False)
        assert_clean_failure(proc, mentions="not writable")
        return
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        proc = run_cli("convert", src, locked / "out", check=False)
        assert_clean_failure(proc, mentions="not writable")
    finally:
        locked.chmod(0o700)


def test_output_parent_is_created_but_a_file_parent_is_refused(src, tmp_path):
    run_cli("convert", src, tmp_path / "new" / "nested" / "out")
    assert (tmp_path / "new" / "nested" / "out" / "config.json").exists()
    (tmp_path / "afile").write_text("x")
    proc = run_cli("convert", src, tmp_path / "afile" / "out", check=False)
    assert_clean_failure(proc, mentions="afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_disk_full_leaves_nothing(src, tmp_path):
    """A write that fails midway (ENOSPC from a tiny tmpfs-like quota) leaves no output behind.
    Every shard byte, whether computed or streamed from the source, leaves through StreamingFile.write."""
    script = (
        "import errno, sys\n"
        "from upcycler.io import writeback as wb\n"
        "real = wb.StreamingFile.write\n"
        "calls = {'n': 0}\n"
        "def full(self, data):\n"
        "    calls['n'] += 1\n"
        "    if calls['n'] > 5: raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    real(self, data)\n"
        "wb.StreamingFile.write = full\n"
        "from upcycler.cli import main\n"
        f"sys.argv = ['upcycle', 'convert', {str(src)!r}, {str(tmp_path / 'out')!r}]\n"
        "main()\n"
    )
    import subprocess
    import sys

    before = snapshot(src)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert_clean_failure(proc, mentions="disk full")
    assert leftovers(tmp_path, "out") == []
    assert snapshot(src) == before


def _retype(src, cast) -> None:
    """Rewrite every shard of `src` with `cast(name, array)` applied to each tensor."""
    from safetensors.numpy import load_file, save_file

    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({name: cast(name, array) for name, array in tensors.items()}, str(shard), metadata={"format": "pt"})


def test_integer_weights_are_refused_before_anything_is_written(src, tmp_path):
    """int32 weights used to be transformed, written and caught only by the function check, in a line that
    named neither the file nor the dtype."""
    import numpy as np

    _retype(src, lambda name, array: array.astype(np.int32))
    before = snapshot(src)
    proc = run_cli("dense-to-moe", src, tmp_path / "out", "--experts", "4", "--topk", "2", check=False)
    line = assert_clean_failure(proc, mentions="is stored as int32")
    assert ".safetensors" in line and "model weights must be floating point" in line and "dequantize" in line
    assert "claims to preserve the function" not in line
    assert snapshot(src) == before and leftovers(tmp_path, "out") == []


def test_one_integer_tensor_is_named(src, tmp_path):
    import numpy as np

    broken = "model.layers.1.mlp.up_proj.weight"
    _retype(src, lambda name, array: array.astype(np.int8) if name == broken else array)
    line = convert_fails(src, tmp_path, f"tensor '{broken}' is stored as int8")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert index["weight_map"][broken] in line  # the shard that holds it


def test_experts_of_one_tensor_in_different_dtypes_are_refused(tmp_path):
    import numpy as np

    src = make_tiny("mixtral", tmp_path / "src")
    odd = "model.layers.0.block_sparse_moe.experts.2.w1.weight"
    _retype(src, lambda name, array: array.astype(np.float16) if name == odd else array)
    mixtral = json.loads((src / "config.json").read_text())
    assert mixtral["architectures"] == ["MixtralForCausalLM"]
    line = convert_fails(src, tmp_path, f"tensor '{odd}' is stored as float16")
    assert "experts.0.w1.weight" in line and "float32" in line and "one dtype" in line
