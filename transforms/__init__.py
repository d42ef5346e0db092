"""Checkpoint transforms: each a frozen config plus a pure `(ModelSpec, TensorMap) -> (ModelSpec, TensorMap)`.

Importing the package registers every transform (`TRANSFORMS`) with what it declares for its command
(`registry.TransformHooks`); `recipe` and `pipeline` chain them.
"""

from upcycler.transforms import context, dense_to_moe, dense_to_moe_hooks, depth
from upcycler.transforms.registry import TRANSFORMS, Transform, register, report, transform_named

__all__ = ["TRANSFORMS", "Transform", "context", "dense_to_moe", "dense_to_moe_hooks", "depth", "register",
           "report", "transform_named"]
