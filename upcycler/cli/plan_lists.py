"""The comma-separated lists that narrow a plan's search (`--plan-remat none,full`, `--plan-microbatches
1,2`), read the same way by `continued-pretrain --plan` and `dense-to-moe --plan-for`."""

from __future__ import annotations

from upcycler.errors import UpcyclerError


def listed(text: str | None, option: str, allowed: tuple[str, ...] | None) -> tuple | None:
    """A comma-separated option's values (positive integers where `allowed` is None), or None when unset;
    anything else is refused in one line naming `option`."""
    if text is None:
        return None
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if allowed is None:
        if not values or not all(v.isdigit() and int(v) > 0 for v in values):
            raise UpcyclerError(f"{option} takes positive integers separated by commas, e.g. 1,2,4; got {text!r}")
        return tuple(int(v) for v in values)
    unknown = [v for v in values if v not in allowed]
    if not values or unknown:
        raise UpcyclerError(f"{option}: {', '.join(map(repr, unknown)) or 'nothing given'}; "
                            f"choose from {', '.join(allowed)}")
    return values
