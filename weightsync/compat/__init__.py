"""Other RL frameworks' released weight-sync APIs on weightsync's strategies: a trainer written
to one switches by changing its imports. ``skyrl``: skyrl-train 0.3.1's ``weight_sync``.
Nothing here is imported by ``import weightsync``."""
