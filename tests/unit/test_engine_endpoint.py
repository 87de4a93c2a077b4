"""The engine-side state machine (weightsync/engine.py), in one process.

Test doubles, for the transport only: ``WireReceiver`` takes a chunk's tensors from an in-memory
dict (``WIRE``) instead of a real data plane, and ``WireSender``/``DirectClient`` put them there
and call the endpoint directly instead of over a control plane. Everything else is real: the
endpoint, request (de)serialisation through plain dicts, the base sender pipeline, the ``hf``
extractor and the ``torch_module`` loader copying into a real module. Real transports are tested
in tests/integration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import ClassVar

import pytest
import torch

import weightsync as ws
from weightsync.engine import WeightUpdateEndpoint
from weightsync.errors import UpdateIncompleteError, WeightMismatchError, WeightSyncError
from weightsync.interfaces import (
    InferenceEngineClient,
    WeightLoader,
    WeightTransferReceiver,
    WeightTransferSender,
    WeightTransferStrategy,
)
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.registry import STRATEGIES
from weightsync.types import WeightChunk, WeightUpdateRequest

WIRE: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
STRATEGY = f"test_wire_{uuid.uuid4().hex[:6]}"


@dataclasses.dataclass(kw_only=True)
class WireRequest(WeightUpdateRequest):
    TYPE: ClassVar[str] = STRATEGY


class WireReceiver(WeightTransferReceiver):
    """Test double of a data plane: the bytes of chunk (update_id, i) are read from ``WIRE``."""

    request_cls = WireRequest

    def __init__(self, rank_offset: int) -> None:
        self.rank_offset = rank_offset
        self.closed = False
        self.refused: list[int] = []  # chunks the endpoint refused (the collective hook)

    async def refuse(self, request) -> None:
        self.refused.append(request.chunk_index)

    async def _receive_and_load(self, request, loader) -> None:
        tensors = WIRE[(request.update_id, request.chunk_index)]  # KeyError = lost bytes
        await loader.load_weights(tensors)

    def close(self) -> None:
        self.closed = True


@dataclasses.dataclass(kw_only=True)
class WireConfig(ws.StrategyConfig):
    type: str = STRATEGY


class WireStrategy(WeightTransferStrategy):
    config_cls = WireConfig

    async def create_sync_info(self, cfg, inference_client):
        return ws.EmptyWeightSyncInfo()

    async def create_sender(self, cfg, inference_client, sync_info):
        return WireSender()

    async def create_receiver(self, cfg, sync_info, rank_offset):
        return WireReceiver(rank_offset)

    @classmethod
    def get_request_type(cls):
        return WireRequest


class WireSender(WeightTransferSender):
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.released = 0

    def create_request(self, chunk: WeightChunk) -> WeightUpdateRequest:
        return WireRequest(names=chunk.names, dtypes=chunk.dtype_names, shapes=chunk.shape_lists)

    async def _transfer(self, chunk, request, inference_client) -> None:
        if request.chunk_index == self.fail_at:
            raise ConnectionError("link dropped")
        WIRE[(request.update_id, request.chunk_index)] = {
            n: t.clone() for n, t in zip(chunk.names, chunk.tensors, strict=True)
        }
        await inference_client.update_named_weights(request.to_dict())

    def _release(self, request) -> None:
        self.released += 1


class DirectClient(InferenceEngineClient):
    """Test double of the control plane: plain dicts (through JSON) straight to endpoints."""

    def __init__(self, endpoints: list[WeightUpdateEndpoint]) -> None:
        self.endpoints = endpoints

    async def get_world_sizes(self):
        return [1] * len(self.endpoints)

    async def init_weight_transfer(self, strategy_cfg, sync_info):
        for ep, off in zip(self.endpoints, self.rank_offsets(await self.get_world_sizes()), strict=True):
            await ep.init_weight_transfer(_j(strategy_cfg), _j(sync_info), off)

    async def start_weight_update(self, start):
        for ep in self.endpoints:
            await ep.start_weight_update(_j(start))

    async def update_named_weights(self, request):
        for ep in self.endpoints:
            await ep.update_named_weights(_j(request))

    async def finish_weight_update(self, finish):
        return [await ep.finish_weight_update(_j(finish)) for ep in self.endpoints]


def _j(d: dict) -> dict:
    return json.loads(json.dumps(d))


@pytest.fixture(scope="module", autouse=True)
def _wire_strategy():
    ws.register_strategy(STRATEGY)(WireStrategy)
    yield
    STRATEGIES._entries.pop(STRATEGY, None)


@pytest.fixture(autouse=True)
def _clear_wire():
    WIRE.clear()
    yield
    WIRE.clear()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _run(coro):
    return asyncio.run(coro)


class Engine:
    """An endpoint + torch_module loader on a real module, and helpers to drive one update."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self.module = module if module is not None else _model(0)
        self.ep = WeightUpdateEndpoint(TorchModuleWeightLoader(module=self.module), name="eng0")
        _run(self.ep.init_weight_transfer({"type": STRATEGY}, ws.EmptyWeightSyncInfo().to_dict(), 1))

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.module.state_dict().items()}

    def start(self, update_id: str, version: int | None, manifest=None, **kwargs) -> None:
        d = ws.WeightUpdateStart(update_id=update_id, version=version, manifest=manifest,
                                 **kwargs).to_dict()
        _run(self.ep.start_weight_update(_j(d)))

    def chunk(self, update_id: str, index: int, tensors: dict[str, torch.Tensor]) -> None:
        WIRE[(update_id, index)] = tensors
        req = WireRequest(
            names=list(tensors), dtypes=[ws.types.dtype_to_str(t.dtype) for t in tensors.values()],
            shapes=[list(t.shape) for t in tensors.values()], update_id=update_id,
            chunk_index=index,
        )
        _run(self.ep.update_named_weights(_j(req.to_dict())))

    def finish(self, update_id: str, version: int | None, num_chunks: int, ok: bool = True):
        d = ws.WeightUpdateFinish(update_id=update_id, version=version, num_chunks=num_chunks,
                                  ok=ok, error="" if ok else "sender died").to_dict()
        return _run(self.ep.finish_weight_update(_j(d)))


def _new_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _model(seed).state_dict().items()}


def _assert_weights(module, expected):
    for k, v in module.state_dict().items():
        assert torch.equal(v, expected[k]), k


def _split(w):
    names = list(w)
    return {n: w[n] for n in names[:2]}, {n: w[n] for n in names[2:]}


# -- the happy path ---------------------------------------------------------------------------------


def test_complete_update_publishes_version_and_weights():
    e = Engine()
    new = _new_weights()
    manifest = [ws.TensorMeta(n, "float32", list(t.shape)) for n, t in new.items()]
    e.start("u1", 5, manifest)
    assert e.ep.state == "receiving"
    a, b = _split(new)
    e.chunk("u1", 0, a)
    e.chunk("u1", 1, b)
    assert e.finish("u1", 5, 2) == 5
    assert (e.ep.version, e.ep.state) == (5, "idle")
    _assert_weights(e.module, new)
    e.ep.check_serving()


def test_status_says_where_the_last_complete_update_spent_its_time():
    e = Engine()
    assert e.ep.status().last_update_ms is None  # no update yet
    new = _new_weights()
    a, b = _split(new)
    e.start("u1", 1)
    e.chunk("u1", 0, a)
    e.chunk("u1", 1, b)
    e.finish("u1", 1, 2)
    ms = e.ep.status().to_dict()["last_update_ms"]
    assert set(ms) == {"start", "chunks", "commit", "finish"} and min(ms.values()) >= 0
    assert ms["chunks"] > 0  # two chunks received and loaded
    e.start("u2", 2)
    e.chunk("u2", 0, a)
    e.finish("u2", 2, 2, ok=False)  # an aborted update does not replace it
    assert e.ep.status().last_update_ms == ms


def test_version_defaults_to_previous_plus_one():
    e = Engine()
    for expected in (1, 2):
        uid = f"u{expected}"
        e.start(uid, None)
        e.chunk(uid, 0, _new_weights(expected))
        assert e.finish(uid, None, 1) == expected


def test_versions_must_increase():
    e = Engine()
    e.start("u1", 3)
    e.chunk("u1", 0, _new_weights())
    e.finish("u1", 3, 1)
    before = e.snapshot()
    for stale in (3, 2):
        with pytest.raises(WeightSyncError, match=f"update version {stale} is not newer than the served version 3"):
            e.start(f"s{stale}", stale)
    assert (e.ep.version, e.ep.state) == (3, "idle")
    _assert_weights(e.module, before)


def _counting_checks(e: Engine) -> tuple[dict, list, list]:
    """New weights, their manifest, and a list that grows at each check of the loader."""
    new = _new_weights()
    manifest = [ws.TensorMeta(n, "float32", list(t.shape)) for n, t in new.items()]
    checks: list[int] = []
    validate = e.ep.loader.validate
    e.ep.loader.validate = lambda metas: (checks.append(1), validate(metas))[1]
    return new, manifest, checks


def test_a_manifest_sent_again_is_checked_once_but_a_new_training_mode_checks_it_again():
    e = Engine()
    new, manifest, checks = _counting_checks(e)
    for v in (1, 2):
        e.start(f"u{v}", v, manifest)
        e.chunk(f"u{v}", 0, new)
        assert e.finish(f"u{v}", v, 1) == v
    assert len(checks) == 1  # the second start reused the first verdict (same manifest)
    head_only = ws.WeightUpdateStart(update_id="h", version=3, manifest=manifest,
                                     training_mode="head_only").to_dict()
    with pytest.raises(WeightMismatchError, match="not a head parameter"):
        _run(e.ep.start_weight_update(_j(head_only)))
    changed = [*manifest[:-1], ws.TensorMeta(manifest[-1].name, "float32", [3])]
    with pytest.raises(WeightMismatchError, match="shape"):
        e.start("c", 3, changed)  # another manifest: checked again, refused
    assert e.ep.version == 2


def test_a_start_may_refer_to_the_manifest_of_an_earlier_update():
    """``manifest_of``: the manifest of an update the engine parsed (a replayed update sends
    it so, not again); checked once. A reference to a manifest the engine does not hold (never
    seen, or pushed out by KEPT_MANIFESTS later ones) is refused before anything changes."""
    from weightsync.engine import KEPT_MANIFESTS
    from weightsync.errors import ManifestUnknownError

    e = Engine()
    new, manifest, checks = _counting_checks(e)
    e.start("u1", 1, manifest)
    e.chunk("u1", 0, new)
    assert e.finish("u1", 1, 1) == 1
    e.start("u2", 2, manifest_of="u1")
    e.chunk("u2", 0, _new_weights(2))
    assert e.finish("u2", 2, 1) == 2
    assert len(checks) == 1  # the referred manifest's verdict stands
    before = e.snapshot()
    with pytest.raises(ManifestUnknownError, match="manifest of update nope"):
        e.start("u3", 3, manifest_of="nope")
    assert (e.ep.version, e.ep.state) == (2, "idle")
    _assert_weights(e.module, before)
    for i in range(KEPT_MANIFESTS):  # other manifests push it out
        e.start(f"o{i}", 0, manifest[: 1 + i % 2])
        e.finish(f"o{i}", 0, 0, ok=False)
    with pytest.raises(ManifestUnknownError):
        e.start("u4", 3, manifest_of="u1")
    assert e.ep.version == 2


def test_version_zero_means_the_next_version():
    """The reference's rule: a forced version of 0 (falsy) bumps the served one."""
    e = Engine()
    for expected in (1, 2):
        e.start(f"z{expected}", 0)
        e.chunk(f"z{expected}", 0, _new_weights(expected))
        assert e.finish(f"z{expected}", 0, 1) == expected


def test_allow_version_reset_takes_the_version_as_given():
    """A trainer that restarted its count: refused by default, published as given when the
    start allows a reset (the reference server's rule)."""
    e = Engine()
    e.start("u1", 7)
    e.chunk("u1", 0, _new_weights(1))
    assert e.finish("u1", 7, 1) == 7
    with pytest.raises(WeightSyncError, match="not newer"):
        e.start("u2", 1)
    e.start("u3", 1, allow_version_reset=True)
    e.chunk("u3", 0, _new_weights(2))
    assert e.finish("u3", 1, 1) == 1 and e.ep.version == 1
    _assert_weights(e.module, _new_weights(2))


# -- bad input changes nothing ---------------------------------------------------------------------


def test_start_with_bad_manifest_leaves_version_and_weights_untouched():
    e = Engine()
    before = e.snapshot()
    manifest = [
        ws.TensorMeta("0.weight", "float32", [8, 4]),
        ws.TensorMeta("0.wieght", "float32", [8, 4]),  # unknown
        ws.TensorMeta("2.weight", "float32", [3, 8]),  # wrong shape
        ws.TensorMeta("2.bias", "float16", [2]),  # wrong dtype
    ]
    with pytest.raises(WeightMismatchError) as err:
        e.start("bad", 1, manifest)
    assert len(err.value.offenders) == 3
    assert "0.wieght" in str(err.value) and "2.weight: shape [3, 8]" in str(err.value)
    assert (e.ep.version, e.ep.state) == (0, "idle")
    _assert_weights(e.module, before)
    e.ep.check_serving()
    with pytest.raises(WeightSyncError, match="without a matching start_weight_update"):
        e.chunk("bad", 0, {"0.weight": torch.zeros(8, 4)})
    _assert_weights(e.module, before)


def test_first_chunk_rejected_by_validation_is_not_torn():
    e = Engine()
    before = e.snapshot()
    e.start("u", 1)  # no manifest: each chunk is validated on arrival
    with pytest.raises(WeightMismatchError, match="2.bias: shape"):
        e.chunk("u", 0, {"0.weight": torch.ones(8, 4), "2.bias": torch.ones(5)})
    _assert_weights(e.module, before)  # nothing of the chunk was loaded
    e.finish("u", 1, 1, ok=False)
    assert (e.ep.version, e.ep.state) == (0, "idle")
    e.ep.check_serving()


def test_out_of_order_and_foreign_chunks_refused():
    e = Engine()
    e.start("u", 1)
    a, b = _split(_new_weights())
    with pytest.raises(WeightSyncError, match="expected chunk 0, got 1"):
        e.chunk("u", 1, b)
    with pytest.raises(WeightSyncError, match="update 'other'"):
        e.chunk("other", 0, a)
    with pytest.raises(WeightSyncError, match="finish for unknown update 'other'"):
        e.finish("other", 1, 1)


def test_request_of_another_strategy_refused():
    e = Engine()
    e.start("u", 1)
    req = ws.BroadcastWeightUpdateRequest(names=["2.bias"], dtypes=["float32"], shapes=[[2]],
                                          update_id="u")
    with pytest.raises(ValueError, match=f"expects a '{STRATEGY}' request, got 'broadcast'"):
        _run(e.ep.update_named_weights(req.to_dict()))


def test_update_before_init_refused():
    ep = WeightUpdateEndpoint(TorchModuleWeightLoader(module=_model()), name="cold")
    with pytest.raises(WeightSyncError, match="cold: no receiver; call init_weight_transfer"):
        _run(ep.update_named_weights({"names": [], "dtypes": [], "shapes": []}))


# -- torn updates ---------------------------------------------------------------------------------


def test_finish_with_missing_chunks_is_torn_until_a_complete_update():
    e = Engine()
    new = _new_weights()
    a, b = _split(new)
    e.start("u1", 1)
    e.chunk("u1", 0, a)  # chunk 1 never arrives
    with pytest.raises(WeightSyncError, match="incomplete update: 1 of 2 chunks landed"):
        e.finish("u1", 1, 2)
    assert (e.ep.version, e.ep.state) == (0, "torn")
    with pytest.raises(UpdateIncompleteError, match="last complete version 0"):
        e.ep.check_serving()

    newer = _new_weights(2)
    a2, b2 = _split(newer)
    e.start("u2", 2)
    assert e.ep.state == "torn"  # still torn while the repairing update is in flight
    with pytest.raises(UpdateIncompleteError):
        e.ep.check_serving()
    e.chunk("u2", 0, a2)
    e.chunk("u2", 1, b2)
    assert e.finish("u2", 2, 2) == 2
    assert (e.ep.version, e.ep.state) == (2, "idle")
    e.ep.check_serving()
    _assert_weights(e.module, newer)


def test_sender_abort_after_a_chunk_is_torn_and_keeps_version():
    e = Engine()
    a, _ = _split(_new_weights())
    e.start("u", 1)
    e.chunk("u", 0, a)
    assert e.finish("u", 1, 2, ok=False) == 0  # ok=False: no raise, the old version is reported
    assert e.ep.state == "torn" and "sender died" in e.ep.last_error
    with pytest.raises(UpdateIncompleteError, match="sender died"):
        e.ep.check_serving()


def test_transport_failure_before_any_byte_loaded_keeps_the_weights_servable():
    e = Engine()
    before = e.snapshot()
    a, _ = _split(_new_weights())
    e.start("u", 1)
    req = WireRequest(names=list(a), dtypes=["float32"] * 2,
                              shapes=[list(t.shape) for t in a.values()], update_id="u")
    with pytest.raises(KeyError):  # the bytes never arrived on the wire: the loader got nothing
        _run(e.ep.update_named_weights(req.to_dict()))
    assert e.ep.state == "receiving" and "chunk 0" in e.ep.status().update.failed
    e.ep.check_serving()  # nothing of the update reached the weights
    assert e.finish("u", 1, 1, ok=False) == 0 and e.ep.state == "idle"
    _assert_weights(e.module, before)


def test_transport_failure_after_a_chunk_landed_is_torn():
    e = Engine()
    a, b = _split(_new_weights())
    e.start("u", 1)
    e.chunk("u", 0, a)
    req = WireRequest(names=list(b), dtypes=["float32"] * 2,
                              shapes=[list(t.shape) for t in b.values()], update_id="u",
                              chunk_index=1)
    with pytest.raises(KeyError):
        _run(e.ep.update_named_weights(req.to_dict()))
    assert e.ep.state == "torn" and "chunk 1 of update u failed after bytes" in e.ep.last_error


def test_new_start_over_a_half_applied_update_is_torn():
    e = Engine()
    a, _ = _split(_new_weights())
    e.start("u1", 1)
    e.chunk("u1", 0, a)
    e.start("u2", 2)  # u1 was abandoned after loading a chunk
    assert e.ep.state == "torn"
    with pytest.raises(UpdateIncompleteError, match="update u1 was abandoned after 1 chunk"):
        e.ep.check_serving()
    e.chunk("u2", 0, _new_weights(3))
    assert e.finish("u2", 2, 1) == 2 and e.ep.state == "idle"


def test_abort_before_any_chunk_stays_ready():
    e = Engine()
    e.start("u", 1)
    assert e.finish("u", 1, 3, ok=False) == 0
    assert (e.ep.version, e.ep.state) == (0, "idle")


# -- dispatch -----------------------------------------------------------------------------------------


def test_call_dispatch():
    e = Engine()
    start = ws.WeightUpdateStart(update_id="u", version=1).to_dict()
    _run(e.ep.call("start_weight_update", {"start": start}))
    assert e.ep.state == "receiving"
    with pytest.raises(WeightSyncError, match="unknown endpoint method 'check_serving'"):
        _run(e.ep.call("check_serving", {}))
    receiver = e.ep.receiver
    _run(e.ep.call("close_weight_transfer", {}))
    assert e.ep.receiver is None and receiver.closed


# -- through the real sender pipeline ---------------------------------------------------------------


def _send(sender, model, client, version, bucket_mb=0.0002):
    async def go():
        ex = ws.build_extractor({"type": "hf", "bucket_size_mb": bucket_mb})
        manifest = ex.metadata(model)
        return await sender.send_chunks(
            ex.extract_weights(model), client, version=version, manifest=manifest
        )

    return _run(go())


@pytest.mark.parametrize("overlap", [True, False])
def test_sender_pipeline_into_two_endpoints(overlap):
    engines = [Engine(), Engine()]
    client = DirectClient([e.ep for e in engines])
    strategy = ws.build_strategy({"type": STRATEGY})
    info = _run(strategy.create_sync_info(strategy.cfg, client))
    _run(client.init_weight_transfer(strategy.config_dict(), info.to_dict()))
    assert [e.ep.receiver.rank_offset for e in engines] == [1, 2]  # rank 0 is the sender
    sender = _run(strategy.create_sender(strategy.cfg, client, info))
    sender.overlap = overlap
    src = _model(7)
    stats = _send(sender, src, client, version=1)
    assert stats.num_chunks == 2 and stats.num_tensors == 4 and sender.released == 2
    assert stats.versions == [1, 1]
    assert stats.total_bytes == sum(t.numel() * 4 for t in src.state_dict().values())
    for e in engines:
        _assert_weights(e.module, src.state_dict())


def test_sender_failure_mid_update_leaves_engines_torn_and_raises():
    e = Engine()
    client = DirectClient([e.ep])
    sender = WireSender(fail_at=1)
    with pytest.raises(ConnectionError, match="link dropped"):
        _send(sender, _model(7), client, version=1)
    assert e.ep.state == "torn" and e.ep.version == 0
    assert "ConnectionError: link dropped" in e.ep.last_error
    assert sender.released == 2  # the failed chunk's buffers were released too
    with pytest.raises(UpdateIncompleteError):
        e.ep.check_serving()
    WIRE.clear()
    stats = _send(WireSender(), _model(8), client, version=2)
    assert stats.versions == [2] and e.ep.state == "idle"
    _assert_weights(e.module, _model(8).state_dict())


def test_sender_with_bad_manifest_moves_nothing():
    e = Engine()
    before = e.snapshot()
    client = DirectClient([e.ep])
    sender = WireSender()
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with pytest.raises(WeightMismatchError, match="2.weight: shape \\[3, 8\\] but target has \\[2, 8\\]"):
        _send(sender, wrong, client, version=1)
    assert sender.released == 0 and not WIRE  # no chunk was even prepared for the wire
    assert (e.ep.version, e.ep.state) == (0, "idle")
    _assert_weights(e.module, before)


# -- pipelining: two chunks in flight ---------------------------------------------------------------


def test_chunk_after_a_failed_chunk_is_refused_and_released():
    e = Engine()
    e.start("u", 1)
    a, b = _split(_new_weights())
    bad = {"2.bias": torch.zeros(5)}
    with pytest.raises(WeightMismatchError):
        e.chunk("u", 0, bad)
    # chunk 1 was already on its way (pipelined): refused, and the receiver told so
    with pytest.raises(WeightSyncError, match="chunk 1 refused: an earlier chunk of this update failed"):
        e.chunk("u", 1, b)
    assert e.ep.receiver.refused == [0, 1]  # the bad chunk voted no too, before any byte
    assert e.finish("u", 1, 2, ok=False) == 0 and e.ep.state == "idle"
    e.start("u2", 1)
    with pytest.raises(WeightSyncError, match="expected chunk 0, got 3"):
        e.chunk("u2", 3, b)
    assert e.ep.receiver.refused == [0, 1, 3]


def test_turnstile_lets_chunks_through_in_order():
    from weightsync.engine import ChunkTurnstile

    async def go():
        gate = ChunkTurnstile(timeout_s=10)
        order: list[tuple[str, int]] = []

        async def chunk(update: str, i: int, delay: float) -> None:
            await asyncio.sleep(delay)
            async with gate.turn({"update_id": update, "chunk_index": i}):
                order.append((update, i))
                await asyncio.sleep(0.01)

        # chunks 3, 1, 2 arrive before chunk 0; each must wait for its predecessor
        await asyncio.gather(*(chunk("u1", i, d) for i, d in [(3, 0), (1, 0.01), (2, 0), (0, 0.05)]))
        await asyncio.gather(chunk("u2", 1, 0), chunk("u2", 0, 0.02))  # a new update restarts
        return order

    assert _run(go()) == [("u1", 0), ("u1", 1), ("u1", 2), ("u1", 3), ("u2", 0), ("u2", 1)]


def test_turnstile_gives_up_after_its_timeout():
    from weightsync.engine import ChunkTurnstile

    async def go():
        gate = ChunkTurnstile(timeout_s=0.2)
        t0 = asyncio.get_running_loop().time()
        async with gate.turn({"update_id": "u", "chunk_index": 0}):
            pass
        async with gate.turn({"update_id": "u", "chunk_index": 5}):  # 1-4 never come
            return asyncio.get_running_loop().time() - t0

    assert 0.15 < _run(go()) < 5


class SlowOrderedClient(DirectClient):
    """DirectClient that allows two chunks in flight and records how many overlap."""

    max_inflight_updates = 2

    def __init__(self, endpoints) -> None:
        super().__init__(endpoints)
        self.inflight = 0
        self.peak = 0
        self.seen: list[int] = []
        self.gate = None

    async def update_named_weights(self, request):
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        self.seen.append(request["chunk_index"])
        try:
            if self.gate is None:
                from weightsync.engine import ChunkTurnstile

                self.gate = ChunkTurnstile(timeout_s=10)
            await asyncio.sleep(0.1)  # long enough for the next request to be issued meanwhile
            async with self.gate.turn(request):
                await super().update_named_weights(request)
        finally:
            self.inflight -= 1


@pytest.mark.parametrize("window", [1, 2])
def test_sender_keeps_at_most_its_window_in_flight(window):
    engines = [Engine(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)]))]
    client = SlowOrderedClient([e.ep for e in engines])
    sender = WireSender()
    sender.max_inflight = window
    src = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])

    async def go():
        ex = ws.build_extractor({"type": "hf", "bucket_size_mb": 1e-4, "group_by_module": True})
        return await sender.send_chunks(ex.extract_weights(src), client, version=1,
                                        manifest=ex.metadata(src))

    stats = _run(go())
    assert stats.num_chunks == 6 and client.seen == list(range(6))
    assert client.peak == window
    assert sender.released == 6
    _assert_weights(engines[0].module, src.state_dict())


def test_serial_lane_runs_jobs_in_order_even_when_cancelled():
    import threading

    from weightsync._runtime.threads import SerialLane

    lane = SerialLane("test-lane")
    gate = threading.Event()
    ran: list[int] = []
    first = lane.submit(lambda: (gate.wait(5), ran.append(0)))
    futs = [lane.submit(ran.append, i) for i in range(1, 4)]
    assert futs[1].cancel()  # not started yet: cancelled, yet it must still run in its turn
    gate.set()
    first.result(5)
    futs[2].result(5)
    assert ran == [0, 1, 2, 3]
    assert futs[1].cancelled()
    lane.close()
    with pytest.raises(RuntimeError, match="lane is closed"):
        lane.submit(ran.append, 9)


# -- the lifecycle: every state, every transition ------------------------------------------------


class HookedLoader(TorchModuleWeightLoader):
    """A real torch_module loader whose finish hook can fail (a fault a plain module cannot
    cause by itself, e.g. re-packing kernels after a load) and that records what the endpoint
    looked like while its hooks ran."""

    def __init__(self, module) -> None:
        super().__init__(module=module)
        self.endpoint: WeightUpdateEndpoint | None = None
        self.fail_finish: str = ""
        self.fail_start: str = ""
        self.seen: list[tuple[str, str]] = []

    async def start_update(self, start) -> None:
        self.seen.append(("start", self.endpoint.state))
        if self.fail_start:
            raise WeightMismatchError([self.fail_start], target="hooked model")

    async def finish_update(self, finish) -> None:
        ep = self.endpoint
        self.seen.append(("finish", ep.state))
        with pytest.raises(UpdateIncompleteError, match="is being finished"):
            ep.check_serving()  # nobody serves while the finish hook runs
        if self.fail_finish:
            raise RuntimeError(self.fail_finish)


def _hooked_engine() -> tuple[Engine, HookedLoader]:
    e = Engine()
    loader = HookedLoader(e.module)
    e.ep = WeightUpdateEndpoint(loader, name="eng0")
    loader.endpoint = e.ep
    _run(e.ep.init_weight_transfer({"type": STRATEGY}, ws.EmptyWeightSyncInfo().to_dict(), 1))
    return e, loader


def test_states_and_status_through_one_update():
    from weightsync.engine import EndpointState

    e, loader = _hooked_engine()
    st = e.ep.status()
    assert (st.state, st.version, st.update, st.last_error) == (EndpointState.IDLE, 0, None, "")
    new = _new_weights()
    a, b = _split(new)
    e.start("u1", 4)
    st = e.ep.status()
    assert st.state is EndpointState.RECEIVING and st.update.update_id == "u1"
    assert (st.update.version, st.update.chunks_done) == (4, 0)
    e.chunk("u1", 0, a)
    assert e.ep.status().update.chunks_done == 1
    e.ep.check_serving()  # between chunks of a live update: the server's gate decides
    e.chunk("u1", 1, b)
    assert e.finish("u1", 4, 2) == 4
    assert loader.seen == [("start", "idle"), ("finish", "finishing")]  # start: nothing changed yet
    st = e.ep.status()
    assert (st.state, st.version, st.update) == (EndpointState.IDLE, 4, None)
    d = st.to_dict()
    assert json.loads(json.dumps(d)) == d and d["state"] == "idle" and d["has_receiver"]
    _assert_weights(e.module, new)


def test_finish_hook_failure_after_chunks_landed_is_torn_until_a_complete_update():
    """Acceptance (issue 10): the finish hook raises after chunks landed -> the endpoint
    refuses to serve; the next complete update restores it."""
    e, loader = _hooked_engine()
    a, b = _split(_new_weights())
    e.start("u1", 1)
    e.chunk("u1", 0, a)
    e.chunk("u1", 1, b)
    loader.fail_finish = "kernel re-pack failed"
    with pytest.raises(RuntimeError, match="kernel re-pack failed"):
        e.finish("u1", 1, 2)
    st = e.ep.status()
    assert (st.state, st.version, st.update) == ("torn", 0, None)
    assert "finishing update u1 failed: RuntimeError: kernel re-pack failed" in st.last_error
    with pytest.raises(UpdateIncompleteError, match="kernel re-pack failed"):
        e.ep.check_serving()
    loader.fail_finish = ""
    newer = _new_weights(2)
    e.start("u2", 2)
    assert e.ep.state == "torn"  # repairing: still refusing
    e.chunk("u2", 0, newer)
    assert e.finish("u2", 2, 1) == 2
    assert (e.ep.state, e.ep.last_error) == ("idle", "")
    e.ep.check_serving()
    _assert_weights(e.module, newer)
    assert ("finish", "finishing") in loader.seen


def test_finish_hook_failure_with_nothing_loaded_keeps_serving():
    e, loader = _hooked_engine()
    e.start("u", 1)
    loader.fail_finish = "boom"
    with pytest.raises(RuntimeError):
        e.finish("u", 1, 0)
    assert (e.ep.state, e.ep.version) == ("idle", 0)
    e.ep.check_serving()


def test_start_hook_refusal_changes_nothing():
    e, loader = _hooked_engine()
    loader.fail_start = "model.layers.0.qkv_proj: incomplete"
    with pytest.raises(WeightMismatchError, match="qkv_proj: incomplete"):
        e.start("u", 1)
    assert (e.ep.state, e.ep.status().update) == ("idle", None)
    with pytest.raises(WeightSyncError, match="without a matching start_weight_update"):
        e.chunk("u", 0, _new_weights())


def test_close_is_final():
    e = Engine()
    receiver = e.ep.receiver
    e.start("u", 1)
    e.chunk("u", 0, _split(_new_weights())[0])
    _run(e.ep.close())
    assert e.ep.state == "closed" and receiver.closed and e.ep.receiver is None
    assert "closed during update u" in e.ep.last_error
    with pytest.raises(WeightSyncError, match="endpoint is closed"):
        e.ep.check_serving()
    for call in (lambda: e.start("v", 2), lambda: e.finish("u", 1, 1),
                 lambda: _run(e.ep.init_weight_transfer({"type": STRATEGY}, {}, 1))):
        with pytest.raises(WeightSyncError, match="closed; cannot"):
            call()
    assert e.ep.status().to_dict()["state"] == "closed"


def test_close_weight_transfer_keeps_the_endpoint_usable():
    e = Engine()
    _run(e.ep.call("close_weight_transfer"))
    assert e.ep.receiver is None and e.ep.state == "idle"
    _run(e.ep.init_weight_transfer({"type": STRATEGY}, ws.EmptyWeightSyncInfo().to_dict(), 1))
    e.start("u", 1)
    e.chunk("u", 0, _new_weights())
    assert e.finish("u", 1, 1) == 1


def test_status_through_call_is_plain_data():
    e = Engine()
    d = _run(e.ep.call("status"))
    assert d == e.ep.status().to_dict() and d["state"] == "idle" and d["version"] == 0


# -- the training mode travels in the start and is enforced by the endpoint -----------------------


def _head_engine() -> Engine:
    m = torch.nn.Module()
    m.backbone = torch.nn.Linear(4, 4)
    m.score = torch.nn.Linear(4, 1)
    return Engine(m)


def test_head_only_manifest_with_backbone_names_is_refused_with_every_offender():
    e = _head_engine()
    before = e.snapshot()
    manifest = [ws.TensorMeta("backbone.weight", "float32", [4, 4]),
                ws.TensorMeta("score.weight", "float32", [2, 4]),  # wrong shape too
                ws.TensorMeta("score.bias", "float32", [1])]
    d = ws.WeightUpdateStart(update_id="u", version=1, manifest=manifest,
                             training_mode="head_only").to_dict()
    assert d["training_mode"] == "head_only"
    with pytest.raises(WeightMismatchError) as ei:
        _run(e.ep.start_weight_update(_j(d)))
    lines = ei.value.offenders
    assert any("backbone.weight: not a head parameter" in o for o in lines)
    assert any("score.weight: shape [2, 4]" in o for o in lines) and len(lines) == 2
    assert (e.ep.state, e.ep.status().update) == ("idle", None)
    _assert_weights(e.module, before)


def test_training_mode_checked_per_chunk_without_a_manifest():
    e = _head_engine()
    before = e.snapshot()
    d = ws.WeightUpdateStart(update_id="u", version=1, training_mode="head_only",
                             head_name_patterns=["score."]).to_dict()
    _run(e.ep.start_weight_update(_j(d)))
    with pytest.raises(WeightMismatchError, match="backbone.bias: not a head parameter"):
        e.chunk("u", 0, {"backbone.bias": torch.ones(4)})
    assert e.ep.receiver.refused == [0]  # its peers were told no before any byte moved
    _assert_weights(e.module, before)
    assert e.finish("u", 1, 1, ok=False) == 0 and e.ep.state == "idle"
    d = ws.WeightUpdateStart(update_id="v", version=1, training_mode="head_only").to_dict()
    _run(e.ep.start_weight_update(_j(d)))
    e.chunk("v", 0, {"score.weight": torch.ones(1, 4), "score.bias": torch.ones(1)})
    assert e.finish("v", 1, 1) == 1
    assert torch.equal(e.module.score.weight, torch.ones(1, 4))


@pytest.mark.parametrize("mode, names, needle", [
    ("full", ["score.weight", "score.bias"], "full mode requires backbone"),
    ("lora", ["backbone.lora_A.default.weight"], "unmerged LoRA"),
    ("full", ["backbone.lora_B.default.weight"], "unmerged LoRA"),
])
def test_training_mode_policy(mode, names, needle):
    from weightsync.validation import training_mode_offenders

    assert any(needle in o for o in training_mode_offenders(names, mode, whole_update=True))
    assert training_mode_offenders(["backbone.weight", "score.weight"], "full",
                                   whole_update=True) == []
    assert training_mode_offenders(["score.weight"], ws.TrainingMode.HEAD_ONLY) == []


# -- LoRA adapter-only updates: the adapter's own loader, never torn -------------------------------


class _AdapterLoader(WeightLoader):
    """An adapter loader as ``weightsync.loaders.vllm_lora`` is one: keeps what it is given,
    swaps the adapter in at ``finish_update`` or not at all."""

    changes_at_finish_only = True

    def __init__(self, fail: str) -> None:
        self.kept: dict[str, torch.Tensor] = {}
        self.installed: dict[str, torch.Tensor] | None = None
        self.fail = fail
        self.validated = 0

    def validate(self, metas):
        self.validated += 1

    async def load_weights(self, named_tensors):
        self.kept.update({k: v.clone() for k, v in named_tensors.items()})

    async def finish_update(self, finish):
        if self.fail:
            raise RuntimeError(self.fail)
        self.installed = dict(self.kept)


class _LoaderWithAdapters(TorchModuleWeightLoader):
    def __init__(self, module, fail: str = "") -> None:
        super().__init__(module=module)
        self.fail = fail
        self.adapters: list[_AdapterLoader] = []

    def adapter_loader(self, spec):
        self.adapters.append(_AdapterLoader(self.fail))
        return self.adapters[-1]


@pytest.mark.parametrize("fail", ["", "the install failed"])
def test_adapter_update_lands_in_the_adapter_loader_and_a_failed_one_is_not_torn(fail):
    e = Engine()
    loader = _LoaderWithAdapters(e.module, fail)
    e.ep = WeightUpdateEndpoint(loader, name="eng0")
    _run(e.ep.init_weight_transfer({"type": STRATEGY}, ws.EmptyWeightSyncInfo().to_dict(), 1))
    before = e.snapshot()
    a = {"base_model.model.0.lora_A.weight": torch.ones(2, 4)}
    spec = {"name": "p", "config": {"r": 2, "lora_alpha": 4, "target_modules": ["0"]}}
    e.start("u1", None, [ws.TensorMeta(n, "float32", list(t.shape)) for n, t in a.items()],
            lora_adapter=spec)
    e.chunk("u1", 0, a)
    # the adapter loader keeps its own copy as the chunk lands (the sink does not stage it too)
    # and installs nothing before the finish
    assert list(loader.adapters[-1].kept) == list(a) and loader.adapters[-1].installed is None
    assert e.ep.status().update.staged is False
    if fail:
        with pytest.raises(RuntimeError, match=fail):
            e.finish("u1", None, 1)
        assert (e.ep.version, e.ep.state) == (0, "idle")  # the last version still serves
        e.ep.check_serving()
    else:
        assert e.finish("u1", None, 1) == 1
        assert torch.equal(loader.adapters[-1].installed["base_model.model.0.lora_A.weight"],
                           a["base_model.model.0.lora_A.weight"])
    _assert_weights(e.module, before)  # the engine's own weights never see an adapter


def test_an_adapters_manifest_is_validated_once_while_the_trainer_sends_the_same_one():
    """The same adapter manifest for the same adapter name and config: the adapter loader's
    answer cannot change, so the start does not ask it again; another config is asked."""
    e = Engine()
    loader = _LoaderWithAdapters(e.module)
    e.ep = WeightUpdateEndpoint(loader, name="eng0")
    _run(e.ep.init_weight_transfer({"type": STRATEGY}, ws.EmptyWeightSyncInfo().to_dict(), 1))
    a = {"base_model.model.0.lora_A.weight": torch.ones(2, 4)}
    metas = [ws.TensorMeta(n, "float32", list(t.shape)) for n, t in a.items()]
    spec = {"name": "p", "config": {"r": 2, "lora_alpha": 4, "target_modules": ["0"]}}
    other = {"name": "p", "config": {"r": 2, "lora_alpha": 8, "target_modules": ["0"]}}
    counts = []
    for i, s in enumerate([spec, spec, other, other, spec]):
        e.start(f"u{i}", None, metas, lora_adapter=s)
        e.chunk(f"u{i}", 0, a)
        e.finish(f"u{i}", None, 1)
        counts.append(loader.adapters[-1].validated)
    assert counts == [1, 0, 1, 0, 1]
