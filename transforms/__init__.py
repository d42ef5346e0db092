"""Checkpoint transforms: each a frozen config plus a pure `(ModelSpec, TensorMap) -> (ModelSpec, TensorMap)`.

Importing the package registers every transform (`TRANSFORMS`); `recipe` and `pipeline` chain them.
"""

from upcycler.transforms import context, dense_to_moe, depth
from upcycler.transforms.registry import TRANSFORMS, Transform, register, report, transform_named

__all__ = ["TRANSFORMS", "Transform", "context", "dense_to_moe", "depth", "register", "report",
           "transform_named"]
