"""Commands on remote locations: sources fetched before a command runs, outputs published after it.

Every command's callback is wrapped (`with_remote_locations`, applied by the CLI group). When a `SOURCE`
or `OUTPUT` argument names a remote location, before the command does any work (a bucket URL whose key has a
`.`, `..` or empty segment is refused first, naming its argument: `upcycler.locations.within`):

1. each bucket output is locked (`bucket_output.locked`: a second writer is refused, naming the first;
   held until the command ends) and checked (not a source, nor inside or around one; replaced only with
   `--overwrite` and only when an earlier upcycler output), so a refusal costs no download;
2. each remote source becomes a local directory: a bucket prefix mirrored into the upcycler cache, a Hub
   model fetched into the HF cache (`upcycler.io.remote_sources`); a local source that does not exist
   and reads as a Hub id (`org/name[@revision]`) is fetched from the Hub;
3. each bucket output is written to a fresh local staging directory by the command as usual (with every
   local check and the function check), then published with the commit protocol of
   `upcycler.io.bucket_output` only if the command succeeds, after checking again under the lock that
   what is at OUT then may be replaced. The staging directory is removed in every case.

What this preserves: a command given local paths runs exactly as before.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click

from upcycler.cli.path_type import LocationType, option_name
from upcycler.errors import UpcyclerError
from upcycler.io import bucket_output
from upcycler.io.object_store import is_bucket_url
from upcycler.io.remote_sources import cache_root, hub_reference, hub_snapshot, mirror
from upcycler.io.write_lock import Lock
from upcycler.locations import bucket_and_key, remember_origin, within
from upcycler.untrusted import describe

SOURCE_MAPPING = "upcycler_source_mapping"
"""Attribute set on a `NAME=PATH` mapping option whose paths are sources (`--experts-from`)."""


def _role(param: click.Parameter) -> str | None:
    if getattr(param, SOURCE_MAPPING, False):
        return "source"
    return param.type.role if isinstance(param.type, LocationType) else None


def _values(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        yield from value.values()
    elif isinstance(value, (tuple, list)):
        yield from value
    elif value is not None:
        yield value


def _is_remote_source(value: Any) -> bool:
    """A bucket URL, an hf:// id, or a relative path that does not exist and reads as a Hub id."""
    if not isinstance(value, (str, Path)):
        return False
    text = str(value)
    if is_bucket_url(text) or text.startswith("hf://"):
        return True
    return not Path(text).is_absolute() and not Path(text).exists() and hub_reference(text) is not None


def _fetch(value: Any, what: str) -> Path:
    text = str(value)
    if is_bucket_url(text):
        local = mirror(text)
    else:
        reference = hub_reference(text)
        if reference is None:
            raise UpcyclerError(f"{what}: {describe(text, 200)}: not a Hub model id; write hf://ORG/NAME[@REVISION]")
        local, text = hub_snapshot(*reference), reference[0]  # the revision is recorded from the snapshot
    remember_origin(local, text)
    return local


def _replace(value: Any, fetched: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        return {k: fetched(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(fetched(v) for v in value)
    if isinstance(value, list):
        return [fetched(v) for v in value]
    return fetched(value)


@contextmanager
def remote_io(sources: dict[str, Any], outputs: dict[str, str], *, overwrite: bool) -> Iterator[tuple[dict, dict]]:
    """Steps 1-3 of the module docstring for `sources` (named as the error lines name them; a value may be
    a path, a URL, or a tuple, list or mapping of them) and the bucket `outputs` (name: URL). Yields
    (sources with every remote value made local, outputs as local staging paths); publishes each staged
    output that exists when the body returns, and removes the staging directory in every case."""
    remote = [str(v) for value in sources.values() for v in _values(value) if _is_remote_source(v)]
    for what, value in sources.items():  # every bucket source's key stays in its bucket, before any request
        for url in (v for v in _values(value) if isinstance(v, str) and is_bucket_url(v)):
            bucket_and_key(url, what)
    if not outputs and not remote:
        yield sources, {}
        return
    with ExitStack() as held:
        locks = {url: held.enter_context(bucket_output.locked(url)) for url in outputs.values()}
        for url in outputs.values():
            bucket_output.check_output(url, overwrite=overwrite, sources=remote)
        yield from _staged(sources, outputs, locks, overwrite)


def _staged(sources: dict[str, Any], outputs: dict[str, str], locks: dict[str, Lock],
            overwrite: bool) -> Iterator[tuple[dict, dict]]:
    """Steps 2-3 of the module docstring, with each bucket output's lock (`locks`) held."""
    local_sources = {what: _replace(value, lambda v, what=what: _fetch(v, what) if _is_remote_source(v) else v)
                     for what, value in sources.items()}
    if not outputs:
        yield local_sources, {}
        return
    root = cache_root() / "staging"
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix="out-", dir=root))
    try:
        local_outputs = {name: _staging_path(stage / name, url) for name, url in outputs.items()}
        yield local_sources, local_outputs
        for name, url in outputs.items():
            if local_outputs[name].is_dir():
                bucket_output.check_output(url, overwrite=overwrite)  # again, under its lock: what is there now
                published = bucket_output.publish(local_outputs[name], url, lock=locks[url])
                click.echo(f"published {url} ({len(published)} files)")
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _staging_path(directory: Path, url: str) -> Path:
    """Where the bucket output `url` is written before it is published: `directory/NAME`, NAME the last
    segment of `url` (`within`: never outside `directory`)."""
    return Path(within(str(directory), url.rstrip("/").rsplit("/", 1)[-1], named=describe(url, 200),
                       fix="write gs://BUCKET/PATH with no '.', '..' or empty segment"))


def with_remote_locations(command: click.Command) -> click.Command:
    """Wrap `command`'s callback so its `SOURCE` and `OUTPUT` parameters may name remote locations."""
    original = command.callback
    if original is None or getattr(original, "__wrapped__", None) is not None:
        return command
    params = {p.name: p for p in command.params}

    @functools.wraps(original)
    def callback(**values: Any) -> Any:
        outputs = {name: value for name, value in values.items()
                   if name in params and _role(params[name]) == "output" and isinstance(value, str)}
        sources = {option_name(params[name]): value for name, value in values.items()
                   if name in params and _role(params[name]) == "source"}
        names = {option_name(params[name]): name for name in values if name in params}
        with remote_io(sources, outputs, overwrite=bool(values.get("overwrite"))) as (local_sources, local_outputs):
            values.update({names[what]: value for what, value in local_sources.items()}, **local_outputs)
            return original(**values)

    command.callback = callback
    return command
