"""A sharded trainer on Ray actors sends from every rank with an IPC strategy: two trainer actors
joined by a real gloo default group, each holding its FSDP2 shard of the same module, wired with
``cuda_ipc`` (shared memory on CPU) to two engine actors through the controller
(``wire_sync_group`` / ``run_sync``). Every rank gathers the full weights anyway, so each keeps
its copy and sends handles to it (``every_rank``, decided because the model is sharded, though
the extractor is the plain ``hf`` one); rank 0
gathers the handles and talks to the engines, and engine ``i`` reads training rank ``i``'s copy.
The engines then hold exactly the unsharded module."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

FACTORY = "weightsync.bench.shapes:build_module"
TINY = {"shape": "tiny", "dtype": "float32"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_a_sharded_trainer_on_ray_sends_every_ranks_copy(ray_cluster):
    from weightsync.bench.shapes import build_module
    from weightsync.digest import module_digest
    from weightsync.ray import (
        close_sync_group,
        run_sync,
        spawn_engine_actors,
        spawn_trainer_actor,
        wire_sync_group,
    )
    from weightsync.testing.servers import free_port

    def shard(self, rank: int, world: int, port: int) -> str:  # runs in each trainer actor
        import os

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weightsync.extractors.auto import model_kind

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fully_shard(self.module, mesh=init_device_mesh("cpu", (world,)))
        return model_kind(self.module)

    def leave(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

    def replica(self) -> int:  # runs in each engine actor: whose copy it read last
        return self._weightsync_endpoint().receiver.last_replica

    trainers = [spawn_trainer_actor(FACTORY, {**TINY, "seed": 0}, name=f"rank{r}")
                for r in range(2)]
    engines = spawn_engine_actors(2, FACTORY, {**TINY, "fill": 0.0},
                                  names=["engine0", "engine1"])
    try:
        port = free_port()
        assert ray.get([t.__ray_call__.remote(shard, r, 2, port)
                        for r, t in enumerate(trainers)]) == ["fsdp", "fsdp"]
        # the hf extractor, not a sharded one: the model's kind decides (its DTensors are
        # gathered with full_tensor() on every rank)
        group = wire_sync_group(trainers, engines, {"type": "cuda_ipc", "timeout_s": 60},
                                extractor_cfg={"type": "hf", "bucket_size_mb": 0.05})
        want = module_digest(build_module(**TINY, seed=0))
        for step in (1, 2):
            stats = run_sync(group)
            assert stats["versions"] == [step, step] and stats["num_chunks"] > 1
            assert ray.get([e.state_digest.remote() for e in engines]) == [want, want]
            # engine 1 read training rank 1's copy: handles came from every rank
            assert ray.get([e.__ray_call__.remote(replica) for e in engines]) == [0, 1]
        close_sync_group(group)
        ray.get([t.__ray_call__.remote(leave) for t in trainers])
    finally:
        for a in (*trainers, *engines):
            ray.kill(a)
