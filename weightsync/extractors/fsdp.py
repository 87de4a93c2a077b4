"""``fsdp`` extractor: FSDP2 (``torch.distributed.fsdp.fully_shard``) models, DTensor parameters.

Who calls: every rank of the FSDP2 group, in lockstep (``full_tensor()`` is a collective on the
parameter's device mesh), with the same model: ``extract_weights`` must be iterated to the end
on every rank. The sending rank (``is_sender``, default: ``rank == src_rank``) gets the chunks;
the others gather and drop.

What holds (see ``weightsync.extractors._gather`` for the machinery):
- gathered module by module (each parameter with ``full_tensor()``; plain, unsharded
  parameters and buffers are used as they are, without a copy), never ahead of the consumer: on
  the sender, gathered bytes alive at once stay within ``max_live_chunks`` (default 2) buckets
  of ``bucket_size_mb``; ``extractor.memory`` reports live/peak bytes, measured exactly;
- names are engine names (``weightsync.naming``): ``_fsdp_wrapped_module.``,
  ``_checkpoint_wrapped_module.``, ``_orig_mod.``, a leading ``module.`` never reach the engine;
  a tied embedding is sent once under the embedding's name;
- ``metadata()`` reads global shapes from the DTensors: no gather, no collective.
- Built from the trainer's whole config as the interface design's example builds it (a
  ``generator`` / ``trainer`` section: SkyRL's ``generator.weight_sync_backend``,
  ``trainer.placement.colocate_all``, ``generator.weight_transfer_threshold_cuda_ipc_GB``),
  those keys set the design's flags: whole modules per chunk, batched up to the threshold, or
  a tensor a chunk (``weightsync.extractors._design_keys``).

- a sharded PEFT LoRA model is sent merged: each LoRA layer's base weight is gathered with its
  adapters and ``W + scaling * B @ A`` computed on the sender (PEFT's arithmetic, bit-exact with
  ``merge_and_unload``); ``lora_A``/``lora_B`` never reach the engine (vanilla LoRA on Linear
  layers; variants such as DoRA are refused).

Not supported: FSDP1 (``FullyShardedDataParallel`` flat parameters); use ``fully_shard``.

Example (every rank)::

    ext = build_extractor({"type": "fsdp", "bucket_size_mb": 256})
    chunks = ext.extract_weights(model, torch.bfloat16)
    if ext.is_sender:
        await sender.send_chunks(chunks, client, manifest=ext.metadata(model, torch.bfloat16))
    else:
        async for _ in chunks:
            pass
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.extractors._gather import GatheringExtractor, ShardedExtractorConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(kw_only=True)
class FSDPExtractorConfig(ShardedExtractorConfig):
    type: str = "fsdp"


class FSDPWeightExtractor(GatheringExtractor):
    """FSDP2 / DTensor extractor (registered as ``fsdp``)."""

    config_cls = FSDPExtractorConfig
    backend_name = "fsdp"

    def _check_model(self, model: Any) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fsdp extractor needs a torch.nn.Module, got {type(model).__name__}")
        for name, _ in model.named_parameters():
            if name.endswith("_flat_param") or "._flat_param" in name:
                raise TypeError(
                    f"fsdp extractor: {name!r} is an FSDP1 flat parameter; this extractor "
                    f"handles FSDP2 (torch.distributed.fsdp.fully_shard) models only"
                )

    def _global_shape(self, t: Any) -> list[int]:
        return list(t.shape)  # a DTensor's shape is its global shape

    def _gather(self, sources: list[Any], keep: bool) -> list[tuple[torch.Tensor, bool] | None]:
        import torch
        from torch.distributed.tensor import DTensor

        out: list[tuple[torch.Tensor, bool] | None] = []
        with torch.no_grad():
            for s in sources:
                if isinstance(s, DTensor):
                    full = s.full_tensor()  # collective on s.device_mesh
                    out.append((full, True) if keep else None)
                    del full
                else:
                    out.append((s.detach(), False) if keep else None)
        return out
