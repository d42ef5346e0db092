"""The JAX side of upcycler: the model, the dropless MoE layer, data blending and the trainer."""
