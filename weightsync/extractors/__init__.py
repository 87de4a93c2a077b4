"""Training-side extractors: a model in the trainer -> a stream of ``WeightChunk``s.

One module per source; each registers itself under its YAML ``type`` (the map of every
strategy, extractor and loader: ``docs/architecture.md``):

- ``hf``, ``hf_head`` (:mod:`weightsync.extractors.hf`): plain torch modules / HF models, the
  whole state or only the head (reward models trained head-only).
- ``lora_merge`` (:mod:`weightsync.extractors.lora`): PEFT models, merged weights.
- ``lora_adapter`` (:mod:`weightsync.extractors.lora_adapter`): PEFT models, the adapter's
  ``lora_A`` / ``lora_B`` only, into an engine's LoRA runtime (``weightsync.lora_adapter``).
- ``fsdp`` (:mod:`weightsync.extractors.fsdp`): FSDP2 (DTensor) models, gathered per module.
- ``deepspeed`` (:mod:`weightsync.extractors.deepspeed`): ZeRO-1/2/3 models.
- ``megatron`` (:mod:`weightsync.extractors.megatron`): Megatron-Core models, exported under HF
  names by Megatron-Bridge or mbridge.

Nothing is imported here: ``weightsync.build_extractor({"type": ...})`` imports the one module
it needs (see ``weightsync.registry``).
"""
