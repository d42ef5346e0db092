"""Training checkpoints: an Orbax CheckpointManager over RUN_DIR, one directory per step, async, keep N.

Layout of `RUN_DIR/<step>/`:

    params/          the parameters in the canonical Orbax layout (leaf `layers.3.attn.q_proj`, …, one
                     array per canonical tensor, float32), so the step is also a model checkpoint
    ema/             with `optimizer.ema`: the weights' moving average, in the same layout as params/
    opt_state/       the optax state (Adam moments laid out like the training parameters)
    data/            the data iterator's state (JSON; the same on every process)
    meta/            step, tokens_seen, lr (of the last step trained), ModelSpec, lineage, and each
                     technique's entries (`techniques_meta`: the loss-spike guard's window and record of
                     rewinds, the open expert window), at the top level under the keys the technique
                     declares (JSON)
    upcycler.json    the model manifest (spec + lineage, as `upcycler.io.orbax_write` writes it), added once
                     the step is committed, with the side files beside it (tokenizer, chat template,
                     generation config: `upcycler.io.SIDE_FILES`, from the tokenizer's directory, else the
                     init's), so `read_checkpoint`, `upcycle convert RUN_DIR/<step> OUT --to hf` and the
                     hf/ export (which a harness or a server loads) carry them
    hf/              with `checkpoint.hf_every`: the step as a Hugging Face checkpoint (`checkpoint.hf_dtype`)

A step directory appears only when Orbax has committed every item (a run killed mid-save leaves a
temporary directory that the next run ignores and removes). A save that fails (a bucket that refuses
writes for good or stops answering, within the retry policy of `upcycler.bucket_client`; a full disk)
ends the run with one line naming the run_dir and what to do, not with the tracebacks Orbax's threads
log for each of its writes. The manifest, tokenizer and Hugging Face
export are added after the commit by the primary process, on Orbax's background thread when saves are
async (the steps go on meanwhile); the export is staged (`upcycler.io.staging`) and appears only
complete. `export_committed` repairs any step that lacks them, so a run killed during an export
rewrites it when it resumes.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from upcycler.bucket_client import configure_tensorstore, refusals
from upcycler.errors import UpcyclerError
from upcycler.io.manifest import MANIFEST, PretrainStep, pretrain_step, write_manifest
from upcycler.io.orbax_layout import COMMIT_FILE, PARAMS, STEP_HF, STEP_SIDE_FILES
from upcycler.io.orbax_write import quiet_failed_writes
from upcycler.locations import is_remote
from upcycler.schema import to_plain
from upcycler.spec import ModelSpec
from upcycler.train.config import TrainConfig
from upcycler.train.loop.preflight import committed_steps
from upcycler.train.model.params import ParamInfo, Params, declare_tree
from upcycler.train.techniques.protocol import MetaEntries, Technique

ITEMS = ("params", "ema", "opt_state", "data", "meta")
HF_DIR, SIDE_FILES = STEP_HF, STEP_SIDE_FILES  # the step layout's (`upcycler.io.orbax_layout`)


# --- trainer tree <-> canonical tree --------------------------------------------------------------------
def to_canonical(params: Params, spec: ModelSpec) -> Params:
    """The canonical nested tree (`{"layers": {"3": {"attn": {"q_proj": …}}}}`) of a stacked training tree."""
    out: Params = {}

    def add(info: ParamInfo, arr: jax.Array) -> None:
        for i, name in enumerate(info.names):
            _insert(out, name.split("."), arr[i] if info.stacked else arr)

    jax.tree.map(add, declare_tree(spec), params, is_leaf=_is_info)
    return out


def from_canonical(tree: Params, spec: ModelSpec) -> Params:
    """The stacked training tree of a canonical nested tree (inverse of `to_canonical`)."""

    def leaf(info: ParamInfo) -> jax.Array:
        parts = [_lookup(tree, name.split(".")) for name in info.names]
        return jax.numpy.stack(parts) if info.stacked else parts[0]

    return jax.tree.map(leaf, declare_tree(spec), is_leaf=_is_info)


def canonical_shardings(spec: ModelSpec, param_shardings: Params) -> Params:
    """Shardings of the canonical tree: each layer's tensor split like its stack, minus the layer axis."""
    out: Params = {}

    def add(info: ParamInfo, sharding: NamedSharding) -> None:
        spec_ = tuple(sharding.spec)[1:] if info.stacked else tuple(sharding.spec)
        for name in info.names:
            _insert(out, name.split("."), NamedSharding(sharding.mesh, PartitionSpec(*spec_)))

    jax.tree.map(add, declare_tree(spec), param_shardings, is_leaf=_is_info)
    return out


# --- the manager -------------------------------------------------------------------------------------------
class RunCheckpoints:
    """Save and restore training state under `run_dir`; saves are collective (every process calls them)."""

    def __init__(
        self,
        run_dir: Path,
        spec: ModelSpec,
        *,
        keep: int,
        async_save: bool = True,
        lineage: Sequence[Mapping[str, Any]] = (),
        side_dirs: Sequence[Path] = (),
        hf_every: int = 0,
        hf_dtype: str = "bfloat16",
    ):
        configure_tensorstore()  # before Orbax opens anything: a bucket's retries bounded as gcsfs's are
        _quiet_orbax_failures()
        self.run_dir = run_dir if is_remote(run_dir) else Path(run_dir).absolute()
        self._failed = False  # a save failed: reported once, `close` stays quiet about it
        self.spec = spec
        self.lineage = [dict(x) for x in lineage]
        self.side_dirs = [Path(d) for d in side_dirs]
        self.hf_every, self.hf_dtype = hf_every, hf_dtype
        self._async = async_save
        self._export_error: BaseException | None = None
        callback = self._export_in_background if async_save else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=callback) if async_save else None,
        )
        self._manager = ocp.CheckpointManager(self.run_dir, options=options, item_names=ITEMS)
        self._canonical = jax.jit(to_canonical, static_argnums=1)
        self.export_committed()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.run_dir / str(step)

    def save(
        self,
        step: int,
        params: Params,
        opt_state: Any,
        data_state: Mapping[str, Any],
        lineage_step: Mapping[str, Any],
        *,
        ema: Params | None = None,
        extra_meta: Mapping[str, Any] = {},
    ) -> None:
        """Start saving `step` (returns once the arrays are copied off the devices when async).

        `extra_meta` goes into meta/ beside step, spec and lineage (tokens_seen, lr, rewinds)."""
        meta = {
            "step": step,
            **extra_meta,
            "spec": json.loads(self.spec.to_json()),
            "lineage": [*self.lineage, dict(lineage_step)],
        }
        items = {
            "params": ocp.args.StandardSave(self._canonical(params, self.spec)),
            "opt_state": ocp.args.StandardSave(opt_state),
            "data": ocp.args.JsonSave(dict(data_state)),
            "meta": ocp.args.JsonSave(meta),
        }
        if ema is not None:
            items["ema"] = ocp.args.StandardSave(self._canonical(ema, self.spec))
        with self._writing():
            self.raise_export_error()
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
            if not self._async:
                self.export_committed()

    def restore(
        self, step: int, abstract_params: Params, abstract_opt_state: Any, *, with_ema: bool = False
    ) -> Restored:
        """Everything saved at `step`, placed like the abstract trees say (the EMA only `with_ema`)."""
        shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
        canonical_abstract = _canonical_abstract(self.spec, abstract_params, shardings)
        items = {
            "params": ocp.args.StandardRestore(canonical_abstract),
            "opt_state": ocp.args.StandardRestore(abstract_opt_state),
            "data": ocp.args.JsonRestore(),
            "meta": ocp.args.JsonRestore(),
        }
        if with_ema:
            if not (self.step_dir(step) / "ema").is_dir():
                raise UpcyclerError(
                    f"{self.step_dir(step)}: was saved without optimizer.ema, so there is no average to "
                    "continue; resume with optimizer.ema 0, or start a new run from this step"
                )
            items["ema"] = ocp.args.StandardRestore(canonical_abstract)
        with self._reading(step):
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        meta = checked_meta(out["meta"], self.step_dir(step), step)
        stack = jax.jit(from_canonical, static_argnums=1, out_shardings=shardings)
        ema = stack(out["ema"], self.spec) if with_ema else None
        return Restored(stack(out["params"], self.spec), out["opt_state"], dict(out["data"]), meta, ema)

    def restore_params(self, step: int, abstract_params: Params) -> Params:
        """The parameters saved at `step` alone, placed like `abstract_params`."""
        shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
        canonical_abstract = _canonical_abstract(self.spec, abstract_params, shardings)
        with self._reading(step):
            out = self._manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(canonical_abstract)))
        return jax.jit(from_canonical, static_argnums=1, out_shardings=shardings)(out["params"], self.spec)

    @contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """Turn whatever reading the step raises (Orbax's errors, tensorstore's bare `Exception`, the
        filesystem's) into one line naming the step directory and the fix (`read_failure`)."""
        try:
            yield
        except UpcyclerError:
            raise
        except Exception as err:  # noqa: BLE001  (tensorstore raises a bare Exception for a damaged array)
            _quiet_abandoned_reads()
            raise read_failure(self.step_dir(step), err) from None

    def delete(self, step: int) -> None:
        """Remove the checkpoint of `step` (collective, like a save)."""
        with self._writing():
            self._manager.delete(step)

    def committed(self) -> list[int]:
        """The steps saved and committed so far, oldest first (waits for a save in flight)."""
        with self._writing():
            self._manager.wait_until_finished()
        return sorted(self._manager.all_steps())

    def close(self) -> None:
        """Wait for the save in flight and finish the exports; after a failed save, only let go."""
        if self._failed:
            with suppress(Exception):  # the same failure, already reported
                self._manager.close()
            return
        with self._writing():
            self._manager.wait_until_finished()
            self._manager.close()
            self.export_committed()

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Turn a failed write under the body (a save, its commit, an export, a deletion) into one line
        naming the run_dir; `close` is quiet after it."""
        try:
            yield
        except UpcyclerError:
            self._failed = True
            raise
        except _storage_failures() as err:
            self._failed = True
            raise UpcyclerError(f"{self.run_dir}: writing a checkpoint failed ({_first_line(err)}); check that "
                                "run_dir can be written (credentials, permissions, quota, space, the network), "
                                "then run the same command again: it resumes from the last committed step") from None

    def export_committed(self) -> None:
        """On the primary process: add the manifest, tokenizer files and Hugging Face export (`hf_every`) to
        committed steps that lack them; raises what an export in the background raised."""
        self.raise_export_error()
        if jax.process_index() != 0:
            return
        for step_dir in committed_steps(self.run_dir).values():
            try:
                self._export(step_dir)
            except (FileNotFoundError, UpcyclerError):
                if step_dir.is_dir():
                    raise
                continue  # removed by keep-N while we looked or wrote

    def raise_export_error(self) -> None:
        """Raise (once) the error of an export that failed on the background thread."""
        error, self._export_error = self._export_error, None
        if error is not None:
            raise error

    def _export_in_background(self) -> None:
        with _lowest_priority():  # the steps' threads come first; the export takes what CPU they leave
            try:
                self.export_committed()
            except Exception as err:  # noqa: BLE001  (kept for the main thread: Orbax's thread would only log it)
                self._export_error = err

    def _export(self, step_dir: Path) -> None:
        if not (step_dir / "meta").is_dir():
            return
        if not (step_dir / MANIFEST).exists():
            self._add_manifest(step_dir)
        if self.hf_every and int(step_dir.name) % self.hf_every == 0 and not _exported(step_dir):
            export_hf(step_dir, self.hf_dtype)

    def _add_manifest(self, step_dir: Path) -> None:
        meta = json.loads(_meta_file(step_dir).read_text(encoding="utf-8"))
        for name in SIDE_FILES:  # each from the first of side_dirs that has it
            src = next((d / name for d in self.side_dirs if (d / name).is_file()), None)
            if src is not None:
                (step_dir / name).write_bytes(src.read_bytes())  # a local or a bucket step alike
        # no `files` or `tensors` digests: hashing every parameter byte at every checkpoint would cost more
        # than the save, and `read_checkpoint` does not need them
        write_manifest(step_dir, ModelSpec.from_json(json.dumps(meta["spec"])), meta["lineage"])


def techniques_meta(techniques: Sequence[Technique]) -> dict[str, Any]:
    """The techniques' entries of a checkpoint's meta, in the order of the list (each under its own keys)."""
    meta: dict[str, Any] = {}
    for technique in techniques:
        meta.update(technique.state())
    return meta


def restore_techniques(techniques: Sequence[Technique], meta: Mapping[str, Any], where: Path) -> None:
    """Give each technique back its entries of a checkpoint's meta (`checked_meta`; `where`: the checkpoint),
    each read through the protocol's checks (`MetaEntries`) against this run."""
    for technique in techniques:
        entries = {k: meta[k] for k in technique.meta_keys if k in meta}
        technique.restore(MetaEntries(entries, str(where), meta["step"]))


def restore_data(data: Any, state: Any, where: Path) -> None:
    """Put the data iterator `data` where the checkpoint `where` left it (`state`); its refusal of a state it
    cannot continue from is one line naming the checkpoint."""
    try:
        data.set_state(state)
    except UpcyclerError as err:
        raise UpcyclerError(f"{where}: {err}") from None


def checked_meta(meta: Any, where: Path, step: int) -> dict[str, Any]:
    """The meta read from the checkpoint `where` of `step`, its own entries checked (an object; its step;
    the spec an object; the lineage a non-empty list of steps): anything else is one line naming the
    checkpoint and the key. The techniques' entries are theirs to check (`restore_techniques`)."""
    if not isinstance(meta, dict):
        raise UpcyclerError(f"{where}: meta is not an object; the checkpoint is damaged or was not written by "
                            "this run; resume from an earlier step (remove this one)")
    entries = MetaEntries(meta, str(where), step)
    if meta.get("step") != step or isinstance(meta.get("step"), bool):
        raise entries.refuse("step", f"is not {step}, the step of its directory")
    if not isinstance(meta.get("spec"), dict):
        raise entries.refuse("spec", "is not a model spec (an object)")
    try:
        ModelSpec.from_json(json.dumps(meta["spec"]))
    except (UpcyclerError, TypeError, ValueError, KeyError, AttributeError) as err:
        raise entries.refuse("spec", f"is not a valid model spec ({_first_line(err)[:160]})") from None
    lineage = meta.get("lineage")
    if not isinstance(lineage, list) or not lineage or not all(isinstance(s, dict) for s in lineage):
        raise entries.refuse("lineage", "is not a non-empty list of lineage steps")
    return dict(meta)


def _quiet_abandoned_reads() -> None:
    """After a read failed: Orbax abandons the reads of the step's other arrays, and each, collected later
    (at the latest when the process exits), would print "Exception ignored in <coroutine …>" or asyncio's
    "exception was never retrieved" with a traceback after the one line that says what failed. From now
    on such reports are dropped; every other unraisable exception and asyncio message is reported."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_abandoned_reads", False):
        return
    logging.getLogger("asyncio").addFilter(lambda record: "exception was never retrieved" not in record.getMessage())

    def hook(unraisable: Any) -> None:
        if not inspect.iscoroutine(unraisable.object):
            previous(unraisable)

    hook.quiets_abandoned_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def read_failure(step_dir: Path, err: BaseException) -> UpcyclerError:
    """The one line for a step that cannot be read: a tree that does not match this model and optimiser
    (Orbax's own ValueError or KeyError) names the config to resume with; anything else (a file missing or
    damaged: tensorstore's errors, bare `Exception` included, or the filesystem's) names the step to remove."""
    cause = _innermost(err)
    damaged = not isinstance(err, (ValueError, KeyError)) or _STORE_STATUS.match(str(cause)) is not None
    if damaged:
        said = _first_line(cause).split(" [tensorstore_spec=")[0]  # not the store's whole spec
        return UpcyclerError(f"{step_dir}: cannot be read ({said}); the checkpoint is damaged or "
                             f"incomplete; resume from an earlier step (remove {step_dir})")
    return UpcyclerError(f"{step_dir}: cannot restore ({_first_line(err)}); the checkpoint does not match this "
                         "model and optimiser; resume with the config it was written with")


_STORE_STATUS = re.compile(r"(NOT_FOUND|FAILED_PRECONDITION|DATA_LOSS|OUT_OF_RANGE|UNKNOWN|INTERNAL|"
                           r"UNAVAILABLE|PERMISSION_DENIED|ABORTED|RESOURCE_EXHAUSTED): ")


def _innermost(err: BaseException) -> BaseException:
    """The first cause of `err` (what tensorstore said, under the exceptions Orbax wraps it in)."""
    seen = {id(err)}
    while (err.__cause__ or err.__context__) is not None and id(err.__cause__ or err.__context__) not in seen:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
        seen.add(id(err))
    return err


def lineage_step(config: TrainConfig, step: int, rewinds: Sequence[Mapping[str, Any]]) -> PretrainStep:
    """This run's lineage step as of step `step`: its data, optimiser, and the rewinds so far."""
    o = config.optimizer
    optimizer: dict[str, Any] = {"lr": o.lr, "schedule": [vars(p) for p in o.schedule]}
    if o.trainable != "all":
        optimizer["trainable"] = o.trainable
    if o.ema:
        optimizer["ema"] = o.ema
    details: dict[str, Any] = {"rewinds": list(rewinds)} if rewinds else {}
    if config.model.init_from_merge:
        details["init_from_merge"] = to_plain(config.model.init_from_merge)
    return pretrain_step(
        step, config.data.tokens_before(step),
        data={"sources": list(config.data.source_names), "phases": _phases(config)},
        optimizer=optimizer, **details,
    )


def _phases(config: TrainConfig) -> list[dict[str, Any]]:
    """The data phases as the lineage records them: their end and weights, and their shape when it is
    their own."""
    data, out = config.data, []
    for phase, (seq_len, batch) in zip(data.phases, data.shapes):
        entry = {"until_step": phase.until_step, "weights": dict(phase.weights)}
        if (seq_len, batch) != (data.seq_len, data.global_batch_size):
            entry.update(seq_len=seq_len, global_batch_size=batch)
        out.append(entry)
    return out


def _storage_failures() -> tuple[type[BaseException], ...]:
    """What a write of Orbax's storage raises when it fails: tensorstore's ValueError (the array data),
    gcsfs's refusals (the directories and small files, through epath; a local disk's OSError too)."""
    return ValueError, *refusals()


def _first_line(err: BaseException) -> str:
    """The first line of `err`'s message (its type when it has none), bounded."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


class _WithoutTracebacks(logging.Filter):
    """Drops the log records that carry a traceback: Orbax's threads log every failed write with one,
    and the failure reaches the trainer as well, which reports it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None


def _quiet_orbax_failures() -> None:
    """Keep Orbax's tracebacks off stderr (absl's logger; once per process), and those tensorstore's
    threads print when a failed save's other writes find their event loop closed
    (`orbax_write.quiet_failed_writes`); Orbax's other records stay."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _WithoutTracebacks) for f in absl.filters):
        absl.addFilter(_WithoutTracebacks())
    quiet_failed_writes()


@contextmanager
def _lowest_priority() -> Iterator[None]:
    """Run the body with the calling thread at the lowest CPU priority (nice 19) and restore it after,
    where the OS schedules threads alone (Linux); elsewhere nothing changes."""
    try:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        yield
        return
    try:
        yield
    finally:
        with suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, before)


class Restored(NamedTuple):
    """A checkpoint read back: parameters, optimiser state, data position, meta, and the EMA (or None)."""

    params: Params
    opt_state: Any
    data: dict
    meta: dict
    ema: Params | None


def export_hf(step_dir: Path, dtype: str, out: Path | None = None) -> Path:
    """Write `step_dir/hf/` (or `out`), the committed step as a Hugging Face checkpoint in `dtype`, staged:
    it appears only complete, and a write killed midway leaves only a hidden partial directory the next
    one removes. A step in a bucket goes through `bucket_export`."""
    if is_remote(step_dir):
        from upcycler.train.loop.bucket_export import export_step

        return export_step(step_dir, dtype, convert=export_hf)
    from upcycler.io import read_checkpoint, write_checkpoint
    from upcycler.io.manifest import convert_step
    from upcycler.tensors import parse_dtype

    ckpt = read_checkpoint(step_dir)
    # the bytes come from params/ (and the side files beside it), never from hf/
    ckpt = ckpt.replace(inputs=tuple(step_dir / PARAMS if p == step_dir else p for p in ckpt.inputs))
    cast = ckpt.cast(parse_dtype(dtype))
    ckpt = ckpt.with_step(convert_step("hf", ckpt.spec.family, dtype), ckpt.spec, cast.tensors)
    return write_checkpoint(ckpt, out or step_dir / HF_DIR, to="hf", progress=False)


def _canonical_abstract(spec: ModelSpec, abstract_params: Params, shardings: Params) -> Params:
    shard_tree = canonical_shardings(spec, shardings)
    out: Params = {}

    def add(info: ParamInfo, a: jax.ShapeDtypeStruct) -> None:
        shape = info.shape[1:] if info.stacked else info.shape
        for name in info.names:
            keys = name.split(".")
            _insert(out, keys, jax.ShapeDtypeStruct(shape, a.dtype, sharding=_lookup(shard_tree, keys)))

    jax.tree.map(add, declare_tree(spec), abstract_params, is_leaf=_is_info)
    return out


def _exported(step_dir: Path) -> bool:
    """Whether the step's HF export is there, complete (in a bucket: committed, `bucket_output`)."""
    if not is_remote(step_dir):
        return (step_dir / HF_DIR).exists()
    from upcycler.io.bucket_output import WRITING

    return (step_dir / HF_DIR / MANIFEST).exists() and not (step_dir / HF_DIR / WRITING).exists()


def _meta_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "meta").iterdir() if p.name != COMMIT_FILE and p.is_file()]
    if not files:
        raise FileNotFoundError(step_dir / "meta")
    return files[0]


def _insert(tree: Params, keys: Sequence[str], value: Any) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _lookup(tree: Params, keys: Sequence[str]) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


def _is_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)
