"""``deepspeed`` extractor: DeepSpeed ZeRO-3 (partitioned) and ZeRO-1/2 (whole) parameters.

Who calls: every rank of the DeepSpeed data-parallel group, in lockstep (ZeRO-3 gathers are
collectives), with the same model (the ``DeepSpeedEngine`` or its ``.module``):
``extract_weights`` must be iterated to the end on every rank. The sending rank
(``is_sender``, default ``rank == src_rank``) gets the chunks; the others gather and drop.

What holds (see ``weightsync.extractors._gather`` for the machinery):
- ZeRO-3: one ``deepspeed.zero.GatheredParameters(..., modifier_rank=None)`` per module (its
  own parameters), entered and left by every rank; the sender copies the gathered data before
  the context releases it (the copy is what ``extractor.memory`` counts; the transient gathered
  module itself is one module at a time). ZeRO-1/2 parameters and buffers are whole on every rank
  and are used without a copy.
- Never ahead of the consumer: on the sender, copies alive at once stay within
  ``max_live_chunks`` (default 2) buckets of ``bucket_size_mb``.
- Names are engine names (``weightsync.naming``): the engine's ``module.`` prefix is dropped; a
  tied embedding is sent once under the embedding's name.
- ``metadata()`` from ``ds_shape``: no gather, no collective.
- Built from the trainer's whole config as the interface design's example builds it (a
  ``generator`` / ``trainer`` section: SkyRL's ``generator.weight_sync_backend``,
  ``trainer.placement.colocate_all``, ``generator.weight_transfer_threshold_cuda_ipc_GB``),
  those keys set the design's flags: whole modules per chunk, batched up to the threshold, or
  a tensor a chunk (``weightsync.extractors._design_keys``).
- PEFT LoRA layers are sent merged (adapters gathered with their base weight), as in ``fsdp``.

The dtype sent is the model's parameter dtype (bf16/fp16 under mixed precision, the fp32 master
copy stays in the optimizer), cast to ``generator_dtype`` when given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.extractors._gather import GatheringExtractor, ShardedExtractorConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(kw_only=True)
class DeepSpeedExtractorConfig(ShardedExtractorConfig):
    type: str = "deepspeed"


def _is_zero3(p: Any) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_shape")


class DeepSpeedWeightExtractor(GatheringExtractor):
    """ZeRO-3 / ZeRO-1/2 extractor (registered as ``deepspeed``)."""

    config_cls = DeepSpeedExtractorConfig
    backend_name = "deepspeed"

    def plan(self, model: Any, generator_dtype: Any = None):  # type: ignore[override]
        return super().plan(_unwrap_engine(model), generator_dtype)

    def _check_model(self, model: Any) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"deepspeed extractor needs a DeepSpeedEngine or torch.nn.Module, got "
                f"{type(model).__name__}"
            )

    def _global_shape(self, t: Any) -> list[int]:
        return [int(s) for s in t.ds_shape] if _is_zero3(t) else list(t.shape)

    def _gather(self, sources: list[Any], keep: bool) -> list[tuple[torch.Tensor, bool] | None]:
        import torch

        partitioned = [s for s in sources if _is_zero3(s)]
        with torch.no_grad():
            if not partitioned:
                return [(s.detach(), False) if keep else None for s in sources]
            import deepspeed

            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
                if not keep:
                    return [None] * len(sources)
                return [
                    (s.detach().clone(), True) if _is_zero3(s) else (s.detach(), False)
                    for s in sources
                ]


def _unwrap_engine(model: Any) -> Any:
    """A ``DeepSpeedEngine`` -> its ``.module`` (names then lack the ``module.`` prefix)."""
    if type(model).__name__ == "DeepSpeedEngine" and hasattr(model, "module"):
        return model.module
    return model
