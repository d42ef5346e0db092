"""Markdown pieces the reference generators share: help text made literal, and tables.

Help texts are plain text written for a terminal: a `<step>` in them must not become an HTML tag, nor
a `*` or `_` emphasis, nor a `|` a new table column. Their backtick spans stay code.
"""

from __future__ import annotations

import html
import inspect
import re

_MARKDOWN_SIGNS = re.compile(r"([\\*_\[\]|])")


def literal(text: str) -> str:
    """`text` on one line, read as written: Markdown and HTML signs escaped outside its `code` spans."""
    parts = " ".join(text.split()).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans at all
        parts = ["`".join(parts)]
    out = []
    for k, part in enumerate(parts):
        if k % 2:
            out.append(code(part))
        else:
            out.append(_MARKDOWN_SIGNS.sub(r"\\\1", html.escape(part, quote=False)).replace("`", r"\`"))
    return "".join(out)


def code(text: str) -> str:
    """`text` as an inline code span (a table cell may hold it: its pipes are escaped)."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", r"\|")


def paragraphs(doc: str) -> list[str]:
    """A docstring or help text as Markdown paragraphs, each one line, separated by blank lines."""
    lines = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        block = block.replace("\b", "").strip()  # click's "do not rewrap" marker
        if block:
            lines += [literal(block), ""]
    return lines


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """A Markdown table; the cells are Markdown already (see `literal` and `code`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return [*lines, ""]
