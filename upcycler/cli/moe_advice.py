"""`upcycle dense-to-moe SRC --plan-for TOPOLOGY`: which MoE to upcycle into for a pod, before a byte is written.

Each shape of `transforms.moe_shapes` is planned for the pod (`train.aot.plan`: the training options that
fit with the margin and give the best roofline bound), compiled from the spec the upcycle would write, so
the source needs only its `config.json`. The table gives each shape's parameters, its best configuration,
fit, peak and bound, and the two commands that make and train it. Bounds, not measurements.

`dense-to-moe` declares this module its command's advisor (`transforms.registry.TransformHooks.advisor`):
`command_options` adds `--plan-for` and its options to the command, `from_command` takes them out of its
values and, given `--plan-for`, advises instead of writing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click

from upcycler.cli.path_type import LOCAL_PATH
from upcycler.cli.plan_lists import listed
from upcycler.errors import UpcyclerError
from upcycler.units import human_bytes, human_count, parse_count, parse_size

# the training run the shapes are planned for, unless --train-config gives one
SEQ_LEN = 4096
ROWS_PER_CHIP = 4


OPTIONS = ("plan_for", "active_params", "total_params", "train_config", "plan_margin", "plan_seq_len", "plan_remat",
           "plan_microbatches")


def command_options(fn: Callable) -> Callable:
    """The advisor's options (`--plan-for` and what it plans with), added to the command `fn`."""
    fn = click.option("--plan-microbatches", metavar="N1,N2,...",
                      help="With --plan-for: plan each shape with only these microbatch counts.")(fn)
    fn = click.option("--plan-remat", metavar="P1,P2,...",
                      help="With --plan-for: plan each shape with only these remat policies (fewer "
                           "compiles).")(fn)
    fn = click.option("--plan-margin", metavar="SIZE", default="1GiB", show_default=True,
                      help="With --plan-for: HBM per chip a proposal must leave free.")(fn)
    fn = click.option("--plan-seq-len", type=click.IntRange(128, 1 << 22), metavar="TOKENS",
                      help="With --plan-for (no --train-config): plan for sequences of this many tokens (default "
                           "4096), the rows per step scaled to keep the tokens per chip; a sequence that does not "
                           "fit one chip is split over several (mesh.context), the degree in each proposal.")(fn)
    fn = click.option("--train-config", type=LOCAL_PATH, metavar="YAML",
                      help="With --plan-for: the training run to plan for (its data, batch and sequence; "
                           "default 4096 tokens × 4 rows per chip).")(fn)
    fn = click.option("--total-params", metavar="N", help="With --plan-for: total parameters to aim at (e.g. 13B).")(fn)
    fn = click.option("--active-params", metavar="N",
                      help="With --plan-for: parameters per token to aim at (e.g. 2.3B; default the source's).")(fn)
    return click.option("--plan-for", metavar="TOPOLOGY",
                        help="Propose expert count, width and top-k for training on this TPU slice (e.g. v5e-256), "
                             "each with its best training configuration, fit and MFU bound (compiled from the "
                             "source's config.json); writes nothing.")(fn)


def from_command(src: Path, out: Path | None, as_json: bool, values: dict) -> bool:
    """Take the advisor's options out of the command's `values`; with `--plan-for`, advise (the experts,
    topk and width the command was given are kept fixed) and return True: the command writes nothing. An
    option that only plans, given without `--plan-for`, is refused; otherwise False: the command goes on."""
    advice = {k: values.pop(k) for k in OPTIONS}
    if advice["plan_for"] is not None:
        fixed = {"experts": values.get("experts"), "topk": values.get("topk"), "width": values.get("expert_width")}
        _advise(src, out, as_json, advice, fixed)
        return True
    stray = [k for k in OPTIONS if k != "plan_margin" and advice[k] is not None]
    if stray:
        raise click.UsageError(f"--{stray[0].replace('_', '-')} plans a shape: it needs --plan-for TOPOLOGY")
    return False


def _advise(src: Path, out: Path | None, as_json: bool, advice: dict, fixed: dict) -> None:
    from upcycler.train.aot.topology import parse_slice

    if out is not None:
        raise click.UsageError("--plan-for writes nothing: drop OUT (the proposals print the command that writes)")
    parse_slice(advice["plan_for"], "--plan-for")
    if advice["plan_seq_len"] is not None and advice["train_config"] is not None:
        raise click.UsageError("--plan-seq-len plans the default run at another length; --train-config names its "
                               "own data.seq_len: drop one of them")
    advise(src, advice["plan_for"], as_json=as_json, train_config=advice["train_config"],
           seq_len=advice["plan_seq_len"],
           active=parse_count(advice["active_params"], "--active-params") if advice["active_params"] else None,
           total=parse_count(advice["total_params"], "--total-params") if advice["total_params"] else None,
           margin=parse_size(advice["plan_margin"], "--plan-margin"), fixed=fixed,
           narrow=_narrowing(advice["plan_remat"], advice["plan_microbatches"]))


def _narrowing(remat: str | None, microbatches: str | None) -> dict[str, tuple]:
    """`train.aot.plan.plan`'s narrowing arguments from `--plan-remat` and `--plan-microbatches`."""
    from upcycler.train.config import REMAT_POLICIES

    narrow = {"policies": listed(remat, "--plan-remat", REMAT_POLICIES),
              "microbatches": listed(microbatches, "--plan-microbatches", None)}
    return {k: v for k, v in narrow.items() if v is not None}


def advise(src: Path, topology: str, *, active: int | None, total: int | None, train_config: Path | None,
           margin: int, as_json: bool, fixed: dict[str, int | None], seq_len: int | None = None,
           narrow: dict[str, tuple] | None = None) -> None:
    """Print the proposals for upcycling `src` to train on `topology` (`fixed`: the experts, topk and width
    the user chose; `seq_len`: the default run's sequence length; `narrow`: the remat policies and
    microbatch counts the search may try); exit 1 when none fits."""
    from upcycler.io.hf_read import read_spec
    from upcycler.train.aot.compile import target
    from upcycler.train.aot.plan import plan
    from upcycler.train.config import TrainConfig, load_config
    from upcycler.transforms.moe_shapes import shapes

    source = read_spec(src)
    proposals = shapes(source, active=active, total=total, **fixed)
    chips = len(target(topology, 1).devices)
    config = (load_config(train_config, {"model.init": str(src)}) if train_config is not None
              else TrainConfig.from_dict(_default_run(src, chips, seq_len or SEQ_LEN), "--plan-seq-len"))
    rows = []
    click.echo(f"planning {len(proposals)} shape(s) for {topology}: each compiles its training step for every "
               "configuration the search tries (a few per shape; each compile's time is printed, then each shape's "
               "answer with an estimate of the time left). Figures are cached in ~/.cache/upcycler/plan: asked "
               "again, the answer comes at once.", err=True)
    began = time.perf_counter()
    for number, shape in enumerate(proposals, 1):
        click.echo(f"planning {shape.flags()} for {topology}", err=True)
        found = plan(config, topology, margin=margin, spec=shape.spec, dispatch=("gspmd",), **(narrow or {}),
                     cache=Path.home() / ".cache" / "upcycler" / "plan", log=lambda line: click.echo(line, err=True))
        best = found.best
        spent = time.perf_counter() - began
        left = len(proposals) - number
        click.echo(f"shape {number}/{len(proposals)} ({shape.flags()}): "
                   + (f"fits, MFU ≤ {best.figures.mfu:.1%} with {' '.join(best.choice.sets())}" if best
                      else "nothing fits")
                   + f"; {found.compiles} compile(s), {found.seconds:.0f} s"
                   + (f"; about {spent / number * left / 60:.0f} min for the other {left}" if left else ""), err=True)
        rows.append({"experts": shape.experts, "topk": shape.topk, "width": shape.width,
                     "total_params": shape.spec.total_params(), "active_params": shape.spec.active_params(),
                     "fits": best is not None, "peak": best.figures.peak if best else None,
                     "mfu": best.figures.mfu if best else 0.0, "bound": best.figures.bound if best else None,
                     "sets": list(best.choice.sets()) if best else [],
                     "upcycle": f"upcycle dense-to-moe {src} OUT {shape.flags()}",
                     "train": ("upcycle continued-pretrain --config TRAIN.yaml "
                               + " ".join(f"--set {s}" for s in best.choice.sets())) if best else None,
                     "compiles": found.compiles, "seconds": round(found.seconds, 1)})
    rows.sort(key=lambda r: -r["mfu"])
    if as_json:
        click.echo(json.dumps({"topology": topology, "proposals": rows}))
    else:
        click.echo(f"shapes for {source.family} ({human_count(source.total_params())} parameters) on {topology}, "
                   f"{config.data.global_batch_size} × {config.data.seq_len} tokens per step; MFU is the roofline's "
                   "bound, not a measurement")
        click.echo(f"{'experts':>7} {'top-k':>5} {'width':>6} {'total':>8} {'active':>8} {'fits':<4} {'peak':>10} "
                   f"{'MFU ≤':>6}  best configuration")
        for r in rows:
            peak = human_bytes(r["peak"]) if r["peak"] is not None else "—"
            config_text = " ".join(s.split("=", 1)[0].split(".")[-1] + "=" + s.split("=", 1)[1] for s in r["sets"])
            click.echo(f"{r['experts']:>7} {r['topk']:>5} {r['width']:>6} {human_count(r['total_params']):>8} "
                       f"{human_count(r['active_params']):>8} {'yes' if r['fits'] else 'no':<4} {peak:>10} "
                       f"{r['mfu']:>6.1%}  {config_text or 'nothing fits'}")
        for r in rows:
            if r["fits"]:
                click.echo(f"  {r['upcycle']}\n    then: {r['train']}")
    if not any(r["fits"] for r in rows):
        raise UpcyclerError(f"no proposed shape fits {topology} with {human_bytes(margin)} to spare: a larger "
                            "slice, a shorter sequence or fewer rows per step (--train-config)")


def _default_run(src: Path, chips: int, seq_len: int = SEQ_LEN) -> dict:
    """The run a shape is planned for without --train-config: `seq_len` tokens per sequence and the tokens
    per chip of `ROWS_PER_CHIP` rows of `SEQ_LEN` (at least one sequence per step; longer sequences than
    that fill fewer rows, the plan splitting each over chips), bf16 compute and weights, FSDP over every
    chip, chunked cross-entropy."""
    rows = max(1, ROWS_PER_CHIP * SEQ_LEN * chips // seq_len)
    return {"run_dir": "runs/planned", "steps": 1,
            "model": {"init": str(src), "compute_dtype": "bfloat16", "weights_dtype": "bfloat16"},
            "data": {"dir": "data", "seq_len": seq_len, "global_batch_size": rows,
                     "phases": [{"weights": {"data": 1.0}}]},
            "loss": {"ce_chunk": 512}, "mesh": {"data": 1, "fsdp": -1, "expert": 1}}
