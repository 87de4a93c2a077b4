"""``lora_merge`` extractor: a PEFT LoRA model -> merged weights under engine names.

Who calls: the sending training process (an unsharded PEFT model, e.g. a reward model trained
with LoRA on its backbone and a full ``score`` head in ``modules_to_save``). Engines never see
adapter tensors (``lora_A``/``lora_B``): every LoRA-targeted layer is sent as its merged weight
``W + scaling * B @ A`` (plus ``lora_B.bias * scaling`` on the bias with ``lora_bias``) under the
base layer's engine name, the trained ``modules_to_save`` copy as the plain name
(``score.modules_to_save.default.weight`` -> ``score.weight``), PEFT's frozen
``original_module`` copy never. Names go through ``weightsync.naming``.

Two modes:

- **default (merged copy)**: the merged weight is computed next to the base weight, one layer
  at a time as the stream reaches it; nothing in the model changes, so training goes on
  undisturbed and bit-for-bit (this is "merge -> extract -> unmerge" without the
  ``W + d - d != W`` rounding of an in-place merge/unmerge).
- **``merge_and_reinit=True``**: at the start of each extraction the adapters are merged into
  the base weights in place (PEFT's own safe merge), then re-initialised fresh (``B = 0``, so the
  model computes exactly what it did), and the merged base weights are sent. Use it to keep
  adapters small and well-conditioned over long runs (ReLoRA-style).

  **Optimizer state.** The adapter ``Parameter`` objects are re-initialised *in place*: they
  stay the same objects, so an optimizer's param groups (and LR schedulers) remain valid, but
  the optimizer state kept for them (Adam's moments and step counts) describes the old adapters
  and must be dropped before the next step: call ``reset_adapter_optimizer_state(optimizer,
  extractor.last_reinit_params)`` (or rebuild the optimizer). Nothing else in the optimizer
  changes; the merged base weights are frozen and have no state.

Only vanilla LoRA layers (Linear, Embedding, Conv) are merged here; LoRA variants (DoRA, ...)
keep state in their merge and are refused with a clear error: merge them with PEFT and use the
``hf`` extractor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.config import ExtractorConfig
from weightsync.extractors._gather import _named_entries, name_filter
from weightsync.extractors.lora_layers import lora_layers, refuse_variant
from weightsync.interfaces import WeightExtractor
from weightsync.naming import NamingError, engine_names, is_lora_param, tied_aliases
from weightsync.types import TensorMeta, as_dtype, dtype_to_str

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(kw_only=True)
class LoraMergeExtractorConfig(ExtractorConfig):
    type: str = "lora_merge"
    merge_and_reinit: bool = False
    adapter_names: list[str] | None = None  # None: the model's active adapters
    include_buffers: bool = True  # persistent buffers too (state_dict semantics, like ``hf``)
    only_trained_modules: bool = False  # send LoRA-targeted layers and trainable params only
    name_patterns: list[str] | None = None  # only engine names matching (e.g. the head); None: all


@dataclass
class _Item:
    name: str  # engine name
    shape: list[int]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


class LoraMergeWeightExtractor(WeightExtractor):
    """PEFT LoRA -> merged weights (registered as ``lora_merge``); see the module docstring."""

    config_cls = LoraMergeExtractorConfig

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg if cfg is not None else LoraMergeExtractorConfig())
        # whole modules per chunk, chunks filled up to the bucket size (the base's are off)
        self._group_by_module = bool(getattr(self.cfg, "group_by_module", True))
        self._batch_by_threshold = True
        self.last_reinit_params: list[torch.nn.Parameter] = []

    # -- public helpers ------------------------------------------------------------------------
    def merge_and_reinit(self, model: Any) -> list[torch.nn.Parameter]:
        """Merge every active adapter into its base weight in place, then re-initialise the
        adapter (``B = 0``). Returns the re-initialised adapter parameters (same objects as
        before); see the module docstring for the optimizer state."""
        params: list[torch.nn.Parameter] = []
        for _, layer, adapters in lora_layers(model, self.cfg.adapter_names):
            for a in adapters:
                refuse_variant(layer, a)
                init = _init_kind(model, a)
                layer.merge(safe_merge=True, adapter_names=[a])
                if a in layer.merged_adapters:
                    layer.merged_adapters.remove(a)  # the base now holds it for good
                layer.reset_lora_parameters(a, init)
                params.extend(_adapter_params(layer, a))
        self.last_reinit_params = params
        return params

    def metadata(self, model: Any, generator_dtype: Any = None) -> list[TensorMeta]:
        """Names, dtypes after the cast and shapes; computes nothing and changes nothing."""
        dtype = as_dtype(generator_dtype)
        out = []
        for item in self._plan(model):
            d = dtype if (dtype is not None and item.dtype.is_floating_point) else item.dtype
            out.append(TensorMeta(item.name, dtype_to_str(d), list(item.shape)))
        return out

    # -- extraction ----------------------------------------------------------------------------
    def _extract_raw_weights(
        self, model: Any, generator_dtype: Any
    ) -> Iterator[tuple[str, torch.Tensor]]:
        plan = self._plan(model)  # validates names before anything changes
        if self.cfg.merge_and_reinit:
            self.merge_and_reinit(model)
            plan = self._plan(model, merged=True)
        for item in plan:
            yield item.name, item.produce()

    def _plan(self, model: Any, *, merged: bool = False) -> list[_Item]:
        """What will be sent, in ``state_dict`` order; a merged weight is computed lazily.

        ``merged``: the adapters were just merged into the base weights (and zeroed), so base
        weights are sent as they are.
        """
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"lora_merge extractor needs a PEFT model (torch.nn.Module), got "
                f"{type(model).__name__}"
            )
        layers = {prefix: (layer, adapters)
                  for prefix, layer, adapters in lora_layers(model, self.cfg.adapter_names)}
        entries = [(full, t, owner) for owner, full, t in
                   _named_entries(model, include_buffers=self.cfg.include_buffers)]
        plain = [(n, t) for n, t, _ in entries if not is_lora_param(n)]
        try:
            mapping = engine_names((n for n, _ in plain), adapter_name=self._head_adapter(model))
        except NamingError as e:  # pragma: no cover - adapters are filtered above
            raise NamingError(f"lora_merge extractor: {e}") from None
        aliases = tied_aliases(plain)
        wanted = name_filter(self.cfg.name_patterns)
        items: list[_Item] = []
        seen: set[str] = set()
        for full, t, owner in entries:
            if is_lora_param(full):
                continue
            name = mapping.get(aliases.get(full, full))
            if name is None or name in seen or not wanted(name):
                continue
            seen.add(name)
            lora = _owning_lora_layer(owner, layers)
            leaf = full.rsplit(".", 1)[-1]
            if lora is not None and not merged:
                layer, adapters = lora
                for a in adapters:
                    refuse_variant(layer, a)
                produce = _merged_producer(layer, adapters, leaf, t)
            else:
                if self.cfg.only_trained_modules and lora is None and not _trainable(t):
                    continue
                produce = _plain_producer(t)
            items.append(_Item(name, list(t.shape), t.dtype, produce))
        return items

    def _head_adapter(self, model: Any) -> str:
        names = self.cfg.adapter_names
        if names:
            return names[0]
        active = getattr(model, "active_adapter", None)
        if isinstance(active, str):
            return active
        if isinstance(active, (list, tuple)) and active:
            return str(active[0])
        return "default"


# --------------------------------------------------------------------------------------------
# optimizer helper
# --------------------------------------------------------------------------------------------


def reset_adapter_optimizer_state(optimizer: Any, params: Iterable[Any]) -> int:
    """Drop the optimizer state (moments, step counts) of ``params`` after
    ``merge_and_reinit``; the param groups are kept. Returns how many entries were dropped.

    Works for torch optimizers (Adam/AdamW/SGD... rebuild their state lazily on the next step).
    Wrapped optimizers (DeepSpeed, FSDP-sharded state) keep their own copies: rebuild those.
    """
    state = getattr(optimizer, "state", None)
    if state is None:
        raise TypeError(f"{type(optimizer).__name__} has no .state to reset; rebuild it instead")
    dropped = 0
    for p in params:
        if p in state:
            del state[p]
            dropped += 1
    return dropped


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _owning_lora_layer(owner: str, layers: dict[str, tuple[Any, list[str]]]) -> Any:
    """The LoRA layer whose base layer owns a tensor (owner ``x.base_layer`` -> layer ``x``)."""
    if owner.endswith(".base_layer") or owner == "base_layer":
        return layers.get(owner[: -len(".base_layer")] if "." in owner else "")
    return None


def _merged_producer(
    layer: Any, adapters: list[str], leaf: str, base: torch.Tensor
) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        import torch

        with torch.no_grad():
            if leaf == "weight":
                out = base.detach().clone()
                for a in adapters:
                    out += layer.get_delta_weight(a).to(out.dtype)
                return out
            if leaf == "bias":
                out = None
                for a in adapters:
                    if (getattr(layer, "lora_bias", {}) or {}).get(a, False):
                        if out is None:
                            out = base.detach().clone()
                        b = layer.lora_B[a].bias
                        out += (b * layer.scaling[a]).to(out.dtype)
                return out if out is not None else base.detach()
            return base.detach()

    return produce


def _plain_producer(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t.detach()


def _trainable(t: Any) -> bool:
    return bool(getattr(t, "requires_grad", False))


def _adapter_params(layer: Any, adapter: str) -> list[Any]:
    out = []
    for attr in ("lora_A", "lora_B"):
        d = getattr(layer, attr, None)
        if d is not None and adapter in d:
            out.extend(d[adapter].parameters())
    for attr in ("lora_embedding_A", "lora_embedding_B"):
        d = getattr(layer, attr, None)
        if d is not None and adapter in d:
            out.append(d[adapter])
    return out


def _init_kind(model: Any, adapter: str) -> Any:
    """Re-initialisation that makes ``B = 0`` (so the merged model is unchanged): "gaussian" if
    the adapter was configured so, else PEFT's default (kaiming A, zero B)."""
    cfg = getattr(model, "peft_config", {}).get(adapter) if hasattr(model, "peft_config") else None
    kind = getattr(cfg, "init_lora_weights", True)
    return "gaussian" if isinstance(kind, str) and kind.lower() == "gaussian" else True
