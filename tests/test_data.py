"""The training data pipeline: tokenising once (`prepare-data`), Megatron-style windows, per-epoch
shuffles, token-share mixing by phase, exact resume, multi-process slicing and config errors."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import random
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from trainer_fixtures import as_single_file

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.train.data.config import DataConfig, Phase
from upcycler.train.data.format import SHARD_HEADER_BYTES, BlockChecksums, shard_header, token_dtype
from upcycler.train.data.mix import MixSchedule, carried, make_data_iterator
from upcycler.train.data.prepare import parse_sources, prepare_sources
from upcycler.train.data.sources import (
    MATERIALISE_BELOW,
    ExampleStream,
    Windows,
    open_source,
    stable_permutation,
)
from upcycler.train.data.token_store import ShardFile, TokenStream
from upcycler.train.data.tokenizer import load_tokenizer

WORDS = [f"w{i}" for i in range(60)]
SEQ_LEN = 16


def _tokenizer(path: Path, specials: list[str]) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=specials))
    tok.save(str(path))
    return path


def _sentences(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tokenizer, three small sources (JSONL, paragraph text, JSONL) and their documents."""
    root = tmp_path_factory.mktemp("corpus")
    docs = {"web": _sentences(1, 400), "code": _sentences(2, 300), "math": _sentences(3, 200)}
    (root / "web-0.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs["web"][:200]))
    (root / "web-1.jsonl").write_text("".join(json.dumps({"text": d}) + "\n\n" for d in docs["web"][200:]))
    (root / "code.txt").write_text("\n\n".join(docs["code"]) + "\n")
    (root / "math.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs["math"]))
    )
    return {"root": root, "docs": docs, "tokenizer": _tokenizer(root / "tokenizer.json", ["<unk>", "</s>"])}


@pytest.fixture(scope="module")
def prepared(corpus: dict) -> Path:
    """The corpus prepared through the CLI."""
    root, out = corpus["root"], corpus["root"] / "prepared"
    args = [
        "prepare-data",
        "--tokenizer",
        str(corpus["tokenizer"]),
        "--out",
        str(out),
        "--text-unit",
        "paragraph",
    ]
    for name, pattern in (("web", "web-*.jsonl"), ("code", "code.txt"), ("math", "math.jsonl")):
        args += ["--source", f"{name}={root / pattern}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return out


def _config(directory: Path, **changes) -> DataConfig:
    config = DataConfig(
        dir=directory,
        seq_len=SEQ_LEN,
        global_batch_size=8,
        seed=5,
        phases=(Phase({"web": 0.7, "code": 0.2, "math": 0.1}),),
    )
    return replace(config, **changes)


def _batches(iterator, count: int) -> list[dict]:
    return [next(iterator) for _ in range(count)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def test_prepare_writes_the_documents_with_eos_and_metadata(corpus: dict, prepared: Path) -> None:
    tok = Tokenizer.from_file(str(corpus["tokenizer"]))
    eos = tok.token_to_id("</s>")
    for name, docs in corpus["docs"].items():
        expected = [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eos]]
        tokens = open_source(prepared, name).tokens
        index = json.loads((prepared / f"{name}.index.json").read_text())
        assert tokens.dtype == np.uint16 and tokens[:].tolist() == expected
        assert index["num_tokens"] == len(expected) and index["num_documents"] == len(docs)
        assert index["eos_id"] == eos and index["vocab_size"] == tok.get_vocab_size()
        assert index["tokenizer"]["sha256"] == load_tokenizer(corpus["tokenizer"]).sha256
        assert all(len(f["sha256"]) == 64 and Path(f["path"]).is_file() for f in index["files"])
        assert [hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest() for f in index["files"]] == [
            f["sha256"] for f in index["files"]]
        for shard in index["shards"]:
            data = (prepared / shard["file"]).read_bytes()
            assert hashlib.sha256(data[SHARD_HEADER_BYTES:]).hexdigest() == shard["sha256"]
            assert len(data) == SHARD_HEADER_BYTES + 2 * shard["tokens"]
    assert len(json.loads((prepared / "web.index.json").read_text())["files"]) == 2
    assert not list(prepared.glob(".*"))
    assert token_dtype(70_000) == np.uint32 and token_dtype(65_536) == np.uint16


def test_text_units_cut_documents(tmp_path: Path, corpus: dict) -> None:
    (tmp_path / "a.txt").write_text("w1 w2\nw3\n\nw4\n")
    tok = load_tokenizer(corpus["tokenizer"])
    counts = {}
    for unit in ("file", "paragraph", "line"):
        (meta,) = prepare_sources(tok, {f"t_{unit}": [tmp_path / "a.txt"]}, tmp_path / "out", text_unit=unit)
        counts[unit] = (meta["num_documents"], meta["num_tokens"])
    assert counts == {"file": (1, 5), "paragraph": (2, 6), "line": (3, 7)}


def test_eos_comes_from_tokenizer_config_or_option(tmp_path: Path) -> None:
    _tokenizer(tmp_path / "tokenizer.json", ["<unk>", "<s>", "<|im_end|>"])
    with pytest.raises(UpcyclerError, match="--eos"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert load_tokenizer(tmp_path).eos_id == 2
    assert load_tokenizer(tmp_path, eos="<s>").eos_id == 1 and load_tokenizer(tmp_path, eos="0").eos_id == 0


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"text": "w1"}\n{"body": "w2"}\n', r"bad\.jsonl:2: no field 'text'; pass --text-field"),
        ('{"text": "w1"}\n{"text": \n', r"bad\.jsonl:2: unreadable JSON"),
        ('{"text": 3}\n', r"bad\.jsonl:1: field 'text' is int"),
    ],
)
def test_bad_input_fails_without_output(tmp_path: Path, corpus: dict, content: str, expected: str) -> None:
    (tmp_path / "good.jsonl").write_text('{"text": "w1 w2"}\n')
    (tmp_path / "bad.jsonl").write_text(content)
    files = parse_sources([f"s={tmp_path}/good.jsonl", f"s={tmp_path}/bad.jsonl"])
    with pytest.raises(UpcyclerError, match=expected):
        prepare_sources(load_tokenizer(corpus["tokenizer"]), files, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_errors_are_one_line(
    tmp_path: Path, corpus: dict, prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(*args: str) -> str:  # stdout may say what the work needs first (an error mid-run comes after it)
        result = CliRunner().invoke(main, ["prepare-data", "--tokenizer", str(corpus["tokenizer"]), *args])
        assert (
            result.exit_code == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
        )
        return result.stderr

    web = str(corpus["root"] / "web-0.jsonl")
    assert "already exists" in run("--source", f"web={web}", "--out", str(prepared))
    assert "matches no file" in run("--source", f"web={tmp_path}/*.jsonl", "--out", str(tmp_path / "o"))
    assert "NAME=GLOB_OR_FILE" in run("--source", web, "--out", str(tmp_path / "o"))
    (tmp_path / "d.csv").write_text("w1\n")
    assert "--format" in run("--source", f"x={tmp_path}/d.csv", "--out", str(tmp_path / "o"))
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert "pip install pyarrow" in run("--source", f"p={tmp_path}/d.parquet", "--out", str(tmp_path / "o"))


@pytest.mark.parametrize("length", [1 + 5 * SEQ_LEN, 3 + 5 * SEQ_LEN])
def test_windows_overlap_by_one_token_and_lose_nothing(length: int) -> None:
    tokens = np.arange(100, 100 + length, dtype=np.uint16)
    windows = Windows(tokens, SEQ_LEN, pad_id=0)
    examples = [windows[i] for i in range(len(windows))]
    targets = np.concatenate([t[m > 0] for _, t, m in examples])
    inputs = np.concatenate([x[m > 0] for x, _, m in examples])
    assert targets.tolist() == tokens[1:].tolist() and inputs.tolist() == tokens[:-1].tolist()
    for (_, previous, _), (following, _, _) in itertools.pairwise(examples):
        assert following[0] == previous[-1]
    assert all(m.all() for _, _, m in examples[:-1])


@pytest.mark.parametrize("materialise_below", [MATERIALISE_BELOW, 0], ids=["array", "grain"])
def test_each_epoch_is_a_fresh_permutation(prepared: Path, materialise_below: int) -> None:
    source = open_source(prepared, "code")
    windows = Windows(source.tokens, SEQ_LEN, 1)
    stream = ExampleStream(windows, "code", seed=5, materialise_below=materialise_below)
    n = stream.epoch_size
    epochs = [[stream.window_index(k * n + i) for i in range(n)] for k in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = ExampleStream(windows, "code", seed=5, materialise_below=materialise_below)
    assert epochs[1] == [again.window_index(n + i) for i in range(n)]
    other = ExampleStream(windows, "web", seed=5, materialise_below=materialise_below)
    assert epochs[0] != [other.window_index(i) for i in range(n)]
    targets = np.concatenate([stream.windows[i][1][stream.windows[i][2] > 0] for i in sorted(epochs[0])])
    assert targets.tolist() == source.tokens[1:].tolist()


def test_shuffles_are_pinned_integer_arithmetic() -> None:
    assert stable_permutation(8, 0).tolist() == [0, 7, 3, 1, 5, 4, 6, 2]
    assert stable_permutation(8, 2**64 - 1).tolist() == [6, 0, 2, 5, 3, 4, 7, 1]


def test_mixing_matches_token_shares(prepared: Path) -> None:
    weights = {"web": 0.7, "code": 0.2, "math": 0.1}
    iterator = make_data_iterator(_config(prepared, global_batch_size=40))
    batches = _batches(iterator, 250)
    iterator.close()
    source_id = np.concatenate([b["source_id"] for b in batches])
    tokens = np.concatenate([b["mask"].sum(axis=1) for b in batches])
    assert source_id.size == 10_000
    for i, name in enumerate(iterator.source_names):
        assert abs(np.mean(source_id == i) - weights[name]) < 0.02
        assert abs(tokens[source_id == i].sum() / tokens.sum() - weights[name]) < 0.02


def test_phase_switches_at_exactly_the_boundary_and_streams_continue() -> None:
    phases = (
        Phase({"web": 1.0}, until_step=7),
        Phase({"code": 0.5, "math": 0.5}, until_step=9),
        Phase({"web": 0.25, "code": 0.75}),
    )
    schedule = MixSchedule(["web", "code", "math"], phases, batch_size=8, seed=0)
    assert [schedule.phase_index(s) for s in (0, 6, 7, 8, 9, 10_000)] == [0, 0, 1, 1, 2, 2]
    assert all((schedule.rows(s)[0] == 0).all() for s in range(7))
    assert set(np.concatenate([schedule.rows(s)[0] for s in (7, 8)]).tolist()) == {1, 2}
    assert schedule.drawn_before(9) == {"web": 56, "code": 8, "math": 8}
    source, example = schedule.rows(9)
    assert sorted(example[source == 0].tolist()) == list(range(56, 56 + int((source == 0).sum())))
    assert example[source == 0].tolist() == sorted(example[source == 0].tolist())


def test_iterator_switches_phase_at_the_boundary_step(prepared: Path) -> None:
    config = _config(prepared, phases=(Phase({"web": 1.0}, until_step=3), Phase({"math": 1.0})))
    iterator = make_data_iterator(config)
    names = [{iterator.source_names[i] for i in next(iterator)["source_id"]} for _ in range(6)]
    assert names == [{"web"}] * 3 + [{"math"}] * 3


def test_resume_gives_the_batches_of_an_uninterrupted_run(prepared: Path) -> None:
    config = _config(prepared, phases=(Phase({"web": 0.5, "code": 0.5}, 6), Phase({"math": 0.4, "web": 0.6})))
    first = make_data_iterator(config)
    _batches(first, 4)
    state = json.loads(json.dumps(first.get_state()))
    expected = _batches(first, 6)
    first.close()
    resumed = make_data_iterator(config)
    resumed.set_state(state)
    assert _same(_batches(resumed, 6), expected) and resumed.get_state()["step"] == 10
    halves = [make_data_iterator(config, p, 2) for p in range(2)]
    for half in halves:
        half.set_state(state)
    regrouped = [
        {k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*(_batches(h, 6) for h in halves))
    ]
    assert _same(regrouped, expected)
    with pytest.raises(UpcyclerError, match="seq_len"):
        make_data_iterator(replace(config, seq_len=8)).set_state(state)


def _lengthening(prepared: Path, **changes) -> DataConfig:
    """Three steps of rows of SEQ_LEN, then rows twice as long (tokens per step kept), then a larger batch."""
    phases = (Phase({"web": 0.5, "code": 0.5}, 3),
              Phase({"web": 0.25, "code": 0.5, "math": 0.25}, 5, seq_len=2 * SEQ_LEN, batch="keep_tokens"),
              Phase({"math": 0.5, "web": 0.5}, seq_len=2 * SEQ_LEN, global_batch_size=8))
    return _config(prepared, phases=phases, **changes)


def test_each_phase_gives_batches_of_its_own_shape(prepared: Path) -> None:
    config = _lengthening(prepared)
    assert config.shapes == ((SEQ_LEN, 8), (2 * SEQ_LEN, 4), (2 * SEQ_LEN, 8))
    assert [config.tokens_before(s) for s in (0, 3, 5, 6)] == [0, 3 * 128, 5 * 128, 5 * 128 + 256]
    batches = _batches(make_data_iterator(config), 7)
    for step, batch in enumerate(batches):
        seq_len, rows = config.shape_at(step)
        assert {k: v.shape for k, v in batch.items()} == {
            "inputs": (rows, seq_len), "targets": (rows, seq_len), "mask": (rows, seq_len), "source_id": (rows,)}
    halves = [_batches(make_data_iterator(config, p, 2), 7) for p in range(2)]
    regrouped = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*halves)]
    assert _same(regrouped, batches)


def test_one_shape_phases_give_the_batches_they_always_gave(prepared: Path) -> None:
    """A phase that repeats the section's seq_len and batch is no phase of its own length."""
    plain = _config(prepared, phases=(Phase({"web": 0.5, "code": 0.5}, 3), Phase({"math": 1.0})))
    spelled = _config(prepared, phases=(Phase({"web": 0.5, "code": 0.5}, 3),
                                        Phase({"math": 1.0}, seq_len=SEQ_LEN, batch="keep_tokens")))
    assert not spelled.phased and make_data_iterator(spelled).get_state() == make_data_iterator(plain).get_state()
    assert _same(_batches(make_data_iterator(spelled), 6), _batches(make_data_iterator(plain), 6))


def test_a_longer_phase_continues_the_stream_where_the_shorter_stopped(prepared: Path) -> None:
    """Unshuffled, one source: the first long row starts at the token the last short row's targets end
    on; shuffled, each source's stream stays in the epoch it had reached."""
    phases = (Phase({"web": 1.0}, 3), Phase({"web": 1.0}, seq_len=2 * SEQ_LEN))
    iterator = make_data_iterator(_config(prepared, phases=phases, shuffle=False))
    short, long = _batches(iterator, 3)[-1], next(iterator)
    assert short["targets"][-1, -1] == long["inputs"][0, 0]
    web = open_source(prepared, "web").tokens
    start = 3 * 8 * SEQ_LEN
    assert np.array_equal(long["inputs"][0], web[start:start + 2 * SEQ_LEN])
    old = [ExampleStream(Windows(np.zeros(1001, np.int32), 10, 0), "a", 0)]
    new = [ExampleStream(Windows(np.zeros(1001, np.int32), 40, 0), "a", 0)]
    assert carried(np.array([250]), old, new).tolist() == [2 * 25 + 13]  # epoch 2, 50 of 100 windows read


def test_resume_across_a_change_of_length_gives_the_uninterrupted_batches(prepared: Path) -> None:
    config = _lengthening(prepared)
    expected = _batches(make_data_iterator(config), 8)
    for stop in (2, 3, 4, 6):  # before the first boundary, on it, after it, after the second
        first = make_data_iterator(config)
        _batches(first, stop)
        state = json.loads(json.dumps(first.get_state()))
        first.close()
        resumed = make_data_iterator(config)
        resumed.set_state(state)
        assert _same(_batches(resumed, 8 - stop), expected[stop:]), stop
    with pytest.raises(UpcyclerError, match="phase shapes"):
        make_data_iterator(_config(prepared, phases=config.phases[:1] + (Phase({"math": 1.0}),))).set_state(state)


@pytest.mark.parametrize(
    "phase, message",
    [
        ({"seq_len": 0}, r"phases\[1\]\.seq_len"),
        ({"seq_len": -4}, r"phases\[1\]\.seq_len"),
        ({"global_batch_size": 0}, r"phases\[1\]\.global_batch_size"),
        ({"batch": "tokens"}, "'tokens'"),
        ({"seq_len": 24, "batch": "keep_tokens"}, "cannot keep 128 tokens per step .* rows of seq_len 24"),
        ({"seq_len": 32, "batch": "keep_tokens", "global_batch_size": 4}, "drop one of them"),
        ({"global_batch_size": 6}, r"phases\[1\] global_batch_size 6 is not divisible by the 4 processes"),
        ({"seq_len": 128, "batch": "keep_tokens"}, r"phases\[1\] global_batch_size 1 is not divisible"),
    ],
)
def test_bad_phase_shapes_are_refused_in_one_line(tmp_path: Path, phase: dict, message: str) -> None:
    raw = {"dir": str(tmp_path), "seq_len": SEQ_LEN, "global_batch_size": 8,
           "phases": [{"until_step": 3, "weights": {"web": 1.0}}, {"weights": {"web": 1.0}, **phase}]}
    with pytest.raises(UpcyclerError, match=message) as err:
        DataConfig.from_dict(raw, origin="train.yaml").check(process_count=4, origin="train.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("train.yaml")


def test_grain_checkpoint_handler_round_trips_the_state(tmp_path: Path, prepared: Path) -> None:
    import grain.checkpoint

    iterator = make_data_iterator(_config(prepared))
    _batches(iterator, 3)
    grain.checkpoint.CheckpointHandler().save(tmp_path, item=iterator)
    expected = _batches(iterator, 2)
    restored = grain.checkpoint.CheckpointHandler().restore(
        tmp_path, item=make_data_iterator(_config(prepared))
    )
    assert _same(_batches(restored, 2), expected)


def test_processes_get_disjoint_rows_of_the_same_global_batch(prepared: Path) -> None:
    config = _config(prepared, global_batch_size=12)
    whole = _batches(make_data_iterator(config), 5)
    parts = [_batches(make_data_iterator(config, p, 3), 5) for p in range(3)]
    for step, batch in enumerate(whole):
        pieces = [part[step] for part in parts]
        assert all(p["inputs"].shape == (4, SEQ_LEN) and p["source_id"].shape == (4,) for p in pieces)
        for key in batch:
            assert np.array_equal(np.concatenate([p[key] for p in pieces]), batch[key])
    assert whole[0]["inputs"].dtype == np.int32 and whole[0]["mask"].dtype == np.float32


def test_truncated_shards_are_reported(tmp_path: Path, prepared: Path) -> None:
    shutil.copy(prepared / "math.index.json", tmp_path)
    shutil.copytree(prepared / "math.shards", tmp_path / "math.shards")
    (shard,) = (tmp_path / "math.shards").iterdir()
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(UpcyclerError, match=r"00000\.tokens: holds .* bytes, math\.index\.json says .*truncated"):
        open_source(tmp_path, "math")


def test_a_damaged_token_is_refused_where_it_is_read(tmp_path: Path, prepared: Path) -> None:
    """One byte of a shard's tokens changed on disk (header and size intact, so opening the source cannot
    tell): the read that covers it is refused in one line naming the shard and its block."""
    index = json.loads((prepared / "math.index.json").read_text())
    assert index["block_bytes"] == 1 << 18 and all(s["block_crc32c"] for s in index["shards"])
    shutil.copy(prepared / "math.index.json", tmp_path)
    shutil.copytree(prepared / "math.shards", tmp_path / "math.shards")
    (shard,) = (tmp_path / "math.shards").iterdir()
    data = bytearray(shard.read_bytes())
    data[SHARD_HEADER_BYTES + 2 * 100] ^= 0x01  # token 100, still an id of the vocabulary
    shard.write_bytes(bytes(data))
    source = open_source(tmp_path, "math")
    with pytest.raises(UpcyclerError, match=r"math\.shards/00000\.tokens: block 0 \(bytes 128-[\d,]+\) read 2 "
                                            r"times, its bytes never matched the CRC32C math\.index\.json holds"):
        source.tokens[90:110]


def test_checked_reads_cut_any_span_from_whole_blocks(tmp_path: Path) -> None:
    """Small blocks (4 KiB) so spans cross them: every span reads the stored tokens exactly, and only the
    spans that touch a damaged block are refused."""
    ids = np.random.default_rng(0).integers(0, 60_000, 10_000, dtype=np.uint16)
    checksums = BlockChecksums(block_bytes=4096)
    checksums.update(ids.tobytes())
    header = shard_header(np.dtype(np.uint16), ids.size, 1, hashlib.sha256(ids.tobytes()).hexdigest())

    def stream(path: Path, data: bytes) -> TokenStream:
        path.write_bytes(header + data)
        blocks = (4096, base64.b64decode(checksums.text()))
        return TokenStream([ShardFile(str(path), header, ids.size, 2, "x.index.json", blocks)], np.dtype(np.uint16))

    whole = stream(tmp_path / "whole.tokens", ids.tobytes())
    spans = [(0, 1), (2047, 2049), (2048, 4096), (4000, 9000), (9999, 10_000), (0, 10_000), (5, 5)]
    assert all(np.array_equal(got, ids[a:b]) for got, (a, b) in zip(whole.read_spans(spans), spans))
    damaged = bytearray(ids.tobytes())
    damaged[3 * 4096 + 7] ^= 0x80  # block 3: tokens 6144-8191
    broken = stream(tmp_path / "broken.tokens", bytes(damaged))
    assert np.array_equal(broken[0:6144], ids[:6144]) and np.array_equal(broken[8192:], ids[8192:])
    with pytest.raises(UpcyclerError, match=r"broken\.tokens: block 3 \(bytes 12,416-16,512\)"):
        broken[6000:6200]


def test_single_file_sources_of_earlier_versions_give_the_same_batches(tmp_path: Path, prepared: Path) -> None:
    single = Path(shutil.copytree(prepared, tmp_path / "single"))
    as_single_file(single)
    assert sorted(p.name for p in single.iterdir())[:2] == ["code.meta.json", "code.tokens.npy"]
    config = _config(prepared, phases=(Phase({"web": 0.5, "code": 0.3, "math": 0.2}),))
    expected = _batches(make_data_iterator(config), 12)
    assert _same(_batches(make_data_iterator(replace(config, dir=single)), 12), expected)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"sources": ("web", "code"), "phases": (Phase({"web": 0.5, "math": 0.5}),)},
            "unknown source 'math'",
        ),
        ({"phases": (Phase({"web": 0.5, "news": 0.5}),)}, "no prepared source 'news'"),
        ({"phases": (Phase({"web": 0.7, "code": 0.2}),)}, "sum to 0.9, not 1"),
        ({"phases": (Phase({"web": 1.0}, 10), Phase({"code": 1.0}, 10), Phase({"web": 1.0}))}, "increasing"),
        ({"phases": (Phase({"web": 1.0}), Phase({"code": 1.0}))}, "only the last phase may omit until_step"),
        ({"seq_len": 100_000}, "fewer than seq_len \\+ 1"),
        ({"global_batch_size": 10}, "not divisible by the 4 processes"),
    ],
)
def test_bad_configs_are_rejected_up_front(prepared: Path, changes: dict, message: str) -> None:
    with pytest.raises(UpcyclerError, match=message):
        make_data_iterator(_config(prepared, **changes), process_index=0, process_count=4)


def test_config_from_yaml_mapping(tmp_path: Path) -> None:
    raw = {
        "dir": str(tmp_path),
        "seq_len": 32,
        "global_batch_size": 4,
        "phases": [{"until_step": 100, "weights": {"web": 0.7, "code": 0.3}}, {"weights": {"code": 1}}],
    }
    config = DataConfig.from_dict(raw, origin="train.yaml")
    assert config.source_names == ("web", "code") and config.phases[0].until_step == 100
    with pytest.raises(UpcyclerError, match="train.yaml: unknown key 'weight'"):
        DataConfig.from_dict({**raw, "weight": 1}, origin="train.yaml")
    with pytest.raises(UpcyclerError, match=r"train.yaml: phases\[1\].weights sum to 1.1"):
        DataConfig.from_dict(
            {**raw, "phases": [raw["phases"][0], {"weights": {"code": 1.1}}]}, origin="train.yaml"
        )
