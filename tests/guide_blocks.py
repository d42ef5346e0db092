"""The shell blocks of the guides and the README, and the `upcycle` commands in them, for `test_guides.py`.

A block is a fenced ```bash block of `docs/guide/*.md` or `README.md`. A block the suite does not run as
written says so in the guide itself, in the paragraph just before its fence: one starting with
`*Illustrative` that says why (a pod, a bucket, the Hub) and where the suite covers it. A block the
guide shows ending in a refusal is followed by the paragraph that says so and a ```text block with the
`error:` line: the suite runs it and compares that line, figures aside (`same_error`). Every `upcycle` command of every block, run or not,
is parsed by the real command line (`check_command`): an unknown command, a renamed or removed flag, a
value its option refuses fails the suite, naming the guide and the line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ILLUSTRATIVE = "*Illustrative"
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)
# a block the guide shows failing: the next paragraph, then a ```text block holding the `error:` line
_SHOWN_ERROR = re.compile(r"\n+(?:(?!```).)+?\n```text\n(error: [^\n]*)\n```", re.DOTALL)
_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
_SEPARATORS = re.compile(r"&&|\|\||[;|{}]|\$\(|\)|\b(?:do|then)\b")


@dataclass(frozen=True)
class Block:
    """A fenced bash block: its guide, the line of its fence, its text, and whether the guide calls it
    illustrative (not run by the suite as written)."""

    guide: Path
    line: int
    text: str
    illustrative: str  # the guide's paragraph saying why the block is not run as written, else ""
    error: str = ""  # the error line the guide shows the block ending with (a ```text block right after it)

    @property
    def where(self) -> str:
        return f"{self.guide.relative_to(ROOT)}:{self.line}"


def guide_files() -> list[Path]:
    return [*sorted((ROOT / "docs" / "guide").glob("*.md")), ROOT / "README.md"]


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The bash blocks of the guide at `path` (its `text` when given)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    found = []
    for match in _FENCE.finditer(text):
        paragraph = text[: match.start()].rstrip("\n").rsplit("\n\n", 1)[-1].strip()
        shown = _SHOWN_ERROR.match(text, match.end())
        found.append(Block(path, text.count("\n", 0, match.start()) + 1, match.group(1),
                           paragraph if paragraph.startswith(ILLUSTRATIVE) else "",
                           shown.group(1) if shown else ""))
    return found


def commands(block: Block) -> list[tuple[int, list[str]]]:
    """Every `upcycle …` command of `block` as (line in the guide, its arguments after `upcycle`): lines
    joined at a trailing backslash, comments and here-documents left out, each pipeline, list and
    command substitution split into its commands."""
    lines = block.text.splitlines()
    out: list[tuple[int, list[str]]] = []
    k, heredoc = 0, None
    while k < len(lines):
        start, line = k, lines[k]
        k += 1
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        while line.rstrip().endswith("\\") and k < len(lines):
            line = line.rstrip()[:-1] + " " + lines[k]
            k += 1
        if found := _HEREDOC.search(line):
            heredoc = found.group(1)
        for part in _simple_commands(line):
            words = shlex.split(part, posix=True)
            if words and words[0] == "upcycle":
                out.append((block.line + 1 + start, words[1:]))
    return out


def _simple_commands(line: str) -> list[str]:
    """The simple commands of one shell line, split at `;`, `|`, `&&`, `{`, `}`, `$(`, `)`, `do` and
    `then` outside quotes (a quoted string may hold any of them), a `#` comment left out."""
    parts, current, quote, i = [], "", None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            quote = None if ch == quote else quote
            current += ch
        elif ch in "'\"":
            quote = ch
            current += ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        elif separator := _SEPARATORS.match(line, i):
            parts.append(current)
            current = ""
            i = separator.end()
            continue
        else:
            current += ch
        i += 1
    return [p for p in (*parts, current) if p.strip()]


def check_command(args: list[str]) -> str | None:
    """Why the command line would refuse `upcycle ARGS` as written, or None: the command exists, every
    option is one it has, every value is one its option takes. Paths that do not exist on this machine
    are not a fault of the guide (they are made by the guide's earlier commands)."""
    import click

    from upcycler.cli import main  # the `upcycle` group

    if not args or args[0].startswith("-"):
        return "no command"
    command = main.get_command(click.Context(main), args[0])
    if command is None:
        return f"unknown command {args[0]!r}"
    try:
        command.make_context(f"upcycle {args[0]}", list(args[1:]))
    except click.exceptions.Exit:
        return None
    except click.BadParameter as err:
        message = err.format_message()
        if re.search(r"does not exist|No such file|not a directory|is not a file", message):
            return None
        return message
    except click.UsageError as err:
        return err.format_message()
    return None


def same_error(shown: str, printed: str) -> bool:
    """Whether `printed` (stderr's last line) is the error line the guide shows, every figure aside (a
    host's memory, a compile's bytes) and the guide's `…` standing for any text."""
    def pattern(line: str) -> str:
        parts = re.split(r"(…|\d[\d.,]*)", line.strip())
        return "".join(".*?" if p == "…" else r"[\d.,]+" if p[:1].isdigit() else re.escape(p) for p in parts)
    return re.fullmatch(pattern(shown), printed.strip()) is not None
