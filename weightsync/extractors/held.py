"""An extractor that keeps its last update while the model still holds it (``HoldsUpdates``).

Who uses it: extractors whose chunks are views of the model's own tensors when nothing is cast
or gathered (``hf``, ``hf_head``, ``lora_adapter``), in the sending training process. An RL
trainer changes its tensors' values in place (the optimizer step), not which tensors the model
holds; so after the first push the names, the manifest and the chunks are the same objects
every step, and only the bytes behind them are new. The mixin keeps a record of what the last
update was made of (the subclass's ``_record_of``: the model, the dtype, the objects and tensor
storage it read) and what it made (``metas``, ``chunks``), and gives them out again while the
record ``holds`` (one pass over the objects and tensors it kept, no names built):

* ``metadata`` and ``extract_weights``: the kept manifest / chunks when the model holds them,
  else made as usual (the chunks are kept only when every one is ``borrowed``: no copy);
* ``held_update`` / ``check_held``: the front door's question (``weightsync.connect``): the
  update it can send without extracting, compared with the model now or (``check=False``)
  left for ``check_held`` while the engines' call travels.

A record's ``holds`` must be False whenever a new extraction would differ (a tensor replaced,
reshaped or moved, a cast of another dtype, a module swapped): the chunks are views, so they
always carry today's values, but only of the tensors the record saw.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from weightsync.types import TensorMeta, WeightChunk, as_dtype


class HeldRecord(Protocol):
    """What ``HoldsUpdates`` needs of a subclass's record."""

    metas: list[TensorMeta] | None
    chunks: list[WeightChunk] | None

    def made_for(self, model: Any, dtype: Any, config: tuple) -> bool: ...

    def holds(self, model: Any, dtype: Any, config: tuple) -> bool: ...


class HoldsUpdates:
    """Mixin before ``WeightExtractor`` (see the module docstring). A subclass implements
    ``_record_of`` and ``_metadata_now``, and may override ``_held_config`` (what else an
    extraction depends on, e.g. the bucket size)."""

    _held: HeldRecord | None = None

    def _record_of(self, model: Any, dtype: Any, config: tuple) -> HeldRecord | None:
        """A new record of what ``model`` holds now; None when nothing can be kept."""
        raise NotImplementedError

    def _metadata_now(self, model: Any, dtype: Any) -> list[TensorMeta]:
        """The manifest made anew."""
        raise NotImplementedError

    def _held_config(self) -> tuple:
        return ()

    def _holding(self, model: Any, dtype: Any) -> HeldRecord | None:
        """The record of what this model holds now: the last one when the model still holds
        it, else a new one (whose manifest and chunks are not made yet); None when nothing can
        be reused (not the sending rank, a mapping of tensors, or ``_record_of`` says so)."""
        config = self._held_config()
        held = self._held
        if held is not None and held.holds(model, dtype, config):
            return held
        self._held = None
        if not self.is_sender or isinstance(model, Mapping):  # type: ignore[attr-defined]
            return None
        self._held = self._record_of(model, dtype, config)
        return self._held

    def metadata(self, model: Any, generator_dtype: Any = None) -> list[TensorMeta]:
        """As ``WeightExtractor.metadata``; an unchanged model's is not made again."""
        dtype = as_dtype(generator_dtype)
        held = self._holding(model, dtype)
        if held is not None and held.metas is not None:
            return list(held.metas)
        out = self._metadata_now(model, dtype)
        if held is not None:
            held.metas = out
        return list(out)

    async def extract_weights(
        self, model: Any, generator_dtype: Any = None
    ) -> AsyncIterator[WeightChunk]:
        """As ``WeightExtractor.extract_weights`` (``generator_dtype`` may be a string). When
        every chunk of the last call was ``borrowed`` (the model's own tensors: no cast, no
        gather) and the model still holds the same tensors, the chunks of the last call are
        yielded again: views of the same memory, so they hold today's values, and the
        per-tensor work of naming and bucketing is skipped."""
        import asyncio

        dtype = as_dtype(generator_dtype)
        held = self._holding(model, dtype)
        if held is not None and held.chunks is not None:
            for chunk in held.chunks:
                yield chunk
                await asyncio.sleep(0)
            return
        made: list[WeightChunk] = []
        async for chunk in super().extract_weights(model, dtype):  # type: ignore[misc]
            made.append(chunk)
            yield chunk
        if held is not None and made and all(c.borrowed for c in made):
            held.chunks = made

    def held_update(
        self, model: Any, generator_dtype: Any = None, *, check: bool = True
    ) -> tuple[list[WeightChunk], list[TensorMeta]] | None:
        """The last call's chunks and manifest when both were made for the model's present
        tensors (``check_held``); None when either would be made anew. ``check`` False: what
        was made last for this model and dtype, not compared with the model now (the caller
        calls ``check_held`` before it sends them)."""
        held = self._held
        dtype = as_dtype(generator_dtype)
        config = self._held_config()
        if (held is None or held.chunks is None or held.metas is None
                or not held.made_for(model, dtype, config)):
            return None
        if check and not held.holds(model, dtype, config):
            return None
        return list(held.chunks), list(held.metas)

    def check_held(self, model: Any, generator_dtype: Any = None) -> bool:
        """Whether the model still holds exactly what the last call's update was made of."""
        held = self._held
        return held is not None and held.holds(model, as_dtype(generator_dtype),
                                               self._held_config())
