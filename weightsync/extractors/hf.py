"""Extractors for plain torch modules and Hugging Face models: ``hf`` (everything) and ``hf_head``
(only the head, e.g. a reward model's ``score`` layer).

Who calls: the sending training process (one rank; these models are not sharded, except that a
DTensor parameter is gathered with ``full_tensor()``, which is a collective: then every rank must
iterate in lockstep, as for any extractor). What is yielded is what the model's ``state_dict``
holds (parameters and persistent buffers) under engine names, with three rules:

- **Tied weights are sent once.** Two names sharing one tensor (HF ``tie_word_embeddings``:
  ``lm_head.weight`` is ``model.embed_tokens.weight``) yield one tensor, under the input
  embedding's name (``get_input_embeddings()`` for HF models; else the first alias that is not
  an output projection such as ``lm_head.weight``; else the first registered name): that is
  what an HF checkpoint holds and what vLLM expects (it skips ``lm_head.weight`` when tied).
- **Names are engine names**, mapped by ``weightsync.naming`` (the one place for it): wrapper
  prefixes (``module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``, ...) never reach the
  engine; PEFT's ``modules_to_save`` head is sent as ``score.weight`` and its frozen
  ``original_module`` copy is skipped. Unmerged LoRA tensors are refused (``NamingError``):
  sending base weights without them would be silently wrong; use ``lora_merge``. ``hf_head``
  ignores adapters outside the head.
- **Nothing is copied unless cast**: tensors are yielded detached, one at a time; the base class
  casts floating tensors to ``generator_dtype`` (a ``torch.dtype`` or a string such as
  ``"bfloat16"``) as they stream, so the model is never materialised twice.

``metadata()`` is cheap (names, dtypes after cast, shapes; no copies and no collectives), so a
caller can validate against an engine before extracting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from weightsync.config import DEFAULT_BUCKET_MB, ExtractorConfig, HeadExtractorConfig
from weightsync.interfaces import WeightExtractor
from weightsync.naming import compile_patterns
from weightsync.registry import register_extractor
from weightsync.types import TensorMeta, WeightChunk, dtype_to_str, str_to_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch


def _unwrap(model: Any) -> Any:
    """Peel DDP / DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    import torch

    seen = 0
    while seen < 8:
        seen += 1
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
            continue
        break
    return model


def _state_entries(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` in ``state_dict`` order, every alias included (no copies).

    A mapping of tensors (a state dict) is accepted as is.
    """
    import torch

    if isinstance(model, Mapping):
        bad = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"state dict values must be tensors; not tensors: {bad[:5]}")
        return [(str(k), v) for k, v in model.items()]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"hf extractor needs a torch.nn.Module (or a dict of tensors), got "
            f"{type(model).__name__}"
        )
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, mod in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out.append((pre + n, p))
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for n, b in mod._buffers.items():
            if b is not None and n not in skip:
                out.append((pre + n, b))
    return out


def _input_embedding_name(model: Any) -> str | None:
    """Name of the HF input-embedding weight (``model.embed_tokens.weight``), if any."""
    getter = getattr(model, "get_input_embeddings", None)
    if not callable(getter):
        return None
    try:
        emb = getter()
    except (NotImplementedError, AttributeError):
        return None
    if emb is None:
        return None
    for prefix, mod in model.named_modules():
        if mod is emb:
            return f"{prefix}.weight" if prefix else "weight"
    return None


def _engine_entries(model: Any) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """``(engine-named tensors, each tied group once; adapter tensors that have no engine name)``.

    Order is ``state_dict`` order; a tied group sits where its first alias appears. Names go
    through ``weightsync.naming`` (wrappers stripped, PEFT's frozen ``original_module`` copies
    skipped); unmerged LoRA tensors are returned apart so the caller decides whether they matter.
    """
    from weightsync.naming import NamingError, alias_key, preferred_tied_name, to_engine_name

    model = _unwrap(model)
    entries = _state_entries(model)
    embedding = _input_embedding_name(model)
    aliases: dict[Any, list[str]] = {}
    order: list[tuple[Any, torch.Tensor]] = []
    for name, t in entries:
        key = alias_key(t)
        if key not in aliases:
            aliases[key] = []
            order.append((key, t))
        aliases[key].append(name)
    out: list[tuple[str, torch.Tensor]] = []
    adapters: list[str] = []
    origin: dict[str, str] = {}
    for key, t in order:
        names = aliases[key]
        chosen = embedding if embedding in names else preferred_tied_name(names)
        try:
            dst = to_engine_name(chosen)
        except NamingError:
            adapters.append(chosen)
            continue
        if dst is None:  # e.g. PEFT's frozen copy of a modules_to_save head
            continue
        if dst in origin:
            raise ValueError(
                f"{origin[dst]!r} and {chosen!r} both map to the engine name {dst!r} after "
                f"normalisation; only one can be sent"
            )
        origin[dst] = chosen
        out.append((dst, t))
    return out, adapters


def unique_named_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """Engine-named tensors of ``model``, each tied group once (see module docstring).

    Raises ``NamingError`` if the model holds unmerged adapter (LoRA) tensors: sending its base
    weights alone would silently drop the adapters (use the ``lora_merge`` extractor).
    """
    named, adapters = _engine_entries(model)
    _refuse_adapters(adapters)
    return named


def _refuse_adapters(adapters: list[str]) -> None:
    if adapters:
        from weightsync.naming import NamingError

        shown = ", ".join(adapters[:6]) + (f" ... ({len(adapters)} in all)" if len(adapters) > 6 else "")
        raise NamingError(
            f"the model holds unmerged adapter tensors ({shown}); the hf extractors would send "
            f"the base weights without them. Use the 'lora_merge' extractor (or merge first)"
        )


def _as_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or not isinstance(dtype, str):
        return dtype
    return str_to_dtype(dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    """Gather a DTensor (a collective: all ranks must call it); plain tensors pass through."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


@register_extractor("hf")
class HFWeightExtractor(WeightExtractor):
    """Every parameter and persistent buffer of a torch module / HF model (``type: hf``).

    Config: ``ExtractorConfig`` (``bucket_size_mb``, ``group_by_module``, ``is_sender``).
    """

    name = "hf"
    config_cls = ExtractorConfig
    yields_model_tensors = True  # parameters themselves; a gathered DTensor is marked fresh

    def _select(
        self, named: list[tuple[str, torch.Tensor]], adapters: list[str]
    ) -> list[tuple[str, torch.Tensor]]:
        """Which engine-named tensors to send (subclasses narrow it); refuses adapter tensors."""
        _refuse_adapters(adapters)
        return named

    def _selected(self, model: Any) -> list[tuple[str, torch.Tensor]]:
        return self._select(*_engine_entries(model))

    def _extract_raw_weights(
        self, model: Any, generator_dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._selected(model):
            full = _full(t)
            yield name, full.detach() if full is t else self._fresh(full.detach())

    def metadata(self, model: Any, generator_dtype: Any = None) -> list[TensorMeta]:
        """As the base class; an unchanged model's (same tensors, see ``extract_weights``) is
        not computed again."""
        dtype = _as_dtype(generator_dtype)
        key = self._reuse_key(model, dtype)
        last = getattr(self, "_last_metadata", None)
        if key is not None and last is not None and last[0] == key:
            return list(last[1])
        out = []
        for name, t in self._selected(model):
            d = dtype if dtype is not None and t.is_floating_point() else t.dtype
            out.append(TensorMeta(name, dtype_to_str(d), list(t.shape)))
        self._last_metadata = (key, out) if key is not None else None
        return list(out)

    async def extract_weights(
        self, model: Any, generator_dtype: Any = None
    ) -> AsyncIterator[WeightChunk]:
        """As the base class; ``generator_dtype`` may also be a string (``"bfloat16"``).

        When every chunk of the last call was ``borrowed`` (the model's own tensors: no cast,
        no gather) and the model still holds the same tensors (same objects, names, storage,
        shapes, strides, dtypes), the chunks of the last call are yielded again: they are views
        of the same memory, so they hold today's values, and the per-tensor work of naming and
        bucketing is skipped (a few milliseconds per sync for a few hundred tensors)."""
        dtype = _as_dtype(generator_dtype)
        key = self._reuse_key(model, dtype)
        last = getattr(self, "_last_chunks", None)
        if key is not None and last is not None and last[0] == key:
            for chunk in last[1]:
                yield chunk
                await asyncio.sleep(0)
            return
        self._last_chunks = None
        made: list[WeightChunk] = []
        async for chunk in super().extract_weights(model, dtype):
            made.append(chunk)
            yield chunk
        if key is not None and made and all(c.borrowed for c in made):
            self._last_chunks = (key, made)

    def held_update(
        self, model: Any, generator_dtype: Any = None
    ) -> tuple[list[WeightChunk], list[TensorMeta]] | None:
        """The last call's chunks and manifest when both were made for the model's present
        tensors (one walk of the model: the reuse key of ``extract_weights``); None when either
        would be made anew (first call, a tensor replaced or reshaped, a cast, a gather)."""
        chunks = getattr(self, "_last_chunks", None)
        metas = getattr(self, "_last_metadata", None)
        if chunks is None or metas is None or chunks[0] != metas[0]:
            return None
        key = self._reuse_key(model, _as_dtype(generator_dtype))
        if key is None or key != chunks[0]:
            return None
        return list(chunks[1]), list(metas[1])

    def _reuse_key(self, model: Any, dtype: Any) -> tuple | None:
        """What the chunks depend on; None when they cannot be reused (DTensors: every call
        gathers; not the sending rank)."""
        if not self.is_sender or isinstance(model, Mapping):
            return None
        inner = _unwrap(model)
        items = []
        for name, t in _state_entries(inner):
            if type(t).__name__ == "DTensor" or t.device.type == "meta":
                return None
            items.append((name, id(t), t.data_ptr(), t.dtype, tuple(t.shape), t.stride()))
        return (id(model), id(inner), dtype, float(getattr(self.cfg, "bucket_size_mb", DEFAULT_BUCKET_MB)),
                bool(getattr(self.cfg, "group_by_module", True)), tuple(items))


@register_extractor("hf_head")
class HFHeadWeightExtractor(HFWeightExtractor):
    """Only head tensors, matched on engine names by ``head_name_patterns`` (``type: hf_head``).

    Patterns follow ``compile_patterns``: a plain string matches as a substring (default
    ``score.``, ``classifier.``, ``v_head.``), ``re:...`` is a regular expression. A model in which
    no tensor matches is an error that lists the patterns and some of the model's names.
    """

    name = "hf_head"
    config_cls = HeadExtractorConfig

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg if cfg is not None else HeadExtractorConfig())
        patterns = list(getattr(self.cfg, "head_name_patterns", None) or [])
        if not patterns:
            raise ValueError("hf_head extractor: head_name_patterns must not be empty")
        self.patterns = patterns
        self._compiled = compile_patterns(patterns)

    def is_head(self, name: str) -> bool:
        return any(p.search(name) for p in self._compiled)

    def _select(
        self, named: list[tuple[str, torch.Tensor]], adapters: list[str]
    ) -> list[tuple[str, torch.Tensor]]:
        _refuse_adapters([n for n in adapters if self.is_head(n)])  # backbone adapters: not sent
        picked = [(n, t) for n, t in named if self.is_head(n)]
        if not picked:
            names = [n for n, _ in named]
            shown = names[:3] + (["..."] if len(names) > 6 else []) + names[max(3, len(names) - 3):]
            raise ValueError(
                f"hf_head extractor: no parameter matches head_name_patterns {self.patterns}; "
                f"the model has {len(names)} tensors, e.g. {shown}. Set head_name_patterns to "
                f"your head's name (a substring, or 're:<regex>')"
            )
        return picked
