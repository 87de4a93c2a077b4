"""The reward spec's distributed layer: a trainer publishes weights through a control plane
(``ControlPlane``: announce a batch, finalize it) and a tensor communicator
(``TensorCommunicator``: broadcast each tensor, barrier), composed by a ``PolicyPublisher``.

The vLLM adapters (``VllmControlPlane``, ``VllmTensorCommunicator``) run on weightsync's
strategies (no transport of their own): the announced batch is one update with a manifest the
engines check before any byte moves, and the broadcast tensors travel bucketed through the
client's strategy sender. Importing this package is light (no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from weightsync.distributed.interfaces import ControlPlane, PolicyPublisher, TensorCommunicator

_LAZY = {
    "VllmControlPlane": "weightsync.distributed.adapters",
    "VllmTensorCommunicator": "weightsync.distributed.adapters",
    "BroadcastPolicyPublisher": "weightsync.distributed.publisher",
    "Rank0OnlyPublisher": "weightsync.distributed.publisher",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["BroadcastPolicyPublisher", "ControlPlane", "PolicyPublisher", "Rank0OnlyPublisher",
           "TensorCommunicator", "VllmControlPlane", "VllmTensorCommunicator"]
