"""MkDocs hook: the pages generated from the code each time the site is built, so they cannot drift.

- `index.md`, the home page, is the README, its links into `docs/` made relative to the site;
- `reference/commands.md` from the click commands of `upcycle` (`commands_page`);
- `reference/configuration.md` from the training config's dataclasses (`config_page`);
- `reference/recipes.md` from the recipe format and the transforms' options (`recipes_page`);
- `reference/merge-methods.md` from the merge registry (`merge_methods_page`).

Nothing is written into `docs/`: the pages exist only in the built site. Every page, written or
generated, is Markdown that GitHub renders too; `on_page_markdown` bridges the one difference in
tables (see `bare_table_pipes`).
"""

from __future__ import annotations

import re
from pathlib import Path

import commands_page
import config_page
import merge_methods_page
import recipes_page
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

from upcycler.cli import main

_CODE_SPAN = re.compile(r"`[^`\n]+`")


def home(config: MkDocsConfig) -> str:
    """The README as the site's home page: `](docs/x.md)` becomes `](x.md)`."""
    readme = Path(config.config_file_path).parent / "README.md"
    return readme.read_text(encoding="utf-8").replace("](docs/", "](")


def bare_table_pipes(markdown: str) -> str:
    """GitHub wants a pipe inside a table's code span escaped (`` `a\\|b` ``); Python-Markdown shows the
    backslash and needs none (a code span's pipes never split cells there): unescape them in table rows."""
    def unescape(span: re.Match) -> str:
        return span.group().replace("\\|", "|")

    return "\n".join(_CODE_SPAN.sub(unescape, line) if line.lstrip().startswith("|") else line
                     for line in markdown.split("\n"))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages to the site's files."""
    pages = {
        "index.md": home(config),
        "reference/commands.md": commands_page.render(main),
        "reference/configuration.md": config_page.render(),
        "reference/recipes.md": recipes_page.render(),
        "reference/merge-methods.md": merge_methods_page.render(),
    }
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files


def on_page_markdown(markdown: str, **_) -> str:
    """Every page's Markdown as Python-Markdown should read it."""
    return bare_table_pipes(markdown)
