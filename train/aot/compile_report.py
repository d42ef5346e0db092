"""What one device needs for one train step, and whether it fits: the compile-only report.

Memory per device comes from two places, shown side by side:
- analytic, from the `ModelSpec` and the sharding rules alone: float32 parameters, the Adam state, float32
  gradients and the batch, each the size of this device's shard (`NamedSharding.shard_shape`);
- compiled, from XLA's memory analysis of the compiled step: arguments, outputs, temporaries (which hold
  the gradients, the activations kept for the backward pass and the gathered weights) and the peak.
The step fits when the compiled peak is within the device's HBM budget (the chip's usable HBM from
`hardware`, or a budget given by the user). FLOPs are analytic (`upcycler.train.reporting.flops.flops_per_token`:
6 · active matmul parameters + causal attention, per token), never the compiler's count; the executed
FLOPs add what the memory options recompute and, read from the program, what grouped-matmul kernels
multiply twice where a row tile straddles two experts (`hbm_traffic.grouped_matmul_waste`). Collective
traffic (`collectives`) and HBM traffic (`hbm_traffic`, Pallas kernels charged at least their own cost
estimates) are read from the compiled HLO, every loop counted by its trip count, and `roofline` turns
FLOPs and the two traffics into a step-time and MFU bound; the report lists the largest sources of HBM
traffic by line of code and kernel, per layer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import numpy as np

from upcycler.hardware import Chip
from upcycler.spec import ModelSpec
from upcycler.train.aot import collectives, hbm_traffic, roofline, save_time
from upcycler.train.config import LossConfig, ModelConfig, TrainConfig
from upcycler.train.loop.memory_check import compiled_peak
from upcycler.train.loop.train_step import program_fingerprint
from upcycler.train.model import remat
from upcycler.train.model.gmm_megablox import scoped_vmem_of
from upcycler.train.reporting.flops import flops_per_token, matmul_params
from upcycler.units import human_count

GIB = 1 << 30
SOURCES_KEPT = 12  # the largest HBM traffic sources a report lists
# the sources that belong to the routed experts' layer (`hbm_traffic.breakdown` names): its code and kernels
MOE_SOURCES = ("model/moe.py", "model/gmm", "model/expert_parallel.py", "model/comm.py", "kernel gmm ",
               "kernel tgmm ")
_CUTS = ("options that cut memory: model.remat full, loss.ce_chunk, model.weights_dtype bfloat16, "
         "model.attention dot_product, data.microbatches, mesh.context (a long sequence split over chips)")


@dataclass(frozen=True)
class Memory:
    """Bytes per device. Analytic: params, optimizer, gradients, batch. Compiled (None when the compile
    failed): arguments, outputs, aliased (outputs reusing donated arguments), temporaries, code, and the
    peak the step needs (the TPU compiler's own figure; on CPU, which leaves the arguments out of it, the
    sum of the buffers)."""

    params: int
    optimizer: int
    gradients: int
    batch: int
    arguments: int | None = None
    outputs: int | None = None
    aliased: int | None = None
    temporaries: int | None = None
    code: int | None = None
    peak: int | None = None

    @property
    def working(self) -> int | None:
        """What the step needs at its peak beyond its inputs and new state: gradients, activations kept for
        the backward pass, gathered weights, work buffers."""
        if self.peak is None:
            return None
        return max(self.peak - self.arguments - (self.outputs - self.aliased), 0)

    def largest(self) -> list[tuple[str, int]]:
        """The categories by size, largest first."""
        items = {"optimizer state": self.optimizer, "parameters": self.params, "batch": self.batch}
        if self.working is not None:
            items["gradients, activations and work buffers"] = self.working
        return sorted(items.items(), key=lambda kv: -kv[1])


@dataclass(frozen=True)
class Report:
    """The compile-only report of one train step on one target (see the module docstring)."""

    target: str
    devices: int
    device_kind: str
    chip: str | None
    mesh: dict[str, int]
    model: dict[str, Any]
    options: dict[str, Any]
    memory: Memory
    budget: int | None
    fits: bool | None
    failure: str | None
    flops: dict[str, float]
    collectives: dict[str, dict[str, float]]
    unknown_loops: tuple[str, ...]
    roofline: dict[str, Any] | None
    compile_seconds: float
    notes: list[str] = field(default_factory=list)
    save: save_time.SaveBound | None = None  # the checkpoint save's lower bound on this target
    slices: int = 1  # TPU slices joined by the data-center network (`dcn_traffic_bytes` of each kind crosses it)
    traffic_sources: list[dict[str, Any]] = field(default_factory=list)  # the largest HBM sources, per layer
    moe_layer_bytes: float | None = None  # HBM traffic of one routed-expert layer (`MOE_SOURCES`), per chip
    program: str | None = None  # `train_step.program_fingerprint` of what was compiled (None: out of memory)

    @property
    def margin(self) -> int | None:
        """HBM left over at the peak (negative: missing); None without a budget or a compiled peak."""
        if self.budget is None or self.memory.peak is None:
            return None
        return self.budget - self.memory.peak

    def context_that_fits(self) -> int | None:
        """When the step does not fit: the smallest larger context degree (`mesh.context`) at which it
        would, estimated from this compile — the activations and work buffers split with the sequence,
        the state does not (context parallelism splits parameters as FSDP already does) — among the
        degrees that divide the devices and cut the sequence into 2 × degree chunks of whole 128-token
        tiles. None when it fits, when there is no figure, or when no degree would."""
        m, context = self.memory, self.mesh.get("context", 1)
        if self.fits is not False or self.budget is None or m.working is None:
            return None
        room = self.budget - (m.peak - m.working)
        for degree in (2 ** k for k in range(1, 11)):
            if degree > context and self.devices % degree == 0 and self.options["seq_len"] % (256 * degree) == 0 \
                    and room > 0 and m.working * context / degree <= room:
                return degree
        return None

    def to_json(self) -> str:
        out = asdict(self)
        out["memory"]["working"] = self.memory.working
        out["margin"] = self.margin
        out["context_that_fits"] = self.context_that_fits()
        if self.save is not None:
            out["save"].update(fits_notice=self.save.fits_notice, fits_maintenance=self.save.fits_maintenance)
        return json.dumps(out, sort_keys=False)

    def to_text(self) -> str:
        return "\n".join(_text_lines(self))


def build(config: TrainConfig, spec: ModelSpec, mesh, layout, batch, compiled, *, target_name: str,
          chip: Chip | None, budget: int | None, compile_seconds: float, failure: str | None,
          save_bandwidth: float = save_time.DEFAULT_HOST_BANDWIDTH) -> Report:
    """The report of `compiled` (None when the compile ran out of memory: `failure` says how); the save
    bound assumes `save_bandwidth` bytes/s written per host."""
    devices = mesh.devices.size
    memory = _memory(layout, batch, compiled)
    peak = memory.peak
    fits = False if failure else (None if budget is None or peak is None else peak <= budget)
    tokens = config.data.global_batch_size * config.data.seq_len
    model_flops = flops_per_token(spec, config.data.seq_len) * tokens
    executed = executed_flops_per_token(spec, config.data.seq_len, config.model.run_config(), config.loss) * tokens
    flops = {"per_token": model_flops / tokens, "per_step": model_flops, "per_device": model_flops / devices,
             "executed_per_device": executed / devices}
    traffic = collectives.collective_traffic(compiled.as_text()) if compiled is not None else None
    kinds = {k: asdict(v) for k, v in traffic.kinds.items()} if traffic else {}
    notes = []
    line = None
    sources: list[dict[str, Any]] = []
    moe_bytes = None
    if compiled is not None and chip is not None:
        text = compiled.as_text()
        rows = hbm_traffic.breakdown(text)
        hbm_bytes = float(sum(row.bytes for row in rows))
        flops["compiled_matmul_per_device"] = hbm_traffic.matmul_flops(text)  # the program's own count
        # what grouped-matmul kernels compute twice at group boundaries: executed, so charged to the bound
        waste = flops["grouped_matmul_waste_per_device"] = hbm_traffic.grouped_matmul_waste(text)
        flops["executed_per_device"] += waste
        if waste:
            notes.append(f"grouped matmuls multiply {waste / 1e12:.2f} TFLOP per chip beyond the model's work: "
                         "a row tile that holds rows of several experts is multiplied once per expert "
                         "(charged to the compute bound)")
        sources = [{"source": row.name, "bytes_per_layer": row.bytes / spec.num_layers, "bytes": row.bytes,
                    "executions": row.executions, "kernel_estimate_bytes": row.kernel_estimate}
                   for row in rows[:SOURCES_KEPT]]
        counted_once = _bytes_accessed(compiled)
        if counted_once is not None and counted_once < 0.9 * hbm_bytes:
            notes.append(f"HBM traffic {_gib(hbm_bytes)} per chip with every loop counted by its trip count; "
                         f"the compiler's own figure counts each loop body once ({_gib(counted_once)})")
        moe_layers = len(spec.moe_layers)
        moe_bytes = sum(row.bytes for row in rows if row.name.startswith(MOE_SOURCES)) / moe_layers \
            if moe_layers else None
        beyond = sum(row.kernel_estimate for row in rows)
        if beyond:
            notes.append(f"kernels are charged their own cost estimates: {_gib(beyond)} of the HBM traffic is what "
                         f"they re-read beyond their operands (tiles chosen for {scoped_vmem_of(chip) >> 20} MiB "
                         "of scoped VMEM)")
        line = asdict(roofline.estimate(model_flops / devices, flops["executed_per_device"], hbm_bytes,
                                        traffic.traffic_bytes, chip))
    return Report(
        target=target_name, devices=devices, device_kind=mesh.devices.flat[0].device_kind,
        chip=chip.name if chip else None, mesh=dict(mesh.shape),
        model={"family": spec.family, "total_params": spec.total_params(), "active_params": spec.active_params(),
               "layers": spec.num_layers, "experts": spec.moe.num_experts if spec.moe else 0,
               "top_k": spec.moe.top_k if spec.moe else 0, "vocab": spec.vocab_size},
        options={"seq_len": config.data.seq_len, "global_batch_size": config.data.global_batch_size,
                 "microbatches": config.data.microbatches, "ce_chunk": config.loss.ce_chunk,
                 **asdict(config.model.run_config())},
        memory=memory, budget=budget, fits=fits, failure=failure, flops=flops, collectives=kinds,
        unknown_loops=traffic.unknown_loops if traffic else (), roofline=line,
        compile_seconds=compile_seconds, notes=notes,
        save=save_time.save_bound((layout.abstract.params, layout.abstract.opt_state, layout.abstract.ema),
                                  mesh.devices, save_bandwidth),
        slices=len({getattr(d, "slice_index", 0) for d in mesh.devices.flat}),
        traffic_sources=sources, moe_layer_bytes=moe_bytes,
        program=program_fingerprint(compiled) if compiled is not None else None,
    )


def executed_flops_per_token(spec: ModelSpec, seq_len: int, cfg: ModelConfig, loss: LossConfig) -> float:
    """Model FLOPs per token plus the forward work the memory options do again in the backward pass: the
    parts of each layer the remat policy recomputes (`remat.RECOMPUTED`), chunked attention its attention
    once more, chunked cross-entropy the logits."""
    head = spec.vocab_size * spec.hidden_size
    attention_forward = 2 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len
    D, h = spec.hidden_size, spec.head_dim
    parts = {"projections": 2 * spec.num_layers * D * (spec.num_heads + 2 * spec.num_kv_heads) * h,
             "attention": attention_forward, "out_projection": 2 * spec.num_layers * spec.num_heads * h * D}
    parts["ffn"] = 2 * (matmul_params(spec) - head) - parts["projections"] - parts["out_projection"]
    extra = sum(share * parts[part] for part, share in remat.RECOMPUTED[cfg.remat].items())
    if cfg.attention == "chunked":
        extra += attention_forward
    if loss.ce_chunk:
        extra += 2 * head
    return flops_per_token(spec, seq_len) + extra


def shard_bytes(tree: Any) -> int:
    """Bytes of this device's shard of every `jax.ShapeDtypeStruct` leaf (laid out by its sharding)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def _memory(layout, batch, compiled) -> Memory:
    params = shard_bytes(layout.abstract.params)
    optimizer = shard_bytes((layout.abstract.opt_state, layout.abstract.ema))  # the weights' EMA, when kept
    analytic = {"params": params, "optimizer": optimizer, "gradients": params,
                "batch": shard_bytes(batch)}
    if compiled is None:
        return Memory(**analytic)
    stats = compiled.memory_analysis()
    arguments, outputs = int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes)
    aliased, temporaries = int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)
    code = int(stats.generated_code_size_in_bytes)
    return Memory(**analytic, arguments=arguments, outputs=outputs, aliased=aliased, temporaries=temporaries,
                  code=code, peak=compiled_peak(compiled))


def _bytes_accessed(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends have no cost model  # noqa: BLE001
        return None
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    value = (cost or {}).get("bytes accessed")
    return float(value) if value is not None else None


def _gib(n: float | None) -> str:
    """Bytes in binary units, three significant figures ("15.8 GiB", "412 MiB")."""
    if n is None:
        return "—"
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _text_lines(r: Report) -> list[str]:
    m = r.memory
    model = r.model
    moe = f", {model['experts']} experts top-{model['top_k']}" if model["experts"] else ""
    lines = [
        (f"model    {model['family']}, {human_count(model['total_params'])} parameters "
         f"({human_count(model['active_params'])} active){moe}, {model['layers']} layers"),
        (f"target   {r.target}: {r.devices} × {r.device_kind}; mesh "
         + " × ".join(f"{k}={v}" for k, v in r.mesh.items())),
        (f"step     {r.options['global_batch_size']} × {r.options['seq_len']} tokens, microbatches "
         f"{r.options['microbatches']}, remat {r.options['remat']}, compute {r.options['compute_dtype']}, "
         f"weights {r.options['weights_dtype']}, attention {r.options['attention']}, ce_chunk "
         f"{r.options['ce_chunk']}, gmm {r.options['gmm_backend']}; compiled in {r.compile_seconds:.1f} s"),
        "memory per device:",
        f"  parameters (fp32)          {_gib(m.params)}",
        f"  optimizer state            {_gib(m.optimizer)}",
        f"  batch                      {_gib(m.batch)}",
        f"  gradients, activations …   {_gib(m.working)}   (of which fp32 gradients {_gib(m.gradients)})",
        (f"  compiled: arguments {_gib(m.arguments)}, temporaries {_gib(m.temporaries)}, "
         f"outputs {_gib(m.outputs)} ({_gib(m.aliased)} reusing arguments), peak {_gib(m.peak)}"),
    ]
    largest = ", ".join(f"{name} {_gib(size)}" for name, size in m.largest()[:3])
    if r.failure:
        state = f"optimizer state {_gib(m.optimizer)}, parameters {_gib(m.params)}"
        lines.append(f"fit      does not fit: the compiler ran out of memory ({r.failure}); state per device: "
                     f"{state}; {_CUTS}")
    elif r.fits is None:
        lines.append("fit      no HBM figure for this device; pass --hbm-budget SIZE to check the fit")
    elif r.fits:
        lines.append(f"fit      fits: peak {_gib(m.peak)} of {_gib(r.budget)} ({_gib(r.margin)} to spare)")
    else:
        degree = r.context_that_fits()
        split = (f"; mesh.context {degree} would fit, estimated with the activations split over the sequence "
                 "(--plan compiles it)" if degree else "")
        lines.append(f"fit      does not fit: peak {_gib(m.peak)} of {_gib(r.budget)} "
                     f"({_gib(-r.margin)} over); largest: {largest}; {_CUTS}{split}")
    f = r.flops
    lines.append(f"flops    {f['per_token'] / 1e9:.2f} GFLOP/token, {f['per_step'] / 1e15:.2f} PFLOP/step, "
                 f"{f['per_device'] / 1e12:.2f} TFLOP/device (executed {f['executed_per_device'] / 1e12:.2f}"
                 + (f"; the compiled program's matmuls and kernels {f['compiled_matmul_per_device'] / 1e12:.2f}"
                    if "compiled_matmul_per_device" in f else "") + ")")
    for kind, t in r.collectives.items():
        if t["executions"]:
            dcn = f", {_gib(t['dcn_traffic_bytes'])} of it over DCN" if r.slices > 1 else ""
            lines.append(f"  {kind:<19} {t['ops']:>4} ops, {t['executions']:>6} runs, "
                         f"{_gib(t['traffic_bytes'])} received per device{dcn}")
    if r.slices > 1:
        dcn_total = sum(t["dcn_traffic_bytes"] for t in r.collectives.values())
        lines.append(f"dcn      {_gib(dcn_total)} per device per step crosses the data-center network between the "
                     f"{r.slices} slices (the rest stays on each slice's ICI)")
    if r.unknown_loops:
        lines.append(f"  ({len(r.unknown_loops)} loop(s) with collectives have unknown trip counts, counted once)")
    if r.roofline:
        rl = r.roofline
        lines.append(f"roofline compute {rl['compute_s']:.3f} s, memory {rl['memory_s']:.3f} s, communication "
                     f"{rl['communication_s']:.3f} s → step ≥ {rl['step_s']:.3f} s ({rl['bound']}-bound), "
                     f"MFU ≤ {rl['mfu']:.1%} on {rl['chip']}")
    if r.traffic_sources:
        moe = f"; one MoE layer's code and kernels {_gib(r.moe_layer_bytes)}" if r.moe_layer_bytes else ""
        lines.append(f"hbm      largest sources, per layer (of {r.model['layers']}){moe}:")
        lines.extend(f"  {_gib(row['bytes_per_layer']):>10}  {row['source']}" for row in r.traffic_sources[:6])
    if r.save is not None:
        lines.append(save_time.describe(r.save))
    lines.extend(f"note     {n}" for n in r.notes)
    return lines
