"""Every guide runs as written: the shell blocks of `docs/guide/*.md` and the README (`guide_blocks.py`).

Every `upcycle` command of every block is parsed by the real command line, so a guide that names a
renamed flag, a removed command or a value an option refuses fails here, naming the guide's line. The
blocks that are not marked illustrative in the guide run as written, in an empty directory, with bash:
the first session and the recipe on the bundled model, the continued-pretraining example on the bundled
corpus (refused in one line before allocating, then trained at the small size the guide gives), the
merging guide's fine-tunes, averages and merges. An illustrative block says in the guide why it is not
run (a pod, a bucket, the Hub, a real long-context model) and where the suite covers what it does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import guide_blocks as G
import pytest

BLOCKS = [block for path in G.guide_files() for block in G.blocks(path)]
RUN = {block.where: block for block in BLOCKS if not block.illustrative}
ASSIGNMENT = re.compile(r"^(?:[A-Za-z_]\w*=|[A-Za-z_]\w*\(\)\s*\{.*\}\s*;?\s*$)")  # VAR=…, f() { …; }


def test_every_upcycle_command_in_the_guides_parses():
    checked, faults = [], []
    for block in BLOCKS:
        for line, args in G.commands(block):
            checked.append(f"{block.guide.name}:{line} upcycle {' '.join(args)}")
            why = G.check_command(args)
            if why is not None:
                faults.append(f"{block.guide.relative_to(G.ROOT)}:{line}: upcycle {args[0]}: {why}")
    print(f"{len(BLOCKS)} blocks, {len(checked)} upcycle commands parsed:", *checked, sep="\n  ")
    assert faults == []
    assert len(BLOCKS) >= 21 and len(checked) >= 54  # a parser that found nothing would pass the line above


def test_a_renamed_flag_fails_the_guide_naming_its_line():
    guide = G.ROOT / "docs" / "guide" / "first-session.md"
    text = guide.read_text(encoding="utf-8")
    assert "--granularity 8" in text
    faults = [(line, G.check_command(args)) for block in G.blocks(guide, text.replace("--granularity", "--shards"))
              for line, args in G.commands(block) if G.check_command(args) is not None]
    assert faults and all("No such option '--shards'" in why for _, why in faults), faults
    lines = text.splitlines()
    assert all("--granularity" in lines[line - 1] for line, _ in faults)


def test_every_illustrative_block_says_why_and_where_the_suite_covers_it():
    for block in BLOCKS:
        if block.illustrative:
            assert "tests/" in block.illustrative or "CI" in block.illustrative, \
                f"{block.where}: say why the block is illustrative and where the suite covers it"
    assert len(RUN) >= 11, "a block newly marked illustrative: say why in the note, and lower this count"


def test_a_shown_error_is_matched_figures_aside():
    shown = "error: train.yaml: the train step of 256 rows × 1,024 tokens needs 75.2 GB per device … data.seq_len"
    assert G.same_error(shown, shown.replace("75.2", "80.1").replace("…", "(compiled) but this host has 9 GB;"))
    assert not G.same_error(shown, shown.replace("train step", "eval step"))


@pytest.mark.heavy
@pytest.mark.parametrize("guide", sorted({block.guide.name for block in RUN.values()}))
def test_the_guides_blocks_run_as_written(guide, tmp_path):
    """Every block of `guide` not marked illustrative, in order, in one empty directory (a later block
    uses what an earlier one made); a block the guide shows refused must end in that error line."""
    assignments = ""  # the shell variables and functions earlier blocks set carry on, as in one terminal
    for block in [b for b in RUN.values() if b.guide.name == guide]:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", assignments + block.text], cwd=tmp_path,
                              capture_output=True, text=True, timeout=1200, env=_shell_env(tmp_path), check=False)
        assignments += "".join(f"{line}\n" for line in block.text.splitlines() if ASSIGNMENT.match(line))
        told = f"{block.where} ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if block.error:
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            assert proc.returncode != 0 and "Traceback" not in proc.stderr, told
            assert G.same_error(block.error, last), f"the guide shows {block.error!r}; printed {last!r}"
        else:
            assert proc.returncode == 0, told
        assert "command not found" not in proc.stderr, told  # in a $(…), which set -e does not see


def _shell_env(home: Path) -> dict[str, str]:
    """This environment with `upcycle` and `python` of this interpreter first on PATH and a HOME of the
    test's own (caches the guide fills stay with it)."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HOME": str(home)}
