"""The worker extension's sliced calls (``weightsync_call`` with a call id, ``weightsync_poll``,
``weightsync_cancel``): a call that blocks in the worker (a real gloo rendezvous that nobody else
joins) answers "pending" within its slice instead of holding the worker, other calls still run,
and it can be polled to its end or abandoned.

The extension is mixed into a plain object here, as vLLM mixes it into its worker: the parts of
a vLLM worker it reads are the parallel config and the rank; the endpoint holds a real
``torch_module`` loader, the strategies are the real ones (gloo on CPU)."""

from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from weightsync._runtime.process_group import build_group
from weightsync.engine import WeightUpdateEndpoint
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.loaders.vllm_worker import WeightSyncWorkerExtension
from weightsync.strategies.broadcast import TorchDistributedWeightSyncInfo

pytestmark = pytest.mark.timeout(60)


class _Loader(TorchModuleWeightLoader):
    mode = "direct"  # what weightsync_state reports of a vLLM loader
    metadata_source = "module"


class Worker(WeightSyncWorkerExtension):
    def __init__(self) -> None:
        self.parallel_config = SimpleNamespace(world_size=1)
        self.rank = 0
        self._ws_endpoint = WeightUpdateEndpoint(_Loader(module=torch.nn.Linear(4, 4)),
                                                 name="worker 0")


def _store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _init(store, join_timeout_s: float = 20.0) -> dict:
    return {"strategy_cfg": {"type": "broadcast", "backend": "gloo", "timeout_s": 5},
            "sync_info": {"type": "torch_distributed", "master_addr": "127.0.0.1",
                          "master_port": store.port, "world_size": 2,
                          "join_timeout_s": join_timeout_s, "timeout_s": 5},
            "rank_offset": 1}


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_a_join_nobody_completes_answers_pending_and_can_be_abandoned():
    w, store = Worker(), _store()
    answer, took = _timed(w.weightsync_call, "init_weight_transfer", _init(store), "c1", 0.05)
    assert answer["ok"] and answer["pending"] == "c1" and took < 2.0, (answer, took)
    answer, took = _timed(w.weightsync_poll, "c1", 0.05)
    assert answer.get("pending") == "c1" and took < 2.0
    # the worker is free meanwhile: another call runs to its end at once
    status, took = _timed(w.weightsync_call, "status", {})
    assert status["ok"] and status["result"]["state"] == "idle" and took < 2.0

    final, took = _timed(w.weightsync_cancel, "c1", "the test gave up on it")
    assert not final["ok"] and final["error_type"] == "UpdateRefusedError", final
    assert final["error"] == "abandoned: the test gave up on it" and took < 2.0
    assert w.weightsync_poll("c1") == final  # a later poll of the same id: the same answer
    assert not final["state"]["has_receiver"]
    # the endpoint takes the next communicator
    ok = w.weightsync_call("init_weight_transfer", {
        "strategy_cfg": {"type": "cuda_ipc"}, "sync_info": {"type": "empty"}}, "c2", 1.0)
    assert ok["ok"] and "pending" not in ok and ok["state"]["has_receiver"], ok


def test_a_join_that_completes_is_polled_to_its_end():
    w, store = Worker(), _store()
    first = w.weightsync_call("init_weight_transfer", _init(store), "c1", 0.0)
    assert first.get("pending") == "c1"
    info = TorchDistributedWeightSyncInfo.from_dict(_init(store)["sync_info"])
    sender: dict = {}
    t = threading.Thread(target=lambda: sender.setdefault("group", build_group(info, 0,
                                                                               store=store)))
    t.start()  # the sender joins as rank 0
    deadline = time.monotonic() + 30
    answer = first
    while answer.get("pending"):
        assert time.monotonic() < deadline, "the join never completed"
        answer = w.weightsync_poll("c1", 0.1)
    t.join(10)
    assert answer["ok"] and answer["state"]["has_receiver"], answer
    sender["group"].close()
    w.weightsync_call("close_weight_transfer", {})


def test_a_call_without_an_id_runs_to_its_end_and_an_unknown_id_is_refused():
    w = Worker()
    answer = w.weightsync_call("status", {})
    assert answer["ok"] and "pending" not in answer and answer["result"]["name"] == "worker 0"
    unknown = w.weightsync_poll("never-started")
    assert not unknown["ok"] and "no call 'never-started'" in unknown["error"]


def test_a_chunk_whose_sender_never_sends_is_abandoned_and_fails_its_update_only():
    """The worker waits in a chunk's go/no-go vote for a sender (rank 0, here: joined, then
    silent); abandoned, the chunk fails its update as any failed chunk does (nothing had landed:
    the weights stay servable) and the endpoint takes the next update."""
    w, store = Worker(), _store()
    first = w.weightsync_call("init_weight_transfer", _init(store), "j", 0.0)
    info = TorchDistributedWeightSyncInfo.from_dict(_init(store)["sync_info"])
    sender = build_group(info, 0, store=store)  # rank 0 joins, then never votes
    while first.get("pending"):
        first = w.weightsync_poll("j", 0.1)
    assert first["ok"], first
    start = {"type": "start", "update_id": "u1", "manifest": [
        {"name": "weight", "dtype": "float32", "shape": [4, 4]}]}
    assert w.weightsync_call("start_weight_update", {"start": start}, "s", 1.0)["ok"]
    chunk = {"type": "broadcast", "update_id": "u1", "names": ["weight"], "dtypes": ["float32"],
             "shapes": [[4, 4]], "chunk_index": 0}
    answer, took = _timed(w.weightsync_call, "update_named_weights", {"request": chunk}, "c", 0.2)
    assert answer.get("pending") == "c" and took < 2.0, answer
    final = w.weightsync_cancel("c", "its sender is gone")
    assert not final["ok"] and final["error"] == "abandoned: its sender is gone", final
    state = final["state"]
    assert state["state"] == "receiving" and "CancelledError" in state["update"]["failed"], state
    done = w.weightsync_call("finish_weight_update", {"finish": {
        "type": "finish", "update_id": "u1", "num_chunks": 1, "ok": False, "error": "abandoned"}})
    assert done["ok"] and done["state"]["state"] == "idle", done
    sender.close()
