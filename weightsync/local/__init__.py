"""Engines as plain local processes (no Ray): ``LocalEngineProcess`` and its client.

See ``process.py`` (parent side), ``worker.py`` (child side), ``client.py``
(``InferenceEngineClient``) and ``modules.py`` (modules of given names/shapes, e.g. Qwen2).
"""

from weightsync.local.client import LocalEngineClient
from weightsync.local.process import LocalEngineProcess

__all__ = ["LocalEngineClient", "LocalEngineProcess"]
