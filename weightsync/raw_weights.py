"""One extraction per update: the interface design's ``_extract_raw_weights`` that returns a dict.

Who uses it: ``weightsync.interfaces.WeightExtractor`` (every training rank), and through it the
front door, the Ray trainer and ``send_chunks``. The design's extractor implements one method,
``_extract_raw_weights(model, generator_dtype)``, ``async`` or not, returning every tensor as
``{name: tensor}``. That dict already holds every name, dtype and shape, so the update's
manifest (what the engines check before any byte moves) is read from it, and the chunks are
then cut from the very same dict: the model is extracted once per update (a sharded model's
gathers run once), and nothing is kept after the update (the pairs are let go as the chunks
are made, and a prepared extraction that is never sent is dropped by ``discard_prepared``).

- ``RawExtraction``: one call of ``_extract_raw_weights`` for one model and dtype: the
  ``(name, tensor)`` pairs and their manifest when it gave a dict, a list or an async generator
  (whole by then); else the iterator it gave (the streaming form, one pair at a time, walked as
  the chunks are made, never held whole).
- ``ExtractedStream``: what the base ``extract_weights`` returns: an async iterator of chunks
  whose ``manifest()`` is the dict's manifest (None for the streaming form), so ``send_chunks``
  given only the stream still announces the whole update in its start.
- ``update_manifest`` / ``discard_prepared``: the callers' two calls for any extractor.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

from weightsync.types import TensorMeta, as_dtype, dtype_to_str


class RawExtraction:
    """What one call of an extractor's ``_extract_raw_weights(model, dtype)`` gave."""

    __slots__ = ("model", "dtype", "pairs", "iterator", "manifest")

    def __init__(self, model: Any, dtype: Any, raw: Any, *, who: str = "extractor") -> None:
        self.model, self.dtype = model, dtype
        self.pairs: list[tuple[str, Any]] | None = None
        self.iterator: Any = None
        self.manifest: list[TensorMeta] | None = None
        if isinstance(raw, Mapping):
            self.pairs = list(raw.items())
        elif isinstance(raw, (list, tuple)):
            self.pairs = list(raw)
        elif isinstance(raw, Iterable):
            self.iterator = raw
        else:
            raise TypeError(
                f"{who}._extract_raw_weights returned {type(raw).__name__}: expected a dict of "
                f"name -> tensor (or a generator of (name, tensor) pairs)")
        if self.pairs is not None:
            self.manifest = manifest_of(self.pairs, dtype, who=who)

    def made_for(self, model: Any, dtype: Any) -> bool:
        return self.model is model and self.dtype == dtype

    def take(self) -> Iterator[tuple[str, Any]]:
        """The pairs, once: a held list is given out front to back and each pair let go as it
        is taken (a tensor lives on only in the chunk that carries it)."""
        if self.pairs is None:
            return iter(self.iterator)
        pairs, self.pairs = self.pairs, None
        pairs.reverse()

        def drain() -> Iterator[tuple[str, Any]]:
            while pairs:
                yield pairs.pop()

        return drain()


def manifest_of(pairs: Iterable[tuple[str, Any]], dtype: Any, *,
                who: str = "extractor") -> list[TensorMeta]:
    """Names, dtypes after the cast to ``dtype`` (floating tensors only) and shapes."""
    out = []
    for pair in pairs:
        try:
            name, t = pair
        except (TypeError, ValueError):
            raise TypeError(f"{who}._extract_raw_weights: expected (name, tensor) pairs, got "
                            f"{type(pair).__name__}") from None
        if not isinstance(name, str) or not hasattr(t, "is_floating_point"):
            raise TypeError(f"{who}._extract_raw_weights: expected name -> tensor, got "
                            f"{type(name).__name__} -> {type(t).__name__}")
        d = dtype if dtype is not None and t.is_floating_point() else t.dtype
        out.append(TensorMeta(name, dtype_to_str(d), list(t.shape)))
    return out


async def extract_raw(extractor: Any, model: Any, dtype: Any) -> RawExtraction:
    """Call ``extractor._extract_raw_weights(model, dtype)`` once, whichever form it has (a
    coroutine is awaited, an async generator collected)."""
    dtype = as_dtype(dtype)
    raw = extractor._extract_raw_weights(model, dtype)
    if inspect.iscoroutine(raw):
        raw = await raw
    if inspect.isasyncgen(raw):
        raw = [pair async for pair in raw]
    return RawExtraction(model, dtype, raw, who=type(extractor).__name__)


class ExtractedStream:
    """The chunks of one extraction (``WeightExtractor.extract_weights``): an async iterator,
    plus ``manifest()``. Nothing is extracted before either is asked for."""

    def __init__(self, extractor: Any, model: Any, dtype: Any) -> None:
        self._extractor, self._model, self._dtype = extractor, model, as_dtype(dtype)
        self._raw: RawExtraction | None = None
        self._manifest: list[TensorMeta] | None = None
        self._chunks: AsyncIterator[Any] | None = None

    async def manifest(self) -> list[TensorMeta] | None:
        """The update's manifest when the extractor's raw weights are a dict (read from it; the
        chunks are then cut from the same dict), else None (a streaming extractor's tensors
        are made as the chunks are). Before the first chunk only: it extracts."""
        if self._chunks is None and self._raw is None:
            self._raw = await self._extractor._raw_extraction(self._model, self._dtype)
            self._manifest = self._raw.manifest
        return None if self._manifest is None else list(self._manifest)

    def __aiter__(self) -> ExtractedStream:
        return self

    async def __anext__(self) -> Any:
        if self._chunks is None:
            raw, self._raw = self._raw, None
            self._chunks = self._extractor._chunk_stream(raw, self._model, self._dtype)
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        self._raw = None
        if self._chunks is not None:
            await self._chunks.aclose()  # type: ignore[attr-defined]


async def stream_manifest(chunks: Any) -> list[TensorMeta] | None:
    """The manifest an ``ExtractedStream`` can give before its first chunk; None for anything
    else (a list's manifest is its chunks' metadata, read by the caller)."""
    if isinstance(chunks, ExtractedStream):
        return await chunks.manifest()
    return None


async def update_manifest(extractor: Any, model: Any, dtype: Any) -> list[TensorMeta]:
    """The manifest of the update the next ``extractor.extract_weights(model, dtype)`` yields:
    ``prepare_update`` (a dict-returning extractor extracts here, once) or, for an extractor
    without it, ``metadata``."""
    prepare = getattr(extractor, "prepare_update", None)
    if prepare is not None:
        return await prepare(model, dtype)
    return extractor.metadata(model, dtype)


def discard_prepared(extractor: Any) -> None:
    """Drop an extraction ``prepare_update`` kept for an update that will not be sent."""
    discard = getattr(extractor, "discard_prepared", None)
    if discard is not None:
        discard()
