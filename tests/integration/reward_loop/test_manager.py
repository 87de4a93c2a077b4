"""``RewardLoopManager`` on a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``):
two ``RewardLoopWorker`` actors placed round robin over the nodes, a batch of 64 rollouts from
the real policy server scored sample by sample while the others still generate (standalone
mode), equal to what one worker computes for the whole batch; the reward combines verl's
default rule and the real reward server's score. Bad configuration fails at construction."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N = 64


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False})
    c.add_node(num_cpus=1, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _config(policy_dir, reward_server, num_workers):
    return {
        "actor_rollout_ref": {"model": {"path": policy_dir}},
        "reward_model": {"enable": True, "num_workers": num_workers,
                         "model": {"path": reward_server.model_dir},
                         "server_urls": [reward_server.url],
                         "reward_weights": {"function": 1.0, "model": 0.5}},
    }


async def _rollouts_scored_as_they_finish(policy_server, tokenizer, manager):
    """64 completions from the policy server, 8 at a time; each is scored the moment it
    finishes, and the last 8 start only once 8 scores are back. -> (the batch in prompt order,
    per-sample results, rollout and scoring times)."""
    from weightsync.reward_loop.data import RewardBatch

    prompts = [f"Q{i}: what is {i} + {i}? Answer after ####." for i in range(N)]
    truths = [str(2 * i) for i in range(N)]
    sem = asyncio.Semaphore(8)
    done_at, scored_at = [0.0] * N, [0.0] * N
    responses: list[str] = [""] * N
    results: list[dict] = [{}] * N
    eight_scored = asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i):
            if i >= N - 8:  # the last rollouts start only once 8 samples were scored: the
                # manager must score while the batch is still being produced
                await asyncio.wait_for(eight_scored.wait(), 120)
            async with sem:
                r = await client.post(policy_server.url + "/v1/completions", json={
                    "model": "tiny-policy", "prompt": prompts[i], "max_tokens": 12,
                    "temperature": 1.0, "seed": i})
            responses[i] = r.json()["choices"][0]["text"] or "."
            done_at[i] = time.monotonic()
            sample = RewardBatch.from_texts(tokenizer, [prompts[i]], [responses[i]],
                                            data_sources="openai/gsm8k", ground_truths=[truths[i]])
            results[i] = await manager.score_sample(sample)
            scored_at[i] = time.monotonic()
            if sum(1 for t in scored_at if t) >= 8:
                eight_scored.set()

        await asyncio.gather(*(one(i) for i in range(N)))
    batch = RewardBatch.from_texts(tokenizer, prompts, responses, data_sources="openai/gsm8k",
                                   ground_truths=truths)
    return batch, results, done_at, scored_at


def test_two_workers_round_robin_score_while_rollouts_run_equal_to_one(
        cluster, policy_server, reward_server, tiny_policy_model_dir):
    from transformers import AutoTokenizer

    from weightsync.reward_loop.manager import RewardLoopManager

    reward_server.restore()
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_model_dir)
    two = RewardLoopManager(_config(tiny_policy_model_dir, reward_server, 2))
    one = None
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
        assert len(nodes) == 2
        assert two.worker_nodes() == [nodes[0], nodes[1]]  # worker i on node i % 2

        batch, streamed, done_at, scored_at = asyncio.run(
            _rollouts_scored_as_they_finish(policy_server, tokenizer, two))
        # scored while rollouts were still being produced: 8 scores came back before the last
        # rollouts had even started
        assert sum(s < min(done_at[N - 8:]) for s in scored_at) >= 8

        one = RewardLoopManager(_config(tiny_policy_model_dir, reward_server, 1))
        whole = one.compute_scores(batch)
        assert [r["reward_score"] for r in streamed] == pytest.approx(
            [r["reward_score"] for r in whole], abs=1e-6)
        assert [r["reward_score"] for r in two.compute_scores(batch)] == pytest.approx(
            [r["reward_score"] for r in whole], abs=1e-6)
        for r in whole:  # the rule and the model, weighted 1.0 and 0.5
            info = r["reward_extra_info"]
            assert r["reward_score"] == pytest.approx(info["function_score"] + 0.5 * info["rm_score"])
        assert len({r["reward_extra_info"]["rm_version"] for r in whole}) == 1

        scored = two.compute_rm_score(batch)  # verl's layout: the score at the last token
        rm = scored.batch["rm_scores"]
        assert rm.shape == batch.batch["responses"].shape
        lengths = batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1]:].sum(1)
        for i in range(N):
            assert float(rm[i, int(lengths[i]) - 1]) == pytest.approx(whole[i]["reward_score"],
                                                                      abs=1e-6)
            assert float(rm[i].abs().sum()) == pytest.approx(abs(whole[i]["reward_score"]),
                                                             abs=1e-5)
        assert {"function_score", "rm_score", "rm_version"} <= set(
            scored.meta_info["reward_extra_keys"])
    finally:
        two.shutdown()
        if one is not None:
            one.shutdown()


def test_bad_configuration_fails_at_construction(cluster, tiny_policy_model_dir, tmp_path):
    from weightsync.reward_loop.manager import RewardLoopManager

    with pytest.raises(ValueError, match=r"reward_model.reward_manager: unknown reward manager "
                                         r"type 'navie'; registered: .*naive"):
        RewardLoopManager({"actor_rollout_ref": {"model": {"path": tiny_policy_model_dir}},
                           "reward_model": {"reward_manager": "navie", "num_workers": 2}})
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        RewardLoopManager({"actor_rollout_ref": {"model": {"path": tiny_policy_model_dir}},
                           "custom_reward_function": {"path": str(tmp_path / "none.py")}})
    assert not [a for a in ray.util.list_named_actors() if a.startswith("reward_loop_worker")]
