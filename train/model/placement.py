"""What the model asks of whoever places it on devices, and the answer for one device.

The model names the axes of everything it computes — every parameter once, in `params.declare_tree`
(from `upcycler.layout`), and its activations where it makes them (`transformer.ACTIVATION_AXES`,
`expert_parallel.TOKEN_AXES`, ...) — and never maps a name to a mesh axis, builds a mesh or imports the
code that does. Whoever runs it over several devices passes a `Placement` to `forward`/`hidden_states`
(the trainer's is `upcycler.train.loop.sharding.PLACEMENT`, built from its rules table); without one the
model runs as on one device (`ONE_DEVICE`), which is also what every placement does when no mesh is
active. A placement changes where values live and which collectives move them, never the values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
from jax.sharding import PartitionSpec

Axes = Sequence[str | None]


class Placement(Protocol):
    """Where the model's logical axes live on the mesh it runs on. Hashable: it is a static argument."""

    expert_axis: str  # the mesh axis that splits the routed experts in expert-parallel dispatch

    def mesh(self) -> Any | None:
        """The mesh the model runs on now (an abstract mesh inside `jit`), or None for one device."""
        ...

    def spec(self, axes: Axes, shape: Sequence[int], mesh: Any) -> PartitionSpec:
        """How one array with logical `axes` and `shape` is split over `mesh`."""
        ...

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        """`x` laid out by its logical `axes` (a sharding constraint); `x` itself on one device."""
        ...

    def per_device(
        self,
        fn: Callable[..., jax.Array],
        args: Sequence[jax.Array],
        axes: Sequence[Axes],
        gathered: Sequence[bool],
        *,
        keep_local: Sequence[str] = (),
        grad_comm: str = "native",
    ) -> jax.Array:
        """`fn(*args)` run by every device on its own block of `args` (laid out by `axes`), the arguments
        marked `gathered` all-gathered first over every mesh axis but `keep_local`; the output laid out
        like the first argument. On one device: `fn(*args)`."""
        ...


class OneDevice:
    """The placement of a model on one device: no mesh, no constraint, every function run as it is."""

    expert_axis = "expert"

    def mesh(self) -> None:
        return None

    def spec(self, axes: Axes, shape: Sequence[int], mesh: Any) -> PartitionSpec:
        return PartitionSpec()

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        return x

    def per_device(self, fn, args, axes, gathered, *, keep_local=(), grad_comm="native") -> jax.Array:
        return fn(*args)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OneDevice)

    def __hash__(self) -> int:
        return hash(OneDevice)


ONE_DEVICE: Placement = OneDevice()
