"""A generative reward model: a judge on ``weightsync serve-policy`` (the session's policy
server) behind the router, asked by an async custom reward function through ``chat_complete``
with ``reward_router_address`` (verl's example, unchanged), its verdict parsed into the score;
checked against the same request sent to the server directly. A generative model without a
custom function is refused (verl's rule)."""

from __future__ import annotations

import asyncio
import textwrap

import httpx
import pytest

from weightsync.reward_loop.client import parse_verdict
from weightsync.reward_loop.data import RewardBatch
from weightsync.reward_loop.model_manager import RewardModelManager
from weightsync.reward_loop.worker import RewardLoopWorker

pytestmark = pytest.mark.slow

JUDGE = textwrap.dedent('''
    from weightsync.reward_loop import chat_complete, parse_verdict

    GRM_PROMPT_TEMPLATE = "Problem: {problem}\\nSolution: {solution}\\nScore from 0 to 9:"

    async def compute_score(data_source, solution_str, ground_truth, extra_info,
                            reward_router_address, reward_model_tokenizer):
        grm_prompt = GRM_PROMPT_TEMPLATE.format(problem=extra_info["question"],
                                                solution=solution_str)
        messages = [{"role": "user", "content": grm_prompt}]
        sampling_params = {"temperature": 0.0, "max_tokens": 12, "seed": 0}
        chat_complete_request = {"model": "tiny-policy", "messages": messages, **sampling_params}
        result = await chat_complete(router_address=reward_router_address,
                                     chat_complete_request=chat_complete_request)
        grm_response = result.choices[0].message.content.strip()
        return {"score": parse_verdict(grm_response), "verdict": grm_response,
                "judge_version": result.model_extra["weight_version"]}
''')

QUESTIONS = ["What is 2 + 2?", "Name a colour."]
ANSWERS = ["4", "blue, or maybe 7"]


def test_parse_verdict_takes_the_last_number():
    assert parse_verdict("thinking... 3 then\n\nScore: 8") == 8.0
    assert parse_verdict("-1.5") == -1.5
    assert parse_verdict("no digits", default=0.0) == 0.0


def test_a_judge_on_the_policy_server_scores_through_the_router(policy_server, tmp_path):
    from transformers import AutoTokenizer

    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE)
    rmm = RewardModelManager({"server_urls": [policy_server.url]})
    try:
        assert rmm.kind == "generative"
        worker = RewardLoopWorker({
            "actor_rollout_ref": {"model": {"path": policy_server.model_dir}},
            "reward_model": {"enable": True, "model": {"path": policy_server.model_dir}},
            "custom_reward_function": {"path": str(judge), "name": "compute_score"},
        }, rmm.get_router_address())
        tok = AutoTokenizer.from_pretrained(policy_server.model_dir)
        batch = RewardBatch.from_texts(tok, QUESTIONS, ANSWERS, data_sources="judge",
                                       extra_infos=[{"question": q} for q in QUESTIONS])
        out = asyncio.run(worker.compute_score_batch(batch))
    finally:
        rmm.shutdown()
    version = int(httpx.get(policy_server.url + "/runtime_version", timeout=10).json()["version"])
    for q, a, o in zip(QUESTIONS, ANSWERS, out, strict=True):
        direct = httpx.post(policy_server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny-policy", "temperature": 0.0, "max_tokens": 12, "seed": 0,
            "messages": [{"role": "user",
                          "content": f"Problem: {q}\nSolution: {a}\nScore from 0 to 9:"}]})
        text = direct.json()["choices"][0]["message"]["content"].strip()
        assert o["reward_extra_info"]["verdict"] == text
        assert o["reward_score"] == parse_verdict(text)
        assert o["reward_extra_info"]["judge_version"] == version


def test_a_generative_model_without_a_custom_function_is_refused(policy_server):
    from weightsync.reward_loop.manager import RewardLoopManager

    with pytest.raises(ValueError, match="generative reward model needs custom_reward_function"):
        RewardLoopManager({"actor_rollout_ref": {"model": {"path": policy_server.model_dir}},
                           "reward_model": {"enable": True, "server_urls": [policy_server.url],
                                            "model": {"path": policy_server.model_dir}}})
