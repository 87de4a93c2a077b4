"""The reward server: a vLLM pooling model behind HTTP, with the weight-sync control plane.

    python -m weightsync.servers.reward --model DIR --port 8001 [--api-key KEY]
    weightsync serve-reward --model DIR --port 8001            (same thing)
    weightsync serve-reward --config weightsync/configs/reward_server.yaml --model DIR

Runs in its own process: vLLM's ``AsyncLLM`` (pooling runner, ``WeightSyncWorkerExtension`` in
every worker) and vLLM's own OpenAI app for that engine (``weightsync.servers.pooling_app``:
``/classify``, ``/pooling``, ``/v1/score``, ``/rerank``, ``/v1/models``, ``/tokenize``, ... as
vLLM defines them), served by uvicorn on one asyncio loop. Ours, ahead of vLLM's: ``GET
/health`` -> ``{"status": "ok", "type": "reward_model"}``, ``POST /score``
(``weightsync.servers.scoring``), OpenRLHF's ``POST /get_reward``
(``weightsync.servers.openrlhf``), sleep mode (``/sleep``, ``/wake_up``, ``/is_sleeping``:
``weightsync.servers.sleep``) and the control plane shared with the policy server
(``weightsync.servers.control_routes``, both our dialect and the reward spec's ``{host, port,
world_size}`` / ``{metadata: [...], version, training_mode}`` form); the update rules live in
``weightsync.servers.control``, what it takes from the sender in
``weightsync.servers._update_policy`` (by default the reward spec's: versions and training mode
as given). Every route that runs the model holds the update gate and answers with
``x-weight-version`` (``weightsync.servers.versioned`` around vLLM's routes). The spec's launch
flags (``--task reward``, ``--pooler-config``, ``--worker-extension-cls`` naming
``RewardWeightSyncExtension``, importable from here) map onto ours
(``weightsync.servers._reward_spec``).

Models: a ``*ForSequenceClassification`` checkpoint, or with ``--convert classify`` a causal
LM whose checkpoint carries a score head (``score.weight``), or any conversion vLLM offers
through ``--hf-overrides`` (e.g. ``classifier_from_token`` / ``method``).

Defaults by device: on CPU ``dtype=float32``, eager mode, and a small fixed KV cache
(``kv_cache_memory_bytes``; without it vLLM CPU asks for most of a NUMA node); on GPU the
model's dtype and ``gpu_memory_utilization`` 0.3 (lowered to the card's free memory; the policy
server takes 0.6 by default, so the two share one GPU: ``weightsync.servers._gpu``), and vLLM's
engine core started with ``spawn`` as ``vllm serve`` starts it. Side by side: give each server its own ``--port`` and let each
client use its own ``group_port`` (e.g. policy 8000 / 51216, reward 8001 / 51217).
Binds 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from weightsync._runtime.cpu_binding import engine_core_follows_workers
from weightsync.loaders.vllm_worker import RewardWeightSyncExtension  # noqa: F401 - the spec's place
from weightsync.servers._gpu import POLICY_GPU_SHARE, REWARD_GPU_SHARE, start_engine_core_with_spawn
from weightsync.servers._reward_spec import json_object_arg
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

log = logging.getLogger("weightsync.servers.reward")

#: ``--warmup``: what it sends, what it costs at start (measured: docs/reliability.md)
WARMUP = {"request": "one scoring request",
          "cost": "0.02 s on 2 CPU cores (tiny model; a pooling model compiles nothing there)"}


@dataclass(kw_only=True)
class RewardServerConfig:
    """Everything the reward server takes; the shipped presets ``weightsync/configs/reward_server*.yaml`` hold these fields."""

    model: str = ""
    host: str = "127.0.0.1"
    port: int = 8001
    served_model_name: str | None = None
    api_key: str | None = None
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when available)
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype on GPU
    max_model_len: int | None = None  # default: the model's (mind the KV cache size on CPU)
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None  # default on CPU: 256 MiB
    gpu_memory_utilization: float | None = None  # GPU share; None: REWARD_GPU_SHARE, fitted
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None  # default: True on CPU (fast start), False on GPU
    pooling_type: str | None = None  # LAST / MEAN / CLS; default: the model's
    tok_pooling_type: str | None = None  # ALL / STEP (pooling_type "step"/"all"); default ALL
    step_tag_id: int | None = None  # the default step tag of pooling_type "step" requests
    returned_token_ids: list[int] | None = None  # STEP only: head columns to return
    load_mode: str = "auto"  # VLLMWeightLoader: auto / direct / reload
    head_name_patterns: list[str] | None = None  # for head_only updates; default score./...
    score_wait_timeout_s: float = 60.0  # a score waits this long for an update (and vice versa)
    update_timeout_s: float = 600.0
    group_timeout_s: float = 120.0  # a Ludic-style trainer group: joining and each collective
    max_body_bytes: int = 16 << 20
    keep_alive_timeout_s: float | None = None  # idle connections; None: _serving's default
    serve_during_updates: bool = False  # stage updates, keep scoring with the last version, flip
    convert: str | None = None  # vLLM's --convert: "classify" for a causal LM with a score head
    hf_overrides: dict[str, Any] | None = None  # vLLM's --hf-overrides (e.g. reward conversion)
    enable_sleep_mode: bool = False  # vLLM's sleep mode (CUDA/ROCm): /sleep, /wake_up
    allow_version_reset: bool = False  # deprecated, no effect: versions are taken as given
    monotonic_versions: bool = False  # refuse a version that is not newer (409)
    strict_training_mode: bool = False  # training_mode is the update's name policy (400)
    # the reward spec's launch options (weightsync.servers._reward_spec)
    task: str | None = None  # reward / classify / score / auto: all the pooling runner
    pooler_config: dict[str, Any] | None = None  # folded into the pooling fields above
    use_activation: bool | None = None  # vLLM's default activation (the spec's "normalize")
    worker_extension_cls: str | None = None  # weightsync's extension under one of its names
    seed: int = 0
    log_level: str = "info"
    warmup: bool = True  # score one text before serving (_serving.warm_up)
    extra_engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from weightsync.servers._reward_spec import check_spec_options
        from weightsync.servers._update_policy import check_version_options

        check_spec_options(self)
        check_version_options(monotonic_versions=self.monotonic_versions,
                              allow_version_reset=self.allow_version_reset)

    def resolved_device(self) -> str:
        """``cpu`` or ``cuda`` (``auto``: cuda when a GPU is visible), found without
        initialising CUDA in this process (vLLM forks its engine core from it)."""
        from weightsync.servers._gpu import resolve_device

        return resolve_device(self.device)


def engine_args(cfg: RewardServerConfig) -> Any:
    """-> ``AsyncEngineArgs`` for the pooling engine the config describes."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from weightsync.servers._reward_spec import worker_extension

    if not cfg.model:
        raise ValueError("model: give the path (or hub id) of a *ForSequenceClassification model")
    cpu = cfg.resolved_device() == "cpu"
    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        runner="pooling",
        dtype=("float32" if cpu else "auto") if cfg.dtype == "auto" else cfg.dtype,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cpu if cfg.enforce_eager is None else cfg.enforce_eager,
        worker_extension_cls=worker_extension(cfg),
        seed=cfg.seed,
        disable_log_stats=True,
    )
    if cfg.served_model_name:
        kwargs["served_model_name"] = cfg.served_model_name
    if cfg.convert:
        kwargs["convert"] = cfg.convert
    if cfg.hf_overrides:
        kwargs["hf_overrides"] = dict(cfg.hf_overrides)
    if cfg.enable_sleep_mode:
        if cpu:
            raise ValueError("enable_sleep_mode: vLLM's sleep mode needs CUDA or ROCm; this "
                             "server runs on cpu (drop --enable-sleep-mode)")
        kwargs["enable_sleep_mode"] = True
    if cfg.max_model_len:
        kwargs["max_model_len"] = cfg.max_model_len
    if cfg.max_num_seqs:
        kwargs["max_num_seqs"] = cfg.max_num_seqs
    if cpu:
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes or (256 << 20)
    else:
        kwargs["gpu_memory_utilization"] = _gpu_share(cfg)
        if cfg.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    pooler = _pooler_config(cfg)
    if pooler is not None:
        kwargs["pooler_config"] = pooler
    kwargs.update(cfg.extra_engine_args)
    return AsyncEngineArgs(**kwargs)


def _gpu_share(cfg: RewardServerConfig) -> float:
    """The share of the GPU the engine takes: ``gpu_memory_utilization``, or the default fitted
    to the card's free memory (``_gpu.fit_gpu_share``; a share that does not fit is an error
    naming the flag, before the engine starts)."""
    from weightsync._runtime.gpu import gpu_memory
    from weightsync.servers._gpu import REWARD_GPU_SHARE, fit_gpu_share, model_bytes

    dtype = None if cfg.dtype == "auto" else cfg.dtype
    share, why = fit_gpu_share(
        cfg.gpu_memory_utilization, default=REWARD_GPU_SHARE, flag="--gpu-memory-utilization",
        memory=gpu_memory(), weights_bytes=model_bytes(cfg.model, dtype), what="reward server")
    log.info("GPU memory: %.2f of the card (%s)", share, why)
    return share


def _pooler_config(cfg: RewardServerConfig) -> Any:
    """vLLM's ``PoolerConfig`` from the pooling fields, or None for the model's defaults.
    ``pooling_type`` may name a sequence pooling (LAST / MEAN / CLS) or a token pooling
    (ALL / STEP, the same as ``tok_pooling_type``)."""
    from weightsync.reward.types import PoolingType

    fields: dict[str, Any] = {}
    tok = PoolingType.parse(cfg.tok_pooling_type) if cfg.tok_pooling_type else None
    if tok is not None and tok.is_sequence_level:
        raise ValueError(f"tok_pooling_type: must be ALL or STEP, got {cfg.tok_pooling_type!r}")
    if cfg.pooling_type:
        kind = PoolingType.parse(cfg.pooling_type)
        if kind.is_sequence_level:
            fields["seq_pooling_type"] = kind.vllm_name
        elif tok is not None and tok is not kind:
            raise ValueError(f"pooling_type {kind.vllm_name} and tok_pooling_type {tok.vllm_name} "
                             "disagree; give one")
        else:
            tok = kind
    if tok is not None:
        fields["tok_pooling_type"] = tok.vllm_name
    if cfg.step_tag_id is not None:
        fields["step_tag_id"] = int(cfg.step_tag_id)
    if cfg.returned_token_ids:
        if tok is not PoolingType.STEP:
            raise ValueError("returned_token_ids: only with tok_pooling_type STEP (vLLM's step "
                             "pooler applies it)")
        fields["returned_token_ids"] = [int(i) for i in cfg.returned_token_ids]
    if cfg.use_activation is not None:
        fields["use_activation"] = bool(cfg.use_activation)
    if not fields:
        return None
    from vllm.config import PoolerConfig

    return PoolerConfig(**fields)


@dataclass
class RewardServer:
    """The running parts: engine, control plane, scorer (one asyncio loop)."""

    cfg: RewardServerConfig
    engine: Any
    control: Any
    ludic: Any
    scorer: Any
    vllm_app: Any  # vLLM's OpenAI app for the engine (weightsync.servers.pooling_app)
    sleep_mode: Any

    def app(self) -> Any:
        """What uvicorn serves: vLLM's app with our routes ahead of its own, gated and tagged
        with the weight version (ours gate themselves and are left alone)."""
        from fastapi import APIRouter

        from weightsync.servers.control_routes import CONTROL_PATHS, control_router, mount
        from weightsync.servers.openrlhf import get_reward_router
        from weightsync.servers.scoring import score_router
        from weightsync.servers.sleep import sleep_router
        from weightsync.servers.versioned import VersionedResponses

        app, limit = self.vllm_app, self.cfg.max_body_bytes
        health = APIRouter()

        @health.get("/health")
        async def healthy() -> dict:
            return {"status": "ok", "type": "reward_model"}

        mount(app, health)
        mount(app, score_router(self.scorer, max_body_bytes=limit))
        mount(app, get_reward_router(self.scorer, max_body_bytes=limit))
        mount(app, sleep_router(self.sleep_mode, api_key=self.cfg.api_key))
        mount(app, control_router(self.control, self.ludic, api_key=self.cfg.api_key,
                                  max_body_bytes=limit))
        own = ("/score", "/get_reward", "/sleep", "/wake_up")
        return VersionedResponses(app, control=self.control, exempt=CONTROL_PATHS + own)


async def build_server(cfg: RewardServerConfig) -> RewardServer:
    """Start the engine (tens of seconds) and wrap it in the control plane and the scorer."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from weightsync.servers._update_policy import server_update_policy
    from weightsync.servers.control import UpdateControl
    from weightsync.servers.ludic import LudicDialect
    from weightsync.servers.pooling_app import pooling_app
    from weightsync.servers.scoring import PoolingSetup, RewardScorer
    from weightsync.servers.sleep import SleepAwareControl, SleepMode

    engine = AsyncLLM.from_engine_args(engine_args(cfg))
    model_config = engine.model_config
    name = cfg.served_model_name or model_config.served_model_name or cfg.model
    sleep_mode = SleepMode(engine, enabled=cfg.enable_sleep_mode, device=cfg.resolved_device())
    control_kwargs: dict[str, Any] = dict(
        name=f"reward server {name}",
        wait_timeout_s=cfg.score_wait_timeout_s,
        update_timeout_s=cfg.update_timeout_s,
        head_name_patterns=cfg.head_name_patterns,
        serve_during_updates=cfg.serve_during_updates,
        policy=server_update_policy(
            monotonic_versions=cfg.monotonic_versions,
            allow_version_reset=cfg.allow_version_reset,
            strict_training_mode=cfg.strict_training_mode, what=f"reward server {name}"),
    )
    control = (SleepAwareControl(engine, sleep_mode, **control_kwargs) if cfg.enable_sleep_mode
               else UpdateControl(engine, **control_kwargs))
    ludic = LudicDialect(control, backend="gloo" if cfg.resolved_device() == "cpu" else "nccl",
                         group_timeout_s=cfg.group_timeout_s)
    scorer = RewardScorer(
        engine, control, model_name=str(name),
        num_labels=int(getattr(model_config.hf_config, "num_labels", 1) or 1),
        pooling=PoolingSetup.from_engine(engine), tokenizer=engine.get_tokenizer(),
    )
    if cfg.load_mode != "auto":
        await engine.collective_rpc("weightsync_setup", args=({"load_mode": cfg.load_mode},))
    await control.refresh_state()
    await control.world_size()  # asked once here: /get_world_size never waits for workers
    if cfg.warmup:
        from vllm import PoolingParams

        await warm_up("one text scored", lambda rid: engine.encode(
            "Hello", PoolingParams(task="classify"), rid), log)
    app = await pooling_app(engine, model=cfg.model, served_model_name=cfg.served_model_name,
                            convert=cfg.convert)
    return RewardServer(cfg, engine, control, ludic, scorer, app, sleep_mode)


async def serve(
    cfg: RewardServerConfig,
    *,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until ``stop`` is set (or the task is cancelled); always shuts the engine down.
    Signals are the caller's business (``main`` maps SIGINT/SIGTERM to ``stop``)."""
    from weightsync.servers._engine_watch import EngineWatch
    from weightsync.servers.control_routes import CONTROL_PATHS

    server = await build_server(cfg)
    try:
        announce = ready_line(
            "reward server", url=f"http://{cfg.host}:{cfg.port}",
            model=str(server.scorer.model_name), version=server.control.version,
            api_key=cfg.api_key, update_timeout_s=cfg.update_timeout_s,
            wait_timeout_s=cfg.score_wait_timeout_s, dtype=_dtype_note(cfg, server.engine),
            serves=f"POST /score and /get_reward ({server.scorer.num_labels} label(s)), "
                   "vLLM's /classify, /pooling, /v1/score, /v1/models",
        )
        await serve_app(server.app(), host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                        lifespan="on", ready=ready, stop=stop, announce=announce,
                        keep_alive_s=cfg.keep_alive_timeout_s, watch=EngineWatch(
                            server.engine, server.control, server.vllm_app, what="reward server",
                            own=CONTROL_PATHS + ("/score", "/get_reward", "/sleep", "/wake_up",
                                                 "/is_sleeping")))
    finally:
        await server.control.shutdown()
        await stop_engine(server.engine)


def _dtype_note(cfg: RewardServerConfig, engine: Any) -> str:
    from weightsync.servers._gpu import served_dtype_note

    device = cfg.resolved_device()
    return served_dtype_note(engine.model_config, asked=cfg.dtype, device=device,
                             server_default="float32" if device == "cpu" else None)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """``weightsync serve-reward``'s flags: one per ``RewardServerConfig`` field (plus
    ``--config``), each help text with its default and unit."""
    from weightsync.servers._reward_spec import add_spec_arguments

    d = RewardServerConfig()
    p = argparse.ArgumentParser(
        prog="weightsync serve-reward",
        description="Serve a reward model (*ForSequenceClassification) on vLLM with POST /score "
        "and the weight-sync control plane. Prints one 'ready' line when it accepts "
        "connections. Flags override --config; unset ones keep the defaults below.",
    )
    p.add_argument("--config", metavar="YAML",
                   help="YAML with RewardServerConfig fields, e.g. the shipped "
                        "weightsync/configs/reward_server.yaml (default: none)")
    p.add_argument("--model", metavar="DIR",
                   help="model directory or hub id of a *ForSequenceClassification, e.g. one "
                        "written by `weightsync make-model --kind reward DIR` (required)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the name /score answers with (default: the --model value)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help=f"where the engine runs; auto: cuda when available (default {d.device})")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16 (default auto: float32 "
                                   "on CPU, the checkpoint's dtype on GPU)")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="longest scored sequence, in tokens; at most the model's "
                        "max_position_embeddings (default: that value)")
    p.add_argument("--max-num-seqs", type=int, metavar="N",
                   help="sequences the engine batches at once (default: vLLM's)")
    p.add_argument("--kv-cache-memory-bytes", type=int, metavar="BYTES",
                   help="KV cache size (default on CPU: 268435456 bytes = 256 MiB; on GPU: "
                        "from --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                   help=f"GPU only: share of the card's memory the engine may take, 0-1 "
                        f"(default {REWARD_GPU_SHARE:g}, lowered to the card's free memory; "
                        f"serve-policy takes {POLICY_GPU_SHARE:g}, so both fit on one GPU)")
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help=f"GPUs per engine (default {d.tensor_parallel_size})")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="no CUDA graphs / torch.compile (default: on for CPU, off for GPU)")
    p.add_argument("--pooling-type", help="LAST | MEAN | CLS (default: the model's)")
    p.add_argument("--tok-pooling-type",
                   help="ALL | STEP: the token pooler behind pooling_type 'step'/'all' "
                        "(default ALL; STEP lets vLLM select the step-tag positions, and turns "
                        "off prefix caching and chunked prefill)")
    p.add_argument("--step-tag-id", type=int, metavar="TOKEN_ID",
                   help="default step tag (token id) of pooling_type 'step' requests "
                        "(default: none, each request names its own)")
    p.add_argument("--returned-token-ids", type=lambda s: [int(x) for x in s.split(",")],
                   metavar="ID,ID,...",
                   help="with --tok-pooling-type STEP: comma-separated head columns to return "
                        "(default: all)")
    p.add_argument("--load-mode", choices=["auto", "direct", "reload"],
                   help="how workers load new weights: direct (the model's load_weights), "
                        "reload (vLLM's layer-wise reload), auto (reload on CPU or a quantized "
                        f"model, direct otherwise) (default {d.load_mode})")
    p.add_argument("--score-wait-timeout-s", type=float, metavar="SECONDS",
                   help="how long a score request waits for an update to finish, and an "
                        f"update for the scores in flight (default {d.score_wait_timeout_s:g} s)")
    p.add_argument("--seed", type=int, help=f"engine seed (default {d.seed})")
    p.add_argument("--convert", choices=["classify"],
                   help="vLLM's model conversion: classify serves a causal LM (*ForCausalLM) "
                        "whose checkpoint has a score head (score.weight) as a reward model "
                        "(default: none, the checkpoint must be *ForSequenceClassification)")
    p.add_argument("--hf-overrides", type=json_object_arg, metavar="JSON",
                   help="vLLM's --hf-overrides, a JSON object merged into the model's config, "
                        "e.g. a reward conversion from a causal LM's logits: "
                        '\'{"classifier_from_token": ["no", "yes"], "method": '
                        '"from_2_way_softmax"}\' (default: none)')
    p.add_argument("--enable-sleep-mode", action="store_true", default=None,
                   help="vLLM's sleep mode, for colocation (GPU only: CUDA or ROCm): POST "
                        "/sleep frees the weights' and KV cache's GPU memory, /wake_up (or the "
                        "next request or push) brings them back (default: off)")
    add_server_arguments(p, d, open_routes="/score, /get_reward, vLLM's routes and /health")
    add_spec_arguments(p)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help=WARMUP_HELP.format(**WARMUP))
    return p


def parse_args(argv: list[str] | None = None) -> RewardServerConfig:
    p = build_parser()
    ns = p.parse_args(argv)

    data: dict[str, Any] = {}
    if ns.config:
        from weightsync.config import make_config, to_plain

        data = dict(to_plain(ns.config))
        make_config(RewardServerConfig, data, what=f"reward server config {ns.config}")
    for f in dataclasses.fields(RewardServerConfig):
        value = getattr(ns, f.name, None)
        if value is not None:
            data[f.name] = value
    if "api_key" not in data and os.environ.get("WEIGHTSYNC_API_KEY"):
        data["api_key"] = os.environ["WEIGHTSYNC_API_KEY"]
    try:
        cfg = RewardServerConfig(**data)
    except ValueError as e:
        p.error(str(e))
    if not cfg.model:
        p.error("--model is required (or 'model:' in --config)")
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    configure_logging(cfg.log_level)
    if cfg.resolved_device() == "cpu":  # vLLM's engine core on its workers' cores, if asked
        engine_core_follows_workers()
    else:
        start_engine_core_with_spawn(log)
    run_main(lambda stop: serve(cfg, stop=stop), what="reward server", log_level=cfg.log_level,
             log=log)


if __name__ == "__main__":
    raise SystemExit(main())
