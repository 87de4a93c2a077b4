"""The reward spec's two planes on weightsync's strategies: ``VllmControlPlane`` /
``VllmTensorCommunicator`` over a client, and the publishers composed from them.

The client here is the two-member interface the adapters document (``sync_loop`` and
``send_update``), implemented as the reward and policy clients do it: a ``weightsync.connect``
session on its own loop thread, to real ``WeightUpdateEndpoint``s in this process
(``torch_module`` loaders on real modules) over a gloo broadcast between threads.
"""

from __future__ import annotations

import pytest
import torch

import weightsync as ws
from weightsync._runtime.threads import LoopThread
from weightsync.distributed import (
    BroadcastPolicyPublisher,
    ControlPlane,
    Rank0OnlyPublisher,
    TensorCommunicator,
    VllmControlPlane,
    VllmTensorCommunicator,
)
from weightsync.errors import WeightMismatchError
from weightsync.loaders.torch_module import TorchModuleWeightLoader


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = torch.nn.Linear(8, 16)
        self.score = torch.nn.Linear(16, 1)


class SessionClient:
    """What the adapters need of a client: its loop and ``send_update``."""

    def __init__(self, endpoints: list, bucket_size_mb: float) -> None:
        self.sync_loop = LoopThread("test-client")
        self.strategy_cfg = {"type": "broadcast", "backend": "gloo", "timeout_s": 30,
                             "bucket_size_mb": bucket_size_mb}

        async def open_session():
            return await ws.connect(endpoints, self.strategy_cfg)

        self.session = self.sync_loop.run(open_session())

    async def send_update(self, make_chunks, manifest, mode, version, timeout_s, *,
                          first_tensor=None):
        return await self.session.push_chunks(make_chunks(), manifest, version=version,
                                              training_mode=mode)

    def close(self) -> None:
        self.sync_loop.run(self.session.close())
        self.sync_loop.close()


@pytest.fixture
def rig():
    engine = Net(0)
    endpoint = ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=engine), name="eng")
    client = SessionClient([endpoint], bucket_size_mb=0.0003)  # ~1 tensor per bucket
    try:
        yield engine, endpoint, client
    finally:
        client.close()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def batch_of(state: dict) -> list[dict]:
    return [{"name": n, "dtype": str(t.dtype), "shape": tuple(t.shape)} for n, t in state.items()]


def test_the_spec_sequence_publishes_one_version(rig):
    engine, endpoint, client = rig
    control, comm = VllmControlPlane(client), VllmTensorCommunicator(client)
    assert isinstance(control, ControlPlane) and isinstance(comm, TensorCommunicator)
    new = Net(1).state_dict()
    control.announce_update_batch(batch_of(new), version=3, extra={"training_mode": "full"})
    for tensor in new.values():
        comm.broadcast(tensor, src=comm.rank)
    comm.barrier()
    stats = control.finalize_update()
    assert stats.versions == [3] and stats.num_tensors == 4 and stats.num_chunks == 2
    assert endpoint.version == 3 and _same(engine, Net(1))


def test_a_refused_batch_raises_at_announce_and_changes_nothing(rig):
    engine, endpoint, client = rig
    control, comm = VllmControlPlane(client), VllmTensorCommunicator(client)
    bad = [{"name": "backbone.nope", "dtype": "torch.float32", "shape": (3,)}]
    with pytest.raises(WeightMismatchError, match="backbone.nope"):
        control.announce_update_batch(bad, version=1)
    with pytest.raises(ValueError, match=r"extra: unknown field\(s\) \['flavour'\]"):
        control.announce_update_batch(batch_of(Net(1).state_dict()), extra={"flavour": "x"})
    assert endpoint.version == 0 and _same(engine, Net(0))
    # the planes stay usable
    BroadcastPolicyPublisher(control, comm).publish(Net(2).state_dict(), version=2)
    assert endpoint.version == 2 and _same(engine, Net(2))


def test_a_tensor_unlike_its_announcement_aborts_the_update(rig):
    engine, endpoint, client = rig
    control, comm = VllmControlPlane(client), VllmTensorCommunicator(client)
    new = Net(1).state_dict()
    control.announce_update_batch(batch_of(new), version=1)
    with pytest.raises(ValueError, match="src=5"):
        comm.broadcast(new["backbone.weight"], src=5)
    with pytest.raises(ValueError, match=r"announced as float32 \[16, 8\], got float32 \[3\]"):
        comm.broadcast(torch.zeros(3), src=comm.rank)
    with pytest.raises(ValueError, match="announced as"):
        control.finalize_update()
    assert endpoint.version == 0  # nothing published
    BroadcastPolicyPublisher(control, comm).publish(new, version=4)
    assert endpoint.version == 4 and _same(engine, Net(1))


def test_a_barrier_before_every_tensor_publishes_nothing(rig):
    engine, endpoint, client = rig
    control, comm = VllmControlPlane(client), VllmTensorCommunicator(client)
    new = Net(1).state_dict()
    control.announce_update_batch(batch_of(new))
    comm.broadcast(new["backbone.weight"], src=0)
    with pytest.raises(ValueError, match="barrier after 1 of 4 announced tensors"):
        comm.barrier()
    assert endpoint.version == 0


def test_rank0_only_publisher_builds_and_publishes_on_rank_0_only(rig):
    engine, endpoint, client = rig
    built = []

    def make():
        built.append(1)
        return BroadcastPolicyPublisher(VllmControlPlane(client), VllmTensorCommunicator(client))

    assert Rank0OnlyPublisher(make, rank=1).publish(Net(3).state_dict()) is None and not built
    stats = Rank0OnlyPublisher(make, rank=0).publish(Net(3).state_dict())  # no version: next
    assert built == [1] and stats.versions == [1] and _same(engine, Net(3))
