"""What `upcycle eval` shows: the result of one or two models' runs (`--json`), the table, and the plot.

`summarize` turns the per-item outcomes of `upcycler.train.evaluation.long_eval.evaluate` into a JSON-ready result:
by length (accuracy, NLL, the fraction of key blocks computed), by needle depth decile, per user prompt,
and, with a second model, the last-token KL(A‖B) and top-1 agreement. `format_table` renders it as text
and `plot` as a PNG (written to a hidden file and renamed into place).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.evaluation.long_eval import (
    DECILES,
    Item,
    decile_means,
    depth_bucket,
    kl_and_agreement,
    show_length,
)
from upcycler.untrusted import describe, shown_path

# --- the result -----------------------------------------------------------------------------------------


def _model_summary(task: str, items: Sequence[Item], outs: Sequence[dict[str, Any]],
                   flex: bool) -> dict[str, Any]:
    """One model's numbers over the items of one length."""
    summary: dict[str, Any] = {}
    if task == "perplexity":
        nll = np.concatenate([o["nll"] for o in outs])
        deciles = np.nanmean([decile_means(o["nll"], it.length) for it, o in zip(items, outs)], axis=0)
        summary.update(nll=float(nll.mean()), ppl=float(math.exp(min(nll.mean(), 700.0))),
                       nll_by_decile=[_num(v) for v in deciles], nll_first10=_num(deciles[0]),
                       nll_last10=_num(deciles[-1]))
    else:
        scored = [o["retrieved"] for o in outs if o["retrieved"] is not None]
        summary["accuracy"] = float(np.mean(scored)) if scored else None
        if task == "needle":
            buckets: dict[int, list[bool]] = {}
            for it, o in zip(items, outs):
                buckets.setdefault(depth_bucket(it.info["target_depth"]), []).append(o["retrieved"])
            summary["accuracy_by_depth"] = {f"{10 * k}%": float(np.mean(v))
                                            for k, v in sorted(buckets.items())}
    if flex:
        layers = np.stack([o["density"] for o in outs]).mean(axis=0)
        sparse = np.stack([o["sparse"] for o in outs]).mean(axis=0)
        summary.update(density=float(layers.mean()), density_by_layer=[float(v) for v in layers],
                       sparse_by_layer=[float(v) for v in sparse])
    return summary


def _num(value: float) -> float | None:
    return None if not np.isfinite(value) else float(value)


def summarize(task: str, items: Sequence[Item], outs: Sequence[dict[str, Any]],
              vs_outs: Sequence[dict[str, Any]] | None, *, flex: bool, header: dict[str, Any],
              decode: Callable[[int], str] = str) -> dict[str, Any]:
    """The machine-readable result: per length (`lengths`) and per item (`items`), for MODEL (`model`)
    and OTHER (`vs`), with the KL and top-1 agreement between them."""
    pairs = None  # perplexity has no last-token distribution to compare: its NLLs are compared instead
    if vs_outs is not None and task != "perplexity":
        pairs = [kl_and_agreement(a, b) for a, b in zip(outs, vs_outs)]
    rows = []
    for index, (item, out) in enumerate(zip(items, outs)):
        row = {"length": item.length, **item.info}
        for key, record in (("model", out), ("vs", None if vs_outs is None else vs_outs[index])):
            if record is None:
                continue
            shown = {}
            if task == "perplexity":
                shown["nll"] = float(record["nll"].mean())
            else:
                shown.update(top1=record["top1"], top1_text=decode(record["top1"]),
                             retrieved=record["retrieved"])
            if flex:
                shown["density"] = float(record["density"].mean())
                shown["sparse_layers"] = int(record["sparse"].sum())
            row[key] = shown
        if pairs is not None:
            row["kl"], row["top1_agree"] = pairs[index][0], pairs[index][1]
        rows.append(row)
    lengths = []
    for length in sorted({it.length for it in items}):
        picked = [k for k, it in enumerate(items) if it.length == length]
        group = [items[k] for k in picked]
        entry: dict[str, Any] = {"length": length, "prompts": len(picked),
                                 "model": _model_summary(task, group, [outs[k] for k in picked], flex)}
        if vs_outs is not None:
            entry["vs"] = _model_summary(task, group, [vs_outs[k] for k in picked], flex)
        if pairs is not None:
            kls = [pairs[k][0] for k in picked]
            entry.update(kl_mean=float(np.mean(kls)), kl_max=float(np.max(kls)),
                         top1_agreement=float(np.mean([pairs[k][1] for k in picked])))
        lengths.append(entry)
    result = {**header, "task": task, "lengths": lengths, "items": rows}
    if task != "perplexity":
        result["accuracy"] = {key: _overall([r[key]["retrieved"] for r in rows])
                              for key in ("model", "vs") if rows and key in rows[0]}
    return result


def _overall(flags: Sequence[bool | None]) -> float | None:
    scored = [f for f in flags if f is not None]
    return float(np.mean(scored)) if scored else None


# --- text -----------------------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:  # the first column left-aligned, the numbers right-aligned
        return "  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(cells, widths)))

    return [line(header), *(line(r) for r in rows)]


def format_table(result: dict[str, Any]) -> str:
    """The result for people: a table by length (and by needle depth, or one row per user prompt)."""
    task, vs = result["task"], result.get("vs_path") is not None
    flex = result.get("attention") == "flexprefill"
    what = {"needle": "needle retrieval", "perplexity": "perplexity", "prompts": "prompts"}[task]
    how = result["attention"] + " attention"
    if vs and result.get("vs_attention") not in (None, result["attention"]):
        how += f" vs {result['vs_attention']} attention"
    how += f", seed {result['seed']}" if task != "prompts" else ""
    lines = [f"{what}: {result['model_path']}" + (f" vs {result['vs_path']}" if vs else "") + f" ({how})"]
    if task == "prompts":
        header = ["#", "tokens", "top-1", "greedy = answer"]
        header += ["vs top-1", "vs greedy = answer", "KL(A‖B)", "top-1 agree"] if vs else []
        rows = []
        for r in result["items"]:
            cells = [str(r["index"]), str(r["length"]), describe(r["model"]["top1_text"], 24),
                     _flag(r["model"]["retrieved"])]
            if vs:
                cells += [describe(r["vs"]["top1_text"], 24), _flag(r["vs"]["retrieved"]), f"{r['kl']:.2e}",
                          "yes" if r["top1_agree"] else "no"]
            rows.append(cells)
        lines += _grid(header, rows)
        acc = result["accuracy"]
        if acc.get("model") is not None:
            lines.append("accuracy: " + _pct(acc["model"]) + (f" (vs {_pct(acc.get('vs'))})" if vs else ""))
        return "\n".join(lines)
    header = ["length", "prompts" if task == "needle" else "windows"]
    if task == "needle":
        header += ["accuracy"] + (["vs accuracy", "KL(A‖B) mean", "top-1 agree"] if vs else [])
    else:
        header += ["NLL", "PPL", "NLL first 10%", "NLL last 10%"]
        header += ["vs NLL", "vs PPL", "vs last 10%"] if vs else []
    if flex:
        header += ["key blocks computed"] + (["vs key blocks"] if vs else [])
    rows = []
    for e in result["lengths"]:
        m = e["model"]
        cells = [show_length(e["length"]), str(e["prompts"])]
        if task == "needle":
            cells.append(_pct(m["accuracy"]))
            if vs:
                cells += [_pct(e["vs"]["accuracy"]), f"{e['kl_mean']:.2e}", _pct(e["top1_agreement"])]
        else:
            cells += [f"{m['nll']:.4f}", f"{m['ppl']:.3f}", _fixed(m["nll_first10"]), _fixed(m["nll_last10"])]
            if vs:
                cells += [f"{e['vs']['nll']:.4f}", f"{e['vs']['ppl']:.3f}", _fixed(e["vs"]["nll_last10"])]
        if flex:
            cells.append(_pct(m["density"]))
            if vs:
                cells.append(_pct(e["vs"]["density"]))
        rows.append(cells)
    lines += _grid(header, rows)
    if task == "needle":
        depths = sorted({d for e in result["lengths"] for d in e["model"]["accuracy_by_depth"]},
                        key=lambda s: int(s[:-1]))
        lines.append("accuracy by needle depth" + (" (model / vs)" if vs else ""))
        rows = []
        for d in depths:
            cells = [d]
            for e in result["lengths"]:
                a = e["model"]["accuracy_by_depth"].get(d)
                cells.append(_pct(a) + (f" / {_pct(e['vs']['accuracy_by_depth'].get(d))}" if vs else ""))
            rows.append(cells)
        lines += _grid(["depth", *(show_length(e["length"]) for e in result["lengths"])], rows)
    return "\n".join(lines)


def _flag(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def _fixed(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


# --- the plot -------------------------------------------------------------------------------------------


def check_plot_path(path: Path, task: str, inputs: Sequence[Path] = ()) -> Path:
    """Refuse a --plot that cannot be written (before any work), that is not a .png, that would replace
    something other than a regular file (a device, a FIFO) or land inside one of `inputs` (the models,
    --data, FILE), or a task without a plot."""
    path = Path(path)
    if task == "prompts":
        raise UpcyclerError("--plot: draws the needle and perplexity tasks (by length and depth); drop it "
                            "for --task prompts")
    try:  # a name longer than the filesystem allows would make every check below raise
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot write --plot there ({err.strerror}); choose another "
                            "path") from None
    except ValueError:  # a NUL byte, or a lone surrogate that no file name can hold
        raise UpcyclerError(f"{shown_path(path)}: --plot is not a file name this system can hold; choose "
                            "another path") from None
    if path.is_dir():
        raise UpcyclerError(f"{shown_path(path)}: --plot is a directory; pass a file name such as eval.png")
    if path.suffix.lower() != ".png":
        raise UpcyclerError(f"{shown_path(path)}: --plot writes a PNG; pass a file name ending in .png")
    if not path.parent.is_dir():
        raise UpcyclerError(f"{shown_path(path.parent)}: no such directory for --plot; create it or choose "
                            "another path")
    if path.exists() and not path.is_symlink() and not path.is_file():  # replacing a link spares its target
        raise UpcyclerError(f"{shown_path(path)}: --plot exists and is not a regular file (a device, pipe or "
                            "socket); choose another --plot")
    target = path.parent.resolve() / path.name
    for source in inputs:
        source = Path(source).resolve()
        if target == source or source in target.parents:
            raise UpcyclerError(f"{shown_path(path)}: --plot is inside an input ({shown_path(source)}), which "
                                "eval never modifies; choose a path outside it")
    probe = path.with_name(f".{path.name}.partial-{os.getpid()}.png")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        probe.unlink()
    except OSError as err:
        raise UpcyclerError(f"{shown_path(path)}: cannot write --plot there ({err.strerror}); choose another "
                            "path") from None
    return path


def plot(result: dict[str, Any], path: Path, inputs: Sequence[Path] = ()) -> Path:
    """A PNG of accuracy (needle) or NLL (perplexity) by length and by depth, for both models with --vs;
    drawn into a hidden sibling and renamed into place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = check_plot_path(path, result["task"], inputs)
    needle = result["task"] == "needle"
    entries = result["lengths"]
    lengths = [e["length"] for e in entries]
    models = [("model", result["model_path"], "-", "o")]
    if result.get("vs_path"):
        models.append(("vs", result["vs_path"], "--", "x"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(1, len(entries))))
    for key, name, style, marker in models:
        values = [e[key]["accuracy"] if needle else e[key]["nll"] for e in entries]
        left.plot(lengths, [np.nan if v is None else v for v in values], style, marker=marker, color="black",
                  label=Path(name).name or name)
        for colour, e in zip(colours, entries):
            if needle:
                by = e[key]["accuracy_by_depth"]
                xs, ys = [int(k[:-1]) for k in by], list(by.values())
            else:
                xs = [10 * k + 5 for k in range(DECILES)]
                ys = [np.nan if v is None else v for v in e[key]["nll_by_decile"]]
            label = show_length(e["length"]) + (f" ({Path(name).name})" if len(models) > 1 else "")
            right.plot(xs, ys, style, marker=marker, markersize=4, color=colour, label=label)
    ylabel = "needle accuracy" if needle else "mean next-token NLL (nats)"
    left.set_xscale("log", base=2)
    left.set(xlabel="prompt length (tokens)", ylabel=ylabel, title=f"{ylabel} by length")
    left.set_xticks(lengths, [show_length(v) for v in lengths])
    left.minorticks_off()
    right.set(xlabel="needle depth (% of the prompt)" if needle else "position in the window (%)",
              ylabel=ylabel, title=f"{ylabel} by depth")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if needle:
            ax.set_ylim(-0.05, 1.05)
    staged = path.with_name(f".{path.name}.partial-{os.getpid()}.png")
    try:
        fig.tight_layout()
        fig.savefig(staged, dpi=110)
        os.replace(staged, path)
    except OSError as err:
        staged.unlink(missing_ok=True)
        message = f"{shown_path(path)}: cannot write ({err.strerror}); choose another --plot"
        raise UpcyclerError(message) from None
    except BaseException:  # Ctrl-C (or a matplotlib error) mid-save: no half-written staging file stays behind
        staged.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
