"""Hostile and clumsy numbers in config.json, an Orbax manifest's spec and transform/merge options.

Every case of the catalogue goes through the reader in-process (one UpcyclerError line naming the file),
and a representative set through the real CLI: a non-zero exit, one `error:` line naming the file or the
option, no traceback, no hang (each run has a timeout, so a regression fails instead of hanging), the
inputs' bytes and mtimes unchanged, nothing that looks like an output left behind. Valid-but-large
models pass with UPCYCLER_LIMITS=off. Hypothesis then feeds random config.json and manifest specs to the
parsers: each gives a valid spec (with an exact, instantly computed parameter count) or an UpcyclerError.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import assert_clean_failure, leftovers, run_cli, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import make_config, make_tiny

from upcycler.errors import UpcyclerError
from upcycler.families import FAMILIES, family_for_config
from upcycler.io.hf_read import read_spec
from upcycler.layout import declare_params
from upcycler.merge import METHODS
from upcycler.spec import LIMITS_ENV, ModelSpec, MoESpec
from upcycler.transforms import TRANSFORMS

HANG = 60  # seconds: far beyond any of these runs (well under a second each), short of a real hang
DELETE = object()  # a change that removes the field


class Raw:
    """JSON text written as is (e.g. `1e999`, which Python's json turns into inf, or deep nesting)."""

    def __init__(self, text: str):
        self.text = text


def config_text(cfg: dict[str, Any], changes: dict[str, Any]) -> str:
    """`cfg` with `changes` applied, as JSON; `Raw` values (at any depth) are spliced in verbatim."""
    out = {k: v for k, v in {**cfg, **changes}.items() if v is not DELETE}
    raw: list[str] = []

    def token(value: Any) -> str:
        if not isinstance(value, Raw):
            raise TypeError(type(value).__name__)
        raw.append(value.text)
        return f"@@raw{len(raw) - 1}@@"

    text = json.dumps(out, indent=1, default=token)
    for i, value in enumerate(raw):
        text = text.replace(json.dumps(f"@@raw{i}@@"), value)
    return text


def base_config(family: str) -> dict[str, Any]:
    """The config.json transformers writes for a tiny model of `family`."""
    cfg = make_config(family).to_dict()
    cfg["architectures"] = [FAMILIES[family].architecture]
    return cfg


def state(*dirs: Path) -> dict[str, Any]:
    """Bytes and mtimes of every file under `dirs` (to prove the inputs were left untouched)."""
    out: dict[str, Any] = {}
    for d in dirs:
        out[str(d)] = snapshot(d)
        out[f"{d}:mtimes"] = {str(p): p.stat().st_mtime_ns for p in sorted(d.rglob("*"))}
    return out


def fails(tmp_path: Path, args: list[Any], mentions: str | tuple[str, ...], inputs: list[Path]) -> str:
    """Run `upcycle ARGS`, expecting the error contract; returns the error line."""
    before = state(*inputs)
    proc = run_cli(*args, check=False, timeout=HANG)
    mentions = (mentions,) if isinstance(mentions, str) else mentions
    line = assert_clean_failure(proc, mentions=mentions[0])
    for text in mentions[1:]:
        assert text in line, f"{text!r} not in {line!r}"
    assert len(line) < 600, f"unbounded message: {line[:200]}…"
    assert state(*inputs) == before, "an input was modified"
    assert leftovers(tmp_path, "out") == [], "something that looks like an output was left behind"
    return line


@pytest.fixture(autouse=True)
def limits_on(monkeypatch):
    monkeypatch.delenv(LIMITS_ENV, raising=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny llama and mixtral checkpoints (HF) and the llama as Orbax, shared by the module (read only)."""
    root = tmp_path_factory.mktemp("models")
    out = {f: make_tiny(f, root / f) for f in ("llama", "mixtral")}
    run_cli("convert", out["llama"], root / "orbax", "--to", "orbax")
    out["orbax"] = root / "orbax"
    return out


def config_only(tmp_path: Path, family: str, changes: dict[str, Any]) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(config_text(base_config(family), changes))
    return src


# --- config.json: one field at a time ----------------------------------------------------------------
class Cli(tuple):
    """A case that also runs through the real CLI (every case runs through the reader in-process)."""


def cli(*case: Any) -> Cli:
    return Cli(case)


def cli_cases(cases: list[Any]) -> list[Cli]:
    return [c for c in cases if isinstance(c, Cli)]


def case_ids(cases: list[Any]) -> list[str]:
    return [str(i) for i in range(len(cases))]


def mention(mentions: str | tuple[str, ...]) -> tuple[str, ...]:
    return (mentions,) if isinstance(mentions, str) else mentions


def assert_one_line(err: UpcyclerError, mentions: tuple[str, ...]) -> None:
    text = str(err)
    assert "\n" not in text and len(text) < 600, text[:300]
    for part in mentions:
        assert part in text, f"{part!r} not in {text!r}"


DEEP = "[" * 100_000 + "]" * 100_000
CONFIG_CASES = [
    # (family, changes, what the error line must mention)
    cli("llama", {"num_hidden_layers": 1_000_000_000_000}, ("num_hidden_layers", "2,048 layers", LIMITS_ENV)),
    cli("llama", {"num_hidden_layers": "4"}, "num_hidden_layers"),
    ("llama", {"num_hidden_layers": 0}, "num_hidden_layers"),
    ("llama", {"num_hidden_layers": -3}, "num_hidden_layers"),
    ("llama", {"num_hidden_layers": True}, "num_hidden_layers"),
    ("llama", {"num_hidden_layers": 2.0}, "num_hidden_layers"),
    cli("llama", {"num_hidden_layers": Raw("1" + "0" * 4000)}, "num_hidden_layers"),
    ("llama", {"num_hidden_layers": DELETE}, "num_hidden_layers"),
    cli("llama", {"hidden_size": 64.5}, "hidden_size"),
    ("llama", {"hidden_size": 0}, "hidden_size"),
    ("llama", {"hidden_size": 1 << 20}, ("hidden_size", LIMITS_ENV)),
    cli("llama", {"intermediate_size": -128}, "intermediate_size"),
    ("llama", {"intermediate_size": 1 << 30}, ("intermediate_size", LIMITS_ENV)),
    cli("llama", {"vocab_size": 1 << 40}, ("vocab_size", LIMITS_ENV)),
    ("llama", {"vocab_size": None}, "vocab_size"),
    ("llama", {"vocab_size": [128]}, "vocab_size"),
    cli("llama", {"num_attention_heads": 0}, "num_attention_heads"),
    ("llama", {"num_attention_heads": "4"}, "num_attention_heads"),
    cli("llama", {"num_key_value_heads": 3}, ("num_key_value_heads", "does not divide")),
    ("llama", {"num_key_value_heads": 8}, "num_kv_heads"),
    ("llama", {"num_key_value_heads": 0}, "num_key_value_heads"),
    ("llama", {"head_dim": -16}, "head_dim"),
    ("llama", {"head_dim": 100_000}, ("head_dim", LIMITS_ENV)),
    ("llama", {"max_position_embeddings": 1 << 30}, ("max_position_embeddings", LIMITS_ENV)),
    ("llama", {"max_position_embeddings": 0}, "max_position_embeddings"),
    cli("llama", {"rms_norm_eps": Raw("1e999")}, ("rms_norm_eps", "finite")),
    ("llama", {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ("llama", {"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    cli("llama", {"rms_norm_eps": Raw("NaN")}, "config.json"),  # not JSON: refused by the parser
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta"),
    ("llama", {"rope_theta": Raw("-1e999")}, "rope_theta"),
    cli("llama", {"rope_scaling": [1, 2]}, "rope_scaling"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": Raw("1e999")}}, "rope_scaling.factor"),
    ("llama", {"rope_scaling": {"rope_type": ["linear"], "factor": 2.0}}, "rope_scaling.rope_type"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "beta": [Raw("1e999")]}}, "rope_scaling"),
    ("llama", {"rope_parameters": "default"}, "rope_parameters"),
    cli("llama", {"rope_scaling": Raw(DEEP)}, "nested"),
    ("llama", {"partial_rotary_factor": 2}, "partial_rotary_factor"),
    cli("llama", {"initializer_range": Raw("1e999")}, "initializer_range"),  # copied into every output
    cli("llama", {"hidden_act": "frobnicate"}, "hidden_act"),
    ("llama", {"hidden_act": 42}, "hidden_act"),
    cli("llama", {"hidden_act": "x" * 100_000}, "hidden_act"),
    ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ("llama", {"attention_bias": 1}, "attention_bias"),
    cli("llama", {"architectures": [["LlamaForCausalLM"]]}, "architectures"),
    cli("llama", {"architectures": "LlamaForCausalLM"}, "architectures"),
    ("llama", {"architectures": [], "model_type": ["llama"]}, "not supported"),
    cli("qwen2", {"layer_types": ["full_attention", "bogus"]}, "layer_types"),
    ("qwen2", {"layer_types": ["full_attention"]}, ("layer_types", "2 layers")),
    ("qwen2", {"layer_types": "full_attention"}, "layer_types"),
    ("qwen2", {"layer_types": [["full_attention"], {}]}, "layer_types"),
    ("mistral", {"sliding_window": -1}, "sliding_window"),
    ("mistral", {"sliding_window": 4096.5}, "sliding_window"),
    cli("mixtral", {"num_experts_per_tok": 8}, ("top_k", "num_experts_per_tok")),
    cli("mixtral", {"num_local_experts": 1_000_000}, ("num_local_experts", "65,536 experts", LIMITS_ENV)),
    ("mixtral", {"num_local_experts": "4"}, "num_local_experts"),
    ("mixtral", {"num_experts_per_tok": DELETE}, "num_experts_per_tok"),
    cli("mixtral", {"num_hidden_layers": 2048, "num_local_experts": 4096}, ("experts in all", LIMITS_ENV)),
    ("qwen2_moe", {"mlp_only_layers": [5]}, "mlp_only_layers"),
    cli("qwen2_moe", {"mlp_only_layers": [[0]]}, "mlp_only_layers"),
    ("qwen2_moe", {"mlp_only_layers": 0}, "mlp_only_layers"),
    ("qwen2_moe", {"decoder_sparse_step": "1"}, "decoder_sparse_step"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -64}, "shared_expert_intermediate_size"),
    ("glm4_moe", {"first_k_dense_replace": 99}, "first_k_dense_replace"),
    cli("glm4_moe", {"routed_scaling_factor": Raw("1e999")}, "routed_scaling_factor"),
    ("glm4_moe", {"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ("glm4_moe", {"n_shared_experts": -1}, "n_shared_experts"),
    ("glm4_moe", {"n_group": "2"}, "n_group"),
    # every field within its limit, but together about 10^15 parameters: over the total limit
    cli("llama", {"hidden_size": 131_072, "num_attention_heads": 1024, "num_key_value_heads": 1024,
                  "head_dim": 128, "num_hidden_layers": 2048, "intermediate_size": 1 << 20,
                  "vocab_size": 1 << 24},
     ("parameters", LIMITS_ENV)),
]


@pytest.mark.parametrize("family,changes,mentions", CONFIG_CASES, ids=case_ids(CONFIG_CASES))
def test_hostile_config_field(tmp_path, family, changes, mentions):
    """Every case through the reader of config.json: one UpcyclerError line naming the file."""
    src = config_only(tmp_path, family, changes)
    before = state(src)
    with time_limit(HANG), pytest.raises(UpcyclerError) as err:
        read_spec(src)
    assert_one_line(err.value, ("config.json", *mention(mentions)))
    assert state(src) == before


@pytest.mark.parametrize("family,changes,mentions", cli_cases(CONFIG_CASES))
def test_hostile_config_field_cli(tmp_path, family, changes, mentions):
    src = config_only(tmp_path, family, changes)
    fails(tmp_path, ["inspect", src], ("config.json", *mention(mentions)), [src])


@pytest.mark.parametrize("command,changes,mentions", [
    (["depth", "--layers", "4", "--dry-run"], {"num_hidden_layers": 1_000_000_000_000}, "2,048 layers"),
    (["dense-to-moe", "--experts", "4", "--topk", "2", "--dry-run"], {"num_hidden_layers": 10**12}, "2,048"),
    (["dense-to-moe", "--experts", "4", "--topk", "2", "--dry-run"], {"hidden_size": 64.5}, "hidden_size"),
    (["convert", "OUT"], {"intermediate_size": -128}, "intermediate_size"),
    (["convert", "OUT"], {"num_attention_heads": 0}, "num_attention_heads"),
    (["dense-to-moe", "OUT", "--experts", "4", "--topk", "2"], {"num_hidden_layers": "4"}, "num_hidden"),
])
def test_hostile_config_through_commands(tmp_path, models, command, changes, mentions):
    """The same checks guard every command that reads a config (a full checkpoint for convert)."""
    src = tmp_path / "src"
    shutil.copytree(models["llama"], src)
    (src / "config.json").write_text(config_text(json.loads((src / "config.json").read_text()), changes))
    args = [command[0], src, *(tmp_path / "out" if a == "OUT" else a for a in command[1:])]
    fails(tmp_path, args, ("config.json", mentions), [src])


def test_valid_config_quirks_still_read(tmp_path):
    """Values transformers itself accepts: null optional fields, head_dim 0 (derived), sliding_window 0."""
    src = config_only(tmp_path, "qwen2", {"head_dim": 0, "num_key_value_heads": None, "rope_scaling": None,
                                          "sliding_window": 0, "rms_norm_eps": None, "layer_types": None})
    info = json.loads(run_cli("inspect", src, "--json", timeout=HANG).stdout)
    assert info["head_dim"] == 16 and info["kv_heads"] == 4 and info["total_params"] > 0


def test_limits_off_plans_a_large_valid_model(tmp_path, monkeypatch):
    """4,096 layers is over the default limit, and fine (planned in a dry run) with UPCYCLER_LIMITS=off."""
    src = config_only(tmp_path, "llama", {"num_hidden_layers": 4096})
    fails(tmp_path, ["depth", src, "--layers", "4100", "--dry-run"], ("config.json", LIMITS_ENV), [src])
    monkeypatch.setenv(LIMITS_ENV, "off")
    before = state(src)
    proc = run_cli("depth", src, "--layers", "4100", "--dry-run", "--json", timeout=HANG)
    plan = json.loads(proc.stdout)
    assert plan["architecture"]["layers"] == 4100 and plan["total_params"] > 0
    assert state(src) == before and leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("command", [
    ["dense-to-moe", "--experts", "4", "--topk", "2", "--dry-run", "--json"],
    ["dense-to-moe", "--experts", "4", "--topk", "2", "--expert-width", "500000000007", "--dry-run", "--json"],
    ["dense-to-moe", "--experts", "6", "--topk", "3", "--granularity", "4", "--shared-experts", "1",
     "--target", "qwen2_moe", "--dry-run", "--json"],
    ["inspect", "--json"],
])
def test_limits_off_plans_a_huge_ffn_without_allocating_by_its_size(tmp_path, monkeypatch, command):
    """intermediate_size 10**12 with UPCYCLER_LIMITS=off: a dry run and inspect plan from the shapes (an
    array of one entry per neuron would be terabytes) and print the plan, touching nothing."""
    src = config_only(tmp_path, "llama", {"intermediate_size": 10**12})
    monkeypatch.setenv(LIMITS_ENV, "off")
    before = state(src)
    proc = run_cli(command[0], src, *command[1:], timeout=HANG, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert plan["total_params"] > 10**12
    if command[0] == "dense-to-moe":
        assert plan["function_preserving"]
    assert state(src) == before and leftovers(tmp_path, "out") == []


# --- Orbax manifest spec ------------------------------------------------------------------------------
ORBAX_CASES = [
    cli({"num_layers": 1e9}, "num_layers"),
    cli({"num_layers": "four"}, "num_layers"),
    cli({"num_layers": 10**9}, ("num_layers", LIMITS_ENV)),
    ({"num_kv_heads": 3}, "num_kv_heads"),
    cli({"family": "gpt2"}, "family"),
    ({"family": ["llama"]}, "family"),
    cli({"moe": [1]}, "moe"),
    ({"moe": {"num_experts": 4, "top_k": 9, "expert_width": 8}}, "top_k"),
    ({"moe": {"num_experts": 4, "top_k": 2}}, "expert_width"),
    ({"dense_layers": [5]}, "dense_layers"),
    ({"dense_layers": {"0": 1}}, "dense_layers"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"extras": [1]}, "extras"),
    ({"extras": {"initializer_range": [Raw("1e999")]}}, "Infinity"),  # re-serialised by the reader
    ({"bogus": 1}, "bogus"),
    ({"hidden_size": DELETE}, "hidden_size"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
]


def hostile_manifest(tmp_path: Path, models: dict[str, Path], changes: dict[str, Any]) -> Path:
    src = tmp_path / "src"
    shutil.copytree(models["orbax"], src)
    manifest = json.loads((src / "upcycler.json").read_text())
    spec = config_text(manifest["spec"], changes)
    text = json.dumps({**manifest, "spec": "@@spec@@"}).replace('"@@spec@@"', spec)
    (src / "upcycler.json").write_text(text)
    return src


@pytest.mark.parametrize("changes,mentions", ORBAX_CASES, ids=case_ids(ORBAX_CASES))
def test_hostile_manifest_spec(tmp_path, models, changes, mentions):
    """Every case through the Orbax reader: one UpcyclerError line naming the manifest."""
    from upcycler.io.orbax_read import read_orbax

    src = hostile_manifest(tmp_path, models, changes)
    before = state(src)
    with time_limit(HANG), pytest.raises(UpcyclerError) as err:
        read_orbax(src)
    assert_one_line(err.value, ("upcycler.json", *mention(mentions)))
    assert state(src) == before


@pytest.mark.parametrize("changes,mentions", cli_cases(ORBAX_CASES))
def test_hostile_manifest_spec_cli(tmp_path, models, changes, mentions):
    src = hostile_manifest(tmp_path, models, changes)
    fails(tmp_path, ["inspect", src], ("upcycler.json", *mention(mentions)), [src])
    if changes == {"num_layers": 1e9}:
        fails(tmp_path, ["convert", src, tmp_path / "out"], ("upcycler.json", *mention(mentions)), [src])


# --- transform and merge options ---------------------------------------------------------------------
TRANSFORM_CASES = [
    (["depth", "--layers", "1000000", "--dry-run"], ("--layers", "2,048 layers")),
    (["depth", "--layers", str(10**30), "--dry-run"], "--layers"),
    (["depth", "--layer-map", ",".join(["0-1"] * 2000), "--dry-run"], "--layer-map"),
    (["depth", "--layer-map", "0-" + "9" * 5000, "--dry-run"], "--layer-map"),
    (["dense-to-moe", "--experts", "4", "--topk", "2", "--router-std", "nan", "--dry-run"], "--router-std"),
    (["dense-to-moe", "OUT", "--experts", "4", "--topk", "2", "--router-std", "nan"], "--router-std"),
    (["dense-to-moe", "OUT", "--experts", "4", "--topk", "2", "--router-std", "inf"], "--router-std"),
    (["dense-to-moe", "OUT", "--experts", "4", "--topk", "2", "--routed-scaling-factor", "-inf",
      "--target", "glm4_moe"], "--routed-scaling-factor"),
    (["dense-to-moe", "OUT", "--experts", "4", "--topk", "2", "--reinit-ratio", "nan"], "--reinit-ratio"),
    (["dense-to-moe", "OUT", "--experts", "4", "--topk", "2", "--target", "glm4_moe",
      "--routed-scaling-factor", "1e-300"], "--routed-scaling-factor"),  # R / rsf would overflow to inf
    (["dense-to-moe", "--experts", "4", "--topk", "2", "--router-std", "1e30", "--dry-run"], "--router-std"),
    (["dense-to-moe", "--experts", "1000000", "--topk", "2", "--dry-run"], ("--experts", LIMITS_ENV)),
    (["dense-to-moe", "--experts", "4", "--topk", "2", "--seed", str(10**30), "--dry-run"], "--seed"),
]


@pytest.mark.parametrize("args,mentions", TRANSFORM_CASES, ids=case_ids(TRANSFORM_CASES))
def test_hostile_transform_option(tmp_path, models, args, mentions):
    src = models["llama"]
    args = [args[0], src, *(tmp_path / "out" if a == "OUT" else a for a in args[1:])]
    fails(tmp_path, args, mentions, [src])


def test_already_moe_says_what_to_do(tmp_path, models):
    src = models["mixtral"]
    line = fails(tmp_path, ["dense-to-moe", src, tmp_path / "out", "--experts", "4", "--topk", "2"],
                 "already MoE", [src])
    assert "dense original" in line


@pytest.mark.parametrize("value", ["nan", "-inf"])
def test_recipe_float_option_must_be_finite(tmp_path, models, value):
    recipe = tmp_path / "recipe.yaml"
    yaml_value = {"nan": ".nan", "-inf": "-.inf"}[value]
    recipe.write_text(f"source: {models['llama']}\ntransforms:\n"
                      f"  - dense-to-moe: {{experts: 4, topk: 2, router_std: {yaml_value}}}\n"
                      f"output: {{path: {tmp_path / 'out'}}}\n")
    fails(tmp_path, ["run", recipe], ("recipe.yaml", "--router-std", "finite"), [models["llama"]])


@pytest.mark.parametrize("method,option,value", [
    ("task-arithmetic", "--lambda", "nan"),
    ("ties", "--lambda", "inf"),
    ("slerp", "--t", "-inf"),
])
def test_merge_float_option_must_be_finite(tmp_path, models, method, option, value):
    src, same = models["llama"], models["orbax"]
    base = ["--base", src] if METHODS[method].needs_base else []
    fails(tmp_path, ["merge", src, same, tmp_path / "out", "--method", method, *base, option, value],
          (option, "finite"), [src, same])


def test_merging_one_input_twice_is_refused(tmp_path, models):
    """The same checkpoint twice, directly or through a symlink, would count double: one line naming both."""
    src = models["llama"]
    (tmp_path / "alias").symlink_to(src)
    fails(tmp_path, ["merge", src, src, tmp_path / "out", "--method", "sma"], ("merged twice", str(src)), [src])
    fails(tmp_path, ["merge", src, tmp_path / "alias", tmp_path / "out", "--method", "sma"],
          ("alias: merged twice", str(src)), [src])


# --- in-process: the spec itself ----------------------------------------------------------------------
def tiny_spec(**changes: Any) -> ModelSpec:
    base = {"family": "llama", "vocab_size": 128, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                "head_dim": 16, "intermediate_size": 128}
    return ModelSpec(**{**base, **changes})


def test_transform_building_an_invalid_spec_is_one_line():
    """A spec is checked wherever it is built: a transform's result too, as an UpcyclerError."""
    with pytest.raises(UpcyclerError, match="num_layers"):
        tiny_spec().replace(num_layers=0)
    with pytest.raises(UpcyclerError, match="top_k"):
        MoESpec(num_experts=4, top_k=5, expert_width=8)
    with pytest.raises(ValueError):  # readers catch ValueError and name the file
        tiny_spec(rope_theta=math.nan)


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


def check_accepted(spec: ModelSpec) -> None:
    """An accepted spec: positive counts, computed at once, equal to what the layout declares."""
    start = time.perf_counter()
    total, active = spec.total_params(), spec.active_params()
    assert time.perf_counter() - start < 0.05
    assert 0 < active <= total
    decls = [d for d in declare_params(spec) if not d.is_buffer]
    assert total == sum(d.numel for d in decls)
    top_k = spec.moe.top_k if spec.moe else 0
    assert active == sum(d.numel // d.shape[0] * top_k if d.expert_stacked else d.numel for d in decls)
    assert ModelSpec.from_json(spec.to_json()) == spec


NUMBERS = st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64, -1, -64, 2**11, 2**11 + 1, 2**17, 2**24 + 1, 10**12,
                           2**63, 10**400, 0.5, 2.0, 64.5, 1e-6, -0.0, 1e308, math.nan, math.inf, -math.inf])
LEAVES = (st.none() | st.booleans() | NUMBERS | st.integers() | st.floats()
          | st.text(max_size=12)
          | st.sampled_from(["4", "silu", "llama", "full_attention", "sliding_attention", "linear"]))
JSON_VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
EXTRA_KEYS = ["rope_scaling", "rope_parameters", "layer_types", "mlp_only_layers", "head_dim",
              "sliding_window", "first_k_dense_replace", "decoder_sparse_step", "architectures", "model_type",
              "hidden_act", "initializer_range"]
BASES = {f: base_config(f) for f in FAMILIES}


@st.composite
def mutated(draw: Any, base: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    out = dict(base)
    for key in draw(st.lists(st.sampled_from(sorted(base) + extra), min_size=1, max_size=4)):
        if draw(st.booleans()) and key in out and draw(st.integers(0, 5)) == 0:
            del out[key]
        else:
            out[key] = draw(JSON_VALUES)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_config_json(data):
    family = data.draw(st.sampled_from(sorted(BASES)))
    cfg = data.draw(mutated(BASES[family], EXTRA_KEYS))
    with time_limit(5):
        try:
            spec = family_for_config(cfg, "config.json").read_config(cfg)
        except UpcyclerError:
            return
    check_accepted(spec)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_config_file(data, tmp_path_factory):
    """Through the reader of the file: random configs serialised as JSON (NaN/Infinity included)."""
    family = data.draw(st.sampled_from(sorted(BASES)))
    cfg = data.draw(mutated(BASES[family], EXTRA_KEYS))
    src = tmp_path_factory.mktemp("fuzz")
    (src / "config.json").write_text(json.dumps(cfg))
    with time_limit(5):
        try:
            spec = read_spec(src)
        except UpcyclerError as err:
            assert "config.json" in str(err) and "\n" not in str(err)
            return
    check_accepted(spec)


SPECS = [tiny_spec(), tiny_spec(family="qwen3_moe", num_layers=3, qk_norm=True, dense_layers=(0,),
                                 moe=MoESpec(num_experts=4, top_k=2, expert_width=16)),
         tiny_spec(family="glm4_moe", rope_scaling=(("factor", 8.0), ("rope_type", "llama3")),
                   moe=MoESpec(num_experts=8, top_k=2, expert_width=8, router="sigmoid", shared_width=8,
                               num_shared_experts=1, router_bias=True)),
         tiny_spec(family="qwen2", sliding_window=8, layer_types=("full_attention", "sliding_attention"),
                   extras=(("bos_token_id", 1),))]
SPEC_DICTS = [json.loads(s.to_json()) for s in SPECS]
MOE_KEYS = ["num_experts", "top_k", "expert_width", "router", "routed_scaling_factor", "shared_width",
            "num_shared_experts", "shared_gated", "router_bias"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_manifest_spec(data):
    spec = data.draw(st.sampled_from(SPEC_DICTS))
    out = data.draw(mutated(spec, ["bogus"]))
    if isinstance(out.get("moe"), dict) and data.draw(st.booleans()):
        out["moe"] = data.draw(mutated(out["moe"], MOE_KEYS))
    with time_limit(5):
        try:
            parsed = ModelSpec.from_json(json.dumps(out))
        except UpcyclerError:
            return
    check_accepted(parsed)


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(sorted(TRANSFORMS)), data=st.data())
def test_fuzz_transform_options(name, data):
    """Options from a recipe: a checked config or a one-line UpcyclerError; float options are finite."""
    t = TRANSFORMS[name]
    options = {o.name: o for o in t.options()}
    values = data.draw(st.dictionaries(st.sampled_from(sorted(options)), JSON_VALUES, max_size=4))
    try:
        cfg = t.make_config({"experts": 4, "topk": 2, **values} if name == "dense-to-moe" else values)
    except UpcyclerError as err:
        assert "\n" not in str(err) and len(str(err)) < 600
        return
    for key, opt in options.items():
        if opt.type is float:
            assert math.isfinite(getattr(cfg, key))


@settings(max_examples=200, deadline=None)
@given(method=st.sampled_from(sorted(METHODS)), value=st.floats() | NUMBERS)
def test_fuzz_merge_options(method, value):
    m = METHODS[method]
    for arg in m.args:
        try:
            bound = m.bind({arg.name: value})
        except UpcyclerError:
            continue
        assert math.isfinite(bound[arg.name])
