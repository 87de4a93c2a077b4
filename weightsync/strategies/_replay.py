"""What a sender keeps of its last update to send the next one of the very same chunks again
without making it anew (``CudaIpcTransferSender``, ``BroadcastTransferSender``), and what a
receiver keeps for the layout references such updates carry (``KeptLayouts``).

A trainer that pushes the same tensors step after step (the front door's held update: views of
the model's own weights; a caller's list of chunks) sends an update whose entries, options and
layout are the last one's; only the values changed. Such an update is *replayed*: its start
refers to the manifest the engines keep from the update that carried it in full
(``WeightUpdateStart.manifest_of``), its request to the layout they keep decoded (the
strategy's ``layout_key``), and nothing is planned, validated or serialized again. The sender's
side runs in the trainer process, on the sender's event loop; ``KeptLayouts`` in each engine
worker, in its receiver.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from weightsync.types import WeightChunk, WeightUpdateFinish


def held_chunks(chunks: Any) -> list | None:
    """The chunks an update is made of when they exist already: a list, or a ready-made
    stream's ``chunks`` (the front door's held update); None for chunks still to be made."""
    if isinstance(chunks, (list, tuple)):
        return list(chunks)
    if getattr(chunks, "ready_made", False) and isinstance(getattr(chunks, "chunks", None),
                                                           list):
        return chunks.chunks
    return None


def update_options(kwargs: dict) -> tuple:
    """An update's options that its start carries, apart from its manifest and version."""
    mode = kwargs.get("training_mode")
    return (getattr(mode, "value", mode), tuple(kwargs.get("head_name_patterns") or ()),
            kwargs.get("extras") or None, kwargs.get("delta"), kwargs.get("lora_adapter"))


def manifest_ids(manifest: Any) -> tuple | None:
    return None if manifest is None else tuple(map(id, manifest))


def engine_loader(loader: Any) -> Any:
    """The engine's own loader behind the per-update sink the endpoint hands receivers (the
    sink is new at every update; the loader's verdict on a layout's metadata is not)."""
    return getattr(loader, "loader", loader)


@dataclass(eq=False)
class LastUpdate:
    """The last update a sender sent in full and may replay: the held chunks it was made of
    (held: their ids stay theirs), the start's per-update options and manifest (ids of its
    entries), the start as sent, the request as a reference to its layout (no entries) and,
    where the sender needs it, the chunk it sent and the bytes of the update."""

    held: list[WeightChunk]
    options: tuple
    manifest_ids: tuple | None
    start: dict
    request: dict
    chunk: WeightChunk | None = None
    nbytes: int = 0

    def fits(self, held: list[WeightChunk], kwargs: dict) -> bool:
        """An update of ``held`` with ``kwargs`` is this one again (its values aside)."""
        return (len(held) == len(self.held) and all(map(operator.is_, held, self.held))
                and update_options(kwargs) == self.options
                and manifest_ids(kwargs.get("manifest")) == self.manifest_ids)

    def messages(self, update_id: str, version: int | None, *,
                 manifest_by_reference: bool = True) -> tuple[dict, dict, dict]:
        """The replay's start, one request and finish. ``manifest_by_reference``: the start
        refers to the manifest of the update that carried it (each engine keeps it); else it
        carries it again."""
        stamp = {"update_id": update_id, "version": version}
        start = {**self.start, **stamp}
        if manifest_by_reference and self.start.get("manifest") is not None:
            start.update(manifest=None, manifest_of=self.start["update_id"])
        request = {**self.request, **stamp, "chunk_index": 0, "is_last": True}
        finish = WeightUpdateFinish(update_id=update_id, version=version, num_chunks=1).to_dict()
        return start, request, finish


class KeptLayouts(OrderedDict):
    """What a receiver decoded from the requests that carried a layout key in full, by key,
    most recently used last; at most ``limit`` (the oldest go first)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def find(self, key: str) -> Any:
        """The layout kept for ``key`` (now the most recently used), or None."""
        found = self.get(key)
        if found is not None:
            self.move_to_end(key)
        return found

    def keep(self, key: str, layout: Any) -> None:
        self[key] = layout
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)
