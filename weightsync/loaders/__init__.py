"""Engine-side loaders: received tensors -> the engine's weights, validated first.

- ``vllm`` (:mod:`weightsync.loaders.vllm`): vLLM workers, through vLLM's own loading machinery;
  :mod:`weightsync.loaders.vllm_worker` holds the worker extension that runs it and the
  in-process vLLM client.
- ``torch_module`` (:mod:`weightsync.loaders.torch_module`): a plain ``torch.nn.Module``.
- ``sglang`` (:mod:`weightsync.loaders.sglang`): an SGLang engine, through SGLang's own
  weight-update API.
- ``remote`` (:mod:`weightsync.loaders.remote`): forwards each update to a remote engine (a
  server's HTTP control plane) over our strategies.

Nothing is imported here: ``weightsync.build_loader({"type": ...})`` imports the one module it
needs (see ``weightsync.registry``).
"""
