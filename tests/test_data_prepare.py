"""`prepare-data` at scale: units on Apache Beam, sharded output, resume after a kill, many sources per host.

The corpus is real text (standard-library modules as JSONL documents, plain and compressed) cut into
small shards (`--shard-size`) so that one JSONL file is split by byte ranges and small files are grouped:
the properties do not depend on size, only on there being several units of each kind. A held-out split
(`--heldout`) is read back document by document and checked against the rule of `format.held_out`,
recomputed here from the documents' tokens.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, run_cli, snapshot
from tokenizers import Tokenizer

from upcycler.train.data.plan import Settings, make_plan
from upcycler.train.data.readers import detect_format
from upcycler.train.data.sources import open_source, prepared_names

TOKENIZER = Path(__file__).resolve().parents[1] / "upcycler" / "data" / "demo" / "tokenizer.json"
STDLIB = Path(os.__file__).parent
SHARD_SIZE = "24KB"
FRACTION = 0.2


def _documents(pattern: str, limit: int) -> list[str]:
    """Real text: the paragraphs of standard-library modules."""
    docs = []
    for path in sorted(STDLIB.glob(pattern)):
        docs += [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return docs[:limit]


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Two sources: `web` (one 100 KB JSONL file, split into ranges, plus a .gz) and `code` (many small
    JSONL files, grouped), with their documents in order."""
    root = tmp_path_factory.mktemp("corpus")
    web = _documents("json/*.py", 10_000) + _documents("email/*.py", 10_000)
    code = _documents("collections/*.py", 10_000)
    (root / "web").mkdir()
    (root / "code").mkdir()
    _write_jsonl(root / "web" / "a.jsonl", web[:-40])
    _write_jsonl(root / "web" / "b.jsonl.gz", web[-40:])
    step = 25
    for k in range(0, len(code), step):
        _write_jsonl(root / "code" / f"{k:05d}.jsonl", code[k:k + step])
    return {"root": root, "docs": {"web": web, "code": code},
            "sources": ("--source", f"web={root}/web/*", "--source", f"code={root}/code/*.jsonl")}


def _prepare(corpus: dict, out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_cli("prepare-data", "--tokenizer", TOKENIZER, *corpus["sources"], "--out", out,
                   "--shard-size", SHARD_SIZE, *extra, check=check)


@pytest.fixture(scope="module")
def one_worker(corpus: dict, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "out"
    _prepare(corpus, out)
    return out


def test_units_are_ranges_of_large_files_and_groups_of_small_ones(corpus: dict) -> None:
    files = {name: [(p, detect_format(p)) for p in sorted((corpus["root"] / name).iterdir())]
             for name in ("web", "code")}
    settings = Settings(str(TOKENIZER), "0" * 64, None, 0, 2048, "text", "file")
    plan = make_plan(settings, files, unit_bytes=24_000)
    web = plan.units_of("web")
    size = files["web"][0][0].stat().st_size
    ranges = [u.pieces[0] for u in web[:-1]]
    assert len(ranges) == -(-size // 24_000) and ranges[0].start == 0 and ranges[-1].stop == size
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    assert web[-1].pieces[0].start is None  # the .gz file: not splittable, whole
    code = plan.units_of("code")
    assert sum(len(u.pieces) for u in code) == len(files["code"]) and 1 < len(code) < len(files["code"])
    assert [u.index for u in plan.units_of("code")] == list(range(len(code)))


def test_shards_hold_exactly_the_tokenizers_encoding(corpus: dict, one_worker: Path) -> None:
    tok = Tokenizer.from_file(str(TOKENIZER))
    eos = json.loads((one_worker / "web.index.json").read_text())["eos_id"]
    for name, docs in corpus["docs"].items():
        expected = [i for e in tok.encode_batch(docs, add_special_tokens=False) for i in [*e.ids, eos]]
        source = open_source(one_worker, name)
        assert source.tokens[:].tolist() == expected
        assert len(source.meta["shards"]) > 2 and source.meta["num_documents"] == len(docs)


def test_four_workers_write_the_same_bytes_as_one(corpus: dict, one_worker: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _prepare(corpus, out, "--workers", "4")
    assert snapshot(out) == snapshot(one_worker)
    assert "reused" in proc.stdout and not list(out.glob(".*"))


def test_a_killed_preparation_resumes_without_tokenising_finished_shards(tmp_path: Path) -> None:
    """SIGKILL once some shards are done; the rerun tokenises only the others (its summary counts them,
    and the finished shards' files are the same inodes, moved, never rewritten) and ends byte-identical
    to an uninterrupted preparation. Six gzip files of ~300 KB of text: one unit each, about half a second
    of tokenising apiece, so the kill lands while units remain."""
    docs = _documents("*.py", 6 * 250)
    (tmp_path / "in").mkdir()
    for k in range(6):
        _write_jsonl(tmp_path / "in" / f"{k}.jsonl.gz", docs[k * 250:(k + 1) * 250])
    argv = ["prepare-data", "--tokenizer", str(TOKENIZER), "--source", f"web={tmp_path}/in/*.gz",
            "--shard-size", "1KB", "--out"]
    run_cli(*argv, tmp_path / "uninterrupted")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "upcycler", *argv, str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(out.glob(".prepare-*/records/web/*.json"))) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, "the preparation finished before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.name: p.stat().st_ino for p in out.glob(".prepare-*/shards/web.shards/*.tokens")}
    assert 2 <= len(finished) < 6 and not list(out.glob("*.index.json"))
    done = run_cli(*argv, out)
    assert f"({6 - len(finished)} tokenised, {len(finished)} reused)" in done.stdout
    assert snapshot(out) == snapshot(tmp_path / "uninterrupted")
    assert {p.name: p.stat().st_ino for p in out.glob("web.shards/*.tokens") if p.name in finished} == finished


def test_sigterm_mid_preparation_is_one_line_and_keeps_only_the_work_for_the_rerun(tmp_path: Path) -> None:
    """SIGTERM (a scheduler's stop) once some shards are done: exit 143 and one line saying the finished
    shards are kept for a rerun; OUT holds no source (no index) and nothing but the work directory, nothing
    is left beside it; the same command then resumes and finishes."""
    docs = _documents("*.py", 6 * 250)
    (tmp_path / "in").mkdir()
    for k in range(6):
        _write_jsonl(tmp_path / "in" / f"{k}.jsonl.gz", docs[k * 250:(k + 1) * 250])
    out = tmp_path / "out"
    argv = ["prepare-data", "--tokenizer", str(TOKENIZER), "--source", f"web={tmp_path}/in/*.gz",
            "--shard-size", "1KB", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "upcycler", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob(".prepare-*/records/web/*.json")) and time.monotonic() < deadline:
        assert proc.poll() is None, "the preparation finished before the signal"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, (proc.returncode, stderr)
    line = ("error: terminated (SIGTERM); no output was finished; the finished shards are kept: rerun the same "
            "command to resume")
    assert [line for line in stderr.splitlines() if line.strip()] == [line], stderr
    assert [p.name.startswith(".prepare-") for p in out.iterdir()] == [True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]
    done = run_cli(*argv)
    assert "reused)" in done.stdout and (out / "web.index.json").is_file()


def test_a_killed_two_worker_run_goes_on_from_its_checkpoints(tmp_path: Path) -> None:
    """SIGKILL of the whole process group (the runner and its two worker processes) once a unit's first step
    is checkpointed: the same command again keeps the finished steps (its summary says why each unit was
    tokenised) and ends byte-identical to an uninterrupted run, the shards exactly the tokenizer's encoding
    (a unit put together from steps is the unit tokenised whole). ~2 MB of JSONL: units of 8 steps."""
    docs, size = [], 0
    for doc in _documents("*.py", 100_000):
        if size > 2_000_000:
            break
        docs.append(doc)
        size += len(doc)
    (tmp_path / "in").mkdir()
    _write_jsonl(tmp_path / "in" / "a.jsonl", docs)
    argv = ["prepare-data", "--tokenizer", str(TOKENIZER), "--source", f"web={tmp_path}/in/a.jsonl",
            "--shard-size", "1MB", "--workers", "2", "--out"]
    run_cli(*argv[:-3], "--out", tmp_path / "uninterrupted")  # in one process: the same bytes, sooner
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "upcycler", *argv, str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.glob(".prepare-*/steps/web/*/*.json")) and time.monotonic() < deadline:
        assert proc.poll() is None, "the preparation finished before it could be killed"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    checkpointed = {p.parent.name for p in out.glob(".prepare-*/steps/web/*/*.json")}
    finished = {p.stem for p in out.glob(".prepare-*/records/web/*.json")}
    assert checkpointed - finished and not list(out.glob("*.index.json"))
    done = run_cli(*argv, out)
    assert f"{len(finished)} reused)" in done.stdout and "continued from a checkpoint (" in done.stdout, done.stdout
    assert snapshot(out) == snapshot(tmp_path / "uninterrupted")
    tok = Tokenizer.from_file(str(TOKENIZER))
    eos = open_source(out, "web").meta["eos_id"]
    expected = [i for e in tok.encode_batch(docs, add_special_tokens=False) for i in [*e.ids, eos]]
    assert open_source(out, "web").tokens[:].tolist() == expected


def _killed_in(monkeypatch, module, name: str, after: Callable[[tuple], bool] | None = None) -> None:
    """Make `module.name` stop the preparation like a kill (KeyboardInterrupt: nothing cleaned up): at once,
    or, with `after`, once `os.replace` has moved something `after` picks while it runs."""
    original = getattr(module, name)

    def killed(*args, **kwargs):
        if after is None:
            raise KeyboardInterrupt
        real = os.replace

        def replace(*moved):
            real(*moved)
            if after(moved):
                raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", replace)
            return original(*args, **kwargs)

    monkeypatch.setattr(module, name, killed)


@pytest.mark.parametrize("moment", ["after the first index", "while the work directory is removed"])
def test_a_kill_while_publishing_is_finished_by_the_same_command_and_refused_to_another(
        corpus: dict, one_worker: Path, tmp_path: Path, monkeypatch, moment: str) -> None:
    """Killed once `web.index.json` is published (`code`'s not yet), or once both are and the work directory
    is half removed: another command (another shard size) is refused the outputs, and the same command
    again finishes the preparation, tokenising nothing, byte-identical to an uninterrupted one."""
    from upcycler.errors import UpcyclerError
    from upcycler.train.data import prepare, resume
    from upcycler.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    files = prepare.parse_sources(corpus["sources"][1::2])
    def half_removed(work: Path) -> None:
        shutil.rmtree(work / "records")  # `resume.discard` removes the journal last
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        if moment == "after the first index":
            _killed_in(patch, prepare, "_publish_local", after=lambda moved: str(moved[1]).endswith(".index.json"))
        else:
            patch.setattr(prepare, "discard", half_removed)
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare_sources(tokenizer, files, tmp_path, unit_bytes=24_000)
    published = sorted(p.name for p in tmp_path.glob("*.index.json"))
    assert published == (["web.index.json"] if moment == "after the first index" else ["code.index.json",
                                                                                        "web.index.json"])
    assert list(tmp_path.glob(f".prepare-*/{resume.JOURNAL}"))
    with pytest.raises(UpcyclerError, match="index.json: already exists; choose another --out or pass --overwrite"):
        prepare.prepare_sources(tokenizer, files, tmp_path, unit_bytes=30_000)
    indexes = prepare.prepare_sources(tokenizer, files, tmp_path, unit_bytes=24_000)
    assert [i["shards_tokenised"] for i in indexes] == [0, 0]
    assert snapshot(tmp_path) == snapshot(one_worker)


def test_a_kill_while_uploading_to_a_bucket_is_finished_by_the_same_command(corpus: dict, one_worker: Path,
                                                                            monkeypatch) -> None:
    """Into a bucket: killed once the first index is uploaded (the second not), the same command again
    uploads the rest (another command is refused), and the bucket holds what a local preparation does."""
    import gcs_emulator

    from upcycler.errors import UpcyclerError
    from upcycler.io import object_store
    from upcycler.train.data import prepare
    from upcycler.train.data.tokenizer import load_tokenizer

    if not gcs_emulator.is_running():
        pytest.skip("the run's storage emulator is not set")
    out = f"{gcs_emulator.unique_prefix('publish-kill')}/data"
    tokenizer = load_tokenizer(TOKENIZER)
    files = prepare.parse_sources(corpus["sources"][1::2])
    upload_all = object_store.upload_all

    def killed_after_one_index(pairs):
        if all(url.endswith(".index.json") for _, url in pairs):
            upload_all(pairs[:1])
            raise KeyboardInterrupt
        upload_all(pairs)

    with monkeypatch.context() as patch:
        patch.setattr(object_store, "upload_all", killed_after_one_index)
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare_into_bucket(tokenizer, files, out, unit_bytes=24_000)
    assert [n for n in object_store.list_objects(out) if n.endswith(".index.json")] == ["code.index.json"]
    with pytest.raises(UpcyclerError, match="already exists"):
        prepare.prepare_into_bucket(tokenizer, files, out, unit_bytes=30_000)
    indexes = prepare.prepare_into_bucket(tokenizer, files, out, unit_bytes=24_000)
    assert [i["shards_tokenised"] for i in indexes] == [0, 0]
    uploaded = {n: object_store.read_bytes(object_store.join(out, n)) for n in object_store.list_objects(out)}
    assert uploaded == snapshot(one_worker)


def _journal_of(tmp_path: Path, monkeypatch, sources: dict[str, list[str]]) -> Path:
    """The publish journal a preparation of `sources` (NAME: documents) into `tmp_path/out` leaves when it is
    killed with every unit done and nothing published; returns its path."""
    from upcycler.train.data import prepare, resume
    from upcycler.train.data.tokenizer import load_tokenizer

    inputs = {}
    tmp_path.mkdir()
    for name, docs in sources.items():
        inputs[name] = [_write_jsonl(tmp_path / f"{name}.jsonl", docs)]
    with monkeypatch.context() as patch:
        _killed_in(patch, prepare, "_publish_local")
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare_sources(load_tokenizer(TOKENIZER), inputs, tmp_path / "out")
    return next((tmp_path / "out").glob(f".prepare-*/{resume.JOURNAL}"))


@pytest.mark.parametrize("case", ["another plan's journal", "another plan's sources under this plan",
                                  "no num_documents", "a negative count", "not JSON"])
def test_a_publish_journal_that_is_not_this_plans_is_refused_in_one_line(tmp_path: Path, monkeypatch,
                                                                         case: str) -> None:
    """The journal names its plan and its sources: one copied from another preparation, one whose sources
    are not this preparation's, or one missing a field the summary reads, is refused in one line naming
    the journal and what is wrong; nothing of it is published and nothing of this plan is claimed done."""
    web, code = _documents("json/*.py", 30), _documents("collections/*.py", 30)
    journal = _journal_of(tmp_path / "this", monkeypatch, {"web": web, "code": code})
    other = json.loads(_journal_of(tmp_path / "other", monkeypatch, {"other": code}).read_text())
    mine = json.loads(journal.read_text())
    assert mine["plan"] == journal.parent.name.removeprefix(".prepare-") and other["plan"] != mine["plan"]
    if case == "another plan's journal":
        journal.write_text(json.dumps(other))
        mentions = f"names plan '{other['plan']}'"
    elif case == "another plan's sources under this plan":
        journal.write_text(json.dumps({"plan": mine["plan"], "indexes": other["indexes"]}))
        mentions = "lists sources ['other']"
    elif case == "no num_documents":
        del mine["indexes"][0]["num_documents"]
        journal.write_text(json.dumps(mine))
        mentions = "indexes[0].num_documents is missing"
    elif case == "a negative count":
        mine["indexes"][1]["shards_reused"] = -1
        journal.write_text(json.dumps(mine))
        mentions = "indexes[1].shards_reused is not a count"
    else:
        journal.write_text("{not json")
        mentions = "is not JSON"
    out = tmp_path / "this" / "out"
    proc = run_cli("prepare-data", "--tokenizer", TOKENIZER, "--source", f"web={tmp_path}/this/web.jsonl",
                   "--source", f"code={tmp_path}/this/code.jsonl", "--out", out, check=False)
    line = assert_clean_failure(proc, mentions=mentions)
    assert "publishing.json" in line and "remove it and run the same command again" in line, line
    assert sorted(p.name for p in out.iterdir()) == [journal.parent.name]  # nothing published
    assert "documents" not in proc.stdout
    journal.unlink()  # the fix the line names: the same command then prepares this plan's sources
    done = run_cli("prepare-data", "--tokenizer", TOKENIZER, "--source", f"web={tmp_path}/this/web.jsonl",
                   "--source", f"code={tmp_path}/this/code.jsonl", "--out", out)
    assert "web: 30 documents" in done.stdout and "code: 30 documents" in done.stdout, done.stdout
    assert sorted(p.name for p in out.glob("*.index.json")) == ["code.index.json", "web.index.json"]


def test_a_rerun_tokenises_again_a_unit_whose_shard_is_gone_and_says_why(corpus: dict, one_worker: Path,
                                                                          tmp_path: Path, monkeypatch) -> None:
    from upcycler.train.data import prepare
    from upcycler.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    files = prepare.parse_sources(corpus["sources"][1::2])
    with monkeypatch.context() as patch:
        _killed_in(patch, prepare, "write_journal")  # every unit done, nothing published
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare_sources(tokenizer, files, tmp_path, unit_bytes=24_000)
    next(tmp_path.glob(".prepare-*/shards/code.shards/00001.tokens")).unlink()
    web, code = prepare.prepare_sources(tokenizer, files, tmp_path, unit_bytes=24_000)
    assert (web["shards_tokenised"], web["shards_redone"]) == (0, [])
    assert (code["shards_tokenised"], code["shards_redone"]) == (1, ["1 shard missing or damaged"])
    assert snapshot(tmp_path) == snapshot(one_worker)


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict:
    """The same documents in every input format users have, prepared by four `prepare-data` runs side by
    side: text formats (source `doc` is the plain JSONL), Megatron ids as source `doc` of its own directory,
    a saved dataset of `input_ids` and ArrayRecord ids."""
    import zstandard
    from data_formats import write_arrayrecord, write_megatron, write_parquet, write_saved_dataset

    root = tmp_path_factory.mktemp("formats")
    docs = _documents("json/*.py", 300)
    tok = Tokenizer.from_file(str(TOKENIZER))
    ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    eos = tok.token_to_id("<|endoftext|>")
    for name in ("doc", "gz", "zst", "pq", "ar", "meg", "ar32"):
        (root / name).mkdir()
    _write_jsonl(root / "doc" / "a.jsonl", docs)
    _write_jsonl(root / "gz" / "a.jsonl.gz", docs)
    (root / "zst" / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=19).compress(
        (root / "doc" / "a.jsonl").read_bytes()))
    write_saved_dataset(root / "ds", docs)
    write_parquet(root / "pq" / "a.parquet", docs)
    write_arrayrecord(root / "ar" / "a.array_record", [d.encode() for d in docs])
    write_megatron(root / "meg" / "a", [[*i, eos] for i in ids])  # preprocess_data.py --append-eod
    write_saved_dataset(root / "ids", ids, column="input_ids")
    write_arrayrecord(root / "ar32" / "a.arrayrecord", [np.asarray(i, "<i4").tobytes() for i in ids])
    runs = {
        "text": ["--source", f"doc={root}/doc/a.jsonl", "--source", f"gz={root}/gz/*", "--source",
                 f"zst={root}/zst/*", "--source", f"ds={root}/ds", "--source", f"pq={root}/pq/*",
                 "--source", f"ar={root}/ar/*"],
        "megatron": ["--source", f"doc={root}/meg/a.bin"],
        "ids": ["--source", f"ids={root}/ids", "--text-field", "input_ids"],
        "ar32": ["--source", f"ar32={root}/ar32/*", "--format", "arrayrecord-int32"],
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        list(pool.map(lambda item: run_cli("prepare-data", "--tokenizer", TOKENIZER, "--out", root / item[0],
                                           *item[1], "--eos", str(eos)), runs.items()))
    expected = [t for i in ids for t in [*i, eos]]
    return {"root": root, "expected": expected}


@pytest.mark.parametrize("where, name", [("text", "doc"), ("text", "gz"), ("text", "zst"), ("text", "ds"),
                                         ("text", "pq"), ("text", "ar"), ("megatron", "doc"), ("ids", "ids"),
                                         ("ar32", "ar32")])
def test_every_input_format_gives_the_tokenizers_encoding(formats: dict, where: str, name: str) -> None:
    """Text formats are tokenised exactly as `tokenizers` encodes the documents; pre-tokenised ones
    (Megatron with its EODs, a saved dataset's `input_ids`, ArrayRecord int32 records) are adopted as
    they are, EOS appended only where a document lacks it."""
    assert open_source(formats["root"] / where, name).tokens[:].tolist() == formats["expected"]


def test_an_adopted_megatron_source_gives_the_batches_of_its_text(formats: dict) -> None:
    from upcycler.train.data.config import DataConfig, Phase
    from upcycler.train.data.mix import make_data_iterator

    def batches(directory: Path) -> list[dict]:
        config = DataConfig(dir=directory, seq_len=64, global_batch_size=6, seed=3, phases=(Phase({"doc": 1.0}),))
        iterator = make_data_iterator(config)
        return [next(iterator) for _ in range(8)]

    text, adopted = batches(formats["root"] / "text"), batches(formats["root"] / "megatron")
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(text, adopted) for k in a)
    index = json.loads((formats["root"] / "megatron" / "doc.index.json").read_text())
    assert index["input"]["formats"] == ["megatron"]


def _hostile_inputs(root: Path) -> dict[str, tuple[str, str]]:
    """name -> (--source value, what the one error line must mention); small on disk, quick to refuse."""
    import zstandard
    from data_formats import write_parquet

    for name in ("zstd", "ar", "pq", "line", "empty"):
        (root / name).mkdir(parents=True)
    with open(root / "zstd" / "bomb.txt.zst", "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as z:
        block = b"a" * (1 << 24)
        for _ in range(64):  # 1 GiB of text in a few kB
            z.write(block)
    (root / "ar" / "x.array_record").write_bytes(np.random.default_rng(0).bytes(10_000))
    write_parquet(root / "pq" / "x.parquet", ["a document"], column="body")
    with open(root / "line" / "x.jsonl", "wb") as f:  # one 500 MB line (sparse: costs no disk)
        f.write(b'{"text": "')
        f.truncate(500 * 10**6)
    for k in range(10_000):
        (root / "empty" / f"{k:05d}.jsonl").touch()
    return {
        "zstd bomb": (f"s={root}/zstd/*", "bomb.txt.zst"),
        "corrupt ArrayRecord": (f"s={root}/ar/*", "x.array_record"),
        "Parquet without a text column": (f"s={root}/pq/*", "x.parquet"),
        "a 500 MB single line": (f"s={root}/line/*", "x.jsonl"),
        "10,000 empty files": (f"s={root}/empty/*.jsonl", "has no text"),
    }


@pytest.mark.heavy  # one prepare-data process per hostile input: 48 s, the fast tier's slowest test
def test_hostile_inputs_give_one_line_and_leave_nothing(tmp_path: Path) -> None:
    from cli_helpers import assert_clean_failure

    cases = _hostile_inputs(tmp_path / "in")
    before = snapshot(tmp_path / "in")

    def attempt(item):
        k, (source, _) = item
        return run_cli("prepare-data", "--tokenizer", TOKENIZER, "--source", source, "--out", tmp_path / f"out{k}",
                       check=False)

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(attempt, enumerate(cases.values())))
    for (case, (_, mentions)), proc in zip(cases.items(), procs):
        try:
            assert_clean_failure(proc, mentions=mentions)
        except AssertionError as err:
            raise AssertionError(f"{case}: {err}") from None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output, no work directory
    assert snapshot(tmp_path / "in") == before


_HOST = """
import json, os, sys
from upcycler.train.data.config import DataConfig, Phase
from upcycler.train.data.mix import make_data_iterator
from upcycler.train.data.token_store import MAX_OPEN_FILES

def status(key):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key)))

directory, index, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
figures = {"max_open_files": MAX_OPEN_FILES}
for n in (4, 64, 4, 64):
    names = [f"s{k:02d}" for k in range(n)]
    config = DataConfig(dir=directory, seq_len=64, global_batch_size=512, seed=0,
                        phases=(Phase({name: 1 / n for name in names}),))
    iterator = make_data_iterator(config, index, count)
    for _ in range(40):
        next(iterator)
    figures[n] = {"rss_kib": status("VmRSS:"), "threads": len(os.listdir("/proc/self/task")),
                  "fds": len(os.listdir("/proc/self/fd"))}
    iterator.close()
print(json.dumps(figures))
"""


def test_sixty_four_sources_on_a_256_host_pod_cost_no_more_memory_threads_or_files(tmp_path: Path) -> None:
    """Four processes, each one host of a 256-host pod (hosts 0, 64, 128 and 192: each reads only its own 2
    rows of a 512-row global batch), read 40 steps from 4 sources, then from 64 (3 shards each): the second
    pass at each count is measured, after warm-up. Memory may grow by 4 MiB at most (measured: 40 KiB), threads not at all,
    and open files stay within the reader's bound (`MAX_OPEN_FILES`, least recently used closed first)."""
    docs = _documents("*.py", 64 * 60)
    sources = []
    for k in range(64):
        _write_jsonl(tmp_path / f"s{k:02d}.jsonl", docs[k::64])
        sources += ["--source", f"s{k:02d}={tmp_path}/s{k:02d}.jsonl"]
    run_cli("prepare-data", "--tokenizer", TOKENIZER, *sources, "--out", tmp_path / "out", "--shard-size", "5KB")
    hosts = [subprocess.Popen([sys.executable, "-c", _HOST, str(tmp_path / "out"), str(k), "256"],
                              stdout=subprocess.PIPE, text=True) for k in (0, 64, 128, 192)]
    for host in hosts:
        out, _ = host.communicate(timeout=300)
        assert host.returncode == 0
        figures = json.loads(out)
        few, many = figures["4"], figures["64"]
        assert many["rss_kib"] - few["rss_kib"] < 4 * 1024, figures
        assert many["threads"] == few["threads"], figures
        assert many["fds"] - few["fds"] <= figures["max_open_files"], figures
    index = json.loads((tmp_path / "out" / "s00.index.json").read_text())
    assert len(index["shards"]) >= 3  # 192 shards in all: more than the open-file bound


def test_stale_work_of_another_plan_is_removed_and_a_held_one_is_left(corpus: dict, tmp_path: Path) -> None:
    """A killed preparation's work directory whose inputs have changed since cannot resume: the next
    preparation into the same OUT removes it, unless another preparation holds it right now."""
    import fcntl

    out = tmp_path / "out"
    stale, held = out / ".prepare-0000000000000000", out / ".prepare-1111111111111111"
    for work in (stale, held):
        (work / "shards").mkdir(parents=True)
    with open(held / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _prepare(corpus, out)
        assert not stale.exists() and held.is_dir()
    assert sorted(p.name for p in out.iterdir()) == [held.name, "code.index.json", "code.shards",
                                                      "web.index.json", "web.shards"]


def _documents_of(directory, name: str) -> list[tuple[int, ...]]:
    """The documents of a prepared source, read back through `open_source`: its stream cut after each EOS
    (no document of this corpus holds EOS inside it)."""
    source = open_source(directory, name)
    tokens = source.tokens[:]
    docs = [tuple(d.tolist()) for d in np.split(tokens, np.flatnonzero(tokens == source.meta["eos_id"]) + 1)[:-1]]
    assert len(docs) == source.meta["num_documents"] and sum(map(len, docs)) == tokens.size
    return docs


def _held(doc: tuple[int, ...], fraction: float = FRACTION) -> bool:
    """The split's rule, written out: the first 8 bytes of the sha256 of the document's ids without its EOS
    (little-endian uint32), as a little-endian integer, below fraction * 2**64."""
    digest = hashlib.sha256(np.asarray(doc[:-1], dtype="<u4").tobytes()).digest()
    return int.from_bytes(digest[:8], "little") < fraction * 2**64


@pytest.fixture(scope="module")
def split(corpus: dict, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("split") / "out"
    _prepare(corpus, out, "--heldout", str(FRACTION))
    return out


def test_a_heldout_split_holds_out_the_documents_the_hash_picks(corpus: dict, one_worker: Path, split: Path) -> None:
    """NAME.heldout holds exactly the documents whose hash is below the fraction and NAME the others, each
    in input order, so together they are the unsplit source's documents (as multisets); about FRACTION of
    the documents are held out; both indexes say which side they are and of what fraction."""
    assert prepared_names(split) == ["code", "code.heldout", "web", "web.heldout"]
    for name in ("web", "code"):
        whole = _documents_of(one_worker, name)
        train, held = _documents_of(split, name), _documents_of(split, f"{name}.heldout")
        assert Counter(train) + Counter(held) == Counter(whole)
        assert train == [d for d in whole if not _held(d)] and held == [d for d in whole if _held(d)]
        spread = math.sqrt(len(whole) * FRACTION * (1 - FRACTION))
        assert abs(len(held) - len(whole) * FRACTION) < 4 * spread, (name, len(held), len(whole))
        unsplit = json.loads((one_worker / f"{name}.index.json").read_text())
        for side, source in (("train", name), ("heldout", f"{name}.heldout")):
            index = json.loads((split / f"{source}.index.json").read_text())
            assert (index["name"], index["split"], index["heldout_fraction"]) == (source, side, FRACTION)
            assert index["files"] == unsplit["files"] and index["input"] == unsplit["input"]
    assert "split" not in unsplit and "heldout_fraction" not in unsplit


def test_two_workers_and_another_unit_cut_hold_out_the_same_documents(corpus: dict, split: Path,
                                                                      tmp_path: Path) -> None:
    """The split depends on the documents alone: 2 workers on units of another --shard-size (more, other
    shards) hold out the same documents as 1 worker."""
    _prepare(corpus, tmp_path / "out", "--heldout", str(FRACTION), "--shard-size", "10KB", "--workers", "2")
    for name in ("web", "web.heldout", "code", "code.heldout"):
        assert _documents_of(tmp_path / "out", name) == _documents_of(split, name)
    shards = {d: len(json.loads((d / "web.index.json").read_text())["shards"]) for d in (split, tmp_path / "out")}
    assert shards[tmp_path / "out"] > shards[split]


def test_a_duplicate_falls_on_the_side_of_its_original_in_any_format(tmp_path: Path) -> None:
    """The same documents twice in one source (another file, reversed) and once as Megatron ids in a
    source of their own: each document is on the same side everywhere, so nothing held out is trained on."""
    from data_formats import write_megatron

    docs = _documents("json/*.py", 150)
    tok = Tokenizer.from_file(str(TOKENIZER))
    _write_jsonl(tmp_path / "a.jsonl", docs)
    _write_jsonl(tmp_path / "b.jsonl", docs[::-1])
    write_megatron(tmp_path / "meg", [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)])
    run_cli("prepare-data", "--tokenizer", TOKENIZER, "--source", f"text={tmp_path}/a.jsonl", "--source",
            f"text={tmp_path}/b.jsonl", "--source", f"ids={tmp_path}/meg.bin", "--out", tmp_path / "out",
            "--heldout", "0.3")
    train, held = _documents_of(tmp_path / "out", "text"), _documents_of(tmp_path / "out", "text.heldout")
    assert not set(train) & set(held) and len(held) > 10
    assert _documents_of(tmp_path / "out", "ids.heldout") == held[: len(held) // 2]
    assert _documents_of(tmp_path / "out", "ids") == train[: len(train) // 2]


def test_heldout_zero_writes_what_no_split_writes(corpus: dict, one_worker: Path, tmp_path: Path) -> None:
    _prepare(corpus, tmp_path / "out", "--heldout", "0")
    assert snapshot(tmp_path / "out") == snapshot(one_worker)


def test_an_interrupted_split_resumes_both_sides(corpus: dict, split: Path, tmp_path: Path, monkeypatch) -> None:
    """Stopped after every unit is done but before publishing, a rerun tokenises nothing and publishes
    both sides byte-identical to an uninterrupted run; another fraction is another plan."""
    from upcycler.train.data import prepare
    from upcycler.train.data.engine import EngineFailure
    from upcycler.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    files = prepare.parse_sources(corpus["sources"][1::2])

    def interrupted(*_):
        raise EngineFailure("interrupted")

    with monkeypatch.context() as patch:
        patch.setattr(prepare, "_publish_local", interrupted)
        with pytest.raises(EngineFailure):
            prepare.prepare_sources(tokenizer, files, tmp_path, unit_bytes=24_000, heldout_fraction=FRACTION)
    indexes = prepare.prepare_sources(tokenizer, files, tmp_path, unit_bytes=24_000, heldout_fraction=FRACTION)
    assert [i["name"] for i in indexes] == ["web", "web.heldout", "code", "code.heldout"]
    assert all(i["shards_tokenised"] == 0 and i["shards_reused"] > 0 for i in indexes)
    assert snapshot(tmp_path) == snapshot(split)
    keys = {f: prepare._plan(tokenizer, files, None, "text", "file", 24_000, None, f).key for f in (0, 0.1, FRACTION)}
    assert len(set(keys.values())) == 3


@pytest.mark.parametrize("fraction", ["1", "-0.1", "nan", "inf", "2"])
def test_a_fraction_outside_zero_to_one_is_refused_in_one_line(corpus: dict, tmp_path: Path, fraction: str) -> None:
    assert_clean_failure(_prepare(corpus, tmp_path / "out", "--heldout", fraction, check=False), mentions="--heldout")
    assert not list(tmp_path.iterdir())


def _refused(tmp_path: Path, cases: dict[tuple[str, ...], str]) -> None:
    """Each case (arguments -> what its one error line mentions) fails cleanly, leaving only `tmp_path/in`."""
    def attempt(item):
        k, argv = item
        return run_cli("prepare-data", "--tokenizer", TOKENIZER, *argv, "--out", tmp_path / f"out{k}", check=False)

    with ThreadPoolExecutor(len(cases)) as pool:
        procs = list(pool.map(attempt, enumerate(cases)))
    for proc, mentions in zip(procs, cases.values()):
        assert_clean_failure(proc, mentions=mentions)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_source_too_small_for_its_split_is_refused_naming_it(tmp_path: Path) -> None:
    """Neither side of a split may be empty: the one line names the source and the way out, and nothing is
    written (no output, no work directory)."""
    (tmp_path / "in").mkdir()
    _write_jsonl(tmp_path / "in" / "tiny.jsonl", ["a document", "another document"])
    tiny = ("--source", f"tiny={tmp_path}/in/tiny.jsonl")
    _refused(tmp_path, {(*tiny, "--heldout", "0.01"): "'tiny' falls in its --heldout 0.01 split; pass a larger --heldout",
                        (*tiny, "--heldout", "0.999999"): "'tiny' fall in its --heldout 0.999999 split"})


def test_a_clashing_name_or_a_bad_line_of_a_split_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    _write_jsonl(tmp_path / "in" / "a.jsonl", ["a document", "another document"])
    (tmp_path / "in" / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    _refused(tmp_path, {
        ("--source", f"web={tmp_path}/in/a.jsonl", "--source", f"web.heldout={tmp_path}/in/a.jsonl",
         "--heldout", "0.5"): "--source web.heldout",
        ("--source", f"bad={tmp_path}/in/bad.jsonl", "--heldout", "0.5"): "bad.jsonl",
    })


def test_a_split_into_a_bucket_is_the_local_split(corpus: dict, split: Path) -> None:
    import gcs_emulator

    from upcycler.io import object_store

    if not gcs_emulator.is_running():
        pytest.skip("the run's storage emulator is not set")
    out = f"{gcs_emulator.unique_prefix('heldout')}/data"
    _prepare(corpus, out, "--heldout", str(FRACTION))
    uploaded = {name: object_store.read_bytes(object_store.join(out, name)) for name in object_store.list_objects(out)}
    assert uploaded == snapshot(split)
    for name in ("web.heldout", "code.heldout"):
        assert _documents_of(out, name) == _documents_of(split, name)
