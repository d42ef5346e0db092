"""The checks of a training run that need the disk but no devices, made before anything is loaded.

`prepare(config, resume)` reads the init checkpoint's spec, the tokenizer, every prepared source's
metadata and token-file header, and the run directory; it raises one `UpcyclerError` on the first
problem. It imports neither JAX nor Grain, so `upcycle continued-pretrain` refuses a bad run in about a
second. The run directory is never a source: a run_dir that is, contains or lies inside `model.init`
or `data.dir` (after resolving symlinks) is refused, so a run cannot write over what it reads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.io import read_checkpoint
from upcycler.io.checkpoint import Checkpoint
from upcycler.io.hashing import sha256_file
from upcycler.io.orbax_layout import COMMIT_FILE
from upcycler.io.staging import overlap
from upcycler.locations import is_remote
from upcycler.spec import ModelSpec
from upcycler.train.config import RESUME_MODES, TrainConfig
from upcycler.train.data.sources import open_source
from upcycler.train.loop import trainable
from upcycler.train.techniques.init_merge import merge_sources, plan_init_merge
from upcycler.untrusted import shown_path


@dataclass(frozen=True)
class RunInputs:
    """What `prepare` learnt while checking: the model's spec and lineage, the tokenizer, the init path."""

    spec: ModelSpec
    lineage: tuple[dict[str, Any], ...]
    tokenizer: Path
    init: Path
    merged_init: Checkpoint | None = None  # `model.init_from_merge`: the (lazy) average to start from


def prepare(config: TrainConfig, resume: bool) -> RunInputs:
    """All file checks of a run (no devices, no tensor bytes): raises `UpcyclerError` on the first problem."""
    refuse_run_dir_overlap(config)
    if config.model.init_from_merge is not None:  # also on a resume: run_dir is never a merge source
        for source in merge_sources(config.model.init_from_merge):
            refuse_overlap(config.run_dir, source, "model.init_from_merge")
    if not is_remote(config.run_dir) and os.path.lexists(config.run_dir) and not config.run_dir.is_dir():
        raise UpcyclerError(
            f"{shown_path(config.run_dir)}: run_dir is not a directory; choose another run_dir"
        )
    init = read_checkpoint(config.model.init)
    tokenizer = config.model.tokenizer or config.model.init
    tokenizer = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    if not tokenizer.is_file():
        raise UpcyclerError(
            f"{shown_path(tokenizer)}: no tokenizer; set model.tokenizer to the tokenizer.json the data was "
            "prepared with"
        )
    digest = sha256_file(tokenizer)
    for name in config.data.source_names:
        source = open_source(config.data.dir, name)
        if source.tokenizer_sha256 != digest:
            raise UpcyclerError(
                f"{shown_path(config.data.dir)}: source {name!r} was prepared with another tokenizer than "
                f"{shown_path(tokenizer)}; "
                "prepare the data with the model's tokenizer or point model.tokenizer at the right one"
            )
        if int(source.meta["vocab_size"]) > init.spec.vocab_size:
            raise UpcyclerError(
                f"{shown_path(tokenizer)}: vocabulary of {source.meta['vocab_size']} tokens exceeds the "
                f"model's {init.spec.vocab_size}; use the model's own tokenizer"
            )
    has_steps = bool(committed_steps(config.run_dir))
    if has_steps and not resume:
        raise UpcyclerError(
            f"{shown_path(config.run_dir)}: holds checkpoints of an earlier run; continue it (--resume auto, "
            "the default) or use a new run_dir"
        )
    if resume and not has_steps:
        raise UpcyclerError(
            f"{shown_path(config.run_dir)}: no checkpoint to resume from; use --resume auto (the default) to "
            "start a new run"
        )
    _check_balancing(config, init.spec)
    merged = None
    if config.model.init_from_merge is not None and not resume:
        merged = plan_init_merge(config.model.init_from_merge, init.spec)
        for source in merged.inputs:
            refuse_overlap(config.run_dir, source, "model.init_from_merge")
    lineage = tuple((merged or init).lineage)
    trainable.check(config.optimizer.trainable, init.spec, lineage)  # before a run directory exists
    return RunInputs(init.spec, lineage, tokenizer.absolute(), config.model.init, merged)


def check_spec_options(config: TrainConfig, spec: ModelSpec, devices: Sequence[Any] | None = None) -> None:
    """The options that need an MoE model: refused for a dense one (they would silently do nothing), and
    bias balancing, which needs a router with a selection bias to move; then the shapes of data phases
    of their own length, on the mesh over `devices` (default: all) and within the model's positions
    (`upcycler.train.loop.phases.check_shapes`). The trainer and `upcycler.train.aot.compile` run this
    once the mesh is built (before a run directory exists), so the mesh's own refusals (`model.moe_chunks`
    that do not divide the gathered tokens) come first."""
    if spec.moe is None:
        m = config.model
        for option, value, default in (("moe_dispatch", m.moe_dispatch, "gspmd"),
                                       ("grad_comm_dtype", m.grad_comm_dtype, "native")):
            if value != default:
                raise UpcyclerError(
                    f"{shown_path(config.model.init)}: model.{option} {value} applies to the routed experts, "
                    f"but this {spec.family} model is dense; set model.{option} to {default}, or start from "
                    "an MoE checkpoint"
                )
    _check_balancing(config, spec)
    _check_gmm_backend(config)
    from upcycler.train.loop.phases import check_shapes  # brings in JAX: only once a mesh is built

    check_shapes(config, spec, devices)


def _check_gmm_backend(config: TrainConfig) -> None:
    """`model.gmm_backend: tokamax` needs tokamax installed, with a JAX it runs on."""
    from upcycler.train.model.gmm_tokamax import tokamax_available

    if config.model.gmm_backend == "tokamax" and not tokamax_available():
        raise UpcyclerError(
            f"{shown_path(config.model.init)}: model.gmm_backend tokamax needs tokamax, which needs JAX >= 0.11.1 "
            "(Python >= 3.12): install upcycler[tpu] on such a Python, or set model.gmm_backend auto"
        )


def _check_balancing(config: TrainConfig, spec: ModelSpec) -> None:
    """Bias balancing needs a router with a selection bias to move."""
    if config.loss.bias_update_rate > 0 and not (spec.moe is not None and spec.moe.router_bias):
        raise UpcyclerError(
            f"{shown_path(config.model.init)}: loss.bias_update_rate {config.loss.bias_update_rate:g} moves the "
            f"router's selection bias, but this {spec.family} model has none (GLM-4-MoE and DeepSeek-V3 "
            "routers have one: upcycle with --target glm4_moe); set loss.bias_update_rate to 0 or use lb_coef"
        )


def resumes(config: TrainConfig, mode: str) -> bool:
    """Whether a run started with `--resume MODE` continues from run_dir's newest committed checkpoint:
    `auto` when there is one, `always` and `never` as they say (`prepare` refuses the run_dir that
    contradicts them)."""
    if mode not in RESUME_MODES:
        raise UpcyclerError(f"--resume {mode}: use one of {', '.join(RESUME_MODES)}")
    return mode == "always" or (mode == "auto" and bool(committed_steps(config.run_dir)))


def refuse_run_dir_overlap(config: TrainConfig) -> None:
    """Refuse a run_dir that is, contains or lies inside model.init or data.dir (symlinks resolved)."""
    for option, source in (("model.init", config.model.init), ("data.dir", config.data.dir)):
        refuse_overlap(config.run_dir, source, option)


def refuse_overlap(run_dir: Path, source: Path, option: str) -> None:
    """Refuse a run_dir that is, contains or lies inside `source` (what `option` names); a bucket run_dir
    cannot overlap a local source."""
    if is_remote(run_dir) != is_remote(source):
        return  # a bucket and a local disk never overlap
    why = url_overlap(str(run_dir), str(source)) if is_remote(run_dir) else overlap(run_dir, source)
    if why is not None:
        raise UpcyclerError(
            f"{shown_path(run_dir)}: run_dir {why} {option} {shown_path(source)}; the run would write "
            "over its own input; choose a run_dir outside the checkpoint and the data"
        )


def url_overlap(run_dir: str, source: str) -> str | None:
    """How the bucket location `run_dir` overlaps `source` ("is", "contains", "lies inside"), or None."""
    a, b = run_dir.rstrip("/"), source.rstrip("/")
    return "is" if a == b else "contains" if b.startswith(a + "/") else "lies inside" if a.startswith(b + "/") else None


def committed_steps(run_dir: Path) -> dict[int, Path]:
    """Step number -> directory of every committed step under `run_dir`: on a local disk Orbax renames a
    finished step into place; in a bucket it writes the step in place and `COMMIT_FILE` last."""
    remote = is_remote(run_dir)
    if not run_dir.is_dir():
        return {}
    return {
        int(p.name): p
        for p in sorted(run_dir.iterdir(), key=lambda p: p.name)
        if p.name.isascii() and p.name.isdigit() and ((p / COMMIT_FILE).exists() if remote else p.is_dir())
    }
