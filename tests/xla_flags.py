"""XLA flags for the child processes tests start: fake CPU devices, and compiling fast where that is the cost.

`with_devices(N)` is the environment's `XLA_FLAGS` plus N host devices, so a flag the user set stays.

`FAST_COMPILE` (LLVM at optimisation level 0, XLA:CPU's classic fusion emitters) compiles a program about
4× faster and runs it up to 2× slower: the elementwise loops are no longer vectorised. It pays only where a
process compiles many small programs and runs each once or twice (`expert_parallel_checks.py`: 60
compiles of one MoE layer, 4 minutes of CPU at XLA's defaults, 1 with these flags); a training run of a
hundred steps or a real model's prefill runs slower with them, so they are not the suite's default. They
are used where programs are compiled and run a few times: the child processes of the few-step sharded and
multi-host training runs (`test_trainer_distributed.py`, `test_bucket_runs.py`, which compare them with
each other bit for bit and with the in-process run within fp32 rounding) and the train steps of
`test_memory_options.py` (`FAST_COMPILE_OPTIONS`, per program). Results move within float rounding (the
same matmul kernels run). XLA dropped its classic emitters, and the flag that chose them, in jaxlib 0.11.1:
an XLA that no longer knows the flag aborts on it in `XLA_FLAGS` and refuses it as a compiler option, so
from that release on `FAST_COMPILE` is the optimisation level alone (`CLASSIC_EMITTERS` False). That still
compiles `expert_parallel_checks.py` about 1.6× faster, but moves results further than rounding allows a
comparison with an in-process run at XLA's defaults: the sharded training runs of
`test_trainer_distributed.py` then compile at the defaults.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import version

# whether the installed XLA still has `xla_cpu_use_fusion_emitters` (jaxlib before 0.11.1); read from the
# package metadata, since `XLA_FLAGS` is set before JAX is imported and an unknown flag aborts
CLASSIC_EMITTERS = tuple(int(n) for n in re.findall(r"\d+", version("jaxlib"))[:3]) < (0, 11, 1)

FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}
if CLASSIC_EMITTERS:
    FAST_COMPILE_OPTIONS["xla_cpu_use_fusion_emitters"] = False
# as XLA_FLAGS for a process about to start its backend; the options above go to one program of a process
# whose backend has started (`jax.jit(f, compiler_options=FAST_COMPILE_OPTIONS)`)
FAST_COMPILE = " ".join(f"--{name}={str(value).lower()}" for name, value in FAST_COMPILE_OPTIONS.items())


def with_devices(devices: int, *, fast_compile: bool = False) -> str:
    """XLA_FLAGS for a child process that sees `devices` CPU devices (with `fast_compile`, `FAST_COMPILE`)."""
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
    if fast_compile:
        flags.insert(0, FAST_COMPILE)
    return " ".join(f for f in flags if f)
