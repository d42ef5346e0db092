"""Spherical linear interpolation (SLERP) between two models, tensor by tensor.

Each tensor (each expert, for stacked experts) is treated as one flat vector; the result moves along the
great circle between the two, so its norm stays between theirs instead of shrinking as a straight
average does between diverging directions. Paper: Shoemake, "Animating rotation with quaternion
curves", SIGGRAPH 1985, https://doi.org/10.1145/325165.325242.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np

from upcycler.merge.registry import Range, Tensors, merge_method

SLERP = "https://doi.org/10.1145/325165.325242"
_PARALLEL = 0.9995  # |cos| above this (within ~1.8°): interpolate linearly, the arc is a straight line


@merge_method("slerp", paper=SLERP, min_inputs=2, max_inputs=2, streams=False)
def slerp(tensors: Tensors, *, t: Annotated[float, Range(0, 1), "Position on the arc: 0 gives the first model, 1 the second"]
          = 0.5) -> np.ndarray:
    """Spherical interpolation of two models: t=0 gives the first exactly, t=1 the second exactly.

    Nearly parallel tensors, and tensors that are all zeros, are interpolated linearly.
    """
    a, b = tensors
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    cos = float(np.dot(a.reshape(-1), b.reshape(-1))) / (na * nb) if na > 0 and nb > 0 else 1.0
    if abs(cos) > _PARALLEL:
        ca, cb = 1.0 - t, t
    else:
        theta = float(np.arccos(np.clip(cos, -1.0, 1.0)))
        ca, cb = np.sin((1.0 - t) * theta) / np.sin(theta), np.sin(t * theta) / np.sin(theta)
    a *= np.float32(ca)
    b *= np.float32(cb)
    a += b
    return a
