"""Hostile and clumsy input to `dense-to-moe --experts-from`, `--expert-width`, `--shared-params/--shared-ffn`,
`--expert-sources` and `--router-init centroids` with its calibration data and options.

Each case of the catalogue runs the real command in-process (`CliRunner`, so the suite stays fast): a
non-zero exit by `SystemExit` (never another exception), exactly one non-empty stderr line `error: …`
naming the option or file (and the fix), every input byte- and mtime-identical afterwards, nothing that
looks like an output left behind, and done within `HANG` seconds (SIGALRM fails a hang instead of
waiting). The resource cases (1,000 sources, calibration requests whose buffers would be tens of GB) also
assert the Python heap stayed under `HEAP` (tracemalloc): refused before anything is sized by the number.
Three representative cases go through a real subprocess (one with its peak RSS). Hypothesis then feeds
random words to the command line, random names and choices to the source parser, random values to the
recipe options and random mappings to the duplicate-key check: a valid result or one clean refusal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tracemalloc
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli, snapshot
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainer_fixtures import as_single_file, prepare_data, tiny_spec, train_tokenizer, write_model

from upcycler.cli import main
from upcycler.errors import UpcyclerError
from upcycler.spec import LIMITS_ENV
from upcycler.train.data.format import npy_header
from upcycler.untrusted import duplicate_key, parse_yaml

HANG = 30  # seconds for one case: each takes well under a second; a hang fails instead of blocking
HEAP = 256 * 2**20  # Python heap bound of the resource cases (the refused requests would take 10+ GB; every
# JSON read briefly allocates its 64 MiB cap, `untrusted.read_bytes`)
RSS = 1536 * 2**20  # peak RSS bound of the subprocess resource case (Python + JAX + tiny model ≈ 0.5 GB)
MOE = ["--experts", "4", "--topk", "2"]
EF = ["--experts-from", "json=<json>", "email=<email>"]
CENTROIDS = ["--router-init", "centroids", "--calibration-sequences", "2", "--calibration-length", "32"]


@pytest.fixture(autouse=True)
def limits_on(monkeypatch):
    monkeypatch.delenv(LIMITS_ENV, raising=False)


# --- the inputs: built once, read only ---------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst, symlinks=True))


def _set_meta(directory: Path, name: str, **changes: Any) -> None:
    path = directory / f"{name}.meta.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _tokens(directory: Path, name: str, values: np.ndarray | int, *, sparse: bool = False) -> None:
    """Replace source `name` by a uint16 stream (`values`, or that many zeros, written sparse)."""
    count = values if isinstance(values, int) else len(values)
    with open(directory / f"{name}.tokens.npy", "wb") as f:
        f.write(npy_header(np.dtype("uint16"), count))
        if sparse:
            f.truncate(f.tell() + 2 * count)
        else:
            f.write(np.asarray(values, np.uint16).tobytes())
    _set_meta(directory, name, num_tokens=count)


def _replace(path: Path, kind: str, target: str | Path = "") -> None:
    """Replace the file `path` by a FIFO, a symlink, a directory, random bytes or nothing."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to(target)
    elif kind == "dir":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "sparse":  # 65 MiB without a newline: over the 64 MiB cap on JSON files
        with open(path, "wb") as f:
            f.truncate(65 * 2**20)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Tiny llamas (base and two domain models json/email sharing a tokenizer), calibration data prepared
    with that tokenizer (sources json and email), and every hostile variant the catalogue names."""
    root = tmp_path_factory.mktemp("hostile-experts")
    tok = train_tokenizer(root / "tok")
    # calibration data in the single-file format of earlier versions, whose two files are easy to damage
    w: dict[str, Path] = {"root": root, "calib": as_single_file(prepare_data(root / "calib", tok))}
    for seed, name in enumerate(("base", "json", "email")):
        w[name] = write_model(root / name, tiny_spec(), tok, seed=seed)
    variants = {"deep": {"num_layers": 3}, "wide": {"hidden_size": 64, "head_dim": 16}, "vocab": {"vocab_size": 512},
                "qwen2": {"family": "qwen2"}, "long": {"max_position_embeddings": 65536, "hidden_size": 1024}}
    for name, changes in variants.items():
        w[name] = write_model(root / name, tiny_spec(**changes), tok, seed=4)
    w["notok"] = write_model(root / "notok", tiny_spec(), None, seed=5)
    other = root / "tok2" / "tokenizer.json"
    other.parent.mkdir()
    other.write_text(tok.read_text() + "\n")  # the same tokenizer, other bytes
    w["othertok"] = write_model(root / "othertok", tiny_spec(), other, seed=6)
    from upcycler.io import read_checkpoint, write_checkpoint
    from upcycler.tensors import parse_dtype

    w["bf16"] = write_checkpoint(read_checkpoint(w["json"]).cast(parse_dtype("bf16")), root / "bf16", progress=False)

    # sources that are not checkpoints
    src = root / "src"
    src.mkdir()
    w["src_fifotok"] = _copy(w["json"], src / "fifotok")
    _replace(w["src_fifotok"] / "tokenizer.json", "fifo")
    w["src_truncated"] = _copy(w["json"], src / "truncated")
    os.truncate(w["src_truncated"] / "model.safetensors", 1000)
    w["src_binconfig"] = _copy(w["json"], src / "binconfig")
    _replace(w["src_binconfig"] / "config.json", "binary")
    w["src_configonly"] = src / "configonly"
    w["src_configonly"].mkdir()
    shutil.copy(w["json"] / "config.json", w["src_configonly"])
    odd = root / "odd"  # things where a directory is expected
    odd.mkdir()
    (odd / "file").write_text("not a checkpoint\n")
    os.mkfifo(odd / "fifo")
    (odd / "loop").symlink_to(odd / "loop")
    (odd / "dangling").symlink_to(root / "nowhere")
    w.update({f"odd_{p.name}": p for p in odd.iterdir()})

    # calibration data gone wrong (source json; email stays intact)
    cal = root / "cal"
    cal.mkdir()

    def variant(name: str) -> Path:
        w[f"cal_{name}"] = _copy(w["calib"], cal / name)
        return w[f"cal_{name}"]

    for name, kind in (("binmeta", "binary"), ("emptymeta", "empty"), ("fifometa", "fifo"), ("dirmeta", "dir"),
                       ("hugemeta", "sparse")):
        _replace(variant(name) / "json.meta.json", kind)
    _replace(variant("loopmeta") / "json.meta.json", "link", cal / "loopmeta" / "json.meta.json")
    _replace(variant("danglingmeta") / "json.meta.json", "link", root / "nowhere")
    _replace(variant("fifotokens") / "json.tokens.npy", "fifo")
    _replace(variant("devzerotokens") / "json.tokens.npy", "link", "/dev/zero")
    _set_meta(variant("zerotokens"), "json", num_tokens=0)
    _set_meta(variant("resized"), "json", num_tokens=27)
    _set_meta(variant("othersha"), "json", tokenizer={"sha256": "0" * 64})
    _set_meta(variant("floatcount"), "json", num_tokens=1e12)
    _tokens(variant("short"), "json", np.zeros(20, np.uint16))
    _tokens(variant("outofvocab"), "json", np.full(4096, 1000, np.uint16))
    nojson = variant("nojson")
    for suffix in (".meta.json", ".tokens.npy"):
        (nojson / f"json{suffix}").unlink()
    big = variant("big")  # 2M tokens per source (sparse): 8,192 windows of 256
    for name in ("json", "email"):
        _tokens(big, name, 2**21, sparse=True)
    return w


def resolve(world: dict[str, Path], tmp_path: Path, args: list[str]) -> tuple[list[str], list[Path]]:
    """`args` with `<name>` replaced by the world's path (`<out>`: tmp_path/out) and the inputs named."""
    used: list[Path] = []

    def path(match: re.Match) -> str:
        name = match[1]
        if name == "out":
            return str(tmp_path / "out")
        if name not in world:
            return match[0]
        used.append(world[name])
        return str(world[name])

    out = [re.sub(r"<(\w+)>", path, a) for a in args]
    inputs = [p if p.is_dir() and not p.is_symlink() else p.parent for p in used]
    return out, list(dict.fromkeys(inputs))


def state(*dirs: Path) -> dict[str, Any]:
    """Bytes of every file and the lstat mtime of every entry under `dirs` (to prove nothing changed)."""
    out: dict[str, Any] = {}
    for d in dirs:
        out[str(d)] = snapshot(d)
        out[f"{d}:entries"] = {str(p): p.lstat().st_mtime_ns for p in sorted(d.rglob("*"))}
    return out


@contextmanager
def time_limit(seconds: float):
    """Fail (instead of hanging) when the body runs longer than `seconds`."""

    def expire(*_: Any) -> None:
        raise TimeoutError(f"took more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def invoke(args: list[str]):
    with time_limit(HANG):
        return CliRunner().invoke(main, args)


def assert_refused(result, mentions: tuple[str, ...]) -> str:
    """The error contract, in-process: SystemExit with a non-zero status and one `error:` line."""
    if not isinstance(result.exception, SystemExit):
        import traceback

        trace = "".join(traceback.format_exception(result.exception)) if result.exception else result.output
        pytest.fail(f"expected a clean refusal, got:\n{trace}")
    assert result.exit_code not in (0, None), result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    assert len(lines[0]) < 2100
    for text in mentions:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    return lines[0]


def refused(world, tmp_path, args: list[str], mentions: str | tuple[str, ...], *, heap: bool = False) -> str:
    """Run `upcycle dense-to-moe ARGS` in-process, expecting the whole contract; returns the error line."""
    argv, inputs = resolve(world, tmp_path, ["dense-to-moe", *args])
    before = state(*inputs)
    if heap:
        import upcycler.train.evaluation.calibration  # noqa: F401  (JAX's import is not the command's heap)

        tracemalloc.start()
    try:
        result = invoke(argv)
        peak = tracemalloc.get_traced_memory()[1] if heap else 0
    finally:
        if heap:
            tracemalloc.stop()
    line = assert_refused(result, (mentions,) if isinstance(mentions, str) else mentions)
    assert peak < HEAP, f"{peak / 2**20:.0f} MiB of Python heap before refusing"
    assert state(*inputs) == before, "an input was modified"
    assert leftovers(tmp_path, "out") == [], "something that looks like an output was left behind"
    return line


# --- the catalogue -----------------------------------------------------------------------------------

def many(n: int) -> list[str]:
    return [f"s{k}=<json>" for k in range(n)]


EXPERTS_FROM = {  # --experts-from: the NAME=PATH parser, the names, the sources
    "no-equals": (["--experts-from", "json"], "NAME=VALUE"),
    "empty-name": (["--experts-from", "=<json>"], "NAME=VALUE"),
    "empty-path": (["--experts-from", "json="], "NAME=VALUE"),
    "name-twice": (["--experts-from", "a=<json>", "a=<email>"], ("--experts-from", "given twice")),
    "name-with-space": (["--experts-from", "a b=<json>", "c=<email>"], ("source name", "rename it")),
    "name-with-newline": (["--experts-from", "a\nb=<json>", "c=<email>"], ("'a\\nb'", "rename it")),
    "name-is-mean": (["--experts-from", "mean=<json>", "c=<email>"], ("'mean'", "rename it")),
    "name-65-chars": (["--experts-from", "n" * 65 + "=<json>", "c=<email>"], ("at most 64", "rename it")),
    "nul-in-path": (["--experts-from", "a=<json>\0x"], ("--experts-from.a", "must be a path")),
    "too-many-for-groups": (["--experts-from", "a=<json>", "b=<email>", "c=<json>", "--granularity", "2"],
                            ("3 sources", "every source needs a group")),
    "deeper": (["--experts-from", "a=<deep>", "b=<email>"], ("a=", "num_layers is 3 but BASE has 2")),
    "wider": (["--experts-from", "a=<wide>", "b=<email>"], ("hidden_size is 64", "BASE's architecture")),
    "other-vocab": (["--experts-from", "a=<vocab>", "b=<email>"], ("vocab_size is 512", "BASE's architecture")),
    "other-family": (["--experts-from", "a=<qwen2>", "b=<email>"], ("family is 'qwen2'", "BASE's architecture")),
    "other-dtype": (["--experts-from", "a=<bf16>", "b=<email>"], ("bfloat16", "upcycle convert --dtype")),
    "no-tokenizer": (["--experts-from", "a=<notok>", "b=<email>"], ("has no tokenizer.json", "share BASE's")),
    "other-tokenizer": (["--experts-from", "a=<othertok>", "b=<email>"], ("tokenizer.json differs", "share BASE's")),
    "fifo-tokenizer": (["--experts-from", "a=<src_fifotok>", "b=<email>"], ("tokenizer.json", "share BASE's")),
    "truncated-weights": (["--experts-from", "a=<src_truncated>", "b=<email>"], "model.safetensors"),
    "binary-config": (["--experts-from", "a=<src_binconfig>", "b=<email>"], ("config.json", "unreadable JSON")),
    "config-only": (["--experts-from", "a=<src_configonly>", "b=<email>"], "no model.safetensors"),
    "a-file": (["--experts-from", "a=<odd_file>", "b=<email>"], "not a directory"),
    "a-fifo": (["--experts-from", "a=<odd_fifo>", "b=<email>"], "not a directory"),
    "dev-null": (["--experts-from", "a=/dev/null", "b=<email>"], ("/dev/null", "not a directory")),
    "symlink-loop": (["--experts-from", "a=<odd_loop>", "b=<email>"], ("loop", "no such directory")),
    "dangling-symlink": (["--experts-from", "a=<odd_dangling>", "b=<email>"], ("dangling", "no such directory")),
    "missing": (["--experts-from", "a=<root>/missing", "b=<email>"], ("missing", "no such directory")),
}
EXPERT_SOURCES = {  # --expert-sources, --shared-params, --shared-ffn
    "assignment-short": ([*EF, "--expert-sources", "json"], ("--expert-sources has 1 names for 4 experts",)),
    "assignment-empty-name": ([*EF, "--expert-sources", "json,,email,email"], ("--expert-sources names ''",)),
    "assignment-unknown": ([*EF, "--expert-sources", "json,json,x,x"], ("'x'", "not a source")),
    "assignment-unused-source": ([*EF, "--expert-sources", "json,json,json,json"], "gives no expert to source email"),
    "assignment-splits-group": ([*EF, "--expert-sources", "json,email,email,json", "--granularity", "2"],
                                ("mixes", "virtual group 0")),
    "assignment-without-sources": (["--expert-sources", "a,a,b,b"], ("--expert-sources", "add --experts-from")),
    "shared-params-empty": ([*EF, "--shared-params", ""], ("--shared-params is ''", "base, mean or a source")),
    "shared-params-unknown": ([*EF, "--shared-params", "nope"], ("--shared-params is 'nope'", "(json, email)")),
    "shared-ffn-huge": ([*EF, "--shared-ffn", "x" * 100_000], ("--shared-ffn", "…")),
    "shared-params-without-sources": (["--shared-params", "mean"], ("--shared-params", "add --experts-from")),
    "shared-ffn-without-sources": (["--shared-ffn", "base2"], ("--shared-ffn", "add --experts-from")),
}
EXPERT_WIDTH = {
    "zero": ([*EF, "--expert-width", "0"], "--expert-width must be ≥ 1"),
    "negative": ([*EF, "--expert-width", "-3"], "--expert-width must be ≥ 1"),
    "nan": ([*EF, "--expert-width", "nan"], ("--expert-width", "not a valid integer")),
    "huge": ([*EF, "--expert-width", str(10**30)], "--expert-width"),
    "wider-than-ffn": ([*EF, "--expert-width", "65"], ("wider than the dense FFN (64 neurons)", "at most 64")),
    "too-narrow": ([*EF, "--expert-width", "7"], ("too narrow", "--expert-width 32 or more")),
    "with-granularity": ([*EF, "--expert-width", "32", "--granularity", "2"], "both set the expert width"),
    "shared-take-all": ([*EF, "--expert-width", "32", "--shared-experts", "2"], "leave none of the 64"),
}
CALIBRATION = {  # --router-init centroids and its options
    "no-calibration": ([*EF, "--router-init", "centroids"], "needs --calibration DIR"),
    "calibration-alone": ([*EF, "--calibration", "<calib>"], "--calibration is read by --router-init centroids"),
    "without-sources": (["--router-init", "centroids", "--calibration", "<calib>"], "add --experts-from"),
    "one-source": (["--experts-from", "json=<json>", *CENTROIDS, "--calibration", "<calib>"], "two or more"),
    "unknown-init": ([*EF, "--router-init", "kmeans", "--calibration", "<calib>"], "--router-init"),
    "sequences-0": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-sequences", "0"],
                    ("--calibration-sequences 0", "[1, 65,536]")),
    "sequences-negative": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-sequences", "-1"],
                           "--calibration-sequences -1"),
    "sequences-1e12": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-sequences", "1e12"],
                       ("--calibration-sequences", "not a valid integer")),
    "sequences-10^12": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-sequences", str(10**12)],
                        ("--calibration-sequences", "[1, 65,536]")),
    "sequences-nan": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-sequences", "nan"],
                      "--calibration-sequences"),
    "length-1": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-length", "1"],
                 ("--calibration-length 1", "[2, 1,048,576]")),
    "length-huge": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-length", str(10**7)],
                    "--calibration-length"),
    "length-beyond-context": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--calibration-length", "4096"],
                              ("--calibration-length 4096", "max_position_embeddings 256", "at most 256")),
    "margin-0": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--centroid-margin", "0"], "--centroid-margin"),
    "margin-nan": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--centroid-margin", "nan"],
                   ("--centroid-margin", "finite")),
    "margin-inf": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--centroid-margin", "inf"], "--centroid-margin"),
    "margin-huge": ([*EF, *CENTROIDS, "--calibration", "<calib>", "--centroid-margin", "1e9"], "--centroid-margin"),
    "calibration-file": ([*EF, *CENTROIDS, "--calibration", "<odd_file>"], ("--calibration", "not a directory")),
    "calibration-fifo": ([*EF, *CENTROIDS, "--calibration", "<odd_fifo>"], ("--calibration", "not a directory")),
    "calibration-loop": ([*EF, *CENTROIDS, "--calibration", "<odd_loop>"], ("--calibration", "no such directory")),
    "calibration-missing": ([*EF, *CENTROIDS, "--calibration", "<root>/missing"], ("--calibration", "no such")),
    "calibration-dev-null": ([*EF, *CENTROIDS, "--calibration", "/dev/null"], ("--calibration", "not a directory")),
    "no-such-source": ([*EF, *CENTROIDS, "--calibration", "<cal_nojson>"], ("no prepared source 'json'",
                                                                             "found: email")),
    "meta-binary": ([*EF, *CENTROIDS, "--calibration", "<cal_binmeta>"], ("json.meta.json", "unreadable JSON")),
    "meta-empty": ([*EF, *CENTROIDS, "--calibration", "<cal_emptymeta>"], ("json.meta.json", "unreadable JSON")),
    "meta-fifo": ([*EF, *CENTROIDS, "--calibration", "<cal_fifometa>"], ("json.meta.json", "not a regular file")),
    "meta-directory": ([*EF, *CENTROIDS, "--calibration", "<cal_dirmeta>"], ("json.meta.json", "is a directory")),
    "meta-symlink-loop": ([*EF, *CENTROIDS, "--calibration", "<cal_loopmeta>"], ("json.meta.json", "cannot open")),
    "meta-dangling": ([*EF, *CENTROIDS, "--calibration", "<cal_danglingmeta>"], ("json.meta.json", "missing")),
    "meta-huge-line": ([*EF, *CENTROIDS, "--calibration", "<cal_hugemeta>"], ("json.meta.json", "larger than")),
    "meta-zero-tokens": ([*EF, *CENTROIDS, "--calibration", "<cal_zerotokens>"], ("num_tokens", "not 0")),
    "meta-float-count": ([*EF, *CENTROIDS, "--calibration", "<cal_floatcount>"], ("num_tokens", "integer")),
    "meta-wrong-count": ([*EF, *CENTROIDS, "--calibration", "<cal_resized>"], ("json.tokens.npy", "does not match")),
    "meta-other-tokenizer": ([*EF, *CENTROIDS, "--calibration", "<cal_othersha>"], "another tokenizer"),
    "tokens-fifo": ([*EF, *CENTROIDS, "--calibration", "<cal_fifotokens>"], ("json.tokens.npy", "not a regular")),
    "tokens-dev-zero": ([*EF, *CENTROIDS, "--calibration", "<cal_devzerotokens>"], ("json.tokens.npy", "not a reg")),
    "tokens-too-few": ([*EF, *CENTROIDS, "--calibration", "<cal_short>"], ("20 tokens", "--calibration-length")),
    "tokens-out-of-vocab": ([*EF, *CENTROIDS, "--calibration", "<cal_outofvocab>"],
                            ("token id 1000", "vocabulary of 384")),
}
COMBINATIONS = {  # options that cannot work together
    "granularity-mismatch": ([*EF, "--granularity", "3"], "--granularity 3 does not divide"),
    "topk-over-experts": (["--experts", "2", "--topk", "4", *EF], "--topk 4 is larger than --experts 2"),
    "no-moe-layer": ([*EF, "--dense-layers", "2"], "--dense-layers 2 leaves no MoE layer"),
    "reinit-nan": ([*EF, "--reinit-ratio", "nan"], "--reinit-ratio"),
    "out-inside-source": ([*EF, "--experts", "4"], "lies inside the source"),
}
RESOURCE = {  # a number in the input must not size anything: refused before, heap bounded
    "1000-sources": (["--experts", "1000", "--topk", "2", "--allow-large", "--experts-from", *many(1000)],
                     ("1,000 sources", "limit of 256", LIMITS_ENV)),
    # checked before a source is opened: the last one is missing, which opening would report first
    "200-sources-for-4-groups": (["--experts-from", *many(199), "z=<root>/missing"],
                                 ("200 sources", "every source needs a group")),
    "attention-of-one-sequence": (["--experts-from", "json=<long>", "email=<long>", "--router-init", "centroids",
                                   "--calibration", "<calib>", "--calibration-length", "16384"],
                                  ("--calibration-length 16384", "attention scores", "limit of 8,589,934,592",
                                   "--calibration-length 13377 or less")),
    "hidden-states-of-all-sequences": (["--experts-from", "json=<long>", "email=<long>", "--router-init",
                                        "centroids", "--calibration", "<cal_big>", "--calibration-sequences",
                                        "65536", "--calibration-length", "256"],
                                       ("--calibration-sequences 65536", "8,192 sequences of json",
                                        "--calibration-sequences 4096 or less", LIMITS_ENV)),
}


def _cases(table: dict[str, tuple]) -> list:
    return [pytest.param(args, mentions, id=name) for name, (args, mentions) in table.items()]


@pytest.mark.parametrize("args,mentions", _cases(EXPERTS_FROM))
def test_experts_from(world, tmp_path, args, mentions):
    refused(world, tmp_path, ["<base>", "<out>", *MOE, *args], mentions)


@pytest.mark.parametrize("args,mentions", _cases(EXPERT_SOURCES))
def test_expert_sources_and_shared(world, tmp_path, args, mentions):
    refused(world, tmp_path, ["<base>", "<out>", *MOE, *args], mentions)


@pytest.mark.parametrize("args,mentions", _cases(EXPERT_WIDTH))
def test_expert_width(world, tmp_path, args, mentions):
    refused(world, tmp_path, ["<base>", "<out>", *MOE, *args], mentions)


@pytest.mark.parametrize("args,mentions", _cases(CALIBRATION))
def test_router_init_centroids(world, tmp_path, args, mentions):
    refused(world, tmp_path, ["<base>", "<out>", *MOE, *args], mentions)


@pytest.mark.parametrize("args,mentions", _cases(COMBINATIONS))
def test_combinations(world, tmp_path, args, mentions):
    out = "<json>/sub" if "lies inside" in mentions else "<out>"
    refused(world, tmp_path, ["<base>", out, *MOE, *args], mentions)


@pytest.mark.parametrize("args,mentions", _cases(RESOURCE))
def test_resource_bounds(world, tmp_path, args, mentions):
    base = "<long>" if "<long>" in " ".join(args) else "<base>"
    refused(world, tmp_path, [base, "<out>", *MOE, *args], mentions, heap=True)


def test_dry_run_refuses_alike(world, tmp_path):
    """--dry-run reads no tensor bytes, but every check above still runs (a sample)."""
    for args, mentions in (EXPERTS_FROM["deeper"], CALIBRATION["length-beyond-context"],
                           RESOURCE["hidden-states-of-all-sequences"]):
        base = "<long>" if "<long>" in " ".join(args) else "<base>"
        refused(world, tmp_path, [base, "--dry-run", *MOE, *args], mentions)


def test_config_only_base_with_a_tokenizer_plans(world, tmp_path):
    """A config-only BASE (dry run) keeps its tokenizer: sources with the same one are not refused (before:
    "has a tokenizer.json that BASE lacks")."""
    base = tmp_path / "configonly"
    base.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(world["base"] / name, base)
    argv, _ = resolve(world, tmp_path, ["dense-to-moe", str(base), "--dry-run", *MOE, *EF, *CENTROIDS,
                                        "--calibration", "<calib>"])
    result = invoke(argv)
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "experts from 2 models" in result.stdout


# --- outputs that overlap an input: the existing output is kept too ---------------------------------

OVERLAPS = {
    # layout of tmp_path/out (an earlier upcycler output, so --overwrite could replace it) -> args, mentions
    "source-is-out": (["--experts-from", "a=<out>", "b=<email>"], "is the source"),
    "source-links-to-out": (["--experts-from", "a=<tmp>/link", "b=<email>"], "is the source"),
    "calibration-inside-out": ([*EF, *CENTROIDS, "--calibration", "<out>/calib"], "contains the source"),
    "out-inside-calibration": ([*EF, *CENTROIDS, "--calibration", "<tmp>"], "lies inside the source"),
}


@pytest.mark.parametrize("args,mentions", _cases(OVERLAPS))
def test_output_overlapping_an_input(world, tmp_path, args, mentions, monkeypatch):
    """`--overwrite` never replaces a directory the command reads, whether a source or calibration data
    (before: calibration data inside OUT was deleted by the replacement, then the command failed); the
    overlap is refused before the plan is made (planning fits the routers for a while)."""
    from upcycler.transforms import pipeline

    def no_planning(*args, **kwargs):
        raise AssertionError("planned before the output was checked")

    monkeypatch.setattr(pipeline, "plan", no_planning)
    out = _copy(world["json"], tmp_path / "out")
    _copy(world["calib"], out / "calib")
    for name in ("json", "email"):
        for suffix in (".meta.json", ".tokens.npy"):
            shutil.copy(world["calib"] / f"{name}{suffix}", tmp_path)
    (tmp_path / "link").symlink_to(out)
    argv = [a.replace("<out>", str(out)).replace("<tmp>", str(tmp_path)) for a in args]
    argv, inputs = resolve(world, tmp_path, ["dense-to-moe", "<base>", str(out), "--overwrite", *MOE, *argv])
    before = state(tmp_path, *inputs)
    assert_refused(invoke(argv), (mentions,))
    assert state(tmp_path, *inputs) == before
    assert [p for p in leftovers(tmp_path, "out") if p != "out"] == []


# --- through the real command line -------------------------------------------------------------------

def test_cli_calibration_inside_the_output_is_kept(world, tmp_path):
    out = _copy(world["json"], tmp_path / "out")
    _copy(world["calib"], out / "calib")
    before = state(out, world["base"], world["json"], world["email"])
    proc = run_cli("dense-to-moe", world["base"], out, "--overwrite", *MOE, "--experts-from", f"json={world['json']}",
                   f"email={world['email']}", *CENTROIDS, "--calibration", out / "calib", check=False, timeout=120)
    assert_clean_failure(proc, mentions="contains the source")
    assert state(out, world["base"], world["json"], world["email"]) == before
    assert leftovers(tmp_path, "out") == ["out"]


def test_cli_fifo_in_the_calibration_data_does_not_hang(world, tmp_path):
    proc = run_cli("dense-to-moe", world["base"], tmp_path / "out", *MOE, "--experts-from", f"json={world['json']}",
                   f"email={world['email']}", *CENTROIDS, "--calibration", world["cal_fifometa"], check=False,
                   timeout=120)
    assert_clean_failure(proc, mentions="not a regular file")
    assert leftovers(tmp_path, "out") == []


_RSS_SCRIPT = """
import sys
from upcycler.cli import main
try:
    main.main(sys.argv[1:])
except SystemExit as done:
    code = done.code
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
sys.exit(code)
"""


def test_cli_calibration_request_is_refused_before_allocating(world, tmp_path):
    """65,536 sequences × 256 tokens of a width-1,024 model would hold 17 GB of hidden states: refused with
    the limit named, the process's peak RSS staying that of starting up."""
    args = ["dense-to-moe", world["long"], tmp_path / "out", *MOE, "--experts-from", f"json={world['long']}",
            f"email={world['long']}", "--router-init", "centroids", "--calibration", world["cal_big"],
            "--calibration-sequences", "65536", "--calibration-length", "256"]
    env = {k: v for k, v in os.environ.items() if k != LIMITS_ENV}
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert_clean_failure(proc, mentions="--calibration-sequences 4096 or less")
    assert int(proc.stdout.split()[-1]) * 1024 < RSS, proc.stdout
    assert leftovers(tmp_path, "out") == []


# --- recipes -----------------------------------------------------------------------------------------

RECIPES = {
    "duplicate-source-name": ("experts_from: {a: <json>, a: <email>}", ("line 6", "key 'a' is given twice")),
    "sources-as-list": ("experts_from: [<json>, <email>]", ("--experts-from must be a mapping",)),
    "sources-empty": ("experts_from: {}", ("--experts-from needs at least one",)),
    "source-path-number": ("experts_from: {a: 1, b: <email>}", ("--experts-from.a must be a path",)),
    "source-name-number": ("experts_from: {1: <json>, b: <email>}", ("key 1; keys must be text",)),
    "assignment-as-text": ("experts_from: {a: <json>, b: <email>}\nexpert_sources: a,a,b,b",
                           ("--expert-sources must be a list",)),
    "calibration-number": ("experts_from: {a: <json>, b: <email>}\nrouter_init: centroids\ncalibration: 5",
                           ("--calibration must be a path",)),
    "sequences-float": (("experts_from: {a: <json>, b: <email>}\nrouter_init: centroids\ncalibration: <calib>"
                         "\ncalibration_sequences: 1.0e+12"), ("--calibration-sequences must be int",)),
}


@pytest.mark.parametrize("body,mentions", [pytest.param(*v, id=k) for k, v in RECIPES.items()])
def test_recipe(world, tmp_path, body, mentions):
    body = body.replace("\n", "\n      ")
    text = ("source: <base>\ntransforms:\n  - dense-to-moe:\n      experts: 4\n      topk: 2\n      " + body
            + "\noutput: {path: <out>}\n")
    (tmp_path / "r.yaml").write_text(resolve(world, tmp_path, [text])[0][0])
    inputs = resolve(world, tmp_path, [text])[1]
    before = state(*inputs)
    assert_refused(invoke(["run", str(tmp_path / "r.yaml")]), mentions)
    assert state(*inputs) == before and leftovers(tmp_path, "out") == []


# --- property-based ----------------------------------------------------------------------------------

WORDS = ["--experts-from", "--experts-from", "a=<json>", "b=<email>", "a=<email>", "=<json>", "a=", "json",
         "a b=<json>", "mean=<json>", "base=<email>", "c=<root>/missing", "d=<base>", "e=<deep>", "f=<odd_fifo>",
         "a=b=c", "-x=1", "--", "--shared-params", "--shared-ffn", "--expert-sources", "a,b,a,b", "a,a,b,b", "a",
         "mean", "base", "b", "", "--router-init", "centroids", "random", "--calibration", "<calib>",
         "--calibration-sequences", "--calibration-length", "--expert-width", "--granularity", "2", "3", "0",
         "-1", "nan", "1e12", "16", "32", "<cal_fifometa>", "<odd_loop>"]
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])


@FUZZ
@given(words=st.lists(st.sampled_from(WORDS) | st.text(max_size=6), max_size=12))
def test_fuzz_command_line(world, tmp_path, words):
    """Random words after `dense-to-moe BASE --dry-run --experts 4 --topk 2`: a plan or one clean refusal."""
    argv, _ = resolve(world, tmp_path, ["dense-to-moe", "<base>", "--dry-run", *MOE, *words])
    result = invoke(argv)
    if result.exit_code != 0 or result.exception is not None:
        assert_refused(result, ())
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def base_ckpt(world):
    from upcycler.io import read_checkpoint

    return read_checkpoint(world["base"])


@FUZZ
@given(names=st.lists(st.text(max_size=8) | st.sampled_from(["a", "b", "mean", "base", "a.b", "-a", "x" * 65]),
                      min_size=0, max_size=5, unique=True),
       paths=st.lists(st.sampled_from(["json", "email", "deep", "odd_fifo", "odd_loop", "base"]), min_size=5,
                      max_size=5),
       choices=st.lists(st.text(max_size=6) | st.sampled_from(["base", "mean", "a", "b"]), min_size=2,
                        max_size=2),
       assignment=st.none() | st.lists(st.sampled_from(["a", "b", "c", ""]), max_size=5))
def test_fuzz_source_parser(world, base_ckpt, names, paths, choices, assignment):
    """`open_sources` with any names, paths, --shared-params/--shared-ffn values and assignment: the
    sources, each checked, or one UpcyclerError line."""
    from upcycler.transforms.experts_from import CHOICES, open_sources

    sources = {n: world[p] for n, p in zip(names, paths)}
    with time_limit(HANG):
        try:
            got = open_sources(sources, base_ckpt.spec, base_ckpt.tensors, groups=4, group=1,
                               assignment=assignment, base_checkpoint=base_ckpt,
                               choices={"--shared-params": choices[0], "--shared-ffn": choices[1]})
        except UpcyclerError as err:
            assert "\n" not in str(err) and len(str(err)) < 2000
            return
    assert list(got.names) == names and len(got.expert_source) == 4
    assert all(c in (*CHOICES, *names) for c in choices)
    assert set(got.expert_source) == set(range(len(names)))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
KEYS = ["experts_from", "expert_sources", "shared_params", "shared_ffn", "router_init", "calibration",
        "calibration_sequences", "calibration_length", "centroid_margin", "expert_width", "min_agreement"]


@FUZZ
@given(values=st.dictionaries(st.sampled_from(KEYS), JSON, max_size=4))
def test_fuzz_recipe_options(values):
    """The new options from a recipe: a checked config or one UpcyclerError line."""
    from upcycler.transforms import TRANSFORMS

    try:
        cfg = TRANSFORMS["dense-to-moe"].make_config({"experts": 4, "topk": 2, **values})
    except UpcyclerError as err:
        assert "\n" not in str(err) and len(str(err)) < 2000
        return
    assert cfg.experts_from is None or all(isinstance(v, Path) and str(v) for v in cfg.experts_from.values())
    assert cfg.calibration_sequences is None or 1 <= cfg.calibration_sequences <= 65536  # None: the default
    assert 2 <= cfg.calibration_length <= 2**20
    assert 0 < cfg.centroid_margin <= 100 and 0 <= cfg.min_agreement <= 1


@FUZZ
@given(pairs=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "ab", "json"]), st.integers(0, 9)), max_size=6),
       nested=st.booleans())
def test_fuzz_duplicate_keys(pairs, nested):
    """`duplicate_key` finds a key given twice in any mapping, at any depth, and nothing else."""
    mapping = "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    text = f"source: x\ntransforms:\n  - dense-to-moe: {mapping}\n" if nested else mapping
    assert isinstance(parse_yaml(text, "r.yaml"), dict)
    found = duplicate_key(text)
    keys = [k for k, _ in pairs]
    assert (found is not None) == (len(set(keys)) < len(keys))
    if found is not None:
        assert keys.count(found[0]) > 1 and found[1] == (3 if nested else 1)
