"""The Ludic reward spec's launch options on ``weightsync serve-reward``.

The spec starts its reward server as ``--model M --task reward --port 8001``, configures
pooling with ``--pooler-config '{"pooling_type": "LAST", "normalize": true}'`` and names its
worker extension ``RewardWeightSyncExtension``. ``weightsync.servers.reward`` takes the same
flags: ``check_spec_options`` (called by ``RewardServerConfig``) maps each onto what this server
runs (vLLM's pooling runner, our pooling fields, our worker extension) or refuses it with an
error naming the option, before any engine starts; ``add_spec_arguments`` adds the flags, with
``--strict-training-mode`` (``weightsync.servers._update_policy``).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from weightsync.loaders.vllm_worker import REWARD_WORKER_EXTENSION, WORKER_EXTENSION

log = logging.getLogger("weightsync.servers.reward")

#: ``--task`` values this server serves (vLLM's pooling runner; /score classifies): the spec's
#: ``reward``, and the tasks that score one text with a *ForSequenceClassification head
TASKS = ("reward", "classify", "score", "auto")
#: ``--pooler-config`` keys -> the ``RewardServerConfig`` field each sets (the spec's
#: ``normalize`` is vLLM's ``use_activation``, its name since vLLM removed ``normalize``)
POOLER_KEYS = {
    "pooling_type": "pooling_type",
    "normalize": "use_activation",
    "use_activation": "use_activation",
    "tok_pooling_type": "tok_pooling_type",
    "step_tag_id": "step_tag_id",
    "returned_token_ids": "returned_token_ids",
}
#: ``--worker-extension-cls`` values -> the class vLLM is given (the spec's own path included,
#: so its launch code runs unchanged: the class it names is this one)
EXTENSIONS = {
    WORKER_EXTENSION: WORKER_EXTENSION,
    REWARD_WORKER_EXTENSION: REWARD_WORKER_EXTENSION,
    "weightsync.servers.reward.RewardWeightSyncExtension": REWARD_WORKER_EXTENSION,
    "weightsync.reward.RewardWeightSyncExtension": REWARD_WORKER_EXTENSION,
    "ludic.inference.vllm_reward_server.RewardWeightSyncExtension": REWARD_WORKER_EXTENSION,
}


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """``--task``, ``--pooler-config``, ``--worker-extension-cls``, ``--strict-training-mode``.

    Args:
        p: ``weightsync serve-reward``'s parser.
    """
    p.add_argument("--task", metavar="TASK",
                   help=f"the reward spec's vLLM task, one of {', '.join(TASKS)}: all run vLLM's "
                        "pooling runner, which this server always uses (default: none)")
    p.add_argument("--pooler-config", type=json_object_arg, metavar="JSON",
                   help="vLLM's pooler config as the reward spec writes it, e.g. "
                        '\'{"pooling_type": "LAST", "normalize": true}\'; keys: '
                        f"{', '.join(POOLER_KEYS)} (normalize is vLLM's use_activation: the "
                        "default activation of vLLM's /classify and /pooling; /score's "
                        "per-request normalize defaults to true either way) (default: none)")
    p.add_argument("--worker-extension-cls", metavar="CLASS",
                   help="the worker extension, weightsync's under any of its names: "
                        f"{', '.join(EXTENSIONS)} (default {WORKER_EXTENSION})")
    p.add_argument("--strict-training-mode", action="store_true", default=None,
                   help="refuse an update whose tensors its training_mode forbids (400 naming "
                        "them: a head_only update with backbone tensors, a full one with only "
                        "the head) (default: off, training_mode is logged as information, as "
                        "the reward spec's server takes it)")


def json_object_arg(text: str) -> dict[str, Any]:
    """argparse ``type=`` for a flag whose value is a JSON object (``--pooler-config``,
    ``--hf-overrides``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, got {type(value).__name__}")
    return value


def check_spec_options(cfg: Any) -> None:
    """Check ``cfg``'s ``task`` and ``worker_extension_cls``, and fold ``pooler_config`` into
    its pooling fields (a key that disagrees with the field set otherwise is an error).

    Args:
        cfg: a ``RewardServerConfig``; its pooling fields are set in place.

    Raises:
        ValueError: naming the option (``task``, ``pooler_config.<key>``,
            ``worker_extension_cls``) and what it accepts.
    """
    if cfg.task is not None and str(cfg.task).strip().lower() not in TASKS:
        raise ValueError(f"task (--task): {cfg.task!r} is not served here; serve-reward runs "
                         f"vLLM's pooling runner and scores texts with the model's "
                         f"classification head: one of {list(TASKS)} (e.g. the reward spec's "
                         f"--task reward)")
    if cfg.worker_extension_cls is not None and cfg.worker_extension_cls not in EXTENSIONS:
        raise ValueError(f"worker_extension_cls (--worker-extension-cls): "
                         f"{cfg.worker_extension_cls!r}; weight updates run in weightsync's "
                         f"worker extension: one of {list(EXTENSIONS)}")
    if cfg.pooler_config is not None:
        _fold_pooler_config(cfg, cfg.pooler_config)


def worker_extension(cfg: Any) -> str:
    """The class path vLLM is given for ``cfg.worker_extension_cls`` (None: ours)."""
    return EXTENSIONS[cfg.worker_extension_cls] if cfg.worker_extension_cls else WORKER_EXTENSION


def _fold_pooler_config(cfg: Any, pooler: Any) -> None:
    if not isinstance(pooler, dict):
        raise ValueError(f"pooler_config (--pooler-config): a JSON object, got "
                         f"{type(pooler).__name__}")
    unknown = sorted(set(pooler) - set(POOLER_KEYS))
    if unknown:
        raise ValueError(f"pooler_config (--pooler-config): unknown key(s) {unknown}; this "
                         f"server takes {list(POOLER_KEYS)}")
    for key, value in pooler.items():
        name = POOLER_KEYS[key]
        value = _pooler_value(key, value)
        current = getattr(cfg, name)
        if current is not None and _same(name, current) != _same(name, value):
            raise ValueError(f"pooler_config.{key} (--pooler-config) is {value!r} but {name} is "
                             f"{current!r}; give one")
        setattr(cfg, name, value)


def _pooler_value(key: str, value: Any) -> Any:
    from weightsync.reward.types import PoolingType

    where = f"pooler_config.{key} (--pooler-config)"
    if key in ("pooling_type", "tok_pooling_type"):
        if not isinstance(value, str):
            raise ValueError(f"{where}: a pooling name, got {value!r}")
        try:
            return PoolingType.parse(value).vllm_name
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if key in ("normalize", "use_activation"):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: true or false, got {value!r}")
        return value
    if key == "step_tag_id":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: a token id (int), got {value!r}")
        return value
    if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"{where}: a list of token ids (ints), got {value!r}")
    return list(value)


def _same(name: str, value: Any) -> Any:
    """``value`` in a form two spellings of one setting compare equal in (pooling names)."""
    if name in ("pooling_type", "tok_pooling_type") and isinstance(value, str):
        from weightsync.reward.types import PoolingType

        try:
            return PoolingType.parse(value)
        except ValueError:
            return value
    return value
