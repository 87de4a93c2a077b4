"""The clients layer: the ``Channel`` protocol, ``as_channel``, ``FanOutClient``'s error policy,
and the error codec of ``weightsync.errors``.

Real syncs go through ``FanOutClient`` over in-process endpoints (``EndpointChannel``) with the
real ``packed_cuda_ipc`` strategy (shared memory on CPU) and ``torch_module`` loaders. The error
policy is tested with ``ScriptedChannel``, a user-written channel (the protocol is meant to be
implemented outside the library) whose calls end as scripted: several engines failing at once
in different ways cannot be caused otherwise in one process.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

import weightsync as ws
from weightsync.clients import (
    Channel,
    EndpointChannel,
    FanOutClient,
    HttpChannel,
    as_channel,
)
from weightsync.engine import WeightUpdateEndpoint
from weightsync.errors import (
    CommunicatorReplacedError,
    EngineDiedError,
    UpdateIncompleteError,
    UpdateRefusedError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncTimeout,
    error_from_dict,
    error_from_http,
    error_to_dict,
    http_status,
    most_telling,
)
from weightsync.loaders.torch_module import TorchModuleWeightLoader


def _run(make):
    """Run ``make()`` (which issues calls, so it needs the loop) inside ``asyncio.run``."""

    async def go():
        return await make()

    return asyncio.run(go())


class ScriptedChannel:
    """A channel written the way a user would (no weightsync base class): each method ends after
    ``delay`` seconds with ``result`` or by raising ``error``."""

    def __init__(self, name: str, *, error: BaseException | None = None, delay: float = 0.0,
                 ordered: bool = True, world: int = 1, result: object = 7) -> None:
        self.name, self.ordered = name, ordered
        self.error, self.delay, self.world, self.result = error, delay, world, result
        self.calls: list[tuple[str, dict]] = []
        self.log: list[str] | None = None

    async def world_size(self) -> int:
        return self.world

    def call(self, method, kwargs, *, timeout_s):
        self.calls.append((method, kwargs))
        if self.log is not None:
            self.log.append(f"{self.name}:{method}")  # issued (synchronously, in call order)
        return self._answer(timeout_s)

    async def _answer(self, timeout_s):
        await asyncio.sleep(min(self.delay, timeout_s))
        if self.delay > timeout_s:
            raise WeightSyncTimeout(f"{self.name}: no answer within {timeout_s:g}s")
        if self.error is not None:
            raise self.error
        return self.result

    async def aclose(self) -> None:
        pass


def test_a_plain_class_is_a_channel_and_adapters_pick_the_right_one():
    ch = ScriptedChannel("a")
    assert isinstance(ch, Channel) and as_channel(ch) is ch
    ep = WeightUpdateEndpoint(TorchModuleWeightLoader(module=torch.nn.Linear(2, 2)), name="ep")
    assert isinstance(as_channel(ep), EndpointChannel) and as_channel(ep).name == "ep"
    http = as_channel("http://127.0.0.1:9/", api_key="k")
    assert isinstance(http, HttpChannel) and http.name == "http://127.0.0.1:9" and not http.ordered
    with pytest.raises(TypeError, match=r"cannot reach an engine through a int.*URL.*Ray actor"):
        as_channel(42)


def test_fanout_orders_calls_and_offsets_ranks():
    log: list[str] = []
    chans = [ScriptedChannel(f"e{i}", world=w, delay=0.01 * (3 - i)) for i, w in enumerate([1, 2, 1])]
    for c in chans:
        c.log = log
    client = FanOutClient(chans)
    assert client.max_inflight_updates == 2 and client.names == ["e0", "e1", "e2"]

    async def go():
        await client.init_weight_transfer({"type": "x"}, {"type": "empty"})
        first = client.update_named_weights({"chunk_index": 0})
        second = client.update_named_weights({"chunk_index": 1})
        return await first, await second

    assert asyncio.run(go()) == ([7, 7, 7], [7, 7, 7])
    assert [kw["rank_offset"] for c in chans for m, kw in c.calls if m == "init_weight_transfer"] \
        == [1, 2, 4]
    # both chunks went out to every engine before either was answered
    assert log[3:] == ["e0:update_named_weights", "e1:update_named_weights",
                       "e2:update_named_weights"] * 2
    assert FanOutClient([ScriptedChannel("a"), ScriptedChannel("b", ordered=False)]) \
        .max_inflight_updates == 1


@pytest.mark.parametrize("errors, winner", [
    ({"e0": WeightSyncTimeout("e0: slow"), "e1": WeightMismatchError(["w: shape [2] but target has [3]"]),
      "e2": EngineDiedError("e2: gone"), "e3": RuntimeError("boom")}, WeightMismatchError),
    ({"e0": WeightSyncTimeout("e0: slow"), "e1": RuntimeError("boom"),
      "e2": EngineDiedError("e2: gone")}, EngineDiedError),
    ({"e0": RuntimeError("boom"), "e1": WeightSyncTimeout("e1: slow")}, WeightSyncTimeout),
])
def test_several_failures_raise_the_most_telling_named_with_the_others_as_notes(errors, winner):
    chans = [ScriptedChannel(n, error=e, delay=0.01 * i) for i, (n, e) in enumerate(errors.items())]
    chans.append(ScriptedChannel("healthy", delay=0.02))
    client = FanOutClient(chans)
    with pytest.raises(winner) as ei:
        _run(lambda: client.start_weight_update({"update_id": "u"}))
    e = ei.value
    culprit = next(n for n, err in errors.items() if isinstance(err, winner))
    assert culprit in str(e) and e.engine == culprit and e.method == "start_weight_update"
    notes = "\n".join(getattr(e, "__notes__", []))
    assert len(getattr(e, "__notes__", [])) == len(errors) - 1  # every other failure is kept
    assert "healthy" not in notes
    if winner is WeightMismatchError:
        assert e.offenders == ["w: shape [2] but target has [3]"]


def test_an_unnamed_failure_gets_the_engine_and_method():
    client = FanOutClient([ScriptedChannel("left", error=ValueError("bad field"))])
    with pytest.raises(ValueError, match=r"left \(finish_weight_update\): bad field"):
        _run(lambda: client.finish_weight_update({"update_id": "u"}))


def test_after_a_failure_a_hanging_engine_is_abandoned_after_the_grace():
    chans = [ScriptedChannel("dead", error=EngineDiedError("dead: EOF")),
             ScriptedChannel("stuck", delay=30)]
    client = FanOutClient(chans, grace_s=0.2, timeout_s=60)

    async def go():
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineDiedError) as ei:
            await client.update_named_weights({"chunk_index": 0})
        return asyncio.get_running_loop().time() - t0, ei.value

    elapsed, err = asyncio.run(go())
    assert elapsed < 5
    assert any("stuck: update_named_weights still running" in n for n in err.__notes__)


def test_a_call_that_outlives_its_timeout_is_a_timeout_naming_the_engine():
    client = FanOutClient([ScriptedChannel("sleepy", delay=5)], timeout_s=0.1)
    with pytest.raises(WeightSyncTimeout, match="sleepy"):
        _run(lambda: client.finish_weight_update({"update_id": "u"}))


def test_a_channel_that_ignores_its_timeout_is_caught_by_the_backstop():
    from weightsync.clients import gather

    async def hangs():
        await asyncio.sleep(30)

    async def go():
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(WeightSyncTimeout, match=r"mute: no answer to status within 0.1s"):
            await gather([hangs(), asyncio.sleep(0, result=1)], names=["mute", "fine"],
                         method="status", timeout_s=0.1, backstop_s=0.1)
        return asyncio.get_running_loop().time() - t0

    assert asyncio.run(go()) < 5


def test_invalid_world_sizes_and_duplicate_names_are_refused():
    with pytest.raises(WeightSyncError, match=r"invalid weight-sync world sizes.*b: 0"):
        asyncio.run(FanOutClient([ScriptedChannel("a"), ScriptedChannel("b", world=0)])
                    .get_world_sizes())
    with pytest.raises(ValueError, match="unique"):
        FanOutClient([ScriptedChannel("a"), ScriptedChannel("a")])
    with pytest.raises(ValueError, match="at least one engine"):
        FanOutClient([])


# -- a real sync through FanOutClient over in-process endpoints -----------------------------------


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_fanout_over_two_in_process_endpoints_syncs_and_reports_status():
    targets = [_module(0), _module(0)]
    endpoints = [WeightUpdateEndpoint(TorchModuleWeightLoader(module=m), name=f"ep{i}")
                 for i, m in enumerate(targets)]
    src = _module(1)

    async def go():
        client = FanOutClient(endpoints, timeout_s=30)
        strategy = ws.build_strategy({"type": "packed_cuda_ipc", "bucket_size_mb": 0.0005})
        info = await strategy.create_sync_info(strategy.cfg, client)
        sender = await strategy.create_sender(strategy.cfg, client, info)
        ex = ws.build_extractor({"type": "hf", "bucket_size_mb": 0.0005})
        try:
            stats = await sender.send_chunks(ex.extract_weights(src), client, version=3,
                                             manifest=ex.metadata(src))
            status = await client.status()
            bad = torch.nn.Linear(3, 3)
            with pytest.raises(WeightMismatchError) as ei:
                await sender.send_chunks(ex.extract_weights(bad), client, version=4,
                                         manifest=ex.metadata(bad))
            return stats, status, ei.value, await client.versions()
        finally:
            await sender.close()
            await client.close_weight_transfer()

    stats, status, mismatch, versions = asyncio.run(go())
    assert stats.versions == [3, 3] and stats.num_chunks >= 2
    assert [s["state"] for s in status] == ["idle", "idle"] and versions == [3, 3]
    assert "ep0" in str(mismatch) and any("weight" in o for o in mismatch.offenders)
    for m in targets:
        for (n, a), b in zip(m.state_dict().items(), src.state_dict().values(), strict=True):
            assert torch.equal(a, b), n


# -- the error codec ------------------------------------------------------------------------------


@pytest.mark.parametrize("err", [
    WeightMismatchError(["a: shape [1] but target has [2]", "b: not a parameter"]),
    WeightSyncTimeout("slow"), UpdateIncompleteError("torn"), EngineDiedError("gone"),
    UpdateRefusedError("stale version"), CommunicatorReplacedError("replaced"),
    WeightSyncError("generic"), ValueError("bad field"), TypeError("wrong type"),
], ids=lambda e: type(e).__name__)
def test_codec_round_trip_through_json_and_http(err):
    d = json.loads(json.dumps(error_to_dict(err)))
    back = error_from_dict(d, engine="eng7", method="start_weight_update")
    assert type(back) is type(err)
    assert "eng7" in str(back)
    if isinstance(err, WeightMismatchError):
        assert back.offenders == err.offenders
    else:
        assert str(err) in str(back) and "start_weight_update" in str(back)
    status = http_status(err)
    assert status == http_status(type(err).__name__)
    via_http = error_from_http(status, {"detail": str(err), "error_type": type(err).__name__,
                                        "offenders": d["offenders"]}, where="http://x/route")
    assert type(via_http) is type(err)


def test_codec_statuses_and_bodies_without_a_type():
    assert [http_status(e) for e in (WeightMismatchError(["x"]), ValueError(), UpdateRefusedError(),
                                     UpdateIncompleteError(), WeightSyncTimeout(), EngineDiedError(),
                                     WeightSyncError(), RuntimeError())] \
        == [400, 400, 409, 503, 504, 502, 409, 500]
    assert http_status("KeyError") == 500
    w = "http://h/update_param_batch"
    assert isinstance(error_from_http(400, {"detail": "d", "offenders": ["o"]}, where=w),
                      WeightMismatchError)
    assert type(error_from_http(400, {"detail": "d"}, where=w)) is ValueError
    assert type(error_from_http(409, {"detail": "communicator_id: 1, but the communicator was "
                                                "replaced"}, where=w)) is CommunicatorReplacedError
    assert type(error_from_http(409, {"detail": "stale"}, where=w)) is UpdateRefusedError
    assert type(error_from_http(503, {"detail": "torn"}, where=w)) is UpdateIncompleteError
    assert type(error_from_http(504, "gateway", where=w)) is WeightSyncTimeout
    other = error_from_http(418, {"detail": "teapot"}, where=w)
    assert type(other) is WeightSyncError and "HTTP 418: teapot" in str(other) and w in str(other)
    openai = error_from_http(400, {"error": {"message": "max_tokens: must be >= 1",
                                             "type": "BadRequestError", "code": 400}}, where=w)
    assert type(openai) is ValueError and str(openai).endswith("max_tokens: must be >= 1")
    unknown = error_from_dict({"error_type": "KeyError", "error": "'x'"}, engine="e")
    assert type(unknown) is WeightSyncError and "e: KeyError: 'x'" in str(unknown)


def test_most_telling_ranks_and_keeps_the_others():
    errs = [RuntimeError("r"), WeightSyncTimeout("t"), EngineDiedError("d")]
    best = most_telling(errs)
    assert best is errs[2] and len(best.__notes__) == 2
    with pytest.raises(ValueError):
        most_telling([])
