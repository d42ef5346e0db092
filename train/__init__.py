"""The JAX side of upcycler: the model, the dropless MoE layer, data blending, the trainer and its ahead-of-time compile reports."""

from upcycler.train.aot.topology import libtpu_defaults

libtpu_defaults()  # before any module of the trainer imports JAX
