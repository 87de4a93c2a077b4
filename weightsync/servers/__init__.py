"""The two HTTP servers and the control plane they share (heavy parts load on first use).

- ``reward.py``          ``weightsync serve-reward``: a vLLM pooling model, ``/score``
                         (``scoring.py``) and the control plane.
- ``policy.py``          ``weightsync serve-policy``: vLLM's own OpenAI server with the control
                         plane mounted beside it; ``versioned.py`` gates and tags every model
                         response with the weight version that produced it.
- ``control.py``         ``UpdateControl``: the server side of a weight update (gate, pause,
                         versions, communicator ids, stale updates, prefix-cache reset).
- ``control_routes.py``  the control-plane routes (one ``APIRouter``), in two dialects: ours and
                         the Ludic/TRL trainers' (``ludic.py``).
- ``vllm_transfer_routes.py`` vLLM's own weight-transfer routes on the policy server (with
                         ``--weight-transfer-config``), each update through ``UpdateControl``.
- ``_workers.py``        calls into the vLLM workers that never hold the engine core (a slice,
                         then "pending" and polls; abandoned on a new init or a close).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RewardServerConfig": "weightsync.servers.reward",
    "PolicyServerConfig": "weightsync.servers.policy",
    "UpdateControl": "weightsync.servers.control",
    "ServiceError": "weightsync.servers.control",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.servers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["PolicyServerConfig", "RewardServerConfig", "ServiceError", "UpdateControl"]
