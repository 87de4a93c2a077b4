"""The built-in reward managers run by a real ``RewardLoopWorker`` in this process (no Ray, no
reward model: rule-based and custom reward functions; the reward-model parts are tested against
a real reward server in tests/integration/reward_loop)."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

from weightsync.reward_loop.base import RewardManagerBase, get_reward_manager_cls, register
from weightsync.reward_loop.data import RewardBatch
from weightsync.reward_loop.managers import (
    AsyncTokenBucket,
    DAPORewardManager,
    NaiveRewardManager,
    RateLimitedRewardManager,
    RateLimitRewardManager,
    overlong_penalty,
)
from weightsync.reward_loop.worker import RewardLoopError, RewardLoopWorker


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from weightsync.testing.tiny_models import build_tokenizer

    path = tmp_path_factory.mktemp("policy-tok")
    tok = build_tokenizer()
    tok.save_pretrained(path)
    return str(path), tok


def _batch(tok, responses, truths, source="openai/gsm8k"):
    return RewardBatch.from_texts(tok, [f"question {i}" for i in range(len(responses))],
                                  responses, data_sources=source, ground_truths=truths)


def _worker(policy_dir, **reward_model):
    path, _ = policy_dir
    custom = reward_model.pop("custom", None)
    cfg = {"actor_rollout_ref": {"model": {"path": path}}, "reward_model": reward_model}
    if custom:
        cfg["custom_reward_function"] = custom
    return RewardLoopWorker(cfg)


def test_registry_has_verls_names_and_refuses_unknown_ones(policy_dir):
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert get_reward_manager_cls("dapo") is DAPORewardManager
    assert get_reward_manager_cls("rate_limited") is RateLimitRewardManager is RateLimitedRewardManager
    with pytest.raises(ValueError, match=r"reward_model.reward_manager: unknown reward manager "
                                         r"type 'navie'; registered: .*dapo, .*naive"):
        _worker(policy_dir, reward_manager="navie")


def test_naive_scores_every_sample_with_the_default_rule(policy_dir):
    _, tok = policy_dir
    w = _worker(policy_dir)
    out = asyncio.run(w.compute_score_batch(_batch(tok, ["#### 4", "#### 5", "I think 4"],
                                                   ["4", "4", "4"])))
    assert [o["reward_score"] for o in out] == [1.0, 0.0, 0.0]
    assert [o["reward_extra_info"]["acc"] for o in out] == [1.0, 0.0, 0.0]


def test_dapo_adds_the_overlong_penalty(policy_dir):
    _, tok = policy_dir
    responses = ["#### 4", "so the answer, after a long and careful derivation, is #### 4"]
    lengths = [len(tok(r, add_special_tokens=False)["input_ids"]) for r in responses]
    max_len, buf, factor = lengths[1] - 2, 4, 2.0  # the long one is 2 tokens into the buffer end
    w = _worker(policy_dir, reward_manager="dapo", reward_kwargs={
        "max_resp_len": max_len,
        "overlong_buffer_cfg": {"enable": True, "len": buf, "penalty_factor": factor, "log": True}})
    out = asyncio.run(w.compute_score_batch(_batch(tok, responses, ["4", "4"])))
    # by hand: short one: no penalty; long one: exceeds max_len - buf by buf + 2 tokens
    want_long = -(lengths[1] - (max_len - buf)) / buf * factor
    assert want_long == pytest.approx(-(buf + 2) / buf * factor)
    assert out[0]["reward_score"] == 1.0 and out[0]["reward_extra_info"]["overlong"] is False
    assert out[1]["reward_score"] == pytest.approx(1.0 + want_long)
    assert out[1]["reward_extra_info"]["overlong_reward"] == pytest.approx(want_long)
    assert overlong_penalty(3, 10, 4, 1.0) == 0.0  # within max - buffer: none
    with pytest.raises(ValueError, match="max_resp_len: required"):
        _worker(policy_dir, reward_manager="dapo",
                reward_kwargs={"overlong_buffer_cfg": {"enable": True, "len": 4}})


REWARDS = textwrap.dedent('''
    import asyncio

    def sync_len(data_source, solution_str, ground_truth, extra_info, scale=1.0):
        return {"score": scale * len(solution_str), "kind": "sync"}

    async def async_match(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(0.01)
        return float(solution_str.strip() == ground_truth)

    def explodes(data_source, solution_str, ground_truth, extra_info):
        if "boom" in solution_str:
            raise ZeroDivisionError("cannot score " + solution_str)
        return 1.0
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


def test_custom_sync_and_async_functions_both_run(policy_dir, rewards_file):
    _, tok = policy_dir
    batch = _batch(tok, ["abc", "yes"], ["x", "yes"], source="my/data")
    sync = _worker(policy_dir, custom={"path": rewards_file, "name": "sync_len",
                                       "reward_kwargs": {"scale": 0.5}})
    out = asyncio.run(sync.compute_score_batch(batch))
    assert [o["reward_score"] for o in out] == [1.5, 1.5]
    assert out[0]["reward_extra_info"] == {"score": 1.5, "kind": "sync"}
    asyn = _worker(policy_dir, custom={"path": rewards_file, "name": "async_match"})
    assert [o["reward_score"] for o in asyncio.run(asyn.compute_score_batch(batch))] == [0.0, 1.0]


def test_a_function_that_raises_names_the_sample_and_the_function(policy_dir, rewards_file):
    _, tok = policy_dir
    w = _worker(policy_dir, custom={"path": rewards_file, "name": "explodes"})
    batch = _batch(tok, ["fine", "fine", "boom"], ["", "", ""], source="my/data")
    with pytest.raises(RewardLoopError, match=r"sample 2 of a batch of 3: RewardFunctionError: "
                                              r"reward function explodes raised .*ZeroDivisionError"):
        asyncio.run(w.compute_score_batch(batch))
    # the worker keeps working
    assert [o["reward_score"] for o in asyncio.run(w.compute_score_batch(batch[:2]))] == [1.0, 1.0]


def test_a_registered_manager_is_chosen_by_name(policy_dir):
    _, tok = policy_dir

    @register("unit_test_length")
    class LengthManager(RewardManagerBase):
        def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None,
                     reward_model_tokenizer=None):
            super().__init__(config, tokenizer)

        async def run_single(self, data):
            text, length = await self.decode_response(data[0])
            return {"reward_score": float(length), "reward_extra_info": {"text": text}}

    w = _worker(policy_dir, reward_manager="unit_test_length")
    out = asyncio.run(w.compute_score_batch(_batch(tok, ["one two"], ["x"])))
    assert out[0]["reward_score"] == len(tok("one two", add_special_tokens=False)["input_ids"])
    assert out[0]["reward_extra_info"]["text"] == "one two"


@pytest.fixture
def fresh_limits():
    RateLimitRewardManager.reset_class()
    yield
    RateLimitRewardManager.reset_class()


def test_rate_limited_caps_concurrency_and_scores_failures_zero(policy_dir, tmp_path, fresh_limits):
    _, tok = policy_dir
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent('''
        import asyncio
        state = {"now": 0, "most": 0}

        async def judge(data_source, solution_str, ground_truth, extra_info):
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            try:
                await asyncio.sleep(5 if solution_str == "hang" else 0.05)
                if solution_str == "fail":
                    raise ConnectionError("judge API down")
                return {"score": 1.0, "most": state["most"]}
            finally:
                state["now"] -= 1
    '''))
    w = _worker(policy_dir, reward_manager="rate_limited", max_concurrent=2, timeout=0.5,
                custom={"path": str(path), "name": "judge"})
    batch = _batch(tok, ["a", "b", "c", "d", "fail", "hang"], [""] * 6, source="api")
    out = asyncio.run(w.compute_score_batch(batch))
    assert [o["reward_score"] for o in out] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert max(o["reward_extra_info"].get("most", 0) for o in out) == 2  # never more than 2
    assert "judge API down" in out[4]["reward_extra_info"]["error"]
    assert out[5]["reward_extra_info"]["timeout"] is True


def test_rate_limited_requests_per_minute(policy_dir, rewards_file, fresh_limits):
    _, tok = policy_dir
    w = _worker(policy_dir, reward_manager="rate_limited", max_concurrent=8, max_rpm=120,
                custom={"path": rewards_file, "name": "async_match"})
    t0 = time.monotonic()
    asyncio.run(w.compute_score_batch(_batch(tok, ["x"] * 4, ["x"] * 4, source="api")))
    # 120/min = 2/s with a burst of 2: the 3rd and 4th wait 0.5 s each
    assert time.monotonic() - t0 >= 0.9


def test_token_bucket_waits_for_the_deficit_of_a_large_request():
    async def run():
        bucket = AsyncTokenBucket(rate=10.0, capacity=2.0)
        t0 = time.monotonic()
        await bucket.acquire(2.0)  # the burst: at once
        first = time.monotonic() - t0
        await bucket.acquire(5.0)  # larger than the bucket: waits for 5 tokens' worth
        return first, time.monotonic() - t0, bucket.tokens

    first, total, left = asyncio.run(run())
    assert first < 0.1 and total >= 0.45 and left < 0
    with pytest.raises(ValueError, match="rate"):
        AsyncTokenBucket(rate=0)
