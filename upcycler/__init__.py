"""upcycler: checkpoint surgery (depth growth, dense-to-MoE, merging) and continued pretraining in JAX."""

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec, MoESpec
from upcycler.tensors import LazyTensor, TensorMap

__all__ = ["LazyTensor", "MoESpec", "ModelSpec", "TensorMap", "UpcyclerError"]
