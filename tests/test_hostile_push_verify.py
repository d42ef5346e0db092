"""Hostile input to `upcycle push` and `upcycle verify`, through the real command line.

push: only regular files inside DIR are uploaded. A symlink leaving DIR (to /etc/passwd, to a sibling
directory, a symlinked subdirectory), a dangling symlink, a pipe, and a manifest that is huge, deeply
nested or not a regular file are refused before the Hub server sees a single request. A symlink that
stays inside DIR is uploaded with its target's bytes, and hidden entries are never read.

verify: a model with NaN/inf weights is named (A, B or both); a NaN, infinite or negative --tolerance
and an out-of-range --tokens, --batch or --seed are refused naming the option, before a model is read.

Every refusal: exit ≠ 0, one `error:` line naming the entry or option, no traceback, inputs untouched.
The manifest reader, the model card and the verify option checks are fuzzed with Hypothesis.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, run_cli
from click.testing import CliRunner
from hub_server import FakeHub
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file
from test_hub_push import TOKEN, write_model
from tiny_models import load_model, make_tiny

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.hub import read_manifest
from upcycler.model_card import _readme_license, render_model_card
from upcycler.verify import MAX_BATCH, MAX_PROBE, MAX_TOKENS, check_options

# --- helpers -----------------------------------------------------------------------------------------


def tree_state(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under `root` (symlinks not followed): its kind, mtime, size and bytes (of files up to
    16 MB) or link target."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                body: Any = os.readlink(path)
            elif stat.S_ISREG(info.st_mode) and info.st_size <= 16 * 1024**2:
                body = path.read_bytes()
            else:
                body = None
            kind = stat.S_IFMT(info.st_mode)
            out[str(path.relative_to(root))] = (kind, info.st_mtime_ns, info.st_size, body)
    return out


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """The fake Hub; the `upcycle` subprocesses find its token in HF_TOKEN and run with Xet off."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with FakeHub() as server:
        server.require_token(TOKEN)
        yield server


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    """The directory holding the model to push and its neighbours (everything the test must not change)."""
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


def push(hub: FakeHub, model: Path):
    return run_cli("push", model, "me/tiny", "--endpoint", hub.url, check=False, timeout=120)


def refused(hub: FakeHub, work: Path, model: Path, mentions: str) -> str:
    """Push `model`, expect a clean refusal naming `mentions`, no request to the Hub, nothing changed."""
    before = tree_state(work)
    line = assert_clean_failure(push(hub, model), mentions=mentions)
    assert hub.requests == [], "a request reached the Hub before the refusal"
    assert tree_state(work) == before, "the directory was modified"
    return line


# --- push: what is uploaded --------------------------------------------------------------------------


def test_symlink_to_etc_passwd_is_refused(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    (model / "notes.txt").symlink_to("/etc/passwd")
    line = refused(hub, work, model, "notes.txt")
    assert "/etc/passwd" in line and "outside" in line and f"copy the file into {model}" in line


def test_symlink_to_a_sibling_directory_is_refused(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    (work / "sibling").mkdir()
    (work / "sibling" / "notes.txt").write_text("private notes\n")
    (model / "notes.txt").symlink_to(Path("..", "sibling", "notes.txt"))
    line = refused(hub, work, model, "notes.txt")
    assert "outside" in line and "copy the file into" in line


def test_a_listed_file_linked_from_outside_is_refused(hub: FakeHub, work: Path) -> None:
    """Even with the recorded bytes, a manifest-listed file may not live outside DIR."""
    model = write_model(work / "out")
    outside = work / "tokenizer_config.json"
    shutil.move(model / "tokenizer_config.json", outside)
    (model / "tokenizer_config.json").symlink_to(outside)
    refused(hub, work, model, "tokenizer_config.json")


def test_a_fifo_is_refused_without_hanging(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    os.mkfifo(model / "notes.txt")
    line = refused(hub, work, model, "notes.txt")
    assert "not a regular file" in line


def test_a_symlinked_subdirectory_pointing_outside_is_refused(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    (work / "elsewhere").mkdir()
    (work / "elsewhere" / "secret.txt").write_text("secret\n")
    (model / "extra").symlink_to(work / "elsewhere", target_is_directory=True)
    line = refused(hub, work, model, "extra")
    assert "symlink to the directory" in line


@pytest.mark.parametrize("target", ["gone.txt", "../gone.txt"], ids=["inside", "outside"])
def test_a_dangling_symlink_is_refused(hub: FakeHub, work: Path, target: str) -> None:
    model = write_model(work / "out")
    (model / "notes.txt").symlink_to(target)
    line = refused(hub, work, model, "notes.txt")
    assert "does not exist" in line


def test_a_manifest_that_is_a_fifo_is_refused(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    (model / "upcycler.json").unlink()
    os.mkfifo(model / "upcycler.json")
    refused(hub, work, model, "upcycler.json")


def test_a_config_linked_to_dev_zero_is_refused(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    refused(hub, work, model, "config.json")


def test_a_one_gigabyte_manifest_is_refused(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    os.truncate(model / "upcycler.json", 1024**3)  # sparse: costs no disk
    line = refused(hub, work, model, "upcycler.json")
    assert "too large" in line


def test_a_deeply_nested_manifest_is_refused(hub: FakeHub, work: Path) -> None:
    model = write_model(work / "out")
    (model / "upcycler.json").write_text('{"format": 1, "lineage": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = refused(hub, work, model, "upcycler.json")
    assert "nested" in line


def test_a_hostile_source_readme_gives_no_licence_and_no_hang(hub: FakeHub, work: Path) -> None:
    """The card looks up the licence of the source the manifest names; pipes and bombs there are skipped."""
    model = write_model(work / "out")
    source = work / "hostile-source"
    source.mkdir()
    os.mkfifo(source / "README.md")
    (source / "config.json").write_text("[" * 100_000)
    manifest = json.loads((model / "upcycler.json").read_text())
    manifest["lineage"][0]["source"] = str(source)
    (model / "upcycler.json").write_text(json.dumps(manifest))
    before = tree_state(work)
    proc = push(hub, model)
    assert proc.returncode == 0, proc.stderr
    card = hub.files("me/tiny")["README.md"].decode()
    assert "license:" not in card and "local checkpoint `hostile-source`" in card
    assert tree_state(work) == before


def test_links_inside_dir_are_uploaded_and_hidden_entries_are_not(hub: FakeHub, work: Path) -> None:
    """The control: the same server does receive a valid push; an inside link uploads its target."""
    model = write_model(work / "out")
    (model / "NOTES.md").write_text("how this model was made\n")
    (model / "notes.txt").symlink_to("NOTES.md")
    (model / ".secret").symlink_to("/etc/passwd")  # hidden: skipped, never read
    before = tree_state(work)
    proc = push(hub, model)
    assert proc.returncode == 0, proc.stderr
    remote = hub.files("me/tiny")
    assert remote["notes.txt"] == remote["NOTES.md"] == b"how this model was made\n"
    assert ".secret" not in remote and "README.md" in remote
    assert tree_state(work) == before


# --- verify ------------------------------------------------------------------------------------------

BROKEN = "model.layers.0.mlp.down_proj.weight"


def _with_non_finite(source: Path, out: Path, value: float) -> Path:
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    tensors[BROKEN][1, 2] = value
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify")
    good = shutil.copytree(tiny_dir("llama"), root / "good")
    return {
        "good": good,
        "nan_a": _with_non_finite(good, root / "nan_a", np.nan),
        "nan_b": _with_non_finite(good, root / "nan_b", np.nan),
        "inf": _with_non_finite(good, root / "inf", np.inf),
    }


def verify_fails(models: dict[str, Path], a: str, b: str, *options: str, mentions: str) -> str:
    before = {name: tree_state(path) for name, path in models.items()}
    proc = run_cli("verify", models[a], models[b], *options, check=False, timeout=300)
    line = assert_clean_failure(proc, mentions=mentions)
    assert proc.returncode == 2 and proc.stdout == "", "a verdict was printed"
    assert {name: tree_state(path) for name, path in models.items()} == before
    return line


@pytest.mark.parametrize(
    ("a", "b", "named", "not_named"),
    [("nan_a", "good", ["nan_a"], ["good"]), ("good", "nan_b", ["nan_b"], ["good"]),
     ("nan_a", "nan_b", ["nan_a", "nan_b"], ["good"]), ("inf", "inf", ["inf"], ["good"])],
    ids=["nan-in-a", "nan-in-b", "nan-in-both", "inf-in-identical-copies"],
)
def test_non_finite_weights_name_the_model(models, a, b, named, not_named) -> None:
    line = verify_fails(models, a, b, mentions=str(models[named[0]]))
    assert all(str(models[n]) in line for n in named)
    assert all(str(models[n]) not in line for n in not_named)
    assert "non-finite weights" in line and "layers.0.mlp.down_proj" in line
    assert "different functions" not in line


@pytest.mark.parametrize(
    ("options", "mentions"),
    [
        (["--tolerance", "nan"], "--tolerance"),
        (["--tolerance", "inf"], "--tolerance"),
        (["--tolerance", "-1"], "--tolerance"),
        (["--tokens", "100000"], "--tokens"),
        (["--tokens", "0"], "--tokens"),
        (["--tokens", "257"], "max_position_embeddings"),  # the tiny model has 256 positions
        (["--batch", "0"], "--batch"),
        (["--batch", "100000"], "--batch"),
        (["--batch", "64", "--tokens", "8192"], "--batch × --tokens"),
        (["--seed", "-1"], "--seed"),
    ],
    ids=["tolerance-nan", "tolerance-inf", "tolerance-negative", "tokens-100000", "tokens-0",
         "tokens-beyond-positions", "batch-0", "batch-huge", "probe-too-large", "seed-negative"],
)
def test_bad_options_are_refused_naming_them(models, options, mentions) -> None:
    line = verify_fails(models, "good", "good", *options, mentions=mentions)
    assert options[1] in line.replace(",", "") or "max_position_embeddings" in line


def test_a_probe_too_large_for_the_vocabulary_is_refused(tiny_dir) -> None:
    """16,384 positions pass the option checks, but not with 32,768 logits each."""
    wide = tiny_dir("llama", vocab_size=32768)
    before = tree_state(wide)
    proc = run_cli("verify", wide, wide, "--batch", "64", "--tokens", "256", check=False, timeout=300)
    line = assert_clean_failure(proc, mentions="--batch × --tokens")
    assert "32,768" in line and proc.stdout == "" and tree_state(wide) == before


def _padded_vocabulary(source: Path, out: Path, vocab: int) -> Path:
    """`source` with its embedding and head padded to `vocab` rows by transformers (tokenizer surgery):
    the logits of the ids it already had are unchanged."""
    model = load_model(source)
    model.resize_token_embeddings(vocab)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory, models) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vocabularies")
    return {"good": models["good"], "padded": _padded_vocabulary(models["good"], root / "padded", 160),
            "other": make_tiny("llama", root / "other", seed=1, vocab_size=160),
            "narrow": make_tiny("llama", root / "narrow", hidden_size=32, intermediate_size=64)}


def verify_in_process(a: Path, b: Path, *options: str):
    """`upcycle verify A B OPTIONS` in this process (the same contract as the CLI, without a JAX start-up)."""
    result = CliRunner().invoke(main, ["verify", str(a), str(b), *options])
    assert isinstance(result.exception, SystemExit) or result.exception is None, result.exception
    return result


def test_vocabularies_that_differ_are_refused_naming_both(vocabularies) -> None:
    """A padded embedding (160 rows against 128): one line naming both sizes and the flag, no verdict."""
    line = verify_fails(vocabularies, "good", "padded", mentions="vocabularies differ")
    assert str(vocabularies["good"]) in line and str(vocabularies["padded"]) in line
    assert "128" in line and "160" in line and "--shared-vocab" in line


def test_shared_vocab_compares_the_ids_both_have(vocabularies) -> None:
    before = {name: tree_state(path) for name, path in vocabularies.items()}
    padded = verify_in_process(vocabularies["good"], vocabularies["padded"], "--shared-vocab", "--json")
    assert padded.exit_code == 0, padded.output
    stats = json.loads(padded.stdout)
    assert stats["passed"] and stats["vocab_compared"] == 128 and stats["probe"]["vocab"] == 128
    assert len(stats["layers"]) == 2  # walked in lockstep, the logits of the shared ids within the noise floor
    other = verify_in_process(vocabularies["padded"], vocabularies["other"], "--shared-vocab")
    assert other.exit_code == 1 and "different functions" in other.stdout
    assert "compared the first 160 entries" not in other.stdout  # both have 160
    assert {name: tree_state(path) for name, path in vocabularies.items()} == before


def test_models_of_other_widths_are_compared_by_their_logits(vocabularies) -> None:
    """Same depth, other hidden size: the residual streams cannot be compared layer by layer."""
    result = verify_in_process(vocabularies["good"], vocabularies["narrow"], "--json")
    assert result.exit_code == 1 and result.stderr == ""
    stats = json.loads(result.stdout)
    assert not stats["passed"] and stats["layers"] == [] and stats["max_abs_diff"] > 0


# --- fuzzing -----------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# (path into the manifest, as keys) the fuzzer may replace with any JSON value
PLACES = [
    ("format",), ("files",), ("spec",), ("lineage",), ("verification",),
    ("spec", "num_layers"), ("spec", "hidden_size"), ("spec", "vocab_size"), ("spec", "num_heads"),
    ("spec", "head_dim"), ("spec", "rope_theta"), ("spec", "moe"), ("spec", "moe", "top_k"),
    ("spec", "moe", "num_experts"), ("spec", "dense_layers"), ("spec", "family"),
    ("lineage", 0), ("lineage", 0, "source"), ("lineage", 0, "revision"), ("lineage", 1, "config"),
    ("lineage", 2, "inputs"), ("lineage", 2, "weights"), ("lineage", 3, "steps"),
    ("verification", "max_abs_logit_diff"), ("files", "config.json", "bytes"),
    ("files", "config.json", "sha256"),
]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("fuzz") / "out")


def _set(document: Any, place: tuple, value: Any) -> None:
    for key in place[:-1]:
        document = document[key]
    document[place[-1]] = value


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(PLACES), JSON), min_size=1, max_size=4))
def test_fuzzed_manifest_gives_a_card_or_a_clean_error(fuzz_model: Path, changes) -> None:
    manifest = json.loads((fuzz_model / "upcycler.json").read_text())
    for place, value in changes:
        try:
            _set(manifest, place, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier change replaced a parent of this place
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "out")
        shutil.copytree(fuzz_model, model)
        (model / "upcycler.json").write_text(json.dumps(manifest))
        try:
            card = render_model_card(model, repo_id="me/tiny")
        except UpcyclerError as err:
            assert "\n" not in str(err) and str(model / "upcycler.json") in str(err)
        else:
            assert card.startswith("---\n") and "## Architecture" in card


@FUZZ
@given(st.binary(max_size=300) | JSON.map(lambda v: json.dumps({"format": 1, "files": v}).encode())
       | st.integers(1, 5000).map(lambda n: b'{"format": 1, "files": ' + b"[" * n + b"]" * n + b"}"))
def test_fuzzed_manifest_bytes_parse_or_are_refused(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "upcycler.json").write_bytes(data)
        try:
            manifest = read_manifest(Path(tmp))
        except UpcyclerError as err:
            assert "\n" not in str(err) and "upcycler.json" in str(err)
        else:
            assert isinstance(manifest.files, dict) and isinstance(manifest.file_records(), dict)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(12))


@FUZZ
@given(st.text(max_size=200) | st.just(BOMB) | st.integers(1, 200).map(lambda n: "[" * n + "]" * n)
       | st.dictionaries(st.text(max_size=5), JSON, max_size=3).map(json.dumps))
def test_fuzzed_source_readme_front_matter_gives_a_licence_or_none(front: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        readme = Path(tmp, "README.md")
        readme.write_text(f"---\n{front}\n---\n# model\n", encoding="utf-8", errors="surrogatepass")
        found = _readme_license(readme)
    assert found is None or (isinstance(front, str) and "license" in front)


@FUZZ
@given(
    tokens=st.integers(-(2**70), 2**70) | st.integers(0, 2 * MAX_TOKENS),
    batch=st.integers(-(2**70), 2**70) | st.integers(0, 2 * MAX_BATCH),
    seed=st.integers(-(2**70), 2**70),
    tolerance=st.floats(allow_nan=True, allow_infinity=True),
)
def test_fuzzed_verify_options_are_bounded_or_refused(tokens, batch, seed, tolerance) -> None:
    try:
        check_options(tokens=tokens, batch=batch, seed=seed, tolerance=tolerance)
    except UpcyclerError as err:
        assert str(err).startswith("--") and "\n" not in str(err)
    else:
        assert 1 <= tokens <= MAX_TOKENS and 1 <= batch <= MAX_BATCH and tokens * batch <= MAX_PROBE
        assert seed >= 0 and np.isfinite(tolerance) and tolerance >= 0
