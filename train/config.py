"""The training config of `upcycle continued-pretrain`: frozen dataclasses, parsed and checked from YAML.

Schema (every section but `model` and `data` is optional; defaults shown):

    run_dir: runs/cpt                  # checkpoints (RUN_DIR/<step>/), metrics.jsonl, config.yaml
    steps: 1000                        # train until this absolute step
    model:
      init: ckpt/                      # HF or Orbax checkpoint to start from (an upcycled MoE, say)
      tokenizer: null                  # tokenizer.json or its directory; default: init/tokenizer.json
      init_from_merge: null            # {sources: [RUN], last: 3, method: sma}: start from an average of a run's steps
      compute_dtype: float32           # float32 | bfloat16 (master weights are always float32)
      weights_dtype: float32           # dtype the forward reads the weights in (bfloat16: half the FSDP traffic)
      attention: einsum                # einsum | dot_product | chunked (query blocks of attention_chunk) | splash (TPU)
      attention_chunk: 512
      context_exchange: gather         # gather | ring: a split sequence's keys and values (splash, mesh.context > 1)
      moe_impl: dropless               # dropless | reference (one-hot)
      gmm_backend: auto                # auto | tiled | ragged_dot | megablox | mosaic_gpu | tokamax (the dropless expert matmul)
      moe_dispatch: gspmd              # gspmd | all_to_all | all_gather (expert parallelism on mesh.expert)
      comm_dtype: fp32                 # fp32 | bf16 | fp8: the expert combine's collectives
      moe_chunks: 1                    # all_gather dispatch: token chunks through the experts (less memory)
      grad_comm_dtype: native          # native | fp32 | bf16: the expert weights' gradient reduce-scatter
      remat: none                      # none | dots | attention | full | ... (what the backward recomputes)
    data: {...}                        # see upcycler.train.data.config (phases may set seq_len and batch)
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
      trainable: all                   # all | new_layers | a regex over canonical tensor names
      ema: 0.0                         # decay of the weights' moving average saved with checkpoints (0: off)
    loss:
      lb_coef: 0.01
      z_coef: 0.001
      z_coef_ramp: 0                   # steps over which the z-loss weight rises to z_coef (0: constant)
      ce_chunk: 0                      # positions per logits block (0: all)
      bias_update_rate: 0.0            # aux-loss-free balancing of the selection bias (0: off)
      bias_update: on                  # on | frozen (keep an inherited bias as it is)
      spike: null                      # {factor: 3.0, window: 20, action: stop | rewind, average: 3}
    mesh: {data: 1, fsdp: -1, expert: 1}   # -1: all remaining devices
    distributed: {coordinator: null, num_processes: null, process_id: null, heartbeat_timeout: 100}
    checkpoint: {every: 100, keep: 3, async: true, hf_every: 0, hf_dtype: bfloat16}
    metrics:
      writers: [jsonl, tensorboard]    # + wandb; jsonl is always written (report and resume read it)
      wandb: {project: upcycler, entity: null, name: null, mode: null}   # mode: online | offline | disabled
      peak_flops: null                 # MFU's per-device peak; default: the chip table, or measured on a CPU
      expert_load_every: 100           # expert load, usage by source and health: window sums, this often
      progress: true
      dead_below: 0.1
      stop_on_collapse: false
    eval: null                         # {every: 100, batches: 4, sources: [web.heldout, …], dir: null, seq_len: data}
    profile: null                      # {start_step: 10, steps: 3}: RUN_DIR/tensorboard/plugins/profile/

Each option is declared once, as a field below (type, default, choices, range, help); the YAML reader
(`upcycler.schema.from_mapping`) and the `continued-pretrain` flags are derived from those fields.
Everything here is checked without touching the disk or the devices (`load_config`); what needs them
(files, tokenizer, device count) is checked by `upcycler.train.loop.preflight.prepare` before anything runs.
The file and every `--set` value are parsed by `upcycler.untrusted` (size-capped, aliases and nesting
bounded); every value is checked for its exact type and range (an integer option takes no bool, float
or string; a float option takes no NaN or infinity), and `check` adds what involves several options,
so any document yields a `TrainConfig` or one `UpcyclerError` line naming the file and the option.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.locations import Location
from upcycler.schema import Range, field, from_mapping, to_plain
from upcycler.train.data.config import MAX_STEP, DataConfig
from upcycler.untrusted import describe, escape, load_yaml, parse_yaml, shown_path

SCHEDULE_KINDS = ("warmup", "constant", "cosine", "linear")
COMPUTE_DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("einsum", "dot_product", "chunked", "splash", "flexprefill")
TRAINING_ATTENTION = ATTENTION_IMPLS[:4]  # flexprefill is a prefill for evaluation
CONTEXT_EXCHANGES = ("gather", "ring")  # how a split sequence's keys and values reach every query (splash)
# `upcycler.train.model.remat`, most memory first
REMAT_POLICIES = ("none", "dots", "all_but_ffn_hidden", "attention_and_ffn_input", "attention", "qkv",
                  "offload_attention", "offload_attention_and_ffn_input", "full")
MOE_IMPLS = ("dropless", "reference")
GMM_BACKENDS = ("auto", "tiled", "ragged_dot", "megablox", "mosaic_gpu", "tokamax")  # the grouped-matmul kernels of `upcycler.train.model.gmm`
MOE_DISPATCHES = ("gspmd", "all_to_all", "all_gather")  # `upcycler.train.model.expert_parallel`
COMM_DTYPES = ("fp32", "bf16", "fp8")  # payloads of the compressed collectives, `upcycler.train.model.comm`
GRAD_COMM_DTYPES = ("native", "fp32", "bf16")
HF_DTYPES = ("bfloat16", "float16", "float32")
MAX_DEVICES = 1 << 20
_FIX = "fix the config (or the flag that sets it)"
_STEPS = Range(1, MAX_STEP)
_NON_NEGATIVE = Range(0, None)

RESUME_MODES = ("auto", "always", "never")  # `continued-pretrain --resume`: see loop.preflight.resumes


AVERAGING_METHODS = ("sma", "ema", "wma", "minus-sqrt")  # `upcycle merge`'s averages of a run's steps


@dataclass(frozen=True)
class InitMergeConfig:
    """`model.init_from_merge`: the checkpoints a run starts from the average of, chosen as `upcycle merge`
    chooses a run's steps (`upcycler.train.techniques.init_merge`)."""

    sources: tuple[str, ...] = field(help="Run directories (their committed steps) or checkpoints to average.")
    last: int | None = field(None, range=Range(1, 1 << 20), help="Only the newest this many steps.")
    every: int | None = field(None, range=Range(1, MAX_STEP), help="Only the steps that are multiples of this.")
    until: int | None = field(None, range=Range(0, MAX_STEP), help="Only the steps up to this one.")
    method: str = field("sma", choices=AVERAGING_METHODS,
                        help="sma (equal weights), ema (--alpha), wma (linear in the step) or minus-sqrt.")
    alpha: float | None = field(None, range=Range(0, 1, lo_open=True),
                                help="ema: the weight of the newest step (1 − decay).")


@dataclass(frozen=True)
class ModelConfig:
    """How to run a model: compute dtype, implementations, rematerialisation (not the architecture, which
    the checkpoint's `ModelSpec` decides). Hashable: it is a static argument of the jitted forward."""

    compute_dtype: str = field("float32", choices=COMPUTE_DTYPES,
                               help="Compute dtype; master weights stay float32.")
    weights_dtype: str = field("float32", choices=COMPUTE_DTYPES,
                               help="dtype the forward reads the weights in, cast once per step before FSDP "
                                    "gathers them (the router stays float32); the optimiser keeps float32 "
                                    "master weights.")
    attention: str = field("einsum", choices=ATTENTION_IMPLS,
                           help="einsum (explicit, exact), dot_product (jax.nn.dot_product_attention) or "
                                "chunked (einsum over blocks of attention_chunk queries, recomputed in the "
                                "backward pass: scores of one block at a time), splash (JAX's Pallas TPU flash "
                                "attention: the scores stay on chip; sequence a multiple of 128; off TPU it runs "
                                "interpreted, for tests), or flexprefill (prefill only, "
                                "`upcycle eval`: per prompt and head, the key blocks that hold γ of the attention).")
    attention_chunk: int = field(512, range=Range(1, 1 << 22), help="Queries per block of chunked attention.")
    context_exchange: str = field("gather", choices=CONTEXT_EXCHANGES,
                                  help="How a sequence split over mesh.context reaches every query under splash "
                                       "attention: gather (every device gathers the whole sequence's keys and "
                                       "values, then attends) or ring (the keys and values pass around the "
                                       "context devices a block at a time, each transfer overlapping the "
                                       "kernels of the block before; no device holds the whole sequence's).")
    moe_impl: str = field("dropless", choices=MOE_IMPLS,
                          help="dropless (sort, then grouped matmul) or reference (one-hot, for tests).")
    gmm_backend: str = field("auto", choices=GMM_BACKENDS,
                             help="Grouped matmul of the dropless MoE: auto (on TPU tokamax where installed, else megablox; tiled "
                                  "on CPU and GPU), tiled, ragged_dot, megablox (Pallas TPU), mosaic_gpu (Pallas, "
                                  "NVIDIA Hopper, 16-bit) or tokamax (its TPU kernels; JAX >= 0.11.1).")
    moe_dispatch: str = field("gspmd", choices=MOE_DISPATCHES,
                              help="How tokens reach their experts: gspmd (every device gathers all experts' "
                                   "weights and runs its own tokens), all_to_all (tokens sent to the device of "
                                   "the `expert` mesh axis that holds their expert, and back) or all_gather "
                                   "(tokens gathered over the `expert` axis, results reduce-scattered back).")
    comm_dtype: str = field("fp32", choices=COMM_DTYPES,
                            help="Payload of the collectives that carry the expert combine and its gradients "
                                 "(all_to_all and all_gather dispatch): fp32 (no rounding beyond the compute "
                                 "dtype), bf16, or fp8 e4m3 with a float32 scale per row; always summed in "
                                 "float32 after the exchange.")
    moe_chunks: int = field(1, range=Range(1, 1 << 16),
                            help="all_gather dispatch: the gathered tokens go through the local experts in "
                                 "this many chunks, each recomputed in the backward pass: dropless buffers "
                                 "1/chunks the size for one more forward pass of the experts.")
    grad_comm_dtype: str = field("native", choices=GRAD_COMM_DTYPES,
                                 help="The reduce-scatter of the expert weights' gradients over the axes they "
                                      "are split on: native (the compiler's, in the gradient's dtype: a running "
                                      "bf16 sum for bf16 weights), fp32, or bf16 sent by all-to-all and summed "
                                      "in float32.")
    remat: str = field("none", choices=REMAT_POLICIES,
                       help="Activations the backward pass recomputes: none (all kept), dots (matmul "
                            "outputs kept), all_but_ffn_hidden (the FFN's gate/up outputs recomputed), "
                            "attention_and_ffn_input (the FFN recomputed), attention (all but the attention "
                            "recomputed), qkv (q, k, v kept), full (each layer's input kept, the rest "
                            "recomputed); offload_attention and offload_attention_and_ffn_input keep those "
                            "sets in host memory.")


@dataclass(frozen=True, kw_only=True)
class ModelSection(ModelConfig):
    """`model:`: the checkpoint to start from, its tokenizer, and how to run it (every `ModelConfig` option)."""

    # the attentions a train step runs (`upcycle eval --attention flexprefill` is a prefill, not one of them)
    attention: str = field("einsum", choices=TRAINING_ATTENTION,
                           help="einsum (explicit, exact), dot_product (jax.nn.dot_product_attention), chunked "
                                "(einsum over blocks of attention_chunk queries, recomputed in the backward pass: "
                                "scores of one block at a time) or splash (JAX's Pallas TPU flash attention: the "
                                "scores stay on chip; sequence a multiple of 128; off TPU it runs interpreted, "
                                "for tests).")
    init: Location = field(help="The checkpoint to start from (HF or Orbax; a path or gs:// URL).")
    tokenizer: Location | None = field(None, help="tokenizer.json or its directory (default: "
                                                  "init/tokenizer.json).")
    init_from_merge: InitMergeConfig | None = field(
        None, help="Start from an average of checkpoints instead of model.init's weights (model.init still gives "
                   "the architecture), e.g. {sources: [runs/a], last: 3, method: sma}.")

    def run_config(self) -> ModelConfig:
        """The `ModelConfig` part alone: what the jitted forward is specialised on."""
        return ModelConfig(**{f.name: getattr(self, f.name) for f in fields(ModelConfig)})


@dataclass(frozen=True)
class SchedulePhase:
    """One piece of the learning-rate schedule, ending at `until_step` with learning rate `lr`."""

    kind: str = field(choices=SCHEDULE_KINDS, help="How the learning rate moves within the phase.")
    until_step: int = field(range=_STEPS, help="The absolute step the phase ends at.")
    lr: float | None = field(None, range=_NON_NEGATIVE, help="Learning rate at the end (default: the peak).")


@dataclass(frozen=True)
class OptimizerConfig:
    """`optimizer`: AdamW (decoupled weight decay, global-norm clipping), its learning-rate schedule by
    phase, what it trains, and a moving average of the weights."""

    lr: float = field(3e-4, range=_NON_NEGATIVE, help="Peak learning rate.")
    b1: float = field(0.9, range=Range(0, 1, hi_open=True), help="Adam b1.")
    b2: float = field(0.95, range=Range(0, 1, hi_open=True), help="Adam b2.")
    eps: float = field(1e-8, range=_NON_NEGATIVE, help="Adam epsilon.")
    weight_decay: float = field(0.1, range=_NON_NEGATIVE, help="Decoupled weight decay, on matrices only.")
    clip_norm: float = field(1.0, range=_NON_NEGATIVE, help="Global-norm clipping (0: off).")
    schedule: tuple[SchedulePhase, ...] = field((), help="Phases in absolute steps (empty: constant lr).")
    trainable: str = field("all", metavar="all|new_layers|REGEX",
                           help="What the optimiser changes: all; new_layers (the blocks every depth growth "
                                "in the checkpoint's lineage inserted); or a regular expression searched "
                                "in canonical tensor names (e.g. 'experts|router'). Frozen tensors keep their "
                                "bytes and have no optimiser state.")
    ema: float = field(0.0, range=Range(0, 1, hi_open=True),
                       help="Decay of an exponential moving average of the weights kept during training and "
                            "saved with each checkpoint (0: off); `upcycle convert RUN/<step> --weights ema` "
                            "exports it.")


SPIKE_ACTIONS = ("stop", "rewind")
BIAS_UPDATES = ("on", "frozen")


@dataclass(frozen=True)
class SpikeConfig:
    """`loss.spike`: a step whose loss exceeds `factor` × the median of the previous `window` steps."""

    factor: float = field(3.0, range=Range(1, None, lo_open=True),
                          help="A loss above this multiple of the recent median is a spike.")
    window: int = field(20, range=Range(1, 1 << 20), help="Steps whose median loss a step is compared with.")
    action: str = field("stop", choices=SPIKE_ACTIONS,
                        help="stop: end the run naming the last good checkpoints; rewind: continue from the "
                             "average of the last `average` good checkpoints (and their optimiser state).")
    average: int = field(3, range=Range(1, 1 << 10), help="How many good checkpoints a rewind averages.")


@dataclass(frozen=True)
class LossConfig:
    """`loss`: what is added to the cross-entropy (load balancing, router z-loss), how the cross-entropy
    is chunked, the selection bias's updates and the loss-spike guard."""

    lb_coef: float = field(0.01, range=_NON_NEGATIVE, help="Weight of the load-balancing loss.")
    z_coef: float = field(0.001, range=_NON_NEGATIVE, help="Weight of the router z-loss.")
    z_coef_ramp: int = field(0, range=Range(0, MAX_STEP),
                             help="Raise the z-loss weight linearly from z_coef / N at step 0 to z_coef at step "
                                  "N − 1 over these N steps (0: z_coef from the start); its value per step is "
                                  "logged as technique/z_coef.")
    ce_chunk: int = field(0, range=Range(0, 1 << 22),
                          help="Positions per block of the cross-entropy (0: all at once); with a block, "
                               "the [tokens, vocab] logits never exist in full.")
    bias_update_rate: float = field(0.0, range=_NON_NEGATIVE,
                                    help="Auxiliary-loss-free balancing: after each step every MoE layer's "
                                         "selection bias moves by rate · sign(mean load − expert load) (0: off).")
    bias_update: str = field("on", choices=BIAS_UPDATES,
                             help="on: bias_update_rate moves the selection bias; frozen: an inherited bias "
                                  "is used as it is and never changes.")
    spike: SpikeConfig | None = field(None, help="Loss-spike guard (off when absent).")


@dataclass(frozen=True)
class MeshConfig:
    """`mesh`: the sizes of the device mesh's axes; at most one is -1, all remaining devices."""

    data: int = field(1, range=Range(-1, MAX_DEVICES), help="Data-parallel size (-1: the remaining devices).")
    fsdp: int = field(-1, range=Range(-1, MAX_DEVICES), help="FSDP size (-1: the remaining devices).")
    context: int = field(1, range=Range(-1, MAX_DEVICES),
                         help="Context-parallel size: every sequence split along its length over this many "
                              "devices, attention's keys and values gathered whole or passed around a ring "
                              "(model.context_exchange), the causal work balanced (-1: the remaining "
                              "devices). Parameters are split over it as over fsdp.")
    expert: int = field(1, range=Range(-1, MAX_DEVICES), help="Expert-parallel size (-1: the remaining devices).")


@dataclass(frozen=True)
class DistributedConfig:
    """`coordinator` host:port starts `jax.distributed`; "auto" lets JAX detect the cluster (SLURM, TPU)."""

    coordinator: str | None = field(None, help="host:port of process 0 (or auto) to run on several processes.")
    num_processes: int | None = field(None, range=Range(1, MAX_DEVICES), help="How many processes.")
    process_id: int | None = field(None, range=Range(0, MAX_DEVICES), help="This process's id.")
    heartbeat_timeout: int = field(100, range=Range(2, 3600),
                                   help="Seconds without a heartbeat after which the other processes give up on "
                                        "a lost one and exit (the job can then be restarted from the last "
                                        "checkpoint).")


@dataclass(frozen=True)
class CheckpointConfig:
    """`checkpoint`: how often the run saves, how many saves it keeps, and its Hugging Face exports."""

    every: int = field(100, range=_STEPS, help="Save every this many steps.")
    keep: int = field(3, range=_STEPS, help="Keep the newest this many checkpoints.")
    async_save: bool = field(True, key="async", help="Save in the background.")
    hf_every: int = field(0, range=Range(0, MAX_STEP),
                          help="Also write RUN_DIR/<step>/hf/, a Hugging Face checkpoint, for every saved step "
                               "divisible by this (0: never); written after the save commits, in the background.")
    hf_dtype: str = field("bfloat16", choices=HF_DTYPES, help="dtype of the Hugging Face exports.")


WRITERS = ("jsonl", "tensorboard", "wandb")  # `upcycler.train.reporting.writers`
WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class WandbConfig:
    """`metrics.wandb`: the Weights & Biases run the `wandb` writer logs to."""

    project: str = field("upcycler", help="W&B project.")
    entity: str | None = field(None, help="W&B entity (team or user); default: the logged-in user's.")
    name: str | None = field(None, help="Run name shown in W&B; default: the run_dir's last part.")
    mode: str | None = field(None, choices=WANDB_MODES,
                             help="online | offline (a local run directory, `wandb sync` later) | disabled; "
                                  "default: WANDB_MODE, else online.")


@dataclass(frozen=True)
class MetricsConfig:
    """`metrics`: where each step's record goes, MFU's peak, and the expert load, usage and health windows."""

    writers: tuple[str, ...] = field(("jsonl", "tensorboard"),
                                     help="Where each step's record goes: jsonl (RUN_DIR/metrics.jsonl, always; "
                                          "what report and resume read), tensorboard (RUN_DIR/tensorboard), "
                                          "wandb (metrics.wandb).")
    wandb: WandbConfig = field(WandbConfig(), help="The W&B run of the wandb writer.")
    peak_flops: float | None = field(None, range=Range(0, None, lo_open=True),
                                     help="Per-device peak FLOP/s that MFU is measured against; default: the "
                                          "chip's published bf16 peak, or on a CPU a float32 matmul measured at start.")
    expert_load_every: int = field(100, range=_STEPS,
                                   help="Write the expert load, usage by source and health every this many steps, "
                                        "each summed over the steps since the previous write.")
    progress: bool = field(True, help="Show a progress bar.")
    dead_below: float = field(0.1, range=Range(0, 1),
                              help="An expert is dead when it received less than this fraction of its fair share "
                                   "of token copies over the last expert_load_every steps.")
    stop_on_collapse: bool = field(False, help="Stop the run when an MoE layer has collapsed (at least half its "
                                               "routed experts dead), naming the layer and the last checkpoint.")


EVAL_LENGTHS = ("data", "phase")


@dataclass(frozen=True)
class EvalConfig:
    """`eval`: held-out loss per source during training (`upcycler.train.loop.heldout_eval`, run on the loop
    by `upcycler.train.techniques.heldout`)."""

    every: int = field(100, range=_STEPS, help="Evaluate after every this many steps (and after the last).")
    batches: int = field(4, range=Range(1, 1 << 16),
                         help="Global batches (data.global_batch_size × data.seq_len) read from each source.")
    sources: tuple[str, ...] | None = field(
        None, help="Prepared sources to evaluate on; default: NAME.heldout for every training source NAME that "
                   "has one (`upcycle prepare-data --heldout`).")
    dir: Location | None = field(None, help="Where those sources are prepared; default: data.dir.")
    seq_len: str = field("data", choices=EVAL_LENGTHS,
                         help="data: every evaluation reads rows of data.seq_len, data.global_batch_size at a "
                              "time; phase: rows of the length (and batch) of the data phase in force at the "
                              "evaluated step, so a lengthening run is measured at the length it trains at.")


@dataclass(frozen=True)
class ProfileConfig:
    """`profile`: a `jax.profiler` trace of a few steps, for TensorBoard's profile tab (XProf)."""

    start_step: int = field(range=Range(0, MAX_STEP), help="First step traced.")
    steps: int = field(3, range=Range(1, 1000), help="How many steps are traced.")


@dataclass(frozen=True)
class TrainConfig:
    run_dir: Location = field(help="Where checkpoints, metrics and config.yaml go: a directory every process "
                                   "sees (a local path, a shared filesystem, or gs://bucket/path).")
    steps: int = field(range=_STEPS, help="Train until this absolute step.")
    model: ModelSection = field(help="The checkpoint to start from and how to run it.")
    data: DataConfig = field(help="The prepared data and its mixture; see upcycler.train.data.config.")
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    eval: EvalConfig | None = field(None, help="Held-out evaluation during training (off when absent).")
    profile: ProfileConfig | None = field(None, help="Trace some steps with jax.profiler (off when absent).")

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able data that `from_dict` turns back into an equal config."""
        return to_plain(self)

    @classmethod
    def from_dict(cls, raw: Any, origin: str = "config") -> TrainConfig:
        """Build and check a config from parsed YAML; raises `UpcyclerError` with one line naming `origin`."""
        config = from_mapping(cls, raw, origin, fix=_FIX)
        check(config, origin)
        return config


def _check_context_chunks(config: TrainConfig, seq_len: int, where: str, origin: str) -> None:
    """Context parallelism cuts each sequence into 2 × mesh.context equal chunks (whole 128-token tiles
    under splash attention); refuse a length that does not cut so, in one line."""
    degree = config.mesh.context
    if degree <= 1:
        return
    if config.model.attention == "chunked":
        raise UpcyclerError(f"{origin}: model.attention chunked walks the whole sequence's query blocks, which "
                            "mesh.context splits over devices; use splash (TPU), dot_product or einsum")
    if config.model.context_exchange == "ring" and config.model.attention != "splash":
        raise UpcyclerError(f"{origin}: model.context_exchange ring runs through the splash kernel; set "
                            "model.attention splash or context_exchange gather")
    unit = 2 * degree * (128 if config.model.attention == "splash" else 1)
    if seq_len % unit:
        tiles = " of whole 128-token splash tiles" if config.model.attention == "splash" else ""
        raise UpcyclerError(f"{origin}: {where}seq_len {seq_len} does not cut into the {2 * degree} equal chunks"
                            f"{tiles} mesh.context {degree} balances; make it a multiple of {unit}")


def check(config: TrainConfig, origin: str = "config") -> None:
    """Raise `UpcyclerError` unless the options agree with each other (each option's own type and range
    are checked by `from_mapping`; no files or devices consulted)."""
    config.data.check(origin=f"{origin}: data")
    check_schedule(config.optimizer, origin)
    sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.expert]
    if any(s == 0 for s in [*sizes, config.mesh.context]) or [*sizes, config.mesh.context].count(-1) > 1:
        raise UpcyclerError(
            f"{origin}: mesh sizes must be positive, with at most one -1 (all remaining devices)"
        )
    known = math.prod(s for s in sizes if s != -1) * config.data.microbatches
    for where, seq_len, batch in _shapes(config.data):
        if batch % known:
            raise UpcyclerError(
                f"{origin}: {where}global_batch_size {batch} is not divisible by the mesh "
                f"(data × fsdp × expert) × data.microbatches = {known}; make it a multiple of {known}"
            )
    for where, seq_len, _ in _shapes(config.data):
        _check_blocks(config, seq_len, where, origin)
        _check_context_chunks(config, seq_len, where, origin)
    if config.model.moe_dispatch == "gspmd" and config.model.comm_dtype != "fp32":
        raise UpcyclerError(
            f"{origin}: model.comm_dtype {config.model.comm_dtype} compresses the expert-parallel combine; "
            "set model.moe_dispatch to all_to_all or all_gather, or model.comm_dtype to fp32"
        )
    if config.mesh.expert == 1 and config.model.moe_dispatch == "all_to_all":
        raise UpcyclerError(
            f"{origin}: model.moe_dispatch all_to_all sends tokens to the devices of mesh.expert, which is 1 "
            "(nothing to exchange); set mesh.expert to the number of devices that split the experts (or -1), "
            "or model.moe_dispatch to gspmd"
        )
    if config.mesh.expert == 1 and config.model.comm_dtype != "fp32":
        raise UpcyclerError(
            f"{origin}: model.comm_dtype {config.model.comm_dtype} compresses the exchange over mesh.expert, "
            "which is 1 (it would only round); set mesh.expert above 1 (or -1), or model.comm_dtype to fp32"
        )
    if config.model.moe_chunks > 1 and config.model.moe_dispatch != "all_gather":
        raise UpcyclerError(
            f"{origin}: model.moe_chunks {config.model.moe_chunks} applies to the all_gather dispatch; set "
            "model.moe_dispatch to all_gather, or model.moe_chunks to 1"
        )
    if config.loss.bias_update == "frozen" and config.loss.bias_update_rate > 0:
        raise UpcyclerError(
            f"{origin}: loss.bias_update is frozen but loss.bias_update_rate is {config.loss.bias_update_rate}; "
            "set the rate to 0 to keep the bias fixed, or bias_update to on"
        )
    spike = config.loss.spike
    if spike is not None and spike.action == "rewind" and spike.average > config.checkpoint.keep:
        raise UpcyclerError(
            f"{origin}: loss.spike.average {spike.average} checkpoints can never be averaged: checkpoint.keep "
            f"is {config.checkpoint.keep}; lower loss.spike.average or raise checkpoint.keep"
        )
    if spike is not None and spike.window >= config.steps:
        raise UpcyclerError(
            f"{origin}: loss.spike.window {spike.window} good steps come before the guard judges any, and the run "
            f"has {config.steps} steps: it would never judge one; lower loss.spike.window below {config.steps}, "
            "or drop loss.spike"
        )
    _check_exports(config.checkpoint, config.steps, origin)
    _check_observability(config, origin)
    _check_trainable(config.optimizer.trainable, origin)
    _check_distributed(config.distributed, origin)


def _shapes(data: DataConfig) -> list[tuple[str, int, int]]:
    """(where, seq_len, global_batch_size) of the section and of each phase with a shape of its own;
    `where` prefixes the option's name in messages."""
    shapes = [("data.", data.seq_len, data.global_batch_size)]
    for k, (seq_len, batch) in enumerate(data.shapes):
        if (seq_len, batch) != (data.seq_len, data.global_batch_size):
            shapes.append((f"data.phases[{k}] ", seq_len, batch))
    return shapes


def _check_blocks(config: TrainConfig, seq_len: int, where: str, origin: str) -> None:
    """A length the run trains at splits into the blocks the attention and the loss work in."""
    option = f"{where}seq_len {seq_len}"
    if config.model.attention == "splash" and seq_len % 128:
        raise UpcyclerError(f"{origin}: model.attention splash runs in tiles of 128 tokens; make {option} "
                            "a multiple of 128 or choose another attention")
    blocks = {"loss.ce_chunk": config.loss.ce_chunk}
    if config.model.attention == "chunked":
        blocks["model.attention_chunk"] = config.model.attention_chunk
    for name, block in blocks.items():
        if block and seq_len % block:
            raise UpcyclerError(f"{origin}: {name} {block} does not divide {option}; pick a divisor")


def _check_exports(c: CheckpointConfig, steps: int, origin: str) -> None:
    """`hf_every` exports at least one step: the saved steps are the multiples of `every` and the last."""
    if c.hf_every and math.lcm(c.every, c.hf_every) > steps and steps % c.hf_every:
        raise UpcyclerError(
            f"{origin}: checkpoint.hf_every {c.hf_every} exports no step of this run (it saves the multiples of "
            f"checkpoint.every {c.every} and step {steps}, none divisible by {c.hf_every}); set it to a "
            f"multiple of {c.every} up to {steps}, or a divisor of {steps}, or 0 for no export"
        )


def _check_observability(config: TrainConfig, origin: str) -> None:
    """Known writers, each once, jsonl among them; a profile window inside the run."""
    writers = config.metrics.writers
    for w in writers:
        if w not in WRITERS:
            raise UpcyclerError(f"{origin}: metrics.writers names {describe(w)}; use some of {', '.join(WRITERS)}")
    if len(set(writers)) != len(writers):
        raise UpcyclerError(f"{origin}: metrics.writers names a writer twice; list each once")
    if "jsonl" not in writers:
        raise UpcyclerError(f"{origin}: metrics.writers must include jsonl (metrics.jsonl is what `upcycle report` "
                            "and a resume read); add it")
    if config.profile is not None and config.profile.start_step >= config.steps:
        raise UpcyclerError(f"{origin}: profile.start_step {config.profile.start_step} is not a step of this run "
                            f"(steps: {config.steps}); pick a step below {config.steps}")
    if config.eval is not None and config.eval.sources is not None:
        from upcycler.train.data.config import SOURCE_NAME

        if not config.eval.sources:
            raise UpcyclerError(f"{origin}: eval.sources is empty; name prepared sources or drop it for the "
                                "default (NAME.heldout of every training source)")
        for name in config.eval.sources:
            if not SOURCE_NAME.fullmatch(name):
                raise UpcyclerError(f"{origin}: eval.sources names {describe(name)}, not a prepared source's "
                                    "name; fix the config")


def _check_trainable(trainable: str, origin: str) -> None:
    """`optimizer.trainable` is all, new_layers or a regular expression that compiles."""
    if trainable in ("all", "new_layers"):
        return
    if not trainable.strip():
        raise UpcyclerError(
            f"{origin}: optimizer.trainable is {describe(trainable)}, a pattern found in every name; write all, "
            "new_layers or a regular expression"
        )
    try:
        re.compile(trainable)
    except re.error as err:
        raise UpcyclerError(
            f"{origin}: optimizer.trainable {describe(trainable)} is not all, new_layers or a valid regular "
            f"expression ({err}); fix the pattern"
        ) from None


def _check_distributed(d: DistributedConfig, origin: str) -> None:
    """`coordinator` is host:port or auto; the process id is below the number of processes."""
    if d.coordinator not in (None, "auto") and ":" not in d.coordinator:
        raise UpcyclerError(
            f"{origin}: distributed.coordinator {describe(d.coordinator)} must be host:port or auto"
        )
    if d.process_id is not None and d.num_processes is not None and d.process_id >= d.num_processes:
        raise UpcyclerError(
            f"{origin}: distributed.process_id {d.process_id} must be below distributed.num_processes "
            f"{d.num_processes}; {_FIX}"
        )


def check_schedule(o: OptimizerConfig, origin: str) -> None:
    """`until_step` strictly increasing from 0 over the phases."""
    previous = 0
    for k, phase in enumerate(o.schedule):
        if not previous < phase.until_step:
            raise UpcyclerError(
                f"{origin}: optimizer.schedule[{k}].until_step is {describe(phase.until_step)}; "
                f"phase steps must increase strictly from {previous} (at most {MAX_STEP:,})"
            )
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
