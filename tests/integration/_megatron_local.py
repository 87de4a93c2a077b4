"""A real Megatron-Core GPT model built from Megatron-Core's own (local) layers, loaded from a
tiny HF Qwen2 checkpoint by mbridge: on CPU, and on a GPU without Transformer Engine.

mbridge (and Megatron-Bridge) build their models with Transformer Engine layers, which need
CUDA and a Transformer Engine build for the machine's torch; here the model is built with
Megatron-Core's own local layers instead and mbridge is told their names (the local spec
keeps the two RMSNorms as modules, where TE fuses them into the next linear layer:
``input_layernorm`` / ``pre_mlp_layernorm`` instead of ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``). Everything else is
mbridge's and Megatron-Core's own code: the tensor-parallel layers, ``load_weights`` (HF ->
Megatron, scattered over the TP group), ``export_weights`` (TP all-gather, QKV and gate/up
splits, Megatron -> HF names). mbridge 0.15.1 reads ``rope_theta`` from the HF config, which
transformers 5 keeps in ``rope_parameters``: it is copied over.

Every rank calls these after ``torch.distributed`` (gloo on CPU, NCCL on GPU) and
``megatron.core.parallel_state.initialize_model_parallel`` are set up.
"""

from __future__ import annotations

from typing import Any

#: Megatron-Core local-spec names -> HF names, in the form of mbridge's mapping tables
_LOCAL_NORMS = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
_LOCAL_MLP_NORM = {
    "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
}


def local_bridge(model_dir: str, dtype: Any = None) -> Any:
    """mbridge's bridge for the HF checkpoint at ``model_dir``, building local layers (their
    parameters made on the CPU; ``dtype`` default float32)."""
    import torch
    from mbridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    if not hasattr(hf_config, "rope_theta"):
        hf_config.rope_theta = hf_config.rope_parameters["rope_theta"]
    bridge = AutoBridge.from_config(hf_config, dtype=dtype or torch.float32)
    bridge.set_extra_args(
        use_cpu_initialization=True, sequence_parallel=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    bridge._get_transformer_layer_spec = lambda vp_stage=None: get_gpt_decoder_block_spec(
        bridge.config, use_transformer_engine=False)
    bridge._OTHER_MAPPING = {**bridge._OTHER_MAPPING, **_LOCAL_NORMS}
    bridge._MLP_MAPPING = {**bridge._MLP_MAPPING, **_LOCAL_MLP_NORM}
    return bridge


def local_model(bridge: Any, model_dir: str, device: Any = None) -> Any:
    """This rank's shard of the GPT model, moved to ``device`` (default: stays on the CPU), with
    the checkpoint's weights loaded."""
    model = bridge._model_provider([])(pre_process=True, post_process=True)
    if device is not None:
        model = model.to(device)
    bridge.load_weights([model], model_dir)
    return model
