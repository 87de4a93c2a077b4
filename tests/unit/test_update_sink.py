"""Staged updates, checksums and size limits at the endpoint (weightsync/update_sink.py,
weightsync/integrity.py, the endpoint's use of them), in one process.

Test double, for the transport only (as in test_engine_endpoint.py): ``FlakyReceiver`` takes a
chunk's tensors from an in-memory dict instead of a real data plane; a test may ask it to flip
one byte of a chunk after "receiving" it (a corrupted transfer, injected on purpose) or to
fail after a chunk. Everything else is real: the endpoint, plain-dict requests, the sink, the
``torch_module`` loader on a real module. Real transports and processes:
tests/integration/test_engine_faults.py.
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
from weightsync.errors import (
    ChecksumMismatchError,
    UpdateIncompleteError,
    UpdateRefusedError,
    WeightMismatchError,
)
from weightsync.integrity import mismatches, tensor_checksums
from weightsync.interfaces import WeightTransferReceiver, WeightTransferStrategy
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.registry import STRATEGIES
from weightsync.types import WeightUpdateRequest

LEND: list = []  # non-empty: the receiver lends its views (``load_borrowed``)
WIRE: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
FLIP: set[tuple[str, int]] = set()  # chunks whose first received byte is flipped (a fault)
STRATEGY = f"test_flaky_{uuid.uuid4().hex[:6]}"


@dataclasses.dataclass(kw_only=True)
class FlakyRequest(WeightUpdateRequest):
    TYPE: ClassVar[str] = STRATEGY


class FlakyReceiver(WeightTransferReceiver):
    request_cls = FlakyRequest

    async def _receive_and_load(self, request, loader) -> None:
        tensors = {n: t.clone() for n, t in WIRE[(request.update_id, request.chunk_index)].items()}
        if (request.update_id, request.chunk_index) in FLIP:
            first = next(iter(tensors.values()))
            first.view(-1).view(torch.uint8)[0] ^= 0xFF  # the injected corruption
        if LEND:  # views the sender keeps until the call that carried them returns
            await loader.load_borrowed(tensors)
        else:
            await loader.load_weights(tensors)


@dataclasses.dataclass(kw_only=True)
class FlakyConfig(ws.StrategyConfig):
    type: str = STRATEGY


class FlakyStrategy(WeightTransferStrategy):
    config_cls = FlakyConfig

    async def create_sync_info(self, cfg, inference_client):
        return ws.EmptyWeightSyncInfo()

    async def create_sender(self, cfg, inference_client, sync_info):  # pragma: no cover
        raise NotImplementedError

    async def create_receiver(self, cfg, sync_info, rank_offset):
        return FlakyReceiver()

    @classmethod
    def get_request_type(cls):
        return FlakyRequest


@pytest.fixture(scope="module", autouse=True)
def _strategy():
    ws.register_strategy(STRATEGY)(FlakyStrategy)
    yield
    STRATEGIES._entries.pop(STRATEGY, None)


@pytest.fixture(autouse=True)
def _clear():
    WIRE.clear()
    FLIP.clear()
    yield
    WIRE.clear()
    FLIP.clear()
    LEND.clear()


def _j(d: dict) -> dict:
    return json.loads(json.dumps(d))


def _run(coro):
    return asyncio.run(coro)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _model(seed).state_dict().items()}


class ShadowLoader(TorchModuleWeightLoader):
    """The ``torch_module`` loader staging through a ``CopyPlan`` (shadows of the parameters,
    swapped in at the finish), as vLLM's direct mode does: the sink's ``stage_weights`` path."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module=module)
        from weightsync.loaders.copy_plan import CopyPlan

        def load(items) -> None:
            params = dict(module.named_parameters())
            with torch.no_grad():
                for name, t in items:
                    params[name].copy_(t)

        self.plan = CopyPlan(module, load)

    async def load_weights(self, named_tensors) -> None:
        self.plan.load(list(named_tensors.items()))
        self.loads += 1

    def stage_weights(self, named_tensors) -> bool:
        return self.plan.stage(list(named_tensors.items()))

    def commit_staged(self) -> None:
        self.plan.commit_staged(swap=True)

    def discard_staged(self) -> None:
        self.plan.discard_staged()


class Engine:
    def __init__(self, stage_updates: bool | None = None, shadow: bool = False) -> None:
        self.module = _model(0)
        self.loader = (ShadowLoader(self.module) if shadow
                       else TorchModuleWeightLoader(module=self.module))
        self.ep = WeightUpdateEndpoint(self.loader, name="eng0", stage_updates=stage_updates)
        _run(self.ep.init_weight_transfer({"type": STRATEGY}, ws.EmptyWeightSyncInfo().to_dict(), 1))

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def start(self, uid: str, version: int, *, staged: bool = False, manifest=None) -> None:
        d = ws.WeightUpdateStart(update_id=uid, version=version, staged=staged,
                                 manifest=manifest).to_dict()
        _run(self.ep.start_weight_update(_j(d)))

    def chunk(self, uid: str, index: int, tensors: dict[str, torch.Tensor], *,
              checksum: bool = True) -> None:
        WIRE[(uid, index)] = tensors
        req = FlakyRequest(
            names=list(tensors), dtypes=[ws.types.dtype_to_str(t.dtype) for t in tensors.values()],
            shapes=[list(t.shape) for t in tensors.values()], update_id=uid, chunk_index=index,
            checksums=tensor_checksums(list(tensors.values())) if checksum else None,
        )
        _run(self.ep.update_named_weights(_j(req.to_dict())))

    def finish(self, uid: str, version: int, num_chunks: int, ok: bool = True) -> int:
        d = ws.WeightUpdateFinish(update_id=uid, version=version, num_chunks=num_chunks, ok=ok,
                                  error="" if ok else "the sender died").to_dict()
        return _run(self.ep.finish_weight_update(_j(d)))


def _halves(w: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    names = list(w)
    return {n: w[n] for n in names[:2]}, {n: w[n] for n in names[2:]}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


# -- the checksum itself --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   torch.int64, torch.bool])
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 1000, 4099])
def test_any_single_flipped_byte_changes_the_checksum(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 100).to(dtype)
    base = tensor_checksums([t])[0]
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
    for pos in sorted({0, raw.numel() // 2, raw.numel() - 1} - {-1}) if raw.numel() else []:
        bad = t.clone()
        braw = bad.view(torch.uint8) if bad.element_size() == 1 else bad.view(-1).view(torch.uint8)
        braw[pos] ^= 0x01
        assert tensor_checksums([bad])[0] != base, (dtype, numel, pos)


def test_checksum_is_layout_independent_and_alignment_safe():
    t = torch.randn(10, 13)
    want = tensor_checksums([t])[0]
    assert tensor_checksums([t.t().contiguous().t()])[0] == want  # a non-contiguous view
    buf = torch.zeros(4 + t.numel() * 4, dtype=torch.uint8)
    buf[4:] = t.view(-1).view(torch.uint8)
    odd = buf[4:].view(torch.float32).view(10, 13)  # 4-byte aligned, not 8
    assert odd.data_ptr() % 8 and tensor_checksums([odd])[0] == want
    # independent of how torch splits the sum over threads: a known value
    assert tensor_checksums([torch.arange(5, dtype=torch.int64)])[0] == 10
    assert tensor_checksums([torch.tensor([-1], dtype=torch.int64)] * 2) == [-1, -1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64,
                                   torch.uint8, torch.bool])
@pytest.mark.parametrize("numel", [0, 1, 3, 4, 8, 13, 64, 1001])
def test_checksum_equals_a_word_sum_computed_elsewhere(dtype, numel):
    """Whole-word tensors take one reduction, others the padded path: both must give the sum
    of little-endian 64-bit words modulo 2^64 (computed here by numpy, from the raw bytes)."""
    import numpy as np

    g = torch.Generator().manual_seed(numel)
    t = (torch.randint(0, 255, (numel,), generator=g, dtype=torch.uint8).to(dtype)
         if dtype in (torch.uint8, torch.int64, torch.bool)
         else torch.randn(numel, generator=g).to(dtype))
    raw = t.view(torch.uint8).numpy().tobytes() if numel else b""
    raw += bytes(-len(raw) % 8)
    words = np.frombuffer(raw, dtype="<u8")
    want = int(words.sum(dtype=np.uint64)) if len(words) else 0
    assert tensor_checksums([t])[0] & (2**64 - 1) == want


def test_mismatches_names_the_tensor():
    a, b = torch.ones(4), torch.zeros(3)
    want = tensor_checksums([a, b])
    assert mismatches(["a", "b"], want, {"a": a, "b": b}) == []
    lines = mismatches(["a", "b"], want, {"b": torch.ones(3)})
    assert len(lines) == 1 and lines[0].startswith("b: checksum")


# -- checksums at the endpoint ----------------------------------------------------------------------


def test_corrupted_chunk_in_place_tears_and_names_the_chunk_and_tensor():
    e = Engine()
    a, b = _halves(_weights(1))
    e.start("u", 1)
    e.chunk("u", 0, a)
    FLIP.add(("u", 1))
    with pytest.raises(ChecksumMismatchError, match=r"chunk 1 of update u: 1 tensor\(s\)") as err:
        e.chunk("u", 1, b)
    assert err.value.offenders[0].startswith(next(iter(b)))
    assert e.ep.state == "torn" and e.ep.version == 0
    with pytest.raises(UpdateIncompleteError, match="ChecksumMismatchError"):
        e.ep.check_serving()


def test_corrupted_chunk_staged_keeps_version_and_weights_exactly():
    e = Engine()
    before = e.weights()
    a, b = _halves(_weights(1))
    e.start("u", 1, staged=True)
    e.chunk("u", 0, a)
    _same(e.weights(), before)  # staged: nothing reached the weights yet
    FLIP.add(("u", 1))
    with pytest.raises(ChecksumMismatchError):
        e.chunk("u", 1, b)
    assert e.finish("u", 1, 2, ok=False) == 0
    assert (e.ep.state, e.ep.version) == ("idle", 0)
    e.ep.check_serving()
    _same(e.weights(), before)
    # the next complete update lands whole
    new = _weights(2)
    e.start("u2", 1, staged=True)
    e.chunk("u2", 0, new)
    assert e.finish("u2", 1, 1) == 1
    _same(e.weights(), new)


def test_chunks_without_checksums_are_not_checked():
    e = Engine()
    new = _weights(3)
    e.start("u", 1)
    FLIP.add(("u", 0))
    e.chunk("u", 0, new, checksum=False)  # no checksum asked for: the flip goes unnoticed
    assert e.finish("u", 1, 1) == 1
    assert not torch.equal(e.weights()[next(iter(new))], new[next(iter(new))])


# -- staging ----------------------------------------------------------------------------------------


def _stage_in_halves(e, version: int, new: dict[str, torch.Tensor]) -> None:
    """A staged update "u" of ``new`` in two chunks, not finished; the endpoint reports all of
    its bytes as staged."""
    a, b = _halves(new)
    e.start("u", version, staged=True)
    e.chunk("u", 0, a)
    e.chunk("u", 1, b)
    progress = e.ep.status().update
    assert progress.staged and progress.staged_bytes == sum(t.numel() * 4 for t in new.values())


def test_staged_update_lands_only_at_finish_and_reports_its_staging():
    e = Engine()
    before = e.weights()
    new = _weights(4)
    _stage_in_halves(e, 7, new)
    _same(e.weights(), before)
    assert e.finish("u", 7, 2) == 7 and e.ep.state == "idle"
    _same(e.weights(), new)
    assert e.loader.loads == 1  # both chunks in one load: one wait for the copies


def test_a_loader_that_keeps_staged_chunks_gets_them_as_they_come_and_publishes_at_finish():
    e = Engine(shadow=True)
    e.start("u0", 1)
    e.chunk("u0", 0, _weights(1))  # in place: the plan learns the module
    assert e.finish("u0", 1, 1) == 1
    before, loads = e.weights(), e.loader.loads
    ptr = e.module[0].weight.data_ptr()
    new = _weights(2)
    _stage_in_halves(e, 2, new)
    _same(e.weights(), before)  # kept by the loader, beside the weights
    assert e.finish("u", 2, 2) == 2
    _same(e.weights(), new)
    # swapped in by pointer at the finish: no load call, the parameter has new storage
    assert e.loader.loads == loads and e.loader.plan.swapped == 4
    assert e.module[0].weight.data_ptr() != ptr
    # a staged update that dies: the loader forgets it, the weights are the last version
    e.start("u2", 3, staged=True)
    e.chunk("u2", 0, _halves(_weights(3))[0])
    assert e.finish("u2", 3, 2, ok=False) == 2
    _same(e.weights(), new)
    e.start("u3", 3, staged=True)  # the next staged update lands whole
    e.chunk("u3", 0, _weights(3))
    assert e.finish("u3", 3, 1) == 3
    _same(e.weights(), _weights(3))


@pytest.mark.parametrize("how", ["abort", "superseded", "closed", "transport"])
def test_staged_update_that_dies_leaves_the_last_version_exactly(how):
    e = Engine()
    before = e.weights()
    a, b = _halves(_weights(5))
    e.start("u", 1, staged=True)
    e.chunk("u", 0, a)
    if how == "abort":
        assert e.finish("u", 1, 2, ok=False) == 0
    elif how == "superseded":
        e.start("u2", 2)
    elif how == "transport":
        with pytest.raises(KeyError):  # chunk 1's bytes never arrived
            _run(e.ep.update_named_weights(_j(FlakyRequest(
                names=list(b), dtypes=["float32"] * 2, shapes=[list(t.shape) for t in b.values()],
                update_id="u", chunk_index=1).to_dict())))
        assert e.finish("u", 1, 2, ok=False) == 0
    else:
        _run(e.ep.close())
    assert e.ep.version == 0 and e.ep.state in ("idle", "receiving", "closed")
    assert e.ep.state != "torn" and e.ep.last_error == ""
    _same(e.weights(), before)


def test_in_place_update_that_dies_is_torn_for_contrast():
    e = Engine()
    a, _ = _halves(_weights(5))
    e.start("u", 1)
    e.chunk("u", 0, a)
    e.finish("u", 1, 2, ok=False)
    assert e.ep.state == "torn"


def test_engine_policy_on_staging():
    never = Engine(stage_updates=False)
    with pytest.raises(UpdateRefusedError, match="does not stage updates"):
        never.start("u", 1, staged=True)
    assert never.ep.state == "idle"
    always = Engine(stage_updates=True)
    before = always.weights()
    a, _ = _halves(_weights(6))
    always.start("u", 1)  # not asked for, staged anyway
    always.chunk("u", 0, a)
    _same(always.weights(), before)
    assert always.ep.status().update.staged


# -- what an update may carry ---------------------------------------------------------------------


def test_a_name_sent_twice_in_one_update_is_refused_before_its_bytes_move():
    e = Engine()
    a, _ = _halves(_weights(7))
    e.start("u", 1)
    e.chunk("u", 0, a)
    before = e.weights()
    with pytest.raises(WeightMismatchError, match="sent more than once in one update"):
        e.chunk("u", 1, a)
    _same(e.weights(), before)


def test_bigger_dtype_than_the_target_is_refused_even_when_the_loader_casts():
    module = _model(0)
    ep = WeightUpdateEndpoint(TorchModuleWeightLoader(module=module, strict_dtype=False))
    manifest = [ws.TensorMeta(n, "float64", list(t.shape)) for n, t in module.state_dict().items()]
    with pytest.raises(WeightMismatchError, match=r"0.weight: 256 bytes \(float64\[8, 4\]\) but "
                                                  r"the target holds 128"):
        _run(ep.start_weight_update(_j(ws.WeightUpdateStart(update_id="u", manifest=manifest)
                                       .to_dict())))
    half = [ws.TensorMeta(n, "float16", list(t.shape)) for n, t in module.state_dict().items()]
    _run(ep.start_weight_update(_j(ws.WeightUpdateStart(update_id="u", manifest=half).to_dict())))


# -- through the front door and the real transports (in this process) -------------------------------


@pytest.mark.parametrize("strategy", ["broadcast", "cuda_ipc", "packed_cuda_ipc"])
def test_checksummed_staged_pushes_land_bit_exact_over_every_strategy(strategy):
    module = _model(0)
    loader = TorchModuleWeightLoader(module=module)
    ep = WeightUpdateEndpoint(loader, name="eng0")
    cfg = {"type": strategy, "checksum": True, "staged": True, "bucket_size_mb": 0.0001}
    if strategy == "broadcast":
        cfg["backend"] = "gloo"
    seen: list[dict] = []
    real = ep.update_named_weights

    async def spy(request: dict) -> None:  # what crossed the control plane
        seen.append(request)
        await real(request)

    ep.update_named_weights = spy  # type: ignore[method-assign]
    src = _weights(11)
    with ws.connect_sync([ep], cfg) as sync:
        stats = sync.push(src, version=3)
    assert stats.versions == [3] and stats.num_chunks >= 2
    assert all(r["checksums"] is not None and len(r["checksums"]) == len(r["names"])
               for r in seen)
    _same({k: v.detach() for k, v in module.state_dict().items()}, src)


class LendingLoader(TorchModuleWeightLoader):
    """Records how it was given each chunk: lent (``load_borrowed``) or to copy."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module=module)
        self.got: list[str] = []

    async def load_borrowed(self, named_tensors) -> None:
        self.got.append("lent")
        await super().load_weights(named_tensors)

    async def load_weights(self, named_tensors) -> None:
        self.got.append("copy")
        await super().load_weights(named_tensors)


@pytest.mark.parametrize("how", ["one call", "three calls", "one call, staged"])
def test_lent_views_reach_the_loader_only_when_one_call_carries_the_finish_too(how):
    """A receiver lends views valid until the call that carried them returns; the sink lends
    them on only inside ``apply_update`` (that call carries the finish: a loader may keep them
    until then) and only in place (a staged update copies them, as any chunk)."""
    LEND.append(True)
    module = _model(0)
    loader = LendingLoader(module)
    ep = WeightUpdateEndpoint(loader, name="eng0")
    _run(ep.init_weight_transfer({"type": STRATEGY}, ws.EmptyWeightSyncInfo().to_dict(), 1))
    new = _weights(1)
    WIRE[("u", 0)] = new
    start = ws.WeightUpdateStart(update_id="u", version=1, staged="staged" in how).to_dict()
    req = FlakyRequest(names=list(new), dtypes=[ws.types.dtype_to_str(t.dtype)
                                                 for t in new.values()],
                       shapes=[list(t.shape) for t in new.values()], update_id="u",
                       chunk_index=0).to_dict()
    finish = ws.WeightUpdateFinish(update_id="u", version=1, num_chunks=1).to_dict()
    if how.startswith("one call"):
        assert _run(ep.apply_update(_j(start), [_j(req)], _j(finish))) == 1
    else:
        _run(ep.start_weight_update(_j(start)))
        _run(ep.update_named_weights(_j(req)))
        assert _run(ep.finish_weight_update(_j(finish))) == 1
    assert loader.got == (["lent"] if how == "one call" else ["copy"])
    _same({k: v.detach() for k, v in module.state_dict().items()}, new)
