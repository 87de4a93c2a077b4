"""A reward manager chosen by name in YAML combining a rule reward and the discriminative reward
model's score with configured weights, checked against values computed by hand (the rule's
verdict written out, the reward model's text written out and scored by transformers), with a
sync and an async custom reward function. The reward model is the session's reward server
behind a ``RewardModelManager`` router; the worker runs in this process."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch

from weightsync.reward_loop.data import RewardBatch
from weightsync.reward_loop.model_manager import RewardModelManager
from weightsync.reward_loop.worker import RewardLoopWorker

pytestmark = pytest.mark.slow

PROMPTS = ["Tom has 3 apples and buys 4 more. How many?", "What is 6 times 7?",
           "Half of 20 is?"]
RESPONSES = ["He has 3 + 4 = 7 apples.\n#### 7", "6 * 7 = 42, so #### 41", "It is 10."]
TRUTHS = ["7", "42", "10"]
RULE_BY_HAND = [1.0, 0.0, 0.0]  # strict GSM8K: '#### 7' right, '#### 41' wrong, no '####'
W_FUNCTION, W_MODEL = 0.75, 0.5

YAML = textwrap.dedent("""
    actor_rollout_ref:
      model: {{path: {policy}}}
    reward_model:
      enable: true
      reward_manager: {manager}
      model: {{path: {rm}}}
      server_urls: [{url}]
      reward_weights: {{function: {wf}, model: {wm}}}
    custom_reward_function: {{path: {fn_path}, name: {fn_name}}}
""")

FUNCTIONS = textwrap.dedent('''
    import asyncio
    from weightsync.reward_loop.rules import gsm8k_score

    def sync_rule(data_source, solution_str, ground_truth, extra_info, **kwargs):
        return gsm8k_score(solution_str, ground_truth)

    async def async_rule(data_source, solution_str, ground_truth, extra_info, **kwargs):
        await asyncio.sleep(0)
        return {"score": gsm8k_score(solution_str, ground_truth), "router": bool(
            kwargs.get("reward_router_address"))}
''')


@pytest.fixture(scope="module")
def setup(reward_server, tiny_policy_model_dir, tmp_path_factory):
    reward_server.restore()
    root = tmp_path_factory.mktemp("managers-rm")
    functions = root / "functions.py"
    functions.write_text(FUNCTIONS)
    rmm = RewardModelManager({"server_urls": [reward_server.url]})
    yield reward_server, tiny_policy_model_dir, root, str(functions), rmm
    rmm.shutdown()


def _rm_scores_by_hand(model_dir) -> list[float]:
    """The texts the reward model must see (the tiny models' chat template written out) and
    transformers' raw score of each."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = [f"user: {p}\nassistant: {r}\n" for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


@pytest.mark.parametrize(("manager", "fn_name"), [("naive", "sync_rule"),
                                                  ("dapo", "async_rule")])
def test_yaml_manager_combines_rule_and_model_with_the_weights(setup, manager, fn_name):
    from transformers import AutoTokenizer

    server, policy_dir, root, fn_path, rmm = setup
    path = root / f"{manager}.yaml"
    path.write_text(YAML.format(policy=policy_dir, manager=manager, rm=server.model_dir,
                                url=server.url, wf=W_FUNCTION, wm=W_MODEL, fn_path=fn_path,
                                fn_name=fn_name))
    worker = RewardLoopWorker(str(path), rmm.get_router_address())
    assert type(worker.reward_loop).__name__ == {"naive": "NaiveRewardManager",
                                                 "dapo": "DAPORewardManager"}[manager]
    batch = RewardBatch.from_texts(AutoTokenizer.from_pretrained(policy_dir), PROMPTS, RESPONSES,
                                   data_sources="openai/gsm8k", ground_truths=TRUTHS)
    out = asyncio.run(worker.compute_score_batch(batch))
    rm = _rm_scores_by_hand(server.model_dir)
    want = [W_FUNCTION * rule + W_MODEL * score for rule, score in zip(RULE_BY_HAND, rm,
                                                                       strict=True)]
    assert [o["reward_score"] for o in out] == pytest.approx(want, abs=1e-4)
    assert [o["reward_extra_info"]["function_score"] for o in out] == RULE_BY_HAND
    assert [o["reward_extra_info"]["rm_score"] for o in out] == pytest.approx(rm, abs=1e-4)
    version = rmm.versions()[server.url]
    assert {o["reward_extra_info"]["rm_version"] for o in out} == {version}
    if fn_name == "async_rule":  # the function got the router's address (verl's contract)
        assert all(o["reward_extra_info"]["router"] for o in out)


def test_without_a_custom_function_the_reward_model_alone_scores(setup):
    """verl's rule: reward model enabled, no custom function, no weights -> the DisRM score."""
    from transformers import AutoTokenizer

    server, policy_dir, _, _, rmm = setup
    worker = RewardLoopWorker({"actor_rollout_ref": {"model": {"path": policy_dir}},
                               "reward_model": {"enable": True,
                                                "model": {"path": server.model_dir}}},
                              rmm.get_router_address())
    batch = RewardBatch.from_texts(AutoTokenizer.from_pretrained(policy_dir), PROMPTS, RESPONSES,
                                   data_sources="openai/gsm8k", ground_truths=TRUTHS)
    out = asyncio.run(worker.compute_score_batch(batch))
    assert [o["reward_score"] for o in out] == pytest.approx(_rm_scores_by_hand(server.model_dir),
                                                             abs=1e-4)
