"""The model card of an upcycler output: a README.md rendered from its manifest `upcycler.json`.

YAML front matter gives the licence (when every source agrees on one), the base model(s) on the Hub and
the tags; the Markdown body gives the lineage step by step, the architecture with total and active
parameter counts, how function preservation was checked, how to load the model, and each file's size and
sha256. A local source is named by its directory name only, never by its path.

The manifest is untrusted input: it is read bounded (`upcycler.io.manifest.read_manifest`), its spec is validated
by `ModelSpec` before any parameter is counted, and a value of an unexpected type is rendered as is or
skipped, never a crash. Looking up a source's licence (its README front matter or config.json, read
size-capped through `upcycler.untrusted`) is best effort: an unreadable or hostile file gives no licence.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from upcycler.errors import UpcyclerError
from upcycler.io.hf_read import read_json
from upcycler.io.manifest import REWRITE, read_manifest
from upcycler.spec import ModelSpec
from upcycler.summary import expert_runs
from upcycler.units import human_bytes, human_count
from upcycler.untrusted import parse_yaml, read_text, shown_path

MAX_README_BYTES = 4 * 1024**2
MAX_SOURCE = 4096  # characters of a source name that are treated as a path or repo id (PATH_MAX)
CONFIG = "config.json"
_FRONT_MATTER = re.compile(r"\s*---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|$)", re.DOTALL)


def render_model_card(directory: str | os.PathLike[str], *, repo_id: str | None = None) -> str:
    """A README.md (YAML front matter + Markdown) describing the model in `directory` from its manifest."""
    root = Path(directory)
    manifest = read_manifest(root)
    spec = manifest.spec()
    lineage = list(manifest.lineage)
    licenses = _source_licenses(lineage, read_json(root / CONFIG, REWRITE))
    title = repo_id.split("/")[-1] if repo_id else root.resolve().name
    sections = [
        f"# {title}",
        _intro(lineage),
        _lineage_section(lineage, licenses),
        _architecture_section(spec),
        _verification_section(manifest.extra.get("verification")),
        _usage_section(repo_id),
        _files_section({name: {"bytes": size, "sha256": sha}
                        for name, (size, sha) in manifest.file_records().items()}),
    ]
    front = yaml.safe_dump(_front_matter(spec, lineage, licenses), sort_keys=False, allow_unicode=True)
    return "---\n" + front + "---\n\n" + "\n\n".join(s for s in sections if s) + "\n"


def _front_matter(spec: ModelSpec, lineage: list[dict], licenses: dict[str, str]) -> dict[str, Any]:
    front: dict[str, Any] = {}
    if len(set(licenses.values())) == 1:
        front["license"] = next(iter(licenses.values()))
    bases = list(dict.fromkeys(h for h in map(_hub_id, _sources(lineage)) if h))
    if bases:
        front["base_model"] = bases[0] if len(bases) == 1 else bases
    tags = ["upcycler"] + (["moe"] if spec.moe else [])
    tags += ["merge"] if any(e.get("step") == "merge" for e in lineage) else []
    front.update(tags=tags, library_name="transformers", pipeline_tag="text-generation")
    return front


def _sources(lineage: list[dict]) -> list[str]:
    """Every model the lineage read or merged, in order, without repeats."""
    out = []
    for entry in lineage:
        if entry.get("step") == "read" and entry.get("source"):
            out.append(str(entry["source"]))
        elif entry.get("step") == "merge":
            out.extend(source for source, _ in _merge_inputs(entry))
        for _, source, inner in _expert_models(entry):
            out.extend(_sources(inner) or [source])
    return list(dict.fromkeys(out))


def _expert_models(entry: dict[str, Any]) -> list[tuple[str, str, list[dict]]]:
    """(name, source, its lineage) of each model a step cut experts from (`dense-to-moe --experts-from`)."""
    models = entry.get("sources") if "expert_sources" in entry else None
    return [(str(m.get("name", "?")), str(m.get("source", "?")),
             [e for e in m.get("lineage", []) if isinstance(e, dict)] if isinstance(m.get("lineage"), list) else [])
            for m in (models if isinstance(models, list) else []) if isinstance(m, dict)]


def _merge_inputs(entry: dict[str, Any]) -> list[tuple[str, Any]]:
    """(source, weight) of each input of a merge step; inputs are names or dicts, weights inline or a list."""
    inputs = next((entry[k] for k in ("inputs", "sources", "models") if k in entry), None)
    inputs = inputs if isinstance(inputs, list) else []
    weights = entry.get("weights") if isinstance(entry.get("weights"), list) else []
    out = []
    for i, item in enumerate(inputs):
        weight = weights[i] if i < len(weights) else None
        if isinstance(item, dict):
            source = next((item[k] for k in ("source", "model", "path") if k in item), json.dumps(item))
            weight = item.get("weight", weight)
        else:
            source = item
        out.append((str(source), weight))
    return out


def _hub_id(source: str) -> str | None:
    """The Hub repo of a source: a repo id, or a Hub cache snapshot `…/models--ORG--NAME/snapshots/REV`."""
    if len(source) > MAX_SOURCE:
        return None
    cached = re.search(r"models--([\w.-]+?)--([\w.-]+)/snapshots/[^/]+/?$", source)
    if cached:
        return f"{cached[1]}/{cached[2]}"
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source) and _local(source) is None:
        return source
    return None


def _local(source: str) -> Path | None:
    """`source` as an existing local path, else None (an odd string from a manifest never raises)."""
    try:
        path = Path(source)
        return path if len(source) <= MAX_SOURCE and path.exists() else None
    except (OSError, ValueError):
        return None


def _source_licenses(lineage: list[dict], config: dict[str, Any]) -> dict[str, str]:
    """Licence of each read source that declares one (lineage, its README front matter, its config)."""
    found = {}
    for entry in lineage:
        if entry.get("step") == "read" and entry.get("source"):
            lic = entry.get("license") or _license_of(str(entry["source"]), entry.get("revision"))
            if lic:
                found[str(entry["source"])] = str(lic)
    if not found and config.get("license"):
        found["config.json"] = str(config["license"])
    return found


def _license_of(source: str, revision: Any) -> str | None:
    """The licence in a source's README front matter (local, or in the Hub cache), else in its config."""
    from huggingface_hub import try_to_load_from_cache

    local = _local(source)
    folder = local if local is not None and local.is_dir() else None
    readme: Any = folder / "README.md" if folder else None
    if folder is None and _hub_id(source):
        try:
            readme = try_to_load_from_cache(source, "README.md",
                                            revision=revision if isinstance(revision, str) else None)
        except (ValueError, OSError):
            readme = None
    found = _readme_license(Path(readme)) if isinstance(readme, (str, Path)) else None
    if not found and folder is not None:
        try:
            found = read_json(folder / CONFIG).get("license")
        except UpcyclerError:
            found = None
    return str(found) if found else None


def _readme_license(readme: Path) -> Any:
    """The `license` of a README's YAML front matter; None when there is none or it cannot be read."""
    try:
        match = _FRONT_MATTER.match(read_text(readme, max_bytes=MAX_README_BYTES, what="README.md"))
        meta = parse_yaml(match[1], shown_path(readme)) if match else None
    except (UpcyclerError, yaml.YAMLError):  # best effort: a source's bad README is not our output's fault
        return None
    return meta.get("license") if isinstance(meta, dict) else None


def _intro(lineage: list[dict]) -> str:
    sources = [_source_link(s) for s in _sources(lineage)]
    made = "Made with upcycler (checkpoint surgery and continued pretraining)"
    return f"{made} from {', '.join(sources)}." if sources else f"{made}."


def _source_link(source: str) -> str:
    """A Hub link for a Hub source; only the name of a local directory (its path is nobody's business)."""
    repo = _hub_id(source)
    if repo:
        return f"[{repo}](https://huggingface.co/{repo})"
    return f"local checkpoint `{Path(source).name or source}`"


def _lineage_section(lineage: list[dict], licenses: dict[str, str]) -> str:
    if not lineage:
        return "## Lineage\n\nNo lineage was recorded."
    lines = [f"{i}. {_render_step(e, licenses)}" for i, e in enumerate(lineage, 1)]
    return "## Lineage\n\n" + "\n".join(lines)


def _render_step(entry: dict[str, Any], licenses: dict[str, str]) -> str:
    rest = {k: v for k, v in entry.items() if k != "step"}
    step = str(entry.get("step", "step"))
    if step == "read":
        return _render_read(rest, licenses)
    if step == "transform":
        name = rest.pop("name", "?")
        config = rest.pop("config", None) or {}
        shown = _kv(config) if isinstance(config, dict) else json.dumps(config)
        return f"**Transform** `{name}`" + (f": {shown}" if config else "") + _extra(rest)
    if step == "merge":
        return _render_merge(rest)
    if "expert_sources" in rest:
        return _render_experts_from(step, rest)
    if step == "train":
        amounts = [_amount(rest.pop("steps", None), "steps"), _amount(rest.pop("tokens", None), "tokens")]
        done = ", ".join(a for a in amounts if a)
        return "**Continued pretraining**" + (f": {done}" if done else "") + _extra(rest)
    return f"**{step}**" + (f": {_kv(rest)}" if rest else "")


def _render_read(rest: dict[str, Any], licenses: dict[str, str]) -> str:
    source = str(rest.pop("source", "?"))
    revision = rest.pop("revision", None)
    fmt = rest.pop("format", "hf")
    for key in ("files", "license"):
        rest.pop(key, None)
    text = f"**Read** {_source_link(source)}" + (f" at revision `{revision}`" if revision else "")
    text += f" ({fmt} format)" if fmt != "hf" else ""
    text += f", license `{licenses[source]}`" if source in licenses else ""
    return text + _extra(rest)


def _render_merge(rest: dict[str, Any]) -> str:
    inputs = _merge_inputs(rest)
    method = rest.pop("method", None)
    for key in ("inputs", "sources", "models", "weights"):
        rest.pop(key, None)
    text = "**Merge**" + (f" with `{method}`" if method else "") + _extra(rest)
    for source, weight in inputs:
        text += f"\n   - {_source_link(source)}" + (f", weight {weight}" if weight is not None else "")
    return text


def _render_experts_from(step: str, rest: dict[str, Any]) -> str:
    """A step that cut experts from several models: its options, then which experts each model gave."""
    models = _expert_models(rest)
    names = rest.pop("expert_sources")
    rest.pop("sources", None)
    config = rest.pop("config", None)
    text = f"**{step}**" + (f": {_kv(config)}" if isinstance(config, dict) else "") + _extra(rest)
    if not isinstance(names, list):
        return text
    per = {name: [e for e, n in enumerate(names) if n == name] for name, _, _ in models}
    for name, source, _ in models:
        text += f"\n   - {expert_runs({name: per[name]}) if per[name] else name} from {_source_link(source)}"
    return text


def _extra(rest: dict[str, Any]) -> str:
    return f" ({_kv(rest)})" if rest else ""


def _kv(mapping: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v if isinstance(v, str) else json.dumps(v)}`" for k, v in mapping.items())


def _architecture_section(spec: ModelSpec) -> str:
    rows = [
        ("Family", f"`{spec.family}`"),
        ("Layers", _layers_text(spec)),
        ("Hidden size", str(spec.hidden_size)),
        (
            "Attention heads (query / key-value)",
            f"{spec.num_heads} / {spec.num_kv_heads}, head dim {spec.head_dim}",
        ),
        ("Vocabulary", str(spec.vocab_size)),
    ]
    if len(spec.moe_layers) < spec.num_layers:
        rows.append(("Dense MLP width", str(spec.intermediate_size)))
    if spec.moe:
        moe = spec.moe
        rows.append(
            (
                "Routed experts",
                f"{moe.num_experts}, top-{moe.top_k}, width {moe.expert_width}, `{moe.router}` router",
            )
        )
        if moe.shared_width:
            gated = ", gated" if moe.shared_gated else ""
            rows.append(("Shared expert", f"width {moe.shared_width}{gated}"))
    rows += [
        ("Tied embeddings", "yes" if spec.tie_embeddings else "no"),
        ("RoPE θ / context", f"{_number(spec.rope_theta)} / {spec.max_position_embeddings:,}"),
        ("**Parameters (total)**", _params(spec.total_params())),
        ("**Parameters (active per token)**", _params(spec.active_params())),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return "## Architecture\n\n| | |\n|---|---|\n" + table


def _layers_text(spec: ModelSpec) -> str:
    if not spec.moe:
        return str(spec.num_layers)
    dense = ", ".join(str(i) for i in spec.dense_layers)
    return f"{spec.num_layers} (" + (
        f"{len(spec.moe_layers)} MoE; dense layers: {dense})" if dense else "all MoE)"
    )


def _params(n: int) -> str:
    return f"{human_count(n)} ({n:,})" if n >= 1000 else str(n)


def _number(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:g}"


def _amount(n: Any, unit: str) -> str:
    if n is None:
        return ""
    return f"{n:,} {unit}" if isinstance(n, int) else f"{n} {unit}"


def _verification_section(verification: Any) -> str:
    if not isinstance(verification, dict) or not verification:
        return "## Verification\n\nNo logit comparison was recorded for this checkpoint."
    rest = dict(verification)
    diff, against = rest.pop("max_abs_logit_diff", None), rest.pop("against", None)
    verdict = rest.pop("verdict", None)
    parent = _source_link(str(against)) if against else "the parent"
    if rest.get("method") == "in-stream":
        text = (f"Every tensor was checked against {parent} as it was written (by digest, and each MoE "
                "block against its dense MLP)")
    else:
        text = f"Logits were compared with those of {parent}"
    finite = isinstance(diff, (int, float)) and abs(diff) < 1e300
    text += f": max \\|Δlogits\\| = {diff:.3g}." if finite else "."
    if isinstance(verdict, str):  # the check run before the write was put in place states its criterion
        shown = " ".join(verdict.replace("`", "'").split())[:1000]
        text += f" Verdict: `{shown}`."
    return "## Verification\n\n" + text + (f" Details: {_kv(rest)}." if rest else "")


def _usage_section(repo_id: str | None) -> str:
    if not repo_id:
        return ""
    load = f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")'
    return f"## Use\n\n```python\nfrom transformers import AutoModelForCausalLM\n\n{load}\n```"


def _files_section(files: dict[str, dict[str, Any]]) -> str:
    rows = "\n".join(
        f"| `{n}` | {human_bytes(e['bytes'])} | `{e['sha256']}` |" for n, e in sorted(files.items())
    )
    return "## Files\n\n| file | size | sha256 |\n|---|---|---|\n" + rows if files else ""
