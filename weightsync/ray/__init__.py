"""Ray wiring: trainer and engine actor mixins, ready-made torch-module actors, and a controller
that wires a sync group and runs syncs (the trainer reaches engine actors through
``weightsync.clients.FanOutClient``: ``RayChannel``).

    import ray
    from weightsync.ray import (
        spawn_engine_actors, spawn_trainer_actor, wire_sync_group, run_sync,
    )

    engines = spawn_engine_actors(2, "weightsync.bench.shapes:build_module", {"shape": "tiny"})
    trainer = spawn_trainer_actor("weightsync.bench.shapes:build_module", {"shape": "tiny"})
    group = wire_sync_group(trainer, engines, {"type": "broadcast", "backend": "gloo"})
    run_sync(group)   # -> stats dict, engines publish version 1

Your own actors: mix ``WeightSyncEngineMixin`` into the inference actor (implement
``_weightsync_loader``) and ``WeightSyncTrainerMixin`` into the training actor (implement
``_weightsync_model``). Importing this package does not import Ray; Ray is imported where used.
"""

from weightsync.ray.actors import (
    TorchModuleEngineActor,
    TorchModuleTrainerActor,
    load_factory,
    spawn_engine_actors,
    spawn_trainer_actor,
)
from weightsync.ray.controller import (
    SyncGroup,
    close_sync_group,
    close_sync_group_async,
    run_sync,
    run_sync_async,
    wire_sync_group,
    wire_sync_group_async,
)
from weightsync.ray.engine import WeightSyncEngineMixin
from weightsync.ray.trainer import WeightSyncTrainerMixin

__all__ = [
    "SyncGroup", "TorchModuleEngineActor", "TorchModuleTrainerActor",
    "WeightSyncEngineMixin", "WeightSyncTrainerMixin", "close_sync_group",
    "close_sync_group_async", "load_factory", "run_sync", "run_sync_async",
    "spawn_engine_actors", "spawn_trainer_actor", "wire_sync_group", "wire_sync_group_async",
]
