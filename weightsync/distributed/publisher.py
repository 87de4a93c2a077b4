"""Publishers composed from a ``ControlPlane`` and a ``TensorCommunicator`` (the reward spec's
``BroadcastPolicyPublisher`` and ``Rank0OnlyPublisher``), and the one publishing sequence they
and ``RewardModelPublisher`` share.

Who calls: the training loop, on the sending rank (``Rank0OnlyPublisher`` lets every rank call
it). One ``publish`` = announce the batch (names, dtypes, shapes in broadcast order), one
broadcast per tensor from ``src_rank``, barrier, finalize: the engines serve the batch as one
version. With the vLLM adapters (``weightsync.distributed.adapters``) the engines check the
announced batch before any byte moves and the tensors travel bucketed on weightsync's
strategies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from weightsync.distributed.interfaces import ControlPlane, PolicyPublisher, TensorCommunicator


class BroadcastPolicyPublisher:
    """``publish(state_dict, version=None)``: the state dict under engine names (HF / PEFT /
    FSDP / DDP wrappers stripped, ``weightsync.naming``), in sorted order, as one announced
    batch. ``src_rank`` (default ``comm.rank``): the rank the tensors are broadcast from.
    Returns what ``control.finalize_update()`` returns (the vLLM adapters: ``SyncStats``)."""

    def __init__(self, control: ControlPlane, comm: TensorCommunicator,
                 src_rank: int | None = None) -> None:
        self.control = control
        self.comm = comm
        self.src_rank = comm.rank if src_rank is None else int(src_rank)

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> Any:
        from weightsync.naming import engine_names

        mapping = engine_names(state_dict)
        named = sorted((mapping[n], t) for n, t in state_dict.items() if n in mapping)
        return publish_batch(self.control, self.comm, self.src_rank, named, version)


class Rank0OnlyPublisher:
    """Lets every training rank call ``publish``: rank 0 builds the publisher with ``make()`` at
    its first call and publishes; the other ranks return None at once. ``rank``: this process's
    rank (default ``torch.distributed``'s, 0 when no process group is up)."""

    def __init__(self, make: Callable[[], PolicyPublisher], *, rank: int | None = None) -> None:
        self._make = make
        self.rank = rank
        self._publisher: PolicyPublisher | None = None

    def publish(self, state_dict: Any, version: int | None = None, **kwargs: Any) -> Any:
        if (_rank() if self.rank is None else int(self.rank)) != 0:
            return None
        if self._publisher is None:
            self._publisher = self._make()
        return self._publisher.publish(state_dict, version, **kwargs)

    def close_sync(self) -> None:
        """Close the publisher built on this rank, if it has a ``close_sync``."""
        close = getattr(self._publisher, "close_sync", None)
        if close is not None:
            close()


def metadata_of(named: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The announced batch: ``{name, dtype: str(tensor.dtype), shape}`` per tensor, in order."""
    return [{"name": n, "dtype": str(t.dtype), "shape": tuple(t.shape)} for n, t in named]


def publish_batch(control: ControlPlane, comm: TensorCommunicator, src_rank: int,
                  named: list[tuple[str, Any]], version: int | None,
                  extra: dict[str, Any] | None = None) -> Any:
    """Announce ``named``, broadcast each tensor, barrier, finalize (blocking)."""
    control.announce_update_batch(metadata_of(named), version=version, extra=extra)
    try:
        for _, tensor in named:
            comm.broadcast(tensor if tensor.is_contiguous() else tensor.contiguous(),
                           src=src_rank)
        comm.barrier()
    except BaseException:
        _close_quietly(control)
        raise
    return control.finalize_update()


async def publish_stream(
    control: ControlPlane, comm: TensorCommunicator, src_rank: int,
    metadata: list[dict[str, Any]], chunks: AsyncIterable[Any], version: int | None,
    extra: dict[str, Any] | None = None,
) -> Any:
    """``publish_batch`` for tensors that arrive as a stream of chunks (``names``, ``tensors``),
    e.g. an extractor gathering a sharded model; each chunk goes out once broadcast (the
    communicator's ``flush``, where it has one), so a stream keeps only a few chunks alive. If
    sending fails part-way the rest of the stream is still consumed (and dropped), so ranks
    gathering in lockstep are not left waiting. Uses a plane's ``*_async`` twins where it has
    them."""
    await _call(control, "announce_update_batch", metadata, version=version, extra=extra)
    failure: BaseException | None = None
    async for chunk in chunks:
        if failure is not None:
            continue  # keep the gathers in lockstep; nothing more is sent
        try:
            for tensor in chunk.tensors:
                await _call(comm, "broadcast",
                            tensor if tensor.is_contiguous() else tensor.contiguous(),
                            src=src_rank)
            if hasattr(comm, "flush"):  # send this chunk now: the stream's memory bound holds
                await _call(comm, "flush")
        except BaseException as e:  # noqa: BLE001 - raised below, after the stream ends
            failure = e
    if failure is None:
        try:
            await _call(comm, "barrier")
        except BaseException as e:  # noqa: BLE001
            failure = e
    if failure is not None:
        await asyncio.to_thread(_close_quietly, control)
        raise failure
    return await _call(control, "finalize_update")


async def _call(plane: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    twin = getattr(plane, f"{method}_async", None)
    if twin is not None:
        return await twin(*args, **kwargs)
    return await asyncio.to_thread(getattr(plane, method), *args, **kwargs)


def _close_quietly(control: Any) -> None:
    """After a failed broadcast: finalize, which ends an incomplete update unpublished."""
    try:
        control.finalize_update()
    except Exception:  # noqa: BLE001 - the broadcast's failure is the news
        pass


def _rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
