"""The reward spec's distributed protocols (structural: implement them without subclassing).

Who calls what, on the sending training rank: a ``PolicyPublisher`` announces a batch on the
``ControlPlane`` (every tensor's name, dtype and shape, in the order they will be broadcast),
broadcasts each tensor through the ``TensorCommunicator`` from ``src_rank``, joins its
``barrier`` and calls ``finalize_update``; the engines then serve the batch as one version.
All four calls block (the spec's flavour).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch


@runtime_checkable
class ControlPlane(Protocol):
    """Announces one update batch and closes it.

    ``metadata``: ``[{"name", "dtype" (``str(tensor.dtype)``), "shape"}]`` in broadcast order;
    ``version``: the version the engines publish (None or 0: the next one); ``extra``: fields
    the update carries (``{"training_mode": "full" | "lora" | "head_only"}``)."""

    def announce_update_batch(
        self, metadata: list[dict[str, Any]], version: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None: ...

    def finalize_update(self) -> Any: ...


@runtime_checkable
class TensorCommunicator(Protocol):
    """Moves the announced tensors: one ``broadcast`` per tensor from ``src`` (this rank,
    ``rank``), in the announced order, then a ``barrier``."""

    @property
    def rank(self) -> int: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def barrier(self) -> None: ...


@runtime_checkable
class PolicyPublisher(Protocol):
    """The one interface a trainer talks to: publish a state dict as one version."""

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> Any: ...
