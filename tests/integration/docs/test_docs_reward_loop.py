"""``docs/reward_loop.md``: its YAML is the example's configuration, character for character
(comments included), and loads as written; its Python snippets use names the package has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGE = (ROOT / "docs/reward_loop.md").read_text()
YAML = ROOT / "examples/reward_loop/gsm8k_hybrid.yaml"


def test_the_yaml_on_the_page_is_the_examples_and_loads():
    from weightsync.reward_loop.config import reward_loop_config

    (block,) = re.findall(r"```yaml\n(.*?)```", PAGE, flags=re.S)
    body = "".join(line + "\n" for line in YAML.read_text().splitlines()
                   if not line.startswith("#"))
    assert block == body
    cfg = reward_loop_config(str(YAML))
    assert cfg.reward_model.reward_weights == {"function": 1.0, "model": 0.5}
    assert cfg.reward_model.num_workers == 2 and cfg.reward_model.router.max_retries == 2


def test_the_names_on_the_page_exist():
    import weightsync.reward_loop as rl

    for name in ("chat_complete", "parse_verdict", "RewardLoopManager", "reward_loop_config",
                 "RewardManagerBase", "register", "register_rule", "RewardBatch",
                 "RateLimitedRewardManager", "RewardModelManager", "VersionMixError"):
        assert name in PAGE and getattr(rl, name) is not None
