"""Engine-side loaders: received tensors -> the engine's weights, validated first.

- ``vllm`` (:mod:`weightsync.loaders.vllm`): vLLM workers, through vLLM's own loading machinery;
  :mod:`weightsync.loaders.vllm_worker` holds the worker extension that runs it and the
  in-process vLLM client.
- ``torch_module`` (:mod:`weightsync.loaders.torch_module`): a plain ``torch.nn.Module``.

Nothing is imported here: ``weightsync.build_loader({"type": ...})`` imports the one module it
needs (see ``weightsync.registry``).
"""
