"""Publishing an output directory to the Hugging Face Hub: check it, describe it, upload it.

- `validate_for_upload` proves a directory is complete before anything touches the network: `config.json`
  parses, the shard index names only shards that are there, and every file the manifest `upcycler.json`
  lists has the recorded size and sha256 (hashed in a stream).
- `render_model_card` turns the manifest into a README.md: licence and base model in the front matter,
  then lineage, architecture, parameter counts and how function preservation was checked.
- `push` creates the repo (and branch), then uploads the checked files plus the card (only when the
  directory has no README.md) from a temporary staging directory of links, so the user's directory is never
  changed. Weight files of an earlier push that this one does not replace are deleted in the same commit.
  Hub failures become one-line `UpcyclerError`s with the token scrubbed; re-running resumes an upload.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec

Echo = Callable[[str], None]

MANIFEST = "upcycler.json"
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
STALE_WEIGHTS = [SINGLE, "model-*-of-*.safetensors", INDEX]
REWRITE = "re-write the directory with upcycler"


# --- validation --------------------------------------------------------------------------------------


def validate_for_upload(directory: str | os.PathLike[str], *, echo: Echo | None = None) -> list[str]:
    """Check `directory` is a complete, uncorrupted upcycler output; return the files to upload (sorted)."""
    root = Path(directory)
    if not root.is_dir():
        raise UpcyclerError(f"{root}: not a directory; pass the output directory upcycler wrote")
    _read_json(root / CONFIG)
    files = _list_files(root)
    manifest = read_manifest(root)
    _check_weights(root, files)
    _check_manifest_files(root, manifest, files, echo or (lambda _: None))
    return files


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest `upcycler.json`, with its `files` table checked for shape."""
    manifest = _read_json(root / MANIFEST)
    if manifest.get("format") != 1:
        raise UpcyclerError(f"{root / MANIFEST}: unknown format {manifest.get('format')!r}; upgrade upcycler")
    files = manifest.get("files")
    ok = isinstance(files, dict) and all(
        isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("bytes"), int)
        for e in files.values()
    )
    if not ok:
        raise UpcyclerError(f"{root / MANIFEST}: 'files' must map names to {{sha256, bytes}}; {REWRITE}")
    return manifest


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UpcyclerError(f"{path}: missing; {REWRITE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UpcyclerError(f"{path}: unreadable JSON ({err}); {REWRITE}") from None
    if not isinstance(data, dict):
        raise UpcyclerError(f"{path}: expected a JSON object; {REWRITE}")
    return data


def _list_files(root: Path) -> list[str]:
    """Every file under `root` as a POSIX relative path, skipping hidden ones (but not `.gitattributes`)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") or name == ".gitattributes":
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(out)


def _inside(root: Path, name: Any, named_by: Path) -> Path:
    """`root / name`, refusing names that would leave `root` (absolute, or with `..`)."""
    if not (isinstance(name, str) and name and not Path(name).is_absolute() and ".." not in Path(name).parts):
        raise UpcyclerError(f"{named_by}: names {name!r}, which is outside the directory; {REWRITE}")
    return root / name


def _check_weights(root: Path, files: list[str]) -> None:
    shards = [f for f in files if SHARD.fullmatch(f)]
    if INDEX in files and SINGLE in files:
        raise UpcyclerError(
            f"{root / SINGLE}: present next to {INDEX}, so loaders would pick one; delete the stale one"
        )
    if INDEX in files:
        _check_index(root, shards)
    elif shards:
        raise UpcyclerError(f"{root / INDEX}: missing, but {shards[0]} is a shard; {REWRITE}")
    elif SINGLE not in files:
        raise UpcyclerError(f"{root}: no {SINGLE} and no {INDEX}; push a directory written by upcycler")


def _check_index(root: Path, shards: list[str]) -> None:
    weight_map = _read_json(root / INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UpcyclerError(f"{root / INDEX}: no 'weight_map'; {REWRITE}")
    named = sorted(set(weight_map.values()))
    for name in named:
        if not _inside(root, name, root / INDEX).is_file():
            raise UpcyclerError(f"{root / name}: missing, but {INDEX} names it; copy it back or {REWRITE}")
    stray = sorted(set(shards) - set(named))
    if stray:
        raise UpcyclerError(f"{root / stray[0]}: a shard {INDEX} does not name; delete it or {REWRITE}")


def _check_manifest_files(root: Path, manifest: dict[str, Any], files: list[str], echo: Echo) -> None:
    entries: dict[str, dict[str, Any]] = manifest["files"]
    unlisted = [f for f in files if f.endswith(".safetensors") and f not in entries]
    if unlisted:
        raise UpcyclerError(
            f"{root / unlisted[0]}: not listed in {MANIFEST}, so it cannot be checked; {REWRITE}"
        )
    paths = {name: _inside(root, name, root / MANIFEST) for name in sorted(entries)}
    for name, path in paths.items():
        if not path.is_file():
            raise UpcyclerError(f"{path}: missing, but {MANIFEST} lists it; copy it back or {REWRITE}")
        size, expected = path.stat().st_size, entries[name]["bytes"]
        if size != expected:
            raise UpcyclerError(
                f"{path}: {size} bytes but {MANIFEST} records {expected} (truncated?); {REWRITE}"
            )
    for name, path in paths.items():
        echo(f"checking sha256 of {name} ({_human_bytes(entries[name]['bytes'])})")
        if sha256_file(path) != entries[name]["sha256"].lower():
            raise UpcyclerError(f"{path}: sha256 differs from {MANIFEST} (corrupted or modified); {REWRITE}")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --- model card --------------------------------------------------------------------------------------


def render_model_card(directory: str | os.PathLike[str], *, repo_id: str | None = None) -> str:
    """A README.md (YAML front matter + Markdown) describing the model in `directory` from its manifest."""
    root = Path(directory)
    manifest = read_manifest(root)
    spec = _spec_of(root, manifest)
    lineage = [e for e in manifest.get("lineage") or [] if isinstance(e, dict)]
    licenses = _source_licenses(lineage, _read_json(root / CONFIG))
    title = repo_id.split("/")[-1] if repo_id else root.resolve().name
    sections = [
        f"# {title}",
        _intro(lineage),
        _lineage_section(lineage, licenses),
        _architecture_section(spec),
        _verification_section(manifest.get("verification")),
        _usage_section(repo_id),
        _files_section(manifest["files"]),
    ]
    front = yaml.safe_dump(_front_matter(spec, lineage, licenses), sort_keys=False, allow_unicode=True)
    return "---\n" + front + "---\n\n" + "\n\n".join(s for s in sections if s) + "\n"


def _spec_of(root: Path, manifest: dict[str, Any]) -> ModelSpec:
    raw = manifest.get("spec")
    try:
        return ModelSpec.from_json(raw if isinstance(raw, str) else json.dumps(raw))
    except (TypeError, ValueError, AttributeError) as err:
        raise UpcyclerError(f"{root / MANIFEST}: 'spec' is not a model spec ({err}); {REWRITE}") from None


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
    return list(dict.fromkeys(out))


def _merge_inputs(entry: dict[str, Any]) -> list[tuple[str, Any]]:
    """(source, weight) of each input of a merge step; inputs are names or dicts, weights inline or a list."""
    inputs = next((entry[k] for k in ("inputs", "sources", "models") if k in entry), None) or []
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
    """The Hub repo a source came from: a repo id itself, or a Hub cache snapshot `models--ORG--NAME/snapshots/REV`."""
    cached = re.search(r"models--([\w.-]+?)--([\w.-]+)/snapshots/[^/]+/?$", source)
    if cached:
        return f"{cached[1]}/{cached[2]}"
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source) and not Path(source).exists():
        return source
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


def _license_of(source: str, revision: str | None) -> str | None:
    """The licence in a source's README front matter (local, or in the Hub cache), else in its config."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.repocard import metadata_load

    local = Path(source)
    readme: Any = local / "README.md"
    if not local.is_dir() and _hub_id(source):
        readme = try_to_load_from_cache(source, "README.md", revision=revision)
    if isinstance(readme, (str, Path)) and Path(readme).is_file():
        try:
            found = (metadata_load(readme) or {}).get("license")
        except (yaml.YAMLError, UnicodeDecodeError, ValueError):
            found = None
        if found:
            return str(found)
    try:
        found = json.loads((local / CONFIG).read_text(encoding="utf-8")).get("license")
    except (OSError, ValueError, AttributeError):
        found = None
    return str(found) if found else None


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
        return f"**Transform** `{name}`" + (f": {_kv(config)}" if config else "") + _extra(rest)
    if step == "merge":
        return _render_merge(rest)
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
        ("RoPE θ / context", f"{spec.rope_theta:,.6g} / {spec.max_position_embeddings:,}"),
        ("**Parameters (total)**", _params(spec.total_params())),
        ("**Parameters (active per token)**", _params(spec.active_params())),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return "## Architecture\n\n| | |\n|---|---|\n" + table


def _layers_text(spec: ModelSpec) -> str:
    if not spec.moe:
        return str(spec.num_layers)
    dense = ", ".join(str(i) for i in spec.dense_layers)
    return f"{spec.num_layers} (" + (f"{len(spec.moe_layers)} MoE; dense layers: {dense})" if dense else "all MoE)")


def _params(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix} ({n:,})"
    return f"{n:,}"


def _amount(n: Any, unit: str) -> str:
    if n is None:
        return ""
    return f"{n:,} {unit}" if isinstance(n, int) else f"{n} {unit}"


def _verification_section(verification: Any) -> str:
    if not isinstance(verification, dict) or not verification:
        return "## Verification\n\nNo logit comparison was recorded for this checkpoint."
    rest = dict(verification)
    diff, against = rest.pop("max_abs_logit_diff", None), rest.pop("against", None)
    parent = _source_link(str(against)) if against else "the parent"
    text = f"Logits were compared with those of {parent}"
    text += f": max \\|Δlogits\\| = {diff:.3g}." if isinstance(diff, (int, float)) else "."
    return "## Verification\n\n" + text + (f" Details: {_kv(rest)}." if rest else "")


def _usage_section(repo_id: str | None) -> str:
    if not repo_id:
        return ""
    code = f'from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained("{repo_id}")'
    return f"## Use\n\n```python\n{code}\n```"


def _files_section(files: dict[str, dict[str, Any]]) -> str:
    rows = "\n".join(
        f"| `{n}` | {_human_bytes(e['bytes'])} | `{e['sha256']}` |" for n, e in sorted(files.items())
    )
    return "## Files\n\n| file | size | sha256 |\n|---|---|---|\n" + rows if files else ""


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exponent = min(4, (n.bit_length() - 1) // 10)
    return f"{n / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


# --- push --------------------------------------------------------------------------------------------


def push(
    directory: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    echo: Echo | None = None,
) -> str:
    """Upload a checked output directory to `repo_id` (created if missing); return the commit URL."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    say = echo or (lambda _: None)
    root = Path(directory)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UpcyclerError(f"{repo_id!r}: not a Hub repo id; use NAMESPACE/NAME") from None
    files = validate_for_upload(root, echo=say)
    card = None if "README.md" in files else render_model_card(root, repo_id=repo_id)
    token = token or get_token()
    api = HfApi(endpoint=endpoint, token=token)
    say(
        f"pushing {len(files)} files to {repo_id}"
        + (f"@{revision}" if revision else "")
        + f" at {api.endpoint}"
    )
    with _staged(root, files, card) as stage, _hub_errors(repo_id, api.endpoint, token):
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=stage,
            revision=revision,
            commit_message=commit_message or f"Upload {root.resolve().name} with upcycler",
            delete_patterns=STALE_WEIGHTS,
        )
    return str(info.commit_url)


@contextmanager
def _staged(root: Path, files: list[str], card: str | None) -> Iterator[Path]:
    """A temporary directory of links to `files`, plus README.md holding `card` when given."""
    with tempfile.TemporaryDirectory(prefix="upcycler-push-") as tmp:
        stage = Path(tmp)
        for name in files:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / name).symlink_to((root / name).resolve())
        if card is not None:
            (stage / "README.md").write_text(card, encoding="utf-8")
        yield stage


@contextmanager
def _hub_errors(repo_id: str, endpoint: str, token: str | None) -> Iterator[None]:
    """Turn Hub and network failures into one-line `UpcyclerError`s that never contain the token."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    retry = "run the same command again: a retry resumes and skips files already uploaded"
    try:
        yield
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else 0
        detail = _scrub(err.server_message or "", token)[:200]
        if status in (401, 403):
            msg = f"not authorised to write {repo_id}: set HF_TOKEN or run `hf auth login`"
        elif status == 404:
            msg = f"{repo_id} not found at {endpoint} (HTTP 404): check the repo id and --endpoint"
        elif status >= 500 or status in (408, 429):
            msg = f"the Hub failed while pushing {repo_id} (HTTP {status}{': ' + detail if detail else ''}); {retry}"
        else:
            msg = f"the Hub refused the push to {repo_id} (HTTP {status}: {detail or 'no detail'}); fix that and retry"
        raise UpcyclerError(_scrub(msg, token)) from None
    except (httpx2.TransportError, ConnectionError, TimeoutError) as err:
        msg = f"could not reach {endpoint} ({type(err).__name__}); check the network or --endpoint, then {retry}"
        raise UpcyclerError(_scrub(msg, token)) from None
    except ValueError as err:
        if "README.md" not in str(err):
            raise
        raise UpcyclerError(
            f"README.md: the Hub rejected its metadata ({_scrub(str(err), token)}); fix it"
        ) from None


def _scrub(text: str, token: str | None) -> str:
    """`text` on one line, with the token and anything shaped like a Hub token masked."""
    if token:
        text = text.replace(token, "***")
    text = re.sub(r"\bhf_[A-Za-z0-9]{8,}", "hf_***", text)
    return " ".join(text.split())
