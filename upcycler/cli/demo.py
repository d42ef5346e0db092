"""`upcycle demo`: the whole journey on the bundled model, as the real commands a user would type.

inspect → dense-to-moe (fine-grained, shared expert, dense first layer) → verify function preservation →
prepare-data (code, prose, math) → continued pretraining with a phase change in the blend → merge the last
checkpoints → export to HF → load with transformers and generate (if installed) → report plots.

Each step prints the command line it runs, so the demo doubles as a tutorial; everything lands in
`--out` (default `upcycler-demo/`). No network is needed: the model, tokenizer and corpus ship with the
package.
"""

from __future__ import annotations

import shlex
import shutil
import time
from importlib import resources
from pathlib import Path

import click
import yaml

from upcycler.cli.path_type import LOCAL_PATH
from upcycler.errors import UpcyclerError


def demo_assets() -> Path:
    """The bundled demo directory (model/, tokenizer.json, corpus/)."""
    return Path(str(resources.files("upcycler") / "data" / "demo"))


def _run(args: list[str]) -> None:
    """Run one `upcycle` command in-process, echoing it first; stop the demo if it fails."""
    from upcycler.cli import main

    click.secho("\n$ upcycle " + shlex.join(args), fg="cyan", bold=True)
    try:
        main.main(args=args, prog_name="upcycle", standalone_mode=False)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise UpcyclerError(f"demo step `upcycle {args[0]}` failed (exit {stop.code}); see above") from None


DEMO_SOURCES = ("code", "prose", "math")  # the bundled corpus: NAME.train.jsonl and NAME.heldout.jsonl each


def _train_config(out: Path, init: Path, steps: int, run_dir: Path) -> Path:
    switch = max(1, steps // 2)
    config = {
        "run_dir": str(run_dir),
        "steps": steps,
        "model": {"init": str(init), "tokenizer": str(init / "tokenizer.json")},
        "data": {
            "dir": str(out / "data"),
            "seq_len": 128,
            "global_batch_size": 8,
            "seed": 0,
            "phases": [
                {"until_step": switch, "weights": {"code": 0.5, "prose": 0.3, "math": 0.2}},
                {"weights": {"code": 0.2, "prose": 0.2, "math": 0.6}},
            ],
        },
        "optimizer": {"lr": 1.0e-3, "schedule": [
            {"kind": "warmup", "until_step": max(1, steps // 10)},
            {"kind": "constant", "until_step": max(2, steps * 8 // 10)},
            {"kind": "cosine", "until_step": steps, "lr": 1.0e-4},
        ]},
        "loss": {"lb_coef": 0.01, "z_coef": 0.001},
        "checkpoint": {"every": max(1, steps // 4), "keep": 4},
        "metrics": {"writers": ["jsonl", "tensorboard"], "expert_load_every": max(1, steps // 10)},
        "eval": {"every": max(1, steps // 4), "batches": 1, "sources": [f"{n}.heldout" for n in DEMO_SOURCES]},
    }
    path = out / "train.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _generate(hf_dir: Path, prompt: str) -> None:
    try:
        import torch
        import transformers
    except ImportError:
        click.echo("(transformers/torch not installed: skipping generation; pip install torch==2.13.0 "
                   "transformers to see the result generate)")
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    click.secho("\ntransformers loads the result and generates:", bold=True)
    click.echo(prompt + tok.decode(out[0, ids.shape[1]:].tolist()))


@click.command("demo")
@click.option("--out", type=LOCAL_PATH, default=Path("upcycler-demo"), show_default=True,
              help="Where every artefact of the demo goes.")
@click.option("--steps", type=click.IntRange(min=3), default=60, show_default=True,
              help="Continued-pretraining steps (at least 3: a warmup, a constant and a cosine phase).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out.")
def command(out: Path, steps: int, overwrite: bool) -> None:
    """Upcycle the bundled dense Llama into a MoE, verify it, train it, merge, export and plot."""
    assets = demo_assets()
    parent = assets / "model"
    if not (parent / "config.json").exists():
        raise UpcyclerError(f"{parent}: the bundled demo model is missing; reinstall upcycler")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UpcyclerError(f"{out}: already exists; choose another --out or pass --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    moe, run_dir, merged, hf = out / "moe", out / "run", out / "merged", out / "final-hf"
    force = ["--overwrite"] if overwrite else []

    _run(["inspect", str(parent)])
    _run(["dense-to-moe", str(parent), str(moe), "--experts", "24", "--topk", "6", "--granularity", "8",
          "--shared-experts", "2", "--dense-layers", "1", "--target", "qwen2_moe", "--seed", "0", *force])
    _run(["inspect", str(moe)])
    _run(["verify", str(parent), str(moe), "--tolerance", "1e-4"])
    corpus = assets / "corpus"
    _run(["prepare-data", "--tokenizer", str(parent / "tokenizer.json"), "--out", str(out / "data"),
          *[a for name in DEMO_SOURCES for split, source in (("train", name), ("heldout", f"{name}.heldout"))
            for a in ("--source", f"{source}={corpus / f'{name}.{split}.jsonl'}")],
          *force])
    config = _train_config(out, moe, steps, run_dir)
    if overwrite and run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run: the earlier demo's checkpoints would be refused as another run's
    _run(["continued-pretrain", "--config", str(config)])
    _run(["merge", str(run_dir), str(merged), "--last", "3", "--method", "ema", "--to", "orbax", *force])
    _run(["convert", str(merged), str(hf), "--to", "hf", *force])
    _generate(hf, "def main(")
    _run(["report", str(run_dir)])
    click.secho(f"\ndemo finished in {time.time() - started:.0f}s; everything is in {out}/", bold=True)
    click.echo(f"  watch it: tensorboard --logdir {run_dir / 'tensorboard'}  (the viewer: pip install "
               "'upcycler[profile]')")
    for name, what in ((moe, "the upcycled MoE (HF)"), (run_dir, "training run: checkpoints, metrics.jsonl, plots"),
                       (merged, "EMA of the last checkpoints (Orbax)"), (hf, "final model (HF, loads in transformers)")):
        click.echo(f"  {name}  {what}")
