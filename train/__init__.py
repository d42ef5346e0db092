"""The JAX side of upcycler: the model, the dropless MoE layer, data blending, the trainer and its ahead-of-time compile reports."""

from upcycler.train.aot.topology import quiet_libtpu_without_chips

quiet_libtpu_without_chips()  # before any module of the trainer imports JAX
