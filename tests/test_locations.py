"""Locations a path cannot take: refused in one line, never taken as a relative local path.

A URL where only a local path goes (a recipe, `prepare-data`, a report) must not become a local
directory (`gs://b/run` would become `gs:/b/run`); nor may a scheme the tool does not speak (`s3://`,
`https://`) where model sources and outputs and the training config's paths take gs:// (and sources Hub
ids: `test_remote_locations.py`, `test_bucket_runs.py`). Every command's path arguments and options,
every path of a training config (also through `--set`), `prepare-data --source` and `--experts-from` are
tried: exit 2, one `error:` line naming the argument or option and the scheme, nothing created in the
working directory. A missing relative path that reads as a Hub id (`org/name`) is looked up on the Hub
(here: a closed loopback endpoint) and the failure says so. A gs:// location or Hub revision with a `.`,
`..` or empty segment is refused the same way at every surface, before any request: nothing is written
outside its root (a victim file where the escape would land keeps its bytes), no object takes such a name
(the sources and outputs that reach a bucket: `test_remote_locations.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trainer_fixtures as F
from cli_helpers import assert_clean_failure, run_cli

from upcycler.errors import UpcyclerError
from upcycler.locations import bucket_and_key, hub_id_hint, local_path, url_scheme, within

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


LEAVES = "gs://bkt/runs/../../../victim"  # normalised: two levels above the bucket
SEGMENT_FIX = "write gs://BUCKET/PATH with no '.', '..' or empty segment"


@pytest.mark.parametrize(("name", "says"), [("a/b.json", None), ("a/../../x", "leaves 'gs://bkt' ('..' segments)"),
                                            ("a/../b", "has a '..' segment"), ("a/./b", "has a '.' segment"),
                                            ("a//b", "has an empty segment"), ("/a", "has an empty segment"),
                                            ("", "has an empty segment"), ("a\0b", "has a NUL character")])
def test_within_refuses_every_name_that_is_not_one_place_under_its_root(name, says):
    if says is None:
        assert within("gs://bkt/", name, fix="fix it") == f"gs://bkt/{name}"
        return
    with pytest.raises(UpcyclerError) as refused:
        within("gs://bkt/", name, fix="fix it")
    line = str(refused.value)
    assert says in line and line.endswith("; fix it") and "\n" not in line


def test_a_url_key_is_normalised_only_around_it():
    assert bucket_and_key("gs://bkt/runs/cpt/") == ("bkt", "runs/cpt")
    assert bucket_and_key("gs://bkt") == ("bkt", "")
    with pytest.raises(UpcyclerError, match=r"^DST: 'gs://bkt/a/\.\./\.\./outside': leaves 'gs://bkt'"):
        bucket_and_key("gs://bkt/a/../../outside", "DST")


ESCAPES = {  # case: (argv with LEAVES in one location, what the error line names)
    "inspect": (["inspect", LEAVES], "PATH"),
    "convert-src": (["convert", LEAVES, "out"], "SRC"),
    "convert-dst": (["convert", "{model}", LEAVES], "DST"),
    "depth-out": (["depth", "{model}", LEAVES, "--layers", "6"], "OUT"),
    "dense-to-moe-src": (["dense-to-moe", LEAVES, "out", "--experts", "4", "--topk", "2"], "SRC"),
    "dense-to-moe-out": (["dense-to-moe", "{model}", LEAVES, "--experts", "4", "--topk", "2"], "OUT"),
    "experts-from": (["dense-to-moe", "{model}", "out", "--experts", "4", "--topk", "2", "--experts-from",
                      f"a={LEAVES}", "--experts-from", "b={model}"], "--experts-from"),
    "merge-input": (["merge", "{model}", LEAVES, "out"], "PATHS"),
    "merge-out": (["merge", "{model}", "{model}", LEAVES], "OUT"),
    "merge-base": (["merge", "{model}", "{model}", "out", "--base", LEAVES, "--method", "task_arithmetic"], "--base"),
    "prepare-data-out": (["prepare-data", "--tokenizer", "{tokenizer}", "--out", LEAVES, "--source", "a=x.txt"],
                         "--out"),
    "prepare-data-glob": (["prepare-data", "--tokenizer", "{tokenizer}", "--out", "data", "--source",
                           f"web={LEAVES}/*.jsonl"], "'gs://bkt/runs/../../../victim/*.jsonl'"),
    "report": (["report", LEAVES], "RUN_DIR"),
}


@pytest.mark.parametrize("case", ESCAPES)
def test_every_surface_refuses_a_url_that_leaves_its_root(case, tiny_dir, ws, tmp_path, monkeypatch):
    """Exit non-zero, one line naming the option, the URL and the fix, before any request; nothing is
    created in the working directory or the cache, and the victim where the normalised path lands (the
    mirror of a source, the cache being its parent) keeps its bytes."""
    argv, names = ESCAPES[case]
    given = {"{model}": str(tiny_dir("llama")), "{tokenizer}": str(ws["tokenizer"])}
    work, victim = tmp_path / "work", tmp_path / "victim"
    work.mkdir()
    victim.mkdir()
    (victim / "notes.txt").write_bytes(b"the user's own")
    monkeypatch.chdir(work)
    proc = run_cli(*[given.get(a, a).replace("{model}", given["{model}"]) for a in argv], check=False,
                   env={"UPCYCLER_CACHE": str(tmp_path)})  # its mirror: CACHE/gs/bkt/runs/../../../victim
    line = assert_clean_failure(proc, mentions=f"{LEAVES}")
    assert line.startswith(f"error: {names}"), line
    assert "leaves 'gs://bkt' ('..' segments); " in line and (SEGMENT_FIX in line or "narrow the glob" in line), line
    assert list(work.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["victim", "work"]
    assert [p.name for p in victim.iterdir()] == ["notes.txt"]
    assert (victim / "notes.txt").read_bytes() == b"the user's own"


@pytest.mark.parametrize("key", ["run_dir", "model.init", "data.dir", "model.tokenizer"])
@pytest.mark.parametrize("value", ["gs://bkt/runs/../../outside", "gs://bkt/runs/./cpt", "gs://bkt/runs//cpt"])
def test_training_config_urls_stay_inside_their_bucket(ws, key, value, tmp_path, monkeypatch):
    """run_dir (and with it every checkpoint, metric and export written under it) and the inputs: refused while
    the config is read, naming the file and the key."""
    cfg = F.config_dict(tmp_path / "local", ws["moe"], ws["data"], steps=2, **{key: value})
    path = F.write_config(tmp_path / "train.yaml", cfg)
    monkeypatch.chdir(tmp_path)
    line = assert_clean_failure(run_cli("continued-pretrain", "--config", path, check=False),
                                mentions=f"train.yaml: {key}: {value!r}: ")
    assert line.endswith(SEGMENT_FIX), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.yaml"], line


def test_a_recipe_output_that_leaves_its_bucket_is_refused(tiny_dir, tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"source: {tiny_dir('llama')}\ntransforms:\n  - dense-to-moe: {{experts: 4, topk: 2}}\n"
                      f"output: {{path: {LEAVES}}}\n")
    monkeypatch.chdir(tmp_path)
    line = assert_clean_failure(run_cli("run", recipe, check=False), mentions=f"output.path: {LEAVES!r}: leaves")
    assert line.endswith(SEGMENT_FIX) and sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"], line


@pytest.mark.parametrize("source", ["org/name@../../../victim", "hf://org/name@main/../../../../victim"])
def test_a_hub_revision_that_leaves_the_cache_is_refused_before_the_hub(source, tmp_path, monkeypatch):
    """The revision names a file in the HF cache (`refs/REVISION`): refused before the cache is touched or
    the Hub asked, and the victim where it would land keeps its bytes."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own")
    monkeypatch.chdir(tmp_path)
    proc = run_cli("inspect", source, check=False, env={"HF_HUB_CACHE": str(tmp_path / "hf" / "hub")})
    line = assert_clean_failure(proc, mentions=f"{source.removeprefix('hf://')!r}: leaves 'hf://org/name'")
    assert line.endswith("; name a branch, tag or commit"), line
    assert victim.read_bytes() == b"the user's own" and sorted(p.name for p in tmp_path.iterdir()) == ["victim"]
