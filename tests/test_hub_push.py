"""`upcycle push` against the in-memory Hub: identical bytes, model card, refusals, auth, retries."""

from __future__ import annotations

import hashlib
import json
import socket
import types
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from click.testing import CliRunner
from hub_server import FakeHub
from huggingface_hub import hf_hub_download
from safetensors.numpy import save_file

from upcycler.cli import main
from upcycler.hub import validate_for_upload
from upcycler.model_card import render_model_card
from upcycler.spec import ModelSpec, MoESpec

# raised inside huggingface_hub's own LFS upload, not by upcycler
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

TOKEN = "hf_testtokenABCDEF123456"
SPEC = ModelSpec(
    family="llama",
    vocab_size=32,
    hidden_size=8,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    moe=MoESpec(num_experts=4, top_k=2, expert_width=4),
    dense_layers=(0,),
)


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """The fake Hub requiring TOKEN (set as HF_TOKEN), with Xet off and the client's retry sleeps skipped."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(huggingface_hub.utils._http, "time", types.SimpleNamespace(sleep=lambda _: None))
    with FakeHub() as server:
        server.require_token(TOKEN)
        yield server


def write_model(path: Path, sharded: bool = True, seed: int = 0) -> Path:
    """A small HF-style output directory with a manifest, as upcycler writes it."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tensors = {f"model.layers.{i}.w": rng.standard_normal((8, 8)).astype(np.float32) for i in range(2)}
    if sharded:
        names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
        for name, (key, value) in zip(names, tensors.items(), strict=True):
            save_file({key: value}, str(path / name), metadata={"format": "pt"})
        index = {"metadata": {"total_size": 512}, "weight_map": dict(zip(tensors, names, strict=True))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    source = path.parent / f"source-{seed}"
    source.mkdir()
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# source\n")
    files = {
        f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
        for f in sorted(path.iterdir())
    }
    manifest = {
        "format": 1,
        "files": files,
        "spec": json.loads(SPEC.to_json()),
        "lineage": [
            {"step": "read", "source": str(source), "revision": None, "files": {}},
            {"step": "transform", "name": "dense-to-moe", "config": {"experts": 4, "topk": 2}},
            {"step": "merge", "method": "linear", "inputs": ["org/a", "org/b"], "weights": [0.7, 0.3]},
            {"step": "train", "steps": 100, "tokens": 409600},
        ],
        "verification": {"max_abs_logit_diff": 1.2e-7, "against": "org/parent"},
    }
    (path / "upcycler.json").write_text(json.dumps(manifest))
    return path


def run_push(hub: FakeHub, *args: str):
    return CliRunner().invoke(main, ["push", *args, "--endpoint", hub.url])


def download(hub: FakeHub, repo_id: str, name: str, cache: Path, revision: str | None = None) -> bytes:
    path = hf_hub_download(repo_id, name, revision=revision, endpoint=hub.url, token=TOKEN, cache_dir=cache)
    return Path(path).read_bytes()


def test_push_uploads_identical_files_and_a_model_card(hub: FakeHub, tmp_path: Path) -> None:
    model = write_model(tmp_path / "out")
    before = sorted(p.name for p in model.iterdir())
    result = run_push(hub, str(model), "me/tiny-moe")
    assert result.exit_code == 0, result.output
    assert f"{hub.url}/me/tiny-moe/commit/" in result.stdout
    for name in before:
        assert download(hub, "me/tiny-moe", name, tmp_path / "cache") == (model / name).read_bytes()
    assert sorted(p.name for p in model.iterdir()) == before
    card = download(hub, "me/tiny-moe", "README.md", tmp_path / "cache").decode()
    assert "license: apache-2.0" in card and "- upcycler" in card and "- moe" in card
    assert "base_model:\n- org/a\n- org/b" in card
    assert f"{SPEC.total_params():,}" in card and f"{SPEC.active_params():,}" in card
    assert "`dense-to-moe`: `experts=4`, `topk=2`" in card and "100 steps, 409,600 tokens" in card
    assert "org/a), weight 0.7" in card and "max \\|Δlogits\\| = 1.2e-07" in card


def test_push_to_a_new_branch_of_a_private_repo(hub: FakeHub, tmp_path: Path) -> None:
    model = write_model(tmp_path / "out", sharded=False)
    result = run_push(
        hub, str(model), "me/tiny", "--private", "--revision", "dev", "--commit-message", "first"
    )
    assert result.exit_code == 0, result.output
    assert hub.repos["me/tiny"].private
    assert hub.files("me/tiny", "main") == {}
    weights = download(hub, "me/tiny", "model.safetensors", tmp_path / "cache", revision="dev")
    assert weights == (model / "model.safetensors").read_bytes()


def test_a_users_readme_is_uploaded_unchanged(hub: FakeHub, tmp_path: Path) -> None:
    model = write_model(tmp_path / "out")
    (model / "README.md").write_text("---\nlicense: mit\n---\n# mine\n")
    assert run_push(hub, str(model), "me/tiny").exit_code == 0
    assert hub.files("me/tiny")["README.md"] == b"---\nlicense: mit\n---\n# mine\n"


def test_a_sharded_push_removes_the_stale_single_file(hub: FakeHub, tmp_path: Path) -> None:
    assert run_push(hub, str(write_model(tmp_path / "one", sharded=False)), "me/tiny").exit_code == 0
    assert run_push(hub, str(write_model(tmp_path / "two", seed=1)), "me/tiny").exit_code == 0
    remote = hub.files("me/tiny")
    assert "model.safetensors" not in remote and "model-00002-of-00002.safetensors" in remote


def _drop_shard(model: Path) -> None:
    (model / "model-00002-of-00002.safetensors").unlink()


def _flip_byte(model: Path) -> None:
    path = model / "model-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(model: Path) -> None:
    path = model / "model-00001-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-4])


def _escape_index(model: Path) -> None:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.w"] = "../elsewhere.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_drop_shard, "model-00002-of-00002.safetensors: missing"),
        (_flip_byte, "model-00001-of-00002.safetensors: sha256 differs"),
        (_truncate, "model-00001-of-00002.safetensors: 364 bytes but upcycler.json records 368"),
        (_escape_index, "'../elsewhere.safetensors', which escapes the directory"),
        (lambda m: (m / "config.json").write_text("{"), "config.json: unreadable JSON"),
        (lambda m: (m / "upcycler.json").unlink(), "upcycler.json: missing"),
    ],
)
def test_a_broken_directory_is_refused_before_any_request(
    hub: FakeHub, tmp_path: Path, damage, message
) -> None:
    model = write_model(tmp_path / "out")
    damage(model)
    result = run_push(hub, str(model), "me/tiny")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1
        and message in errors[0]
        and errors[0].endswith("re-write the directory with upcycler")
    )
    assert "Traceback" not in result.output
    assert hub.requests == []


def test_a_wrong_token_gives_one_clear_line_without_the_token(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = "hf_wrongTokenXYZ987654321"
    monkeypatch.setenv("HF_TOKEN", wrong)
    result = run_push(hub, str(write_model(tmp_path / "out")), "me/tiny")
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last == "error: not authorised to write me/tiny: set HF_TOKEN or run `hf auth login`"
    assert wrong not in result.output and TOKEN not in result.output
    assert "me/tiny" not in hub.repos


@pytest.mark.parametrize("route", ["commit", "lfs-upload", "preupload"])
def test_a_server_error_fails_clearly_and_a_retry_completes(hub: FakeHub, tmp_path: Path, route: str) -> None:
    model = write_model(tmp_path / "out")
    hub.fail(route, 500)
    result = run_push(hub, str(model), "me/tiny")
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: the Hub failed while pushing me/tiny (HTTP 500") and "retry resumes" in last
    )
    assert "Traceback" not in result.output and TOKEN not in result.output
    uploaded = [r for _, r, _ in hub.requests if r == "lfs-upload"]
    hub.clear_failures()
    result = run_push(hub, str(model), "me/tiny")
    assert result.exit_code == 0, result.output
    if route == "commit":
        assert [r for _, r, _ in hub.requests if r == "lfs-upload"] == uploaded
    remote = hub.files("me/tiny")
    assert all(remote[p.name] == p.read_bytes() for p in model.iterdir())


def test_an_unreachable_endpoint_fails_clearly(hub: FakeHub, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    args = ["push", str(write_model(tmp_path / "out")), "me/tiny", "--endpoint", closed]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: could not reach {closed} (ConnectError)")


def test_validate_lists_the_files_to_upload(tmp_path: Path) -> None:
    model = write_model(tmp_path / "out")
    (model / ".cache").mkdir()
    (model / ".cache" / "junk").write_text("x")
    assert validate_for_upload(model) == sorted(p.name for p in model.iterdir() if p.is_file())


def test_card_names_the_hub_base_model_and_its_cached_license(tmp_path: Path) -> None:
    model = write_model(tmp_path / "out")
    snapshot = tmp_path / "hub" / "models--org--base" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nlicense: llama3.2\n---\n")
    manifest = json.loads((model / "upcycler.json").read_text())
    manifest["lineage"] = [
        {"step": "read", "source": str(snapshot), "revision": "abc123", "format": "hf"},
        {"step": "quantise", "bits": 4},
    ]
    manifest.pop("verification")
    (model / "upcycler.json").write_text(json.dumps(manifest))
    card = render_model_card(model, repo_id="me/tiny")
    assert card.startswith("---\nlicense: llama3.2\nbase_model: org/base\n")
    assert "**Read** [org/base](https://huggingface.co/org/base) at revision `abc123`" in card
    assert "**quantise**: `bits=4`" in card and "No logit comparison was recorded" in card
    assert str(tmp_path) not in card
