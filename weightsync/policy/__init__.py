"""The policy side: the reference's chat client for a policy server (``weightsync serve-policy``)
and its ``ChatClient`` protocol.

Importing this package is light (no vLLM, no httpx, no torch); ``VLLMChatClient`` and its
request / response types load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "VLLMChatClient": "weightsync.policy.client",
    "ChatCompletionRequest": "weightsync.policy.types",
    "ChatResponse": "weightsync.policy.types",
    "ChatClient": "weightsync.policy.types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.policy' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["ChatClient", "ChatCompletionRequest", "ChatResponse", "VLLMChatClient"]
