"""The documentation site builds with `mkdocs build --strict` (a warning, such as a broken link or anchor,
fails it), and its generated references are complete: every command of `upcycle` with every argument and
flag, every key of the training config and every key of a recipe, each in a table row of its own section
with a description. The walks here read click and the dataclasses directly, not the generator's code.
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import os
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from upcycler.cli import main
from upcycler.merge import METHODS
from upcycler.train.config import TrainConfig
from upcycler.transforms import TRANSFORMS
from upcycler.transforms.recipe import Output

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the module."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def sections(text: str) -> dict[str, str]:
    """The HTML of each `<h2>` section of a page, by the heading's id."""
    parts = re.split(r'<h2 id="([^"]+)"', text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def rows(text: str) -> dict[str, list[str]]:
    """The table rows of `text` by the first code of their first cell: {"--progress": [cells…]}."""
    found = {}
    for row in re.findall(r"<tr>(.*?)</tr>", text, re.DOTALL):
        cells = re.findall(r"<td>(.*?)</td>", row, re.DOTALL)
        if cells and cells[0].startswith("<code>"):
            found[codes(cells[0])[0]] = cells
    return found


def codes(cell: str) -> list[str]:
    """The text of each `<code>` in a cell."""
    return [html.unescape(c) for c in re.findall(r"<code>(.*?)</code>", cell)]


def plain(text: str) -> str:
    """HTML as the text a reader sees."""
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def test_the_site_builds_every_page(site: Path):
    for name in ("guide/first-session", "guide/continued-pretraining", "guarantees", "benchmarks",
                 "guide/merging", "guide/recipes", "reference/commands", "reference/configuration",
                 "reference/recipes", "reference/merge-methods"):
        assert (site / name / "index.html").is_file(), name
    assert "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q" in plain(page(site, ""))  # the README


def test_the_command_reference_lists_every_command_and_flag(site: Path):
    by_id = sections(page(site, "reference/commands"))
    ctx = click.Context(main, info_name="upcycle")
    names = main.list_commands(ctx)
    assert len(names) >= 13
    for name in names:
        section = by_id.get(f"upcycle-{name}")
        assert section is not None, f"no section for upcycle {name}"
        table = rows(section)
        params = [p for p in main.get_command(ctx, name).params if not getattr(p, "hidden", False)]
        for param in params:
            if isinstance(param, click.Argument):
                assert param.human_readable_name in table, (name, param.human_readable_name)
                continue
            flags = [*param.opts, *param.secondary_opts]
            assert flags[0] in table and codes(table[flags[0]][0]) == flags, (name, flags)
            assert table[flags[0]][3].strip(), (name, flags, "no help text")
        assert len(table) == len(params), name


def config_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, bool]]:
    """(dotted key, is a section) of every key of config dataclass `cls`; `[]` marks a list's entries."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.metadata.get('key', f.name)}" if prefix else f.metadata.get("key", f.name)
        hint = hints[f.name]
        hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint) \
            if type(None) in typing.get_args(hint) else hint
        if typing.get_origin(hint) is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            key, hint = key + "[]", typing.get_args(hint)[0]
        yield key, dataclasses.is_dataclass(hint)
        if dataclasses.is_dataclass(hint):
            yield from config_keys(hint, key)


def test_the_configuration_reference_lists_every_key(site: Path):
    text = page(site, "reference/configuration")
    table = rows(text)
    keys = list(config_keys(TrainConfig))
    assert {"model.remat", "optimizer.schedule[].until_step", "data.phases[].weights", "checkpoint.async",
            "metrics.wandb.mode", "loss.spike.action"} <= {k for k, _ in keys}
    for key, is_section in keys:
        assert key in table, key
        assert table[key][3].strip(), (key, "no meaning")
        if is_section:
            assert f'<h2 id="{key.replace("[]", "").replace(".", "-")}"' in text, (key, "no section")
    assert len(table) == len(keys)


def test_the_recipe_reference_lists_every_transform_and_key(site: Path):
    text = page(site, "reference/recipes")
    by_id = sections(text)
    for name, transform in TRANSFORMS.items():
        table = rows(by_id[name])
        for f in dataclasses.fields(transform.config):
            key = f.metadata.get("key", f.name)
            assert key in table and table[key][4].strip(), (name, key)
    example = plain(text)
    for key in ("source:", "transforms:", "output:", *(f"{f.name}:" for f in dataclasses.fields(Output))):
        assert key in example, key


def test_the_merge_method_reference_lists_every_method_and_option(site: Path):
    by_id = sections(page(site, "reference/merge-methods"))
    assert len(METHODS) >= 11
    for name, method in METHODS.items():
        section = by_id.get(name)
        assert section is not None, f"no section for merge method {name}"
        table = rows(section)
        params = [p for p in inspect.signature(method.fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
        for param in params:
            flag = "--" + param.name.rstrip("_").replace("_", "-")
            assert flag in table, (name, flag)
            assert codes(table[flag][2]) == [str(param.default)], (name, flag, "default")
            assert table[flag][3].strip(), (name, flag, "no meaning")
        assert len(table) == len(params), name


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), target
