"""Before a run allocates its train state: the compiled step's memory per device against what a device has.

The trainer compiles its step for the shape of every data phase the run will still meet, from the train
state's shapes alone (`phases.CompiledSteps`: the very programs the run then executes, so nothing is
compiled twice), and reads each program's peak per device as `--compile-only` reports it
(`compiled_peak`). A run whose step needs more than a device has is refused in one line,
before a parameter is read or a buffer allocated, with the figure and what lowers it. What a device has:

- an accelerator: its allocator's limit (`memory_stats()["bytes_limit"]`);
- a CPU: the memory this host has available now (`MemAvailable`), shared by its local CPU devices (the
  fake devices of `--xla_force_host_platform_device_count` each need their own share).

A device that reports neither is not checked. Where the compiler itself refuses a step that cannot fit (a
TPU's, RESOURCE_EXHAUSTED), that is the same one-line refusal with the compiler's words.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.train.config import TrainConfig
from upcycler.train.reporting.goodput import RunClock
from upcycler.units import human_bytes


class StepTooLarge(UpcyclerError):
    """The run's step needs more memory per device than a device has (the message says both figures)."""


FIX = ("lower data.global_batch_size or data.seq_len, raise data.microbatches, set model.remat: full, or let "
       "`upcycle continued-pretrain --config … --compile-only --plan best.yaml` choose (on the target "
       "with --topology)")


def check_step_memory(config: TrainConfig, built: Any, steps: Any, start: int, clock: RunClock | None = None,
                      devices: Sequence[Any] | None = None) -> None:
    """Compile `built`'s step into `steps` for every batch shape met from step `start` on and raise
    `StepTooLarge` (one line) when one needs more memory per device than `devices` (default: this
    process's) have."""
    import jax

    from upcycler.train.loop.train_step import abstract_batch

    devices = list(devices if devices is not None else jax.local_devices())
    available = device_memory(devices)
    data = config.data
    shapes = dict.fromkeys(data.phase_shape(k) for k in range(data.phase_at(min(start, config.steps - 1)),
                                                                len(data.phases)))
    for seq_len, rows in shapes:
        batch = abstract_batch(rows, seq_len, built.mesh)
        try:
            steps.compile(built.layout.abstract, batch, clock)
        except jax.errors.JaxRuntimeError as err:  # an accelerator's compiler refuses what cannot fit
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            said = next((line.strip() for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line), "")
            raise StepTooLarge(f"the train step of {rows} rows × {seq_len:,} tokens does not fit a "
                               f"{devices[0].platform.upper()} device: the compiler ran out of memory "
                               f"({said[:300]}); {FIX}") from None
        peak = compiled_peak(steps.for_batch(batch))
        if available is not None and peak > available:
            where = devices[0].platform.upper()
            has = (f"this host has {human_bytes(available * len(devices))} available for its {len(devices)} CPU "
                   f"device(s), {human_bytes(available)} each" if devices[0].platform == "cpu"
                   else f"a {where} device has {human_bytes(available)}")
            raise StepTooLarge(f"the train step of {rows} rows × {seq_len:,} tokens needs {human_bytes(peak)} per "
                                f"device (compiled: parameters, optimiser state, activations) but {has}; {FIX}")


def compiled_peak(compiled) -> int:
    """The memory one device needs at the peak of the compiled program `compiled`: the compiler's own peak
    on an accelerator; on the CPU, whose compiler's peak leaves the temporaries out (53.6 MiB said for a
    step with 560 GiB of them), arguments + outputs − aliased + temporaries + code whenever its peak is
    below the arguments or the temporaries. An accelerator's temporaries may sum to more than its peak
    (buffers that are never live together: the reference MoE on v5e, 16.3 GB of temporaries under a
    12.5 GB peak, which the compiler, refusing what does not fit, compiles for a 15.75 GiB chip). The
    figure `--compile-only` reports as `memory.peak` (`upcycler.train.aot.compile_report`) and the trainer
    checks before allocating."""
    stats = compiled.memory_analysis()
    arguments, outputs = int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes)
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if _platform(compiled) == "cpu" and peak < max(arguments, int(stats.temp_size_in_bytes)):
        peak = arguments + outputs - int(stats.alias_size_in_bytes) + int(stats.temp_size_in_bytes) \
            + int(stats.generated_code_size_in_bytes)
    return peak


def _platform(compiled) -> str | None:
    """The platform `compiled` runs on (`cpu`, `tpu`, `gpu`), read from its input shardings."""
    import jax

    for sharding in jax.tree.leaves(compiled.input_shardings):
        return next(iter(sharding.device_set)).platform
    return None


def device_memory(devices: Sequence[Any]) -> int | None:
    """Bytes one of `devices` can hold: an accelerator's allocator limit, a CPU device's share of this
    host's available memory; None when neither is known."""
    if devices[0].platform == "cpu":
        available = _host_available()
        return None if available is None else available // len(devices)
    stats = devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def _host_available() -> int | None:
    """This host's available memory (`MemAvailable` of /proc/meminfo, else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
