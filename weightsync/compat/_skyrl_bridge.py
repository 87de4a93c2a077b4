"""What joins SkyRL's weight-sync calls to weightsync's strategies (``weightsync.compat.skyrl``).

SkyRL drives a transfer differently from weightsync: its trainer builds the engines' receivers
itself (``init_weight_update_communicator``) while the sender joins, sends one request object
per chunk through its own engine client (``update_named_weights(request)``) with no update start
or finish, and an engine pulls ``(name, tensor)`` pairs from a synchronous
``receive_weights(request)``. Here our sender is handed a client (``SkyRLEngines``) that turns
each of our chunk requests into SkyRL's request object (ours travels inside it as plain data),
and an engine runs our receiver on a private event loop into a loader that only collects
(``receive_into_list``). The transports are ours, unchanged: the broadcast's private group and
go/no-go vote, the packed shared buffers of ``packed_cuda_ipc``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from weightsync._runtime.threads import LoopThread
from weightsync.compat._skyrl_types import WeightTransferSender
from weightsync.errors import WeightSyncError
from weightsync.interfaces import InferenceEngineClient, WeightLoader, WeightTransferReceiver
from weightsync.types import WeightChunk, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: the loop the blocking SkyRL calls run our coroutines on (group joins, receives, teardown):
#: usable from plain code, from a worker thread and from inside another running loop
LOOP = LoopThread("weightsync-skyrl-compat")


def this_rank() -> int:
    """This process's rank in its default ``torch.distributed`` group (0 when there is none):
    a training rank on the trainer, the worker's rank inside its engine on an engine."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The default group's size (1 when there is none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def as_weightsync_chunk(chunk: Any, dtype: torch.dtype | None) -> WeightChunk:
    """A SkyRL chunk (or one of ours) as our ``WeightChunk``: tensors cast to ``dtype`` (SkyRL
    sends every tensor in the model's dtype) and shaped as the chunk declares them (SkyRL's
    ``get_shape_fn`` may give another shape of the same size: the engine gets that one)."""
    tensors = []
    for name, shape, t in zip(chunk.names, chunk.shapes, chunk.tensors, strict=True):
        t = t.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        want = [int(s) for s in shape]
        if list(t.shape) != want:
            if t.numel() != math.prod(want):
                raise ValueError(f"WeightChunk: parameter {name!r} declares shape {want} but its "
                                 f"tensor holds {t.numel()} elements")
            t = t.reshape(want)
        tensors.append(t)
    return WeightChunk(list(chunk.names), tensors)


def chunk_stream(chunks: Iterable[Any], dtype: torch.dtype | None) -> Iterator[WeightChunk]:
    """SkyRL's chunks converted one at a time, as our sender asks for them."""
    for chunk in chunks:
        yield as_weightsync_chunk(chunk, dtype)


class SkyRLEngines(InferenceEngineClient):
    """Our sender's engine client over SkyRL's: each chunk request goes to SkyRL's
    ``update_named_weights`` as the SkyRL request ``wrap`` makes of it. SkyRL's trainer builds
    the engines' receivers itself and has no update start or finish, so those are local."""

    def __init__(self, client: Any, wrap: Callable[[dict], Any]) -> None:
        self.client = client
        self.wrap = wrap

    async def get_world_sizes(self) -> list[int]:
        raise WeightSyncError("SkyRL's engine client has no world sizes: the init info carries "
                              "the group's size")

    async def init_weight_transfer(self, strategy_cfg: dict, sync_info: dict) -> None:
        """Nothing: SkyRL's trainer calls ``init_weight_update_communicator`` itself."""

    async def start_weight_update(self, start: dict) -> None:
        """Nothing: SkyRL's engines take chunk requests only."""

    async def update_named_weights(self, request: dict) -> None:
        await self.client.update_named_weights(self.wrap(request))

    async def finish_weight_update(self, finish: dict) -> list[int | None]:
        return []


class _Collector(WeightLoader):
    """A loader that keeps the pairs it is given, in order (they are views of the transfer's
    buffers, valid until the next request: SkyRL's engine loads them before that)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.Tensor]] = []

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        self.pairs.extend(named_tensors.items())


def receive_into_list(receiver: WeightTransferReceiver, transfer: dict | None, what: str,
                      check: Callable[[], None]) -> list[tuple[str, torch.Tensor]]:
    """Run ``receiver`` on one of our requests (``transfer``, its plain form) and return what
    it received. ``check`` runs first: when it raises, the receiver refuses the request (a
    broadcast votes no, so the sender and the other engines are released and no byte moves)
    and the error is raised. Blocks (the private loop runs the receive)."""
    if transfer is None:
        raise ValueError(
            f"{what} carries no weightsync transfer (its `transfer` field is None): it was not "
            f"made by weightsync.compat.skyrl's sender; trainer and engines must both import "
            f"the weight-sync classes from weightsync.compat.skyrl")
    request = receiver.parse_request(transfer)
    try:
        check()
    except ValueError:
        LOOP.run(receiver.refuse(request))
        raise
    collector = _Collector()
    LOOP.run(receiver.receive_and_load_weights(request, collector))
    return collector.pairs


def check_dtypes(dtypes: list[str], model_dtype: torch.dtype, message: str) -> None:
    """Every entry of ``dtypes`` names ``model_dtype``, else ``ValueError(message)``
    (``{dtype}`` and ``{model}`` filled in)."""
    for d in dtypes:
        if str_to_dtype(d) != model_dtype:
            raise ValueError(message.format(dtype=d, model=model_dtype))


class WrappedSender(WeightTransferSender):
    """A SkyRL sender over one of ours (None on ranks that do not send): chunks in the model's
    dtype, converted as our sender asks for them; requests made by ``wrap``."""

    def __init__(self, ours: Any, client: Any, model_dtype_str: str,
                 wrap: Callable[[dict], Any]) -> None:
        self._ours = ours
        self._dtype = str_to_dtype(model_dtype_str)
        self._client = None if client is None else SkyRLEngines(client, wrap)

    async def send_chunks(self, chunks: Iterable[Any]) -> None:
        """Send one update; every training rank calls it with the same chunks.

        Args:
            chunks: SkyRL ``WeightChunk``s (or weightsync's), any number of tensors each.
        """
        if self._ours is None:  # a rank that only takes part in the extraction
            for _ in chunks:
                pass
            return
        await self._ours.send_chunks(chunk_stream(chunks, self._dtype), self._client)

    def teardown(self) -> None:
        """Release the transport (process group, shared buffers)."""
        if self._ours is not None:
            ours, self._ours = self._ours, None
            LOOP.run(ours.close())

