"""The training config of `upcycle continued-pretrain`: frozen dataclasses, parsed and checked from YAML.

Schema (every section but `model` and `data` is optional; defaults shown):

    run_dir: runs/cpt                  # checkpoints (RUN_DIR/<step>/), metrics.jsonl, config.yaml
    steps: 1000                        # train until this absolute step
    model:
      init: ckpt/                      # HF or Orbax checkpoint to start from (an upcycled MoE, say)
      tokenizer: null                  # tokenizer.json or its directory; default: init/tokenizer.json
      compute_dtype: float32           # float32 | bfloat16 (master weights are always float32)
      attention: einsum                # einsum | dot_product
      moe_impl: dropless               # dropless | reference (one-hot)
      remat: false
    data: {...}                        # see upcycler.train.data.config
    optimizer:
      lr: 3.0e-4                       # peak learning rate
      b1: 0.9
      b2: 0.95
      eps: 1.0e-8
      weight_decay: 0.1                # on matrices only
      clip_norm: 1.0                   # global-norm clipping; 0 = off
      schedule:                        # phases in absolute steps; empty = constant lr
        - {kind: warmup, until_step: 100}
        - {kind: constant, until_step: 900}
        - {kind: cosine, until_step: 1000, lr: 3.0e-5}
    loss: {lb_coef: 0.01, z_coef: 0.001}
    mesh: {data: 1, fsdp: -1, expert: 1}   # -1: all remaining devices
    distributed: {coordinator: null, num_processes: null, process_id: null}
    checkpoint: {every: 100, keep: 3, async: true}
    metrics: {peak_flops: null, expert_load_every: 1, progress: true}

Everything here is checked without touching the disk or the devices (`load_config`); what needs them
(files, tokenizer, device count) is checked by `upcycler.train.preflight.prepare` before anything runs.
The file and every `--set` value are parsed by `upcycler.untrusted` (size-capped, aliases and nesting
bounded); every value is checked for its exact type and range (an integer option takes no bool, float
or string; a float option takes no NaN or infinity), so any document yields a `TrainConfig` or one
`UpcyclerError` line naming the file and the option.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.train.data.config import MAX_STEP, DataConfig, key_names, path_value
from upcycler.untrusted import describe, escape, integer, load_yaml, parse_yaml, real, shown_path

SCHEDULE_KINDS = ("warmup", "constant", "cosine", "linear")
COMPUTE_DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("einsum", "dot_product")
MOE_IMPLS = ("dropless", "reference")
MAX_DEVICES = 1 << 20
_FIX = "fix the config (or the flag that sets it)"


@dataclass(frozen=True)
class ModelSection:
    init: Path
    tokenizer: Path | None = None
    compute_dtype: str = "float32"
    attention: str = "einsum"
    moe_impl: str = "dropless"
    remat: bool = False


@dataclass(frozen=True)
class SchedulePhase:
    """One piece of the learning-rate schedule, ending at `until_step` with learning rate `lr`."""

    kind: str
    until_step: int
    lr: float | None = None


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    schedule: tuple[SchedulePhase, ...] = ()


@dataclass(frozen=True)
class LossConfig:
    lb_coef: float = 0.01
    z_coef: float = 0.001


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1
    expert: int = 1


@dataclass(frozen=True)
class DistributedConfig:
    """`coordinator` host:port starts `jax.distributed`; "auto" lets JAX detect the cluster (SLURM, TPU)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100
    keep: int = 3
    async_save: bool = field(default=True, metadata={"key": "async"})


@dataclass(frozen=True)
class MetricsConfig:
    peak_flops: float | None = None  # per device, FLOP/s; MFU is reported only when set
    expert_load_every: int = 1
    progress: bool = True


@dataclass(frozen=True)
class TrainConfig:
    run_dir: Path
    steps: int
    model: ModelSection
    data: DataConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able data that `from_dict` turns back into an equal config."""
        return _plain(self)

    @classmethod
    def from_dict(cls, raw: Any, origin: str = "config") -> TrainConfig:
        """Build and check a config from parsed YAML; raises `UpcyclerError` with one line naming `origin`."""
        if not isinstance(raw, Mapping):
            raise UpcyclerError(
                f"{origin}: the config must be a mapping of sections, not {describe(raw)}; "
                "see the documented schema"
            )
        raw = dict(raw)
        for key in ("run_dir", "steps", "model", "data"):
            if key not in raw:
                raise UpcyclerError(f"{origin}: missing {key!r}; add it (or pass it as a flag)")
        data = DataConfig.from_dict(raw.pop("data"), f"{origin}: data")
        optimizer = dict(_mapping(raw.pop("optimizer", {}), origin, "optimizer"))
        schedule = optimizer.pop("schedule", []) or []
        if not isinstance(schedule, list):
            raise UpcyclerError(
                f"{origin}: optimizer.schedule must be a list of {{kind, until_step, lr}} phases"
            )
        phases = tuple(
            _build(SchedulePhase, p, origin, f"optimizer.schedule[{k}]") for k, p in enumerate(schedule)
        )
        sections = {
            "model": ModelSection,
            "optimizer": OptimizerConfig,
            "loss": LossConfig,
            "mesh": MeshConfig,
            "distributed": DistributedConfig,
            "checkpoint": CheckpointConfig,
            "metrics": MetricsConfig,
        }
        built = {"data": data}
        for name, kind in sections.items():
            section = optimizer if name == "optimizer" else raw.pop(name, {})
            extra = {"schedule": phases} if name == "optimizer" else {}
            built[name] = _build(kind, section, origin, name, extra)
        top = _build(_Top, raw, origin, "")
        config = cls(run_dir=top.run_dir, steps=top.steps, **built)
        check(config, origin)
        return config


@dataclass(frozen=True)
class _Top:
    run_dir: Path
    steps: int


def check(config: TrainConfig, origin: str = "config") -> None:
    """Raise `UpcyclerError` unless every value is in range and the config is consistent in itself
    (no files or devices consulted)."""
    integer(config.steps, "steps", origin, low=1, high=MAX_STEP, fix=_FIX)
    m = config.model
    _choice(m.compute_dtype, COMPUTE_DTYPES, f"{origin}: model.compute_dtype")
    _choice(m.attention, ATTENTION_IMPLS, f"{origin}: model.attention")
    _choice(m.moe_impl, MOE_IMPLS, f"{origin}: model.moe_impl")
    check_schedule(config.optimizer, origin)
    o = config.optimizer
    for name in ("eps", "weight_decay", "clip_norm"):
        real(getattr(o, name), f"optimizer.{name}", origin, low=0, fix=_FIX)
    for name in ("b1", "b2"):
        if real(getattr(o, name), f"optimizer.{name}", origin, low=0, high=1, fix=_FIX) == 1:
            raise UpcyclerError(f"{origin}: optimizer.{name} must be below 1, not 1; {_FIX}")
    for name in ("lb_coef", "z_coef"):
        real(getattr(config.loss, name), f"loss.{name}", origin, low=0, fix=_FIX)
    sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.expert]
    for name, size in zip(("data", "fsdp", "expert"), sizes):
        integer(size, f"mesh.{name}", origin, low=-1, high=MAX_DEVICES, fix=_FIX)
    if any(s == 0 for s in sizes) or sizes.count(-1) > 1:
        raise UpcyclerError(
            f"{origin}: mesh sizes must be positive, with at most one -1 (all remaining devices)"
        )
    known = math.prod(s for s in sizes if s != -1)
    if config.data.global_batch_size % known:
        raise UpcyclerError(
            f"{origin}: data.global_batch_size {config.data.global_batch_size} is not divisible by the mesh "
            f"(data × fsdp × expert = {known}); make it a multiple of {known}"
        )
    _check_distributed(config.distributed, origin)
    c = config.checkpoint
    integer(c.every, "checkpoint.every", origin, low=1, high=MAX_STEP, fix=_FIX)
    integer(c.keep, "checkpoint.keep", origin, low=1, high=MAX_STEP, fix=_FIX)
    integer(config.metrics.expert_load_every, "metrics.expert_load_every", origin, low=1, high=MAX_STEP,
            fix=_FIX)
    peak = config.metrics.peak_flops
    if peak is not None and real(peak, "metrics.peak_flops", origin, low=0, fix=_FIX) == 0:
        raise UpcyclerError(f"{origin}: metrics.peak_flops must be positive (FLOP/s per device) or null")


def _check_distributed(d: DistributedConfig, origin: str) -> None:
    """`coordinator` is host:port or auto; process counts and ids are in range."""
    coordinator = d.coordinator
    if coordinator not in (None, "auto") and (not isinstance(coordinator, str) or ":" not in coordinator):
        raise UpcyclerError(
            f"{origin}: distributed.coordinator {describe(d.coordinator)} must be host:port or auto"
        )
    if d.num_processes is not None:
        integer(d.num_processes, "distributed.num_processes", origin, low=1, high=MAX_DEVICES, fix=_FIX)
    if d.process_id is not None:
        last = d.num_processes - 1 if d.num_processes is not None else MAX_DEVICES
        integer(d.process_id, "distributed.process_id", origin, low=0, high=last, fix=_FIX)


def check_schedule(o: OptimizerConfig, origin: str) -> None:
    """Phase kinds known, `until_step` strictly increasing from 0, learning rates non-negative."""
    real(o.lr, "optimizer.lr", origin, low=0, fix=_FIX)
    previous = 0
    for k, phase in enumerate(o.schedule):
        where = f"{origin}: optimizer.schedule[{k}]"
        _choice(phase.kind, SCHEDULE_KINDS, f"{where}.kind")
        if isinstance(phase.until_step, bool) or not isinstance(phase.until_step, int) \
                or not previous < phase.until_step <= MAX_STEP:
            raise UpcyclerError(
                f"{where}.until_step is {describe(phase.until_step)}; "
                f"phase steps must increase strictly from {previous} (at most {MAX_STEP:,})"
            )
        if phase.lr is not None:
            real(phase.lr, f"optimizer.schedule[{k}].lr", origin, low=0, fix=_FIX)
        previous = phase.until_step


def load_config(path: Path, overrides: Mapping[str, Any] = {}, sets: Sequence[str] = ()) -> TrainConfig:
    """Read YAML `path`, apply `sets` ("a.b=value", value parsed as YAML) then `overrides` (dotted keys)."""
    raw = load_yaml(Path(path), what="training config", fix="fix the YAML of --config")
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise UpcyclerError(
            f"{shown_path(path)}: the config must be a mapping of sections, not {describe(raw)}; "
            "see the documented schema"
        )
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not all(key.split(".")):
            raise UpcyclerError(f"--set {describe(item)}: write it as section.key=value")
        _assign(raw, key, parse_yaml(value, f"--set {escape(key)}", "quote the value or fix its YAML"), path)
    for key, value in overrides.items():
        if value is not None:
            _assign(raw, key, value, path)
    return TrainConfig.from_dict(raw, shown_path(path))


def _assign(raw: dict, dotted: str, value: Any, path: Path) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        child = raw.setdefault(key, {})
        if not isinstance(child, dict):
            raise UpcyclerError(
                f"{shown_path(path)}: cannot set {escape(dotted)}: {escape(key)} is {describe(child)}, "
                "not a section; fix the config or the key"
            )
        raw = child
    raw[last] = value


def _build(cls: type, raw: Any, origin: str, section: str, extra: Mapping[str, Any] = {}) -> Any:
    """An instance of dataclass `cls` from a mapping, with each value's type checked against the field's.

    `section` is the dotted name of the mapping in the config ("" for the top level)."""
    raw = _mapping(raw, origin, section)
    where = f"{origin}: {section}" if section else origin
    hints = typing.get_type_hints(cls)
    fields = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls) if f.name not in extra}
    unknown = sorted(key_names(raw) - set(fields))
    if unknown:
        raise UpcyclerError(
            f"{where}: unknown key {describe(unknown[0])}; allowed: {', '.join(sorted(fields))}"
        )
    values = dict(extra)
    for key, f in fields.items():
        if key in raw:
            values[f.name] = _coerce(raw[key], hints[f.name], f"{section}.{key}" if section else key, origin)
        elif f.default is dataclasses.MISSING:
            raise UpcyclerError(f"{where}: missing {key!r}; add it")
    return cls(**values)


def _coerce(value: Any, hint: Any, name: str, origin: str) -> Any:
    """`value` as the field type `hint` (bool, int, float, str, Path, maybe None), else `UpcyclerError`."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise UpcyclerError(f"{origin}: {name} must be set, not null; {_FIX}")
    if float in options and isinstance(value, str):
        value = _yaml_float(value)  # PyYAML reads 3e-4 (no dot) as a string
    for kind in options:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return real(value, name, origin, fix=_FIX)
        if kind is str and isinstance(value, str):
            return value
        if kind is Path and isinstance(value, (str, Path)):
            return path_value(value, name, origin, "a file or directory")
    names = " or ".join(_KINDS.get(k, str(k)) for k in options if k is not type(None))
    raise UpcyclerError(f"{origin}: {name} must be {names}, not {describe(value)}; {_FIX}")


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "text", Path: "a path"}


def _yaml_float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _mapping(raw: Any, origin: str, section: str) -> Mapping:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        what = f"{origin}: {section}" if section else origin
        raise UpcyclerError(f"{what} must be a mapping of keys to values, not {describe(raw)}")
    return raw


def _choice(value: str, allowed: Sequence[str], where: str) -> None:
    if value not in allowed:
        raise UpcyclerError(f"{where} is {describe(value)}; use one of {', '.join(allowed)}")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            out[f.metadata.get("key", f.name)] = _plain(getattr(value, f.name))
        return out
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
