"""The fastest configuration that fits, found by compiling: `continued-pretrain --compile-only --plan`.

The options that change how a step runs but not what it computes are searched for the best roofline
bound (`roofline`: an upper bound on MFU, not a measurement) whose per-chip peak leaves `margin` bytes of
the chip's HBM free:

- the remat policy (`model.remat`) and the microbatches (`data.microbatches`);
- for an MoE, the expert dispatch with the mesh's expert axis (`model.moe_dispatch`, `mesh.expert`):
  FSDP-gathered experts (gspmd) or experts split over `EXPERT_AXES` devices with tokens gathered to them
  (all_gather; the all_to_all dispatch pads every exchange to the worst case on chips without a ragged
  all-to-all, so it is tried only with `dispatches=` given);
- the attention: splash (the TPU flash-attention kernel) whenever the target is a TPU and the sequence
  allows it. It does the same FLOPs as the config's attention and keeps the scores off HBM, so it never
  loses; the config's attention otherwise;
- the context degree (`mesh.context`, context parallelism: each sequence split over that many chips), from
  the config's upwards through `CONTEXT_DEGREES`. A larger degree computes the same FLOPs and moves more
  (the keys and values gathered), so it is tried only while nothing fits yet, and once more after the
  first degree that fits unless that fit is already at the best policy's ceiling;
- with the sequence split under splash, how the keys and values reach the queries
  (`model.context_exchange`): gathered whole, then the ring (the same FLOPs; each block's transfer hidden
  behind the kernels of the block before, and no chip holding the whole sequence's keys and values). The
  ring is walked after the gather with the same pruning, so it is compiled only where it can still win:
  a policy the gather could not fit, or fit only with more microbatches. At equal bounds the candidate
  that moves fewer bytes ranks first (the ring moves more: its partial results merged in fp32 per block).

Every candidate is compiled whole. The layers run under `lax.scan`, so a compile costs about the same at
any depth (the reference MoE: 47 s for 32 layers, 48-57 s for slices of 2 and 4), and a slice of the
model would need two compiles to extrapolate what one gives exactly. The search prunes, each rule
following from what a candidate can change:

- policies are walked from the least recomputation to the most: one whose compute-bound ceiling (model
  over executed FLOPs, analytic) cannot beat the best bound found is skipped;
- per policy, the fewest microbatches that fit win (more only gather the weights more often): the most
  allowed are compiled first (if they do not fit, no count does: the peak falls as microbatches grow),
  then the fewest that fit are found by bisection;
- a later policy, recomputing more, is tried only with fewer microbatches than the best so far, so a
  policy that fits with one microbatch ends the walk for its dispatch; unless that best is memory-bound:
  recomputing can then move fewer bytes than keeping (remat `qkv` re-reads less than `attention` keeps
  and reloads), so the next policy is tried at the same count too.

Each compile's figures are cached on disk under everything that was compiled, so planning again (a
larger margin, a longer table) compiles only what is new.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec
from upcycler.train.aot.compile_report import executed_flops_per_token
from upcycler.train.config import CONTEXT_EXCHANGES, REMAT_POLICIES, TrainConfig
from upcycler.train.reporting.flops import flops_per_token
from upcycler.units import human_bytes

MICROBATCHES = (1, 2, 4, 8)
# the policies searched unless named: not `dots` (every matmul output kept: never less than `attention` and
# `all_but_ffn_hidden` together), nor the offloading ones (their host transfers are not in the roofline,
# which would favour them blindly)
POLICIES = ("none", "all_but_ffn_hidden", "attention_and_ffn_input", "attention", "qkv", "full")
EXPERT_AXES = (8,)  # mesh.expert sizes tried with the expert-parallel dispatch
CONTEXT_DEGREES = (1, 2, 4, 8, 16)  # mesh.context sizes the search may try (from the config's upwards)
SPLASH_TILE = 128  # splash attention's sequence tile


@dataclass(frozen=True)
class Choice:
    """One configuration: the options the plan sets."""

    remat: str
    microbatches: int
    moe_dispatch: str = "gspmd"
    expert: int = 1
    attention: str = "einsum"
    context: int = 1
    exchange: str = "gather"

    def sets(self) -> tuple[str, ...]:
        """As `--set KEY=VALUE` arguments."""
        return (f"model.remat={self.remat}", f"data.microbatches={self.microbatches}",
                f"model.moe_dispatch={self.moe_dispatch}", f"mesh.expert={self.expert}",
                f"model.attention={self.attention}", f"mesh.context={self.context}",
                f"model.context_exchange={self.exchange}")


@dataclass(frozen=True)
class Figures:
    """One compiled candidate, per chip (`peak` None: the compiler ran out of memory)."""

    peak: int | None
    hbm_bytes: float
    traffic_bytes: float
    mfu: float
    step_s: float
    bound: str
    compile_seconds: float
    failure: str | None


@dataclass(frozen=True)
class Outcome:
    """A candidate and its figures; `fits` with the plan's margin."""

    choice: Choice
    fits: bool
    figures: Figures

    @property
    def mfu(self) -> float:
        return self.figures.mfu if self.fits else 0.0


@dataclass
class Plan:
    """Every candidate compiled, best first, and what the search cost."""

    topology: str
    budget: int
    margin: int
    outcomes: list[Outcome]
    seconds: float
    compiles: int  # compiled now (not found in the cache)

    @property
    def best(self) -> Outcome | None:
        return next((o for o in self.outcomes if o.fits), None)

    def to_text(self) -> str:
        head = (f"plan for {self.topology}: {len(self.outcomes)} configurations, {self.compiles} compiled in "
                f"{self.seconds:.0f} s; fits = peak ≤ {human_bytes(self.budget)} − {human_bytes(self.margin)} "
                "margin; MFU is the roofline's bound, not a measurement")
        rows = [(f"{'remat':<32} {'mb':>3} {'attention':<10} {'dispatch':<10} {'expert':>6} {'context':>7} "
                 f"{'exchange':<8} "
                 f"{'fits':<4} {'peak':>10} {'MFU ≤':>6} {'bound':<13} {'HBM traffic':>11} {'collectives':>11}")]
        for o in self.outcomes:
            c, f = o.choice, o.figures
            peak = human_bytes(f.peak) if f.peak is not None else "out of mem"
            rows.append(f"{c.remat:<32} {c.microbatches:>3} {c.attention:<10} {c.moe_dispatch:<10} {c.expert:>6} "
                        f"{c.context:>7} {c.exchange:<8} "
                        f"{'yes' if o.fits else 'no':<4} {peak:>10} {f.mfu:>6.1%} {f.bound:<13} "
                        f"{human_bytes(f.hbm_bytes):>11} {human_bytes(f.traffic_bytes):>11}")
        best = self.best
        tail = (f"best: {' '.join('--set ' + s for s in best.choice.sets())}" if best
                else "nothing fits: more chips, a larger mesh.context, a smaller batch or sequence, or bf16 weights")
        return "\n".join([head, *rows, tail])

    def to_json(self) -> str:
        def row(o: Outcome) -> dict:
            return {"choice": asdict(o.choice), "fits": o.fits, **asdict(o.figures)}

        return json.dumps({"topology": self.topology, "budget": self.budget, "margin": self.margin,
                           "seconds": round(self.seconds, 1), "compiles": self.compiles,
                           "best": row(self.best) if self.best else None,
                           "outcomes": [row(o) for o in self.outcomes]})


def configured(config: TrainConfig, choice: Choice) -> TrainConfig:
    """`config` with the options `choice` sets (checked as a loaded config is)."""
    raw = config.to_dict()
    raw["model"].update(remat=choice.remat, moe_dispatch=choice.moe_dispatch, attention=choice.attention,
                        context_exchange=choice.exchange)
    raw["data"]["microbatches"] = choice.microbatches
    raw["mesh"]["expert"] = choice.expert
    raw["mesh"]["context"] = choice.context
    return TrainConfig.from_dict(raw, "the plan's configuration")


def context_degrees(config: TrainConfig, devices: int, wanted: Sequence[int] | None = None) -> list[int]:
    """The context degrees to try, smallest first: `wanted`, else the config's and the larger of
    `CONTEXT_DEGREES`; those that divide the devices and split the sequence into 2 × degree chunks of
    whole splash tiles."""
    start = max(config.mesh.context, 1)
    pool = sorted(set(wanted)) if wanted else [c for c in sorted(set(CONTEXT_DEGREES) | {start}) if c >= start]
    return [c for c in pool if devices % c == 0 and (c == 1 or config.data.seq_len % (2 * c * SPLASH_TILE) == 0)]


def exchanges(attention: str, context: int, wanted: Sequence[str] | None = None) -> list[str]:
    """The exchanges of keys and values to try at a context degree: gather, then ring, where the sequence is
    split under splash (`wanted` narrows them); gather alone otherwise (it is what an unsplit sequence does)."""
    if context <= 1 or attention != "splash":
        return ["gather"]
    return [e for e in CONTEXT_EXCHANGES if not wanted or e in wanted]


def dispatches(spec: ModelSpec, devices: int, wanted: Sequence[str] | None = None) -> list[tuple[str, int]]:
    """(moe_dispatch, mesh.expert) pairs to try: gspmd, and for an MoE the expert-parallel ones over each
    of `EXPERT_AXES` that divides the experts and the devices (`wanted` names the dispatches; default
    gspmd and all_gather)."""
    wanted = tuple(wanted) if wanted else ("gspmd", "all_gather")
    pairs = [("gspmd", 1)] if "gspmd" in wanted else []
    if spec.moe is not None:
        for axis in EXPERT_AXES:
            if spec.moe.num_experts % axis == 0 and devices % axis == 0 and devices > axis:
                pairs += [(d, axis) for d in ("all_gather", "all_to_all") if d in wanted]
    return pairs


def plan(config: TrainConfig, topology: str, *, margin: int = 1 << 30, cache=None,
         policies: Sequence[str] = POLICIES, microbatches: Sequence[int] = MICROBATCHES,
         dispatch: Sequence[str] | None = None, spec: ModelSpec | None = None,
         contexts: Sequence[int] | None = None, exchange: Sequence[str] | None = None,
         log: Callable[[str], None] = lambda _: None) -> Plan:
    """Search `config`'s options for `topology` (see the module docstring); `cache` (a directory) keeps
    compiled figures between plans; `policies`, `microbatches`, `dispatch`, `contexts` (context degrees) and
    `exchange` (context exchanges) narrow the search; `spec` stands for model.init's architecture; `log`
    hears of each compile."""
    from upcycler.train.aot.compile import model_spec, target

    started = time.perf_counter()
    spec = spec if spec is not None else model_spec(config.model.init)
    tgt = target(topology, 1)
    if tgt.chip is None:
        raise UpcyclerError(f"--plan needs a chip with known HBM and peak rates; {topology} has none")
    budget = tgt.chip.hbm_budget_bytes
    attention = "splash" if tgt.devices[0].platform == "tpu" and config.data.seq_len % SPLASH_TILE == 0 \
        else config.model.attention
    ceilings = {p: _ceiling(config, spec, p) for p in policies}
    order = sorted(policies, key=lambda p: (-ceilings[p], REMAT_POLICIES.index(p)))
    store = _Cache(cache)
    outcomes: list[Outcome] = []
    compiled = 0
    best = 0.0

    def tried(choice: Choice) -> Outcome | None:
        """The candidate compiled (or found in the cache), recorded; None when the config refuses it."""
        nonlocal compiled
        try:
            candidate = configured(config, choice)
            key = store.key(topology, candidate, spec)
            figures = store.get(key)
            if figures is None:
                log(f"compiling {' '.join(choice.sets())}")
                began = time.perf_counter()
                figures = _compile(candidate, topology, tgt.chip, spec)
                store.put(key, figures)
                compiled += 1
                log(f"  compiled in {time.perf_counter() - began:.0f} s")
        except UpcyclerError as err:  # a split the batch or the mesh does not allow
            log(f"skipped {' '.join(choice.sets())}: {err}")
            return None
        outcome = Outcome(choice, figures.peak is not None and figures.peak <= budget - margin, figures)
        outcomes.append(outcome)
        return outcome

    top_ceiling = max(ceilings.values())
    fitted_at: int | None = None  # the first context degree at which something fitted
    for context in context_degrees(config, len(tgt.devices), contexts):
        if fitted_at is not None and (context > 2 * fitted_at or best >= top_ceiling * 0.999):
            break
        walks = [(e, d, x) for e in exchanges(attention, context, exchange)
                 for d, x in dispatches(spec, len(tgt.devices) // context, dispatch)]
        for how, moe_dispatch, expert in walks:
            fewest = max(microbatches) + 1  # only fewer microbatches than this can beat what fits
            for policy in order:
                if ceilings[policy] <= best:
                    continue
                counts = sorted(m for m in microbatches if m < fewest)
                if not counts:
                    break
                # the peak falls as the microbatches grow: if the most allowed do not fit, none do; else
                # bisect for the fewest that fit
                top = None
                while counts and top is None:  # the most microbatches the batch and the mesh allow
                    top = tried(Choice(policy, counts[-1], moe_dispatch, expert, attention, context, how))
                    if top is None:
                        counts.pop()
                if top is None or not top.fits:
                    continue
                lo, hi = 0, len(counts) - 1
                fit = top
                while lo < hi:
                    mid = (lo + hi) // 2
                    outcome = tried(Choice(policy, counts[mid], moe_dispatch, expert, attention, context, how))
                    if outcome is not None and outcome.fits:
                        hi, fit = mid, outcome
                    else:
                        lo = mid + 1
                best = max(best, fit.figures.mfu)
                fitted_at = context if fitted_at is None else fitted_at
                # a memory-bound fit can lose to more recomputation at its own count
                fewest = fit.choice.microbatches + (fit.figures.bound == "memory")
    outcomes.sort(key=_rank)
    return Plan(topology, budget, margin, outcomes, time.perf_counter() - started, compiled)


def _rank(outcome: Outcome) -> tuple:
    """Best first: what fits, the higher bound; at equal bounds the fewer bytes moved (HBM, then collectives:
    less to hide behind the matmuls the bound assumes they overlap), then the smaller peak."""
    f = outcome.figures
    return (not outcome.fits, -outcome.mfu, f.hbm_bytes, f.traffic_bytes,
            f.peak if f.peak is not None else float("inf"))


def _ceiling(config: TrainConfig, spec: ModelSpec, policy: str) -> float:
    """The MFU a step with remat `policy` reaches when compute-bound: model FLOPs over executed FLOPs."""
    run = replace(config.model.run_config(), remat=policy)
    return flops_per_token(spec, config.data.seq_len) / executed_flops_per_token(spec, config.data.seq_len, run,
                                                                                 config.loss)


def _compile(config: TrainConfig, topology: str, chip, spec: ModelSpec) -> Figures:
    from upcycler.train.aot.compile import compile_only

    report = compile_only(config, topology=topology, spec=spec)
    line = report.roofline or {}
    traffic = sum(kind["traffic_bytes"] for kind in report.collectives.values())
    hbm = float(line.get("memory_s", 0.0)) * chip.hbm_bandwidth
    return Figures(report.memory.peak if report.failure is None else None, hbm,
                   float(traffic), float(line.get("mfu", 0.0)), float(line.get("step_s", 0.0)),
                   line.get("bound", "out of memory"), round(report.compile_seconds, 1), report.failure)


@functools.cache
def _code_digest() -> str:
    """A digest of the trainer package's Python sources (the model, its kernels' tiles, the step, how the
    report charges traffic): figures compiled by other code are not reused."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class _Cache:
    """Compiled figures on disk, one JSON file per compile, keyed by the topology, the architecture and the
    whole config but its paths and run options, and by what else sets the figures: this code (the model,
    its kernels' tiles, how traffic is charged), JAX's version and libtpu's flags."""

    def __init__(self, root):
        self.root = root

    def key(self, topology: str, config: TrainConfig, spec: ModelSpec) -> str:
        what = json.dumps([topology, repr(spec), repr(config.model.run_config()),
                           repr(config.loss), repr(config.mesh), config.data.global_batch_size,
                           config.data.seq_len, config.data.microbatches, repr(config.optimizer),
                           _code_digest(), importlib.metadata.version("jax"),
                           os.environ.get("LIBTPU_INIT_ARGS", "")],
                          sort_keys=True)
        return hashlib.sha256(what.encode()).hexdigest()[:32]

    def get(self, key: str) -> Figures | None:
        path = None if self.root is None else self.root / f"{key}.json"
        if path is None or not path.is_file():
            return None
        try:
            return Figures(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            return None  # written by another version: compile again

    def put(self, key: str, figures: Figures) -> None:
        if self.root is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{key}.tmp"
        tmp.write_text(json.dumps(asdict(figures)))
        tmp.replace(self.root / f"{key}.json")
