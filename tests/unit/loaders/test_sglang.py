"""``sglang`` loader: how our updates become SGLang's weight-update calls.

SGLang does not run here (no GPU), so ``RecordingSGLang`` below is a stand-in for
``sglang.Engine``, NOT SGLang: it has the engine's weight-update methods with their keyword
signatures (SGLang 0.5.x), records every call, copies the tensors it is given (as SGLang's
``update_weights_from_tensor`` loads them before it returns) and answers ``(success, message)``
as SGLang does. Everything else is real: the update reaches the loader through a real
``WeightUpdateEndpoint`` over the real ``cuda_ipc`` strategy (shared memory on CPU), whose
receive buffers are reused between chunks. The real engine is driven by
tests/gpu/test_gpu_sglang_loader.py.
"""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import weightsync as ws
from weightsync.errors import WeightMismatchError, WeightSyncError
from weightsync.loaders.sglang import SGLangLoaderConfig, SGLangWeightLoader
from weightsync.strategies.broadcast import (
    BroadcastWeightUpdateRequest,
    TorchDistributedWeightSyncInfo,
)

STRATEGY = {"type": "cuda_ipc", "bucket_size_mb": 0.002}


class RecordingSGLang:
    """A stand-in for ``sglang.Engine`` (see the module docstring); ``fail`` maps a method to
    the message it answers with ``(False, message)``."""

    def __init__(self, model_path: str | None = None, fail: dict[str, str] | None = None):
        self.server_args = SimpleNamespace(model_path=model_path)
        self.calls: list[tuple[str, dict]] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.threads: set[str] = set()
        self.fail = fail or {}

    def _answer(self, method: str, **kwargs):
        self.threads.add(threading.current_thread().name)
        self.calls.append((method, kwargs))
        if method in self.fail:
            return False, self.fail[method]
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        for name, t in named_tensors:
            self.loaded[name] = t.clone()
        return self._answer("update_weights_from_tensor", names=[n for n, _ in named_tensors],
                            load_format=load_format, flush_cache=flush_cache)

    def flush_cache(self):
        self.threads.add(threading.current_thread().name)
        self.calls.append(("flush_cache", {}))

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name, backend="nccl"):
        return self._answer("init_weights_update_group", master_address=master_address,
                            master_port=master_port, rank_offset=rank_offset,
                            world_size=world_size, group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names, dtypes, shapes,
                                        group_name="weight_update_group", flush_cache=True,
                                        load_format=None):
        return self._answer("update_weights_from_distributed", names=names, dtypes=dtypes,
                            shapes=shapes, group_name=group_name, flush_cache=flush_cache,
                            load_format=load_format)

    def destroy_weights_update_group(self, group_name):
        return self._answer("destroy_weights_update_group", group_name=group_name)


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    return {f"model.{k}": v.detach() for k, v in net.state_dict().items()}


def _checkpoint(tmp_path, state) -> str:
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp_path,
                                                                          "model.safetensors"))
    return str(tmp_path)


async def _push(engine, state, version, **cfg):
    loader = SGLangWeightLoader(SGLangLoaderConfig(**cfg), engine=engine)
    ep = ws.WeightUpdateEndpoint(loader, name="sglang")
    async with ws.connect([ep], STRATEGY) as sync:
        stats = await sync.push(state, version=version)
    loader.close()
    return stats, ep


def test_each_chunk_is_one_update_weights_from_tensor_then_one_flush(tmp_path) -> None:
    state = _state(0)
    engine = RecordingSGLang(_checkpoint(tmp_path, state))
    trained = _state(1)
    stats, ep = asyncio.run(_push(engine, trained, 4, load_format="direct"))
    tensor_calls = [kw for m, kw in engine.calls if m == "update_weights_from_tensor"]
    assert len(tensor_calls) == stats.num_chunks >= 2
    assert all(kw["flush_cache"] is False and kw["load_format"] == "direct" for kw in tensor_calls)
    assert [n for kw in tensor_calls for n in kw["names"]] == list(trained)
    assert [m for m, _ in engine.calls][-1] == "flush_cache"  # once, after the last chunk
    assert [m for m, _ in engine.calls].count("flush_cache") == 1
    assert all(torch.equal(engine.loaded[n], t) for n, t in trained.items())
    assert ep.status().version == 4
    assert engine.threads == {"weightsync-sglang"}  # never on the endpoint's event loop


def test_names_and_shapes_are_checked_against_the_checkpoint_before_sglang_is_called(
    tmp_path,
) -> None:
    engine = RecordingSGLang(_checkpoint(tmp_path, _state(0)))
    bad = _state(1)
    bad["model.1.weight"] = torch.zeros(3, 3)
    bad["model.2.weight"] = torch.zeros(2)
    with pytest.raises(WeightMismatchError) as err:
        asyncio.run(_push(engine, bad, 1))
    assert "model.1.weight" in str(err.value) and "model.2.weight" in str(err.value)
    assert engine.calls == []
    # another dtype is not refused: SGLang casts to the dtype it serves
    half = {k: v.half() for k, v in _state(2).items()}
    asyncio.run(_push(engine, half, 2))
    assert engine.loaded["model.0.weight"].dtype == torch.float16


def test_a_failed_sglang_answer_fails_the_update_with_its_message() -> None:
    engine = RecordingSGLang(fail={"update_weights_from_tensor": "Failed to update parameter"})
    with pytest.raises(WeightSyncError, match="Failed to update parameter"):
        asyncio.run(_push(engine, _state(0), 1))
    assert "flush_cache" not in [m for m, _ in engine.calls]


def test_sglang_data_plane_translation() -> None:
    engine = RecordingSGLang()
    loader = SGLangWeightLoader(engine=engine)
    info = TorchDistributedWeightSyncInfo(master_addr="10.1.2.3", master_port=29500,
                                          world_size=5, group_name="g1", backend="nccl")
    req = BroadcastWeightUpdateRequest(names=["a", "b"], dtypes=["bfloat16", "float32"],
                                       shapes=[[4, 2], [3]], packed=False)

    async def run():
        with pytest.raises(WeightSyncError, match="join_update_group"):
            await loader.receive_broadcast(req)
        await loader.join_update_group(info.to_dict(), rank_offset=3)
        await loader.receive_broadcast(req.to_dict())
        with pytest.raises(ValueError, match="packed=True"):
            await loader.receive_broadcast(
                BroadcastWeightUpdateRequest(names=["a"], dtypes=["float32"], shapes=[[1]]))
        await loader.leave_update_group()
        await loader.leave_update_group()  # once only

    asyncio.run(run())
    loader.close()
    assert engine.calls == [
        ("init_weights_update_group", {"master_address": "10.1.2.3", "master_port": 29500,
                                       "rank_offset": 3, "world_size": 5, "group_name": "g1",
                                       "backend": "nccl"}),
        ("update_weights_from_distributed", {"names": ["a", "b"],
                                             "dtypes": ["bfloat16", "float32"],
                                             "shapes": [[4, 2], [3]], "group_name": "g1",
                                             "flush_cache": False, "load_format": None}),
        ("destroy_weights_update_group", {"group_name": "g1"}),
    ]


def test_refuses_what_is_not_an_sglang_engine() -> None:
    with pytest.raises(TypeError, match="update_weights_from_tensor"):
        SGLangWeightLoader(engine=object())
    engine = RecordingSGLang(fail={"init_weights_update_group": "Failed to initialize"})
    loader = SGLangWeightLoader(engine=engine)
    info = TorchDistributedWeightSyncInfo(master_addr="h", master_port=1, world_size=2)
    with pytest.raises(WeightSyncError, match="Failed to initialize"):
        asyncio.run(loader.join_update_group(info, rank_offset=1))
    assert loader.group_name is None
    with pytest.raises(ValueError, match="rank_offset"):
        asyncio.run(loader.join_update_group(info, rank_offset=0))
    loader.close()
