"""Engines as plain local processes (no Ray): ``LocalEngineProcess``.

See ``process.py`` (parent side), ``worker.py`` (child side) and ``modules.py`` (modules of
given names/shapes, e.g. Qwen2). The sending side reaches them through
``weightsync.clients.FanOutClient`` (``LocalChannel``).
"""

from weightsync.local.process import LocalEngineProcess

__all__ = ["LocalEngineProcess"]
