"""The reward spec's launch options on ``weightsync serve-reward`` (``servers._reward_spec``),
parsed by the command's own parser: ``--task``, ``--pooler-config``, ``--worker-extension-cls``,
and the update rules' flags; bad values are errors naming the option before anything starts."""

from __future__ import annotations

import pytest

from weightsync.loaders.vllm_worker import (
    REWARD_WORKER_EXTENSION,
    WORKER_EXTENSION,
    RewardWeightSyncExtension,
    WeightSyncWorkerExtension,
)
from weightsync.servers._reward_spec import worker_extension
from weightsync.servers.reward import RewardServerConfig, parse_args

SPEC_POOLER = '{"pooling_type": "LAST", "normalize": true}'


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", *argv])
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def test_the_spec_launch_line_parses_onto_our_fields(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_API_KEY", raising=False)
    cfg = parse_args(["--model", "internlm/internlm2-1_8b-reward", "--task", "reward",
                      "--port", "8001", "--pooler-config", SPEC_POOLER])
    assert (cfg.model, cfg.task, cfg.port) == ("internlm/internlm2-1_8b-reward", "reward", 8001)
    assert (cfg.pooling_type, cfg.use_activation) == ("LAST", True)
    assert worker_extension(cfg) == WORKER_EXTENSION
    assert (cfg.monotonic_versions, cfg.strict_training_mode, cfg.serve_during_updates) == (
        False, False, False)
    ours = parse_args(["--model", "m", "--monotonic-versions", "--strict-training-mode"])
    assert ours.monotonic_versions and ours.strict_training_mode
    for task in ("classify", "score", "auto", "REWARD"):
        assert parse_args(["--model", "m", "--task", task]).task == task


def test_pooler_config_keys_map_to_the_pooling_fields():
    cfg = RewardServerConfig(model="m", pooler_config={
        "pooling_type": "step", "use_activation": False, "step_tag_id": 7,
        "returned_token_ids": [1, 2]})
    assert (cfg.pooling_type, cfg.use_activation, cfg.step_tag_id, cfg.returned_token_ids) == (
        "STEP", False, 7, [1, 2])
    same = RewardServerConfig(model="m", pooling_type="last", pooler_config={"pooling_type": "LAST"})
    assert same.pooling_type == "LAST"


@pytest.mark.parametrize("argv, needle", [
    (["--task", "embed"], "task (--task): 'embed' is not served here"),
    (["--task", "generate"], "one of ['reward', 'classify', 'score', 'auto']"),
    (["--pooler-config", '{"pooling_type": "LAST", "dimensions": 8}'],
     "pooler_config (--pooler-config): unknown key(s) ['dimensions']"),
    (["--pooler-config", '{"pooling_type": "FIRST"}'], "pooler_config.pooling_type (--pooler-config)"),
    (["--pooler-config", '{"normalize": "yes"}'], "pooler_config.normalize (--pooler-config): true or false"),
    (["--pooler-config", '{"normalize": true, "use_activation": false}'],
     "pooler_config.use_activation (--pooler-config) is False but use_activation is True"),
    (["--pooling-type", "MEAN", "--pooler-config", SPEC_POOLER],
     "pooler_config.pooling_type (--pooler-config) is 'LAST' but pooling_type is 'MEAN'"),
    (["--pooler-config", "[1]"], "argument --pooler-config: a JSON object, got list"),
    (["--worker-extension-cls", "my.Extension"],
     "worker_extension_cls (--worker-extension-cls): 'my.Extension'"),
    (["--monotonic-versions", "--allow-version-reset"], "contradict each other"),
])
def test_bad_spec_options_are_errors_naming_the_option(capsys, argv, needle):
    assert needle in refused(capsys, *argv)


def test_every_name_of_the_worker_extension_is_ours():
    assert issubclass(RewardWeightSyncExtension, WeightSyncWorkerExtension)
    import weightsync.reward
    import weightsync.servers.reward

    assert weightsync.reward.RewardWeightSyncExtension is RewardWeightSyncExtension
    assert weightsync.servers.reward.RewardWeightSyncExtension is RewardWeightSyncExtension
    for name in ("weightsync.loaders.vllm_worker.RewardWeightSyncExtension",
                 "weightsync.servers.reward.RewardWeightSyncExtension",
                 "weightsync.reward.RewardWeightSyncExtension",
                 "ludic.inference.vllm_reward_server.RewardWeightSyncExtension"):
        cfg = parse_args(["--model", "m", "--worker-extension-cls", name])
        assert worker_extension(cfg) == REWARD_WORKER_EXTENSION
    assert worker_extension(RewardServerConfig(model="m", worker_extension_cls=WORKER_EXTENSION)) \
        == WORKER_EXTENSION
