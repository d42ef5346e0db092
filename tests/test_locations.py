"""Locations a path cannot take: refused in one line, never taken as a relative local path.

A URL where only a local path goes (a recipe, `prepare-data`, a report) must not become a local
directory (`gs://b/run` would become `gs:/b/run`); nor may a scheme the tool does not speak (`s3://`,
`https://`) where model sources and outputs and the training config's paths take gs:// (and sources Hub
ids: `test_remote_locations.py`, `test_bucket_runs.py`). Every command's path arguments and options,
every path of a training config (also through `--set`), `prepare-data --source` and `--experts-from` are
tried: exit 2, one `error:` line naming the argument or option and the scheme, nothing created in the
working directory. A missing relative path that reads as a Hub id (`org/name`) is looked up on the Hub
(here: a closed loopback endpoint) and the failure says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trainer_fixtures as F
from cli_helpers import assert_clean_failure, run_cli

from upcycler.errors import UpcyclerError
from upcycler.locations import hub_id_hint, local_path, url_scheme

GS = "gs://bkt/some/dir"
S3 = "s3://bkt/some/dir"  # for the model sources and outputs, which take gs://


@pytest.mark.parametrize(("text", "scheme"), [("gs://b/x", "gs"), ("S3://b", "s3"), ("hf://org/name@main", "hf"),
                                               ("https://huggingface.co/org/name", "https"), ("file:///tmp/x", "file"),
                                               ("org/name", None), ("./gs:/x", None), ("gs:/b", None),
                                               ("/abs/path", None), ("3d://x", None)])
def test_url_scheme(text, scheme):
    assert url_scheme(text) == scheme


def test_local_paths_pass_unchanged_and_urls_name_their_option():
    assert local_path("runs/cpt", "run_dir") == Path("runs/cpt")
    assert local_path(Path("gs:/x"), "run_dir") == Path("gs:/x")  # already a Path: the caller made it local
    with pytest.raises(UpcyclerError, match=r"^run_dir: 'gs://b/r': gs:// locations are not supported here"):
        local_path("gs://b/r", "run_dir")


@pytest.mark.parametrize(("path", "hinted"), [("kakaocorp/kanana-nano-2.1b-base", True), ("org/name", True),
                                               ("/org/name", False), ("org/na me", False), ("a/b/c", False),
                                               ("model", False)])
def test_hub_id_hint(path, hinted):
    hint = hub_id_hint(Path(path))
    assert bool(hint) == hinted
    if hinted:
        assert f"huggingface-cli download {path} --local-dir DIR" in hint


COMMANDS = {  # case: (argv with the URL in one path position, what the error line names)
    "inspect": (["inspect", S3], "PATH"),
    "convert-src": (["convert", S3, "out"], "SRC"),
    "convert-dst": (["convert", "{model}", S3], "DST"),
    "depth-src": (["depth", "https://huggingface.co/org/name", "out", "--layers", "6"], "SRC"),
    "dense-to-moe-out": (["dense-to-moe", "{model}", S3, "--experts", "4", "--topk", "2"], "OUT"),
    "experts-from": (["dense-to-moe", "{model}", "out", "--experts", "4", "--topk", "2", "--experts-from",
                      f"a={S3}", "--experts-from", "b={model}"], "upcycle dense-to-moe: --experts-from.a"),
    "run-recipe": (["run", GS], "RECIPE"),
    "merge-input": (["merge", "{model}", S3, "out"], "PATHS"),
    "merge-out": (["merge", "{model}", "{model}", S3], "OUT"),
    "merge-base": (["merge", "{model}", "{model}", "out", "--base", S3, "--method", "task_arithmetic"], "--base"),
    "verify": (["verify", "{model}", S3], "B"),
    "eval": (["eval", S3, "--task", "needle"], "MODEL"),
    "eval-vs": (["eval", "{model}", "--task", "needle", "--vs", S3], "--vs"),
    "push": (["push", S3, "org/name"], "DIR"),
    "prepare-data-out": (["prepare-data", "--tokenizer", "{tokenizer}", "--out", S3, "--source", "a=x.txt"], "--out"),
    "prepare-data-source": (["prepare-data", "--tokenizer", "{tokenizer}", "--out", "data", "--source",
                             "web=s3://bkt/web/*.jsonl"], "--source web"),
    "report": (["report", S3], "RUN_DIR"),
    "report-out": (["report", "run", "--out", GS], "--out"),
    "demo-out": (["demo", "--out", GS], "--out"),
}


@pytest.mark.parametrize("case", COMMANDS)
def test_every_command_refuses_a_url_where_a_path_goes(case, tiny_dir, ws, tmp_path, monkeypatch):
    argv, names = COMMANDS[case]
    given = {"{model}": str(tiny_dir("llama")), "{tokenizer}": str(ws["tokenizer"])}
    monkeypatch.chdir(tmp_path)
    proc = run_cli(*[given.get(a, a).replace("{model}", given["{model}"]) for a in argv], check=False)
    line = assert_clean_failure(proc, mentions="locations are not supported here")
    assert line.startswith(f"error: {names}"), line
    assert list(tmp_path.iterdir()) == [], "nothing may be created in the working directory"


@pytest.mark.parametrize("key", ["run_dir", "model.init", "data.dir", "model.tokenizer"])
@pytest.mark.parametrize("how", ["file", "--set"])
def test_training_config_paths_refuse_urls(ws, key, how, tmp_path, monkeypatch):
    cfg = F.config_dict(tmp_path / "local", ws["moe"], ws["data"], steps=2)
    value = "s3://bkt/runs/cpt"  # gs:// is taken (test_bucket_runs.py); other schemes are refused
    if how == "file":
        cfg = F.config_dict(tmp_path / "local", ws["moe"], ws["data"], steps=2, **{key: value})
    path = F.write_config(tmp_path / "train.yaml", cfg)
    monkeypatch.chdir(tmp_path)
    extra = ["--set", f"{key}={value}"] if how == "--set" else []
    proc = run_cli("continued-pretrain", "--config", path, *extra, check=False)
    line = assert_clean_failure(proc, mentions=f"{key.split('.')[-1]}: 's3://bkt/runs/cpt': s3:// locations")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.yaml"], line  # no local gs:, no run dir


NO_BUCKET = {"gs://": "names no bucket", "gs:///runs/cpt": "names no bucket",
             "gs://My_Bucket/runs": "'My_Bucket' is not a bucket name"}


@pytest.mark.parametrize("key", ["run_dir", "model.init", "data.dir", "model.tokenizer"])
@pytest.mark.parametrize("value", NO_BUCKET)
def test_training_config_urls_must_name_a_bucket(ws, key, value, tmp_path, monkeypatch):
    """As on the command line: refused while the config is read, naming the file and the key, before any
    request (no `gs:/…` path, no hint to pass `--out gs:`)."""
    cfg = F.config_dict(tmp_path / "local", ws["moe"], ws["data"], steps=2, **{key: value})
    path = F.write_config(tmp_path / "train.yaml", cfg)
    monkeypatch.chdir(tmp_path)
    line = assert_clean_failure(run_cli("continued-pretrain", "--config", path, check=False),
                                mentions=f"train.yaml: {key}: {value!r}: {NO_BUCKET[value]}")
    assert line.endswith("; write gs://BUCKET/PATH") and "gs:/" not in line.replace("gs://", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.yaml"], line


@pytest.mark.parametrize("value", NO_BUCKET)
def test_command_line_urls_must_name_a_bucket(tiny_dir, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_cli("convert", tiny_dir("llama"), value, check=False)
    assert_clean_failure(proc, mentions=f"DST: {value!r}: {NO_BUCKET[value]}")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_local_path_that_reads_as_a_hub_id_is_looked_up_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_cli("inspect", "kakaocorp/kanana-nano-2.1b-base", check=False, timeout=120)
    line = assert_clean_failure(proc, mentions="kakaocorp/kanana-nano-2.1b-base: no such local directory, and "
                                              "not in the HF cache")
    assert "the Hub cannot be reached" in line
    assert list(tmp_path.iterdir()) == []
