"""The interface design's controller flow on a simulated two-node Ray cluster
(``ray.cluster_utils.Cluster``): the trainer actor on node 0, two engine actors on node 1
(node-affinity scheduling). The controller does what the design's ``trainer.py`` does:
``sync_info = trainer.initialize_weight_sync(strategy, cfg, engines)`` on training rank 0, then
``engine.initialize_weight_sync(strategy, cfg, sync_info, rank_offset)`` on each engine, then
``sync_weights()``; the strategy comes from a SkyRL-style config. The broadcast group forms at
the address Ray reports for the trainer's node, and both engines end bit-exact."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FACTORY = "weightsync.bench.shapes:build_module"
TINY = {"shape": "tiny", "dtype": "float32"}


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node0": 1}, "include_dashboard": False,
        "object_store_memory": 80 * 1024 * 1024})
    cluster.add_node(num_cpus=1, resources={"node1": 1}, object_store_memory=80 * 1024 * 1024)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of(resource: str) -> dict:
    return next(n for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def test_the_designs_controller_flow_across_two_nodes(two_nodes):
    from omegaconf import OmegaConf
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import weightsync as ws
    from weightsync.ray import spawn_engine_actors, spawn_trainer_actor

    def on(resource: str) -> NodeAffinitySchedulingStrategy:
        return NodeAffinitySchedulingStrategy(node_id=_node_of(resource)["NodeID"], soft=False)

    trainer = spawn_trainer_actor(FACTORY, {**TINY, "seed": 3}, scheduling_strategy=on("node0"))
    engines = spawn_engine_actors(2, FACTORY, {**TINY, "fill": 0.0},
                                  scheduling_strategy=on("node1"))
    try:
        cfg = OmegaConf.create({"generator": {"weight_sync_backend": "gloo"},
                                "trainer": {"placement": {"colocate_all": False}}})
        strategy = ws.BroadcastTransferStrategy()  # the design's controller picks the class
        assert ws.config.resolve_strategy(cfg) == {"type": "broadcast", "backend": "gloo"}
        sync_info = ray.get(trainer.initialize_weight_sync.remote(strategy, cfg, engines))
        assert isinstance(sync_info, ws.TorchDistributedWeightSyncInfo)
        # the rendezvous is the trainer's node as Ray reports it, not an assumption of one host
        trainer_ip = ray.get(trainer.node_ip.remote())
        assert sync_info.master_addr == trainer_ip == _node_of("node0")["NodeManagerAddress"]
        assert sync_info.world_size == 3
        ray.get([e.initialize_weight_sync.remote(strategy, cfg, sync_info, 1 + i)
                 for i, e in enumerate(engines)])
        assert ray.get(trainer.train_step.remote(seed=1)) > 0
        stats = ray.get(trainer.sync_weights.remote())
        assert stats["versions"] == [1, 1]
        want = ray.get(trainer.state_digest.remote())
        assert ray.get([e.state_digest.remote() for e in engines]) == [want, want]
        nodes = {ray.get(a.node_id.remote()) for a in engines}
        assert nodes == {_node_of("node1")["NodeID"]}
    finally:
        for a in (trainer, *engines):
            ray.kill(a)
