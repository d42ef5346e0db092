"""Writing one report figure: the PNG file and the one error a failed write gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from upcycler.errors import UpcyclerError


def save(fig: Any, path: Path) -> str:
    """Write `fig` to `path` and return the file's name."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise UpcyclerError(
            f"{path.name}: cannot write ({err.strerror}); free space or choose another --out"
        ) from None
    finally:
        plt.close(fig)
    return path.name
