"""Delta updates: send only what changed since the version an engine serves, exactly.

- :mod:`weightsync.delta.codec`: what travels (``DeltaSpec``, ``DeltaTarget``) and the one
  encoder / decoder both sides use;
- :mod:`weightsync.delta.tracker`: the sending rank (``DeltaTracker``, used by
  ``ws.connect(..., delta=True)``);
- :mod:`weightsync.delta.store`: the engine (``DeltaStore``, ``DeltaLoader``, used by
  ``WeightUpdateEndpoint``).
"""

from weightsync.delta.codec import DeltaSpec, DeltaTarget
from weightsync.delta.store import DeltaLoader, DeltaStore
from weightsync.delta.tracker import DeltaTracker

__all__ = ["DeltaLoader", "DeltaSpec", "DeltaStore", "DeltaTarget", "DeltaTracker"]
