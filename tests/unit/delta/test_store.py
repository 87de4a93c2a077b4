"""The engine side of delta updates (``weightsync.delta.store`` inside ``WeightUpdateEndpoint``):
a delta start that cannot be applied is refused before any byte moves, naming why, and leaves
the engine as it was; what the engine keeps follows the version it serves."""

from __future__ import annotations

import asyncio

import pytest
import torch

import weightsync as ws
from weightsync.delta.codec import DeltaSpec, DeltaTarget
from weightsync.errors import (
    DeltaBaseMismatchError,
    WeightMismatchError,
    error_from_dict,
    error_to_dict,
    http_status,
)
from weightsync.loaders.torch_module import TorchModuleWeightLoader


def _endpoint() -> tuple[torch.nn.Module, ws.WeightUpdateEndpoint]:
    module = torch.nn.Linear(8, 4).to(torch.bfloat16)
    return module, ws.WeightUpdateEndpoint(TorchModuleWeightLoader(module=module), name="eng")


def _start(update_id: str, spec: DeltaSpec, **kw) -> dict:
    return ws.WeightUpdateStart(update_id=update_id, manifest=spec.wire_metas(),
                                delta=spec.to_dict(), **kw).to_dict()


def _delta(base: int, *targets: DeltaTarget) -> DeltaSpec:
    return DeltaSpec(base, list(targets) or [
        DeltaTarget("weight", "bfloat16", (4, 8), "indices+values", 2),
        DeltaTarget("bias", "bfloat16", (4,), "unchanged")])


async def _push_full(ep: ws.WeightUpdateEndpoint, module: torch.nn.Module, version: int) -> None:
    async with ws.connect([ep], strategy="packed_cuda_ipc", delta=True) as sync:
        await sync.push({n: torch.randn_like(p) for n, p in module.state_dict().items()},
                        version=version)


def test_deltas_an_engine_cannot_apply_are_refused_before_any_byte():
    async def main() -> None:
        module, ep = _endpoint()
        before = {n: p.clone() for n, p in module.state_dict().items()}
        with pytest.raises(DeltaBaseMismatchError, match="keeps no base"):
            await ep.start_weight_update(_start("u1", _delta(0)))
        await _push_full(ep, module, version=3)
        assert ep.status().delta == {"version": 3, "shadow_bytes": 0}
        before = {n: p.clone() for n, p in module.state_dict().items()}
        with pytest.raises(DeltaBaseMismatchError, match="serves version 3.*full update"):
            await ep.start_weight_update(_start("u2", _delta(2)))
        status = ep.status()
        assert (status.state, status.version, status.update) == (ws.EndpointState.IDLE, 3, None)
        assert all(torch.equal(before[n], p) for n, p in module.state_dict().items())
        await ep.start_weight_update(_start("u3", _delta(3)))  # the right base is accepted
        assert ep.status().update.update_id == "u3"

    asyncio.run(main())


def test_malformed_or_mismatched_deltas_name_the_problem():
    async def main() -> None:
        module, ep = _endpoint()
        await _push_full(ep, module, version=1)
        unknown = _delta(1, DeltaTarget("weight", "bfloat16", (4, 8), "dense", 32),
                         DeltaTarget("lm_head.weight", "bfloat16", (4, 8), "dense", 32))
        with pytest.raises(WeightMismatchError, match="lm_head.weight"):
            await ep.start_weight_update(_start("u1", unknown))
        shape = _delta(1, DeltaTarget("weight", "bfloat16", (8, 4), "gaps+bitdiff", 3))
        with pytest.raises(WeightMismatchError, match="weight"):
            await ep.start_weight_update(_start("u2", shape))
        spec = _delta(1)
        wrong = ws.WeightUpdateStart(update_id="u3", manifest=spec.target_metas(),
                                     delta=spec.to_dict()).to_dict()
        with pytest.raises(WeightMismatchError, match="not the delta's wire tensors"):
            await ep.start_weight_update(wrong)
        bad = {**_start("u4", spec), "delta": {"base_version": 1, "targets": [["weight"]]}}
        with pytest.raises(ValueError, match="delta target must be"):
            await ep.start_weight_update(bad)
        assert ep.status().state == ws.EndpointState.IDLE and ep.status().delta["version"] == 1

    asyncio.run(main())


def test_the_refusal_crosses_processes_as_itself():
    e = DeltaBaseMismatchError("eng: refusing a delta against version 2: it serves version 3")
    again = error_from_dict(error_to_dict(e), engine="http://x")
    assert isinstance(again, DeltaBaseMismatchError) and "serves version 3" in str(again)
    assert http_status(e) == 409 and isinstance(again, ws.UpdateRefusedError)
