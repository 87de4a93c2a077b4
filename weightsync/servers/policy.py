"""The policy server: vLLM's own OpenAI-compatible server with our weight-sync control plane.

    weightsync serve-policy --model DIR [--host 127.0.0.1] [--port 8000] [--api-key T]
                            [--tensor-parallel-size N] [any other vLLM engine argument]
    python -m weightsync.servers.policy ...   (same thing)

Runs in its own process, on one asyncio loop: vLLM's ``AsyncLLM`` (``worker_extension_cls`` =
weightsync's ``WeightSyncWorkerExtension``) and vLLM's own FastAPI app, built by vLLM's app
builder and ``init_app_state`` (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
streaming, ``/tokenize``, ...: nothing OpenAI is re-implemented here), served by uvicorn. Beside
it: ``GET /health`` -> ``{"status": "ok"}`` (503 if the engine died) and the control plane shared
with the reward server (``weightsync.servers.control_routes``: our dialect and the Ludic/TRL
one). ``VersionedResponses`` gates and tags every model response (``x-weight-version``).

Arguments: ours are ``--host`` (127.0.0.1), ``--port`` (8000), ``--api-key`` (default
``$WEIGHTSYNC_API_KEY``; guards the control plane, not the OpenAI routes: vLLM's own
``--api-key`` is therefore not available, set ``VLLM_API_KEY`` for that),
``--update-timeout-s``, ``--request-wait-timeout-s``, ``--group-timeout-s``,
``--max-body-bytes``, ``--log-level``; everything else goes to vLLM's own parser unchanged. On
CPU, unless given: ``--dtype float32``, ``--enforce-eager``, ``--kv-cache-memory-bytes``
256 MiB (vLLM CPU otherwise asks for most of a NUMA node). On GPU, unless given:
``--gpu-memory-utilization`` 0.6, lowered to the card's free memory, so a reward server (0.3)
fits beside it (``weightsync.servers._gpu``), and vLLM's engine core started with ``spawn`` as
``vllm serve`` starts it. The ready line names the dtype served and why.

LoRA adapters (``--enable-lora``, ``--max-lora-rank``, ``--max-cpu-loras``): a trainer pushes
only its adapter (the ``lora_adapter`` extractor, ``weightsync.lora_adapter``); once the update
landed, requests whose ``"model"`` is the adapter's name are served by its latest version,
requests naming the base model by the base weights. ``--adapter-slots N`` (N >= 2) keeps N
versions of each adapter, so an adapter update waits for none of its requests in flight
(``weightsync.servers._adapter_slots``).

Updates (the pause policy): an update waits until the requests in flight have finished on the
old weights (drain), new requests wait at the gate until it is done, then run on the new
weights; the engine's scheduler is paused meanwhile as well. A request's latency therefore
grows by at most the update's transfer time plus the longest request in flight when it began.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from weightsync._runtime.cpu_binding import engine_core_follows_workers
from weightsync.loaders.vllm_worker import WORKER_EXTENSION
from weightsync.servers._gpu import (
    POLICY_GPU_SHARE,
    REWARD_GPU_SHARE,
    served_dtype_note,
    start_engine_core_with_spawn,
)
from weightsync.servers._serving import (
    WARMUP_HELP,
    add_server_arguments,
    configure_logging,
    ready_line,
    run_main,
    serve_app,
    stop_engine,
    warm_up,
)

log = logging.getLogger("weightsync.servers.policy")

CPU_KV_CACHE_BYTES = 256 << 20


@dataclass(kw_only=True)
class PolicyServerConfig:
    """Our own settings; vLLM's engine and frontend arguments travel separately (``vllm_args``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    update_timeout_s: float = 600.0  # an update with no call for this long is aborted
    request_wait_timeout_s: float = 300.0  # a request waits this long for an update (and v.v.)
    group_timeout_s: float = 120.0  # a Ludic-style trainer group: joining and each collective
    max_body_bytes: int = 16 << 20
    keep_alive_timeout_s: float | None = None  # idle connections; None: _serving's default
    log_level: str = "info"
    serve_during_updates: bool = False  # stage updates, keep serving the last version, flip
    allow_version_reset: bool = False  # deprecated, no effect: versions are taken as given
    monotonic_versions: bool = False  # refuse a version that is not newer (409)
    warmup: bool = True  # one logprobs request before serving (_serving.warm_up)
    in_flight_requests: str = "finish"  # at an update: "finish" (drain) or "continue" on it
    in_flight_kv: str = "recompute"  # "continue": the requests' KV recomputed, or "keep" it
    #: run each request that asks for prompt logprobs alone: "on", "off", or "auto" (on with
    #: --enable-lora on vLLM's CPU build, whose engine dies computing them beside other
    #: requests: vLLM issues 16668 and 29955)
    prompt_logprobs_alone: str = "auto"
    adapter_slots: int = 1  # versions kept per LoRA adapter (``servers._adapter_slots``)
    device: str = "auto"  # filled by parse_args: "cpu" or "cuda", the device the engine runs on
    dtype_asked: str | None = None  # filled by parse_args: the --dtype the user gave, if any
    gpu_share_note: str = ""  # filled by parse_args on a GPU: the share taken and why

    def __post_init__(self) -> None:
        from weightsync.servers._update_policy import check_version_options

        check_version_options(monotonic_versions=self.monotonic_versions,
                              allow_version_reset=self.allow_version_reset)


#: ``--warmup``: what it sends, what it costs at start (measured: docs/reliability.md)
WARMUP = {"request": "one request that asks for logprobs",
          "cost": "7-13 s on 2 CPU cores with an empty compile cache (vLLM compiles its "
                  "logprobs kernel), 1.3 s once $TORCHINDUCTOR_CACHE_DIR holds it"}


def _our_parser(*, for_help: bool = False) -> argparse.ArgumentParser:
    """Our flags (parsed here; the rest goes to vLLM's parser). ``for_help``: also the vLLM
    flags a user of this command meets first, with the defaults this command gives them."""
    d = PolicyServerConfig()
    p = argparse.ArgumentParser(
        prog="weightsync serve-policy", add_help=False,
        description="Serve a causal LM with vLLM's OpenAI-compatible server plus weightsync's "
        "weight-sync control plane. Prints one 'ready' line when it accepts connections.",
    )
    ours = p.add_argument_group("weightsync's arguments")
    add_server_arguments(ours, d, open_routes="the OpenAI routes")
    ours.add_argument("--request-wait-timeout-s", type=float, metavar="SECONDS",
                      help="how long a request waits for an update to finish, and an update "
                           f"for the requests in flight (default {d.request_wait_timeout_s:g} s)")
    ours.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                      help=WARMUP_HELP.format(**WARMUP))
    ours.add_argument("--in-flight-requests", choices=["finish", "continue"],
                      help="what requests in flight do when an update lands: finish on the "
                           "old weights first ('finish', the update waits for them), or "
                           "'continue' on the new ones at once (PipelineRL-style: updates are "
                           "staged, generation pauses only for the flip, and an answer says at "
                           "which token its version changed in 'weight_version_spans') "
                           f"(default {d.in_flight_requests})")
    ours.add_argument("--in-flight-kv", choices=["recompute", "keep"],
                      help="with --in-flight-requests continue: at the flip, drop the "
                           "requests' KV so the new weights recompute it ('recompute'), or "
                           "keep the KV the old weights computed and go on from it ('keep', as "
                           "PipelineRL: no recompute after the flip; each request's prefix "
                           "cache is keyed by the version it started on, so no later request "
                           f"reuses old-weight KV) (default {d.in_flight_kv})")
    ours.add_argument("--prompt-logprobs-alone", choices=["auto", "on", "off"],
                      help="run each request that asks for prompt logprobs ('prompt_logprobs', "
                           "or 'echo' with logprobs) alone: it waits until the requests in "
                           "flight finished and new ones wait for it. 'auto': on with "
                           "--enable-lora on vLLM's CPU build, whose engine dies computing a "
                           "LoRA model's prompt logprobs beside other requests (vLLM issues "
                           f"16668, 29955) (default {d.prompt_logprobs_alone})")
    ours.add_argument("--adapter-slots", type=int, metavar="N",
                      help="with --enable-lora: versions kept per adapter. 1: an adapter "
                           "update rewrites the adapter, so it waits for the adapter's "
                           "requests in flight and holds new ones back until it landed; N >= 2: "
                           "each version goes into the next of N slots, requests in flight "
                           "finish on the version they started with, new ones get the new "
                           "version at once, and an update waits only for requests still on "
                           "the slot it reuses. Each slot holds one copy of the adapter "
                           "(--max-cpu-loras >= N x adapters; --max-loras >= 2 lets two "
                           f"versions run in one batch) (default {d.adapter_slots})")
    if for_help:
        vllm = p.add_argument_group(
            "vLLM's arguments (passed to vLLM's own parser; every other one too: see `vllm "
            "serve --help`)")
        vllm.add_argument("--model", metavar="DIR",
                          help="the model directory (or hub id) of a causal LM, e.g. one "
                               "written by `weightsync make-model --kind policy DIR` (required)")
        vllm.add_argument("--max-model-len", type=int, metavar="TOKENS",
                          help="longest prompt + completion, in tokens; at most the model's "
                               "max_position_embeddings (default: that value)")
        vllm.add_argument("--served-model-name", metavar="NAME",
                          help="the name clients put in 'model' (default: the --model value)")
        vllm.add_argument("--dtype", help="float32, bfloat16, float16 or auto (default on CPU: "
                                          "float32; on GPU: auto, the checkpoint's dtype)")
        vllm.add_argument("--kv-cache-memory-bytes", type=int, metavar="BYTES",
                          help=f"KV cache size (default on CPU: {CPU_KV_CACHE_BYTES} bytes = "
                               f"{CPU_KV_CACHE_BYTES >> 20} MiB; on GPU: vLLM's, from "
                               f"--gpu-memory-utilization)")
        vllm.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                          help=f"GPU only: share of the card's memory the engine may take, 0-1 "
                               f"(default {POLICY_GPU_SHARE:g}, lowered to the card's free "
                               f"memory; serve-reward takes {REWARD_GPU_SHARE:g}, so both fit on "
                               "one GPU; vLLM's own default, 0.92, leaves no room for another "
                               "server)")
        vllm.add_argument("--enforce-eager", action="store_true",
                          help="no CUDA graphs / torch.compile (default on CPU: on)")
        vllm.add_argument("--chat-template", metavar="FILE",
                          help="Jinja chat template for /v1/chat/completions (default: the "
                               "tokenizer's)")
        vllm.add_argument("--tensor-parallel-size", type=int, metavar="N",
                          help="GPUs per engine (default 1)")
        vllm.add_argument("--seed", type=int, help="sampling seed (default: vLLM's, 0)")
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return p


def _given(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def _default_device() -> str:
    """cuda when a GPU is visible, found without initialising CUDA (vLLM forks from here)."""
    from weightsync.servers._gpu import resolve_device

    return resolve_device("auto")


def parse_args(argv: list[str] | None = None, *, device: str | None = None
               ) -> tuple[PolicyServerConfig, argparse.Namespace]:
    """argv -> (our config, vLLM's parsed serve arguments with our defaults applied).

    ``device``: ``cpu`` or ``cuda`` (default: cuda when available) picks the defaults."""
    from weightsync._runtime.vllm_compat import openai_server_parts

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        _our_parser(for_help=True).print_help()
        raise SystemExit(0)
    ns, rest = _our_parser().parse_known_args(argv)
    del ns.help
    parts = openai_server_parts()
    vparser = parts.make_arg_parser(parts.FlexibleArgumentParser(prog="weightsync serve-policy"))
    args = vparser.parse_args(rest)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if not _given(rest, "--model") and not getattr(args, "model_tag", None):
        vparser.error("--model is required (a directory or hub id of a causal LM)")
    device = device or _default_device()
    dtype_asked = args.dtype if _given(rest, "--dtype") else None
    if device == "cpu":
        if not _given(rest, "--dtype"):
            args.dtype = "float32"
        if not _given(rest, "--enforce-eager", "--no-enforce-eager"):
            args.enforce_eager = True
        if not _given(rest, "--kv-cache-memory-bytes"):
            args.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
    gpu_share_note = ""
    if device != "cpu" and not _given(rest, "--kv-cache-memory-bytes"):
        try:
            args.gpu_memory_utilization, gpu_share_note = _gpu_share(
                args, asked=args.gpu_memory_utilization
                if _given(rest, "--gpu-memory-utilization") else None)
        except ValueError as e:
            vparser.error(str(e))
    given_ext = getattr(args, "worker_extension_cls", "") or ""
    if given_ext and given_ext != WORKER_EXTENSION:
        vparser.error(f"--worker-extension-cls: the policy server needs {WORKER_EXTENSION} "
                      f"(weight updates run there), got {given_ext}")
    args.worker_extension_cls = WORKER_EXTENSION
    try:
        cfg = PolicyServerConfig(**{k: v for k, v in vars(ns).items() if v is not None},
                                 device=device, dtype_asked=dtype_asked,
                                 gpu_share_note=gpu_share_note)
    except ValueError as e:  # options that contradict each other, named
        _our_parser().error(str(e))
    if cfg.in_flight_kv == "keep" and cfg.in_flight_requests != "continue":
        _our_parser().error("--in-flight-kv keep needs --in-flight-requests continue (only "
                            "requests that continue across an update have KV to keep)")
    if cfg.adapter_slots < 1:
        _our_parser().error(f"--adapter-slots must be >= 1, got {cfg.adapter_slots}")
    if cfg.adapter_slots > 1 and not getattr(args, "enable_lora", False):
        _our_parser().error("--adapter-slots keeps versions of LoRA adapters: it needs "
                            "--enable-lora")
    if cfg.adapter_slots > 1 and cfg.in_flight_requests == "continue":
        _our_parser().error("--adapter-slots keeps each request on the adapter version it "
                            "started with, --in-flight-requests continue moves it to the new "
                            "one: choose one")
    if cfg.api_key is None and os.environ.get("WEIGHTSYNC_API_KEY"):
        cfg.api_key = os.environ["WEIGHTSYNC_API_KEY"]
    args.host, args.port, args.api_key = cfg.host, cfg.port, None
    parts.validate_parsed_serve_args(args)
    return cfg, args


def _gpu_share(args: argparse.Namespace, *, asked: float | None) -> tuple[float, str]:
    """The share of the GPU the engine takes: ``asked`` (``--gpu-memory-utilization``), or
    ``POLICY_GPU_SHARE`` lowered to the card's free memory (``_gpu.fit_gpu_share``: a share
    that does not fit is an error naming the flag, before the engine starts), and a line that
    says so."""
    from weightsync._runtime.gpu import gpu_memory
    from weightsync.servers._gpu import POLICY_GPU_SHARE, fit_gpu_share, model_bytes

    dtype = None if args.dtype in (None, "auto") else str(args.dtype)
    share, why = fit_gpu_share(
        asked, default=POLICY_GPU_SHARE, flag="--gpu-memory-utilization", memory=gpu_memory(),
        weights_bytes=model_bytes(str(args.model), dtype), what="policy server")
    return share, f"GPU memory: {share:.2f} of the card ({why})"


@dataclass
class PolicyServer:
    """The running parts (one asyncio loop): engine, vLLM's app, our control plane."""

    cfg: PolicyServerConfig
    engine: Any
    app: Any  # vLLM's FastAPI app with our routes
    asgi: Any  # what uvicorn serves: ``VersionedResponses`` around ``app``
    control: Any


async def build_server(cfg: PolicyServerConfig, args: argparse.Namespace, engine: Any
                       ) -> PolicyServer:
    """vLLM's app and state for ``engine``, with our routes and middleware added."""
    from weightsync._runtime.vllm_compat import openai_server_parts
    from weightsync.servers import vllm_transfer_routes
    from weightsync.servers._update_policy import server_update_policy
    from weightsync.servers.control import UpdateControl
    from weightsync.servers.control_routes import CONTROL_PATHS, control_router, mount
    from weightsync.servers.ludic import LudicDialect
    from weightsync.servers.versioned import VersionedResponses

    parts = openai_server_parts()
    supported = await engine.get_supported_tasks()
    app = parts.build_app(args, supported, engine.model_config)
    await parts.init_app_state(engine, app.state, args, supported)
    control = UpdateControl(
        engine, name=f"policy server {args.model}",
        wait_timeout_s=cfg.request_wait_timeout_s, update_timeout_s=cfg.update_timeout_s,
        default_training_mode=None, pause_generation=True,
        serve_during_updates=cfg.serve_during_updates,
        policy=server_update_policy(  # the training mode stays the update's name policy here
            monotonic_versions=cfg.monotonic_versions, allow_version_reset=cfg.allow_version_reset,
            strict_training_mode=True, what=f"policy server {args.model}"),
        in_flight=cfg.in_flight_requests,
        in_flight_kv=cfg.in_flight_kv, adapter_slots=cfg.adapter_slots,
    )
    control.adapter_published = _adapter_names_for(app.state)
    # requests of the base model (or of another adapter) neither wait for an adapter-only
    # update nor hold it back
    control.scoped_by_model = bool(getattr(args, "enable_lora", False))
    control.prompt_logprobs_alone = prompt_logprobs_alone(
        cfg.prompt_logprobs_alone, lora=control.scoped_by_model,
        cpu=cfg.device == "cpu")
    await control.refresh_state()
    await control.world_size()  # asked once here: /get_world_size never waits for workers
    if cfg.warmup:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=1)
        await warm_up("one request with logprobs", lambda rid: engine.generate(
            "Hello", params, rid), log)
    ludic = LudicDialect(control, backend="gloo" if cfg.device == "cpu" else "nccl",
                         group_timeout_s=cfg.group_timeout_s)
    if not getattr(args, "enable_elastic_ep", False):
        # vLLM mounts its elastic-EP admin routes on every server; without elastic EP they can
        # only fail (a 500) or try to rescale the engine, and nothing guards them: drop them
        _drop_routes(app, ELASTIC_EP_PATHS)
    _drop_routes(app, unserved_paths(app.state))
    mount(app, _health_router(engine))
    mount(app, control_router(control, ludic, api_key=cfg.api_key,
                              max_body_bytes=cfg.max_body_bytes))
    vllm_transfer_routes.install(app, control, engine, args, api_key=cfg.api_key,
                                 max_body_bytes=cfg.max_body_bytes, timeout_s=cfg.group_timeout_s)
    # outermost (vLLM's app has built its middleware stack already): a plain ASGI wrapper
    asgi = VersionedResponses(app, control=control,
                              exempt=CONTROL_PATHS + vllm_transfer_routes.TRANSFER_PATHS)
    return PolicyServer(cfg, engine, app, asgi, control)


def prompt_logprobs_alone(mode: str, *, lora: bool, cpu: bool) -> bool:
    """Whether the server runs each request that asks for prompt logprobs alone
    (``PolicyServerConfig.prompt_logprobs_alone``; "auto": a LoRA server on vLLM's CPU build)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"prompt_logprobs_alone must be 'auto', 'on' or 'off', got {mode!r}")
    return mode == "on" or (mode == "auto" and lora and cpu)


#: vLLM's admin routes that make sense only with ``--enable-elastic-ep``
ELASTIC_EP_PATHS = ("/scale_elastic_ep", "/is_scaling_elastic_ep")


#: vLLM routes mounted whatever the model, served by the handler in ``app.state.<attr>``; when
#: vLLM leaves that handler ``None`` (the model cannot do it) the route only answers 501
#: ("the model does not support ..."): such a route is not served here, so it is not mounted (404)
HANDLER_ROUTES: dict[str, tuple[str, ...]] = {
    "serving_structured_decisions": ("/v1/systemone",),
    "serving_pooling": ("/pooling",),
    "serving_classification": ("/classify",),
    "serving_scores": ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"),
    "serving_embedding": ("/v1/embeddings", "/v2/embed"),
    "serving_render": ("/v1/chat/completions/render", "/v1/messages/render",
                       "/v1/completions/render", "/v1/responses/render"),
    "serving_derender": ("/v1/chat/completions/derender", "/v1/completions/derender"),
}


def unserved_paths(state: Any) -> tuple[str, ...]:
    """The paths of ``HANDLER_ROUTES`` whose handler vLLM set to ``None`` on ``state`` (an
    attribute vLLM does not set at all is left alone: that version serves the route itself)."""
    return tuple(path for attr, paths in HANDLER_ROUTES.items()
                 if hasattr(state, attr) and getattr(state, attr) is None for path in paths)


def _drop_routes(app: Any, paths: tuple[str, ...]) -> None:
    app.router.routes[:] = [r for r in app.router.routes
                            if getattr(r, "path", None) not in paths]


def _adapter_names_for(state: Any) -> Any:
    """After a LoRA adapter-only update landed in slot ``slot``: requests whose ``model`` names
    the adapter are served by that slot's version (vLLM's table of adapter names, as its
    ``/v1/load_lora_adapter`` fills it, made a ``_adapter_slots.SlotTable``: a request seated on
    an older slot keeps it; the adapter itself is in every worker already, from memory, so vLLM
    reads no file). ``/v1/models`` lists it."""
    from weightsync.servers._adapter_slots import install

    table = install(getattr(state, "openai_serving_models", None))

    def publish(name: str, slot: int) -> None:
        from weightsync.lora_adapter import lora_request

        if table is not None:
            table.publish(name, slot, lora_request(name, slot),
                          lora_request(name, slot, listed=True))

    return publish


def _health_router(engine: Any) -> Any:
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    router = APIRouter()

    @router.get("/health")
    async def health() -> Any:
        try:
            await engine.check_health()
        except Exception as e:  # noqa: BLE001 - a dead engine is the answer
            return JSONResponse({"status": "error", "detail": f"{type(e).__name__}: {e}"},
                                status_code=503)
        return {"status": "ok"}

    return router


async def serve(
    cfg: PolicyServerConfig,
    args: argparse.Namespace,
    *,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until ``stop`` is set (or the task is cancelled); always shuts the engine down."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from weightsync._runtime.vllm_compat import openai_server_parts
    from weightsync.servers._engine_watch import EngineWatch
    from weightsync.servers.control_routes import CONTROL_PATHS

    parts = openai_server_parts()
    engine_args = AsyncEngineArgs.from_cli_args(args)
    async with parts.build_async_engine_client_from_engine_args(engine_args) as engine:
        try:
            server = await build_server(cfg, args, engine)
            try:
                await serve_app(server.asgi, host=cfg.host, port=cfg.port,
                                log_level=cfg.log_level, lifespan="on", ready=ready, stop=stop,
                                announce=_ready_line(cfg, engine, server.control.version),
                                keep_alive_s=cfg.keep_alive_timeout_s,
                                watch=EngineWatch(engine, server.control, server.app,
                                                  what="policy server", own=CONTROL_PATHS))
            finally:
                await server.control.shutdown()
        finally:
            await stop_engine(engine)  # before vLLM's own shutdown, which would kill it at once


def _ready_line(cfg: PolicyServerConfig, engine: Any, version: int) -> str:
    return ready_line(
        "policy server", url=f"http://{cfg.host}:{cfg.port}",
        model=str(engine.model_config.served_model_name), version=version,
        api_key=cfg.api_key, update_timeout_s=cfg.update_timeout_s,
        wait_timeout_s=cfg.request_wait_timeout_s,
        serves="OpenAI API /v1/completions, /v1/chat/completions, /v1/models",
        dtype=served_dtype_note(engine.model_config, asked=cfg.dtype_asked, device=cfg.device,
                                server_default="float32" if cfg.device == "cpu" else None),
    )


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    configure_logging(cfg.log_level)
    if cfg.device == "cpu":  # vLLM's engine core on its workers' cores, if asked
        engine_core_follows_workers()
    else:
        start_engine_core_with_spawn(log)
        if cfg.gpu_share_note:
            log.info("%s", cfg.gpu_share_note)
    run_main(lambda stop: serve(cfg, args, stop=stop), what="policy server",
             log_level=cfg.log_level, log=log)


if __name__ == "__main__":
    raise SystemExit(main())
