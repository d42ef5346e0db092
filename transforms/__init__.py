"""Checkpoint transforms: each a frozen config plus a pure `(ModelSpec, TensorMap) -> (ModelSpec, TensorMap)`."""
