"""vLLM's own OpenAI app for the reward server's pooling engine.

Callers: ``weightsync.servers.reward`` (``build_server``), in the server process, once the
engine runs. ``pooling_app(engine, ...)`` builds vLLM's app with vLLM's app builder and
``init_app_state`` exactly as ``vllm serve`` would for that model (the routes are vLLM's:
``/classify``, ``/pooling``, ``/v1/score``, ``/rerank``, ``/v1/models``, ``/tokenize``, ...
with vLLM's request and answer shapes), then drops the routes the model cannot serve (vLLM
leaves their handler ``None`` and would answer 501: here they are 404; a classification model
has no ``/v1/embeddings``) and vLLM's elastic-EP admin routes. The reward server mounts its own
routes ahead of these (``/health``, ``/score``, ``/get_reward``, the control plane) and wraps
the whole app in ``VersionedResponses``.
"""

from __future__ import annotations

from typing import Any

#: vLLM tasks the reward server needs from its engine (``/score`` runs vLLM's ``classify``)
REQUIRED_TASK = "classify"


async def pooling_app(engine: Any, *, model: str, served_model_name: str | None,
                      convert: str | None) -> Any:
    """vLLM's FastAPI app serving ``engine`` (see the module docstring). Raises ``ValueError``
    when the engine cannot classify (a model that is neither a ``*ForSequenceClassification``
    nor converted with ``--convert classify``)."""
    from weightsync._runtime.vllm_compat import openai_server_parts
    from weightsync.servers.policy import ELASTIC_EP_PATHS, _drop_routes, unserved_paths

    supported = tuple(await engine.get_supported_tasks())
    if REQUIRED_TASK not in supported:
        raise ValueError(f"model {model}: vLLM serves it for {list(supported)}, not "
                         f"{REQUIRED_TASK!r}; give a *ForSequenceClassification checkpoint, or "
                         "--convert classify for a causal LM whose checkpoint has a score head "
                         "(score.weight)")
    parts = openai_server_parts()
    argv = ["--model", model, "--runner", "pooling"]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if convert:
        argv += ["--convert", convert]
    args = parts.make_arg_parser(
        parts.FlexibleArgumentParser(prog="weightsync serve-reward")).parse_args(argv)
    args.api_key = None  # the control plane has its own token; vLLM's routes stay open
    app = parts.build_app(args, supported, engine.model_config)
    await parts.init_app_state(engine, app.state, args, supported)
    _drop_routes(app, ELASTIC_EP_PATHS + unserved_paths(app.state))
    return app
