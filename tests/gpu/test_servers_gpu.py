"""``broadcast`` over NCCL from a trainer on GPU 0 into our servers on GPU 1, through the front
door (``ws.connect(url, strategy="broadcast").push(model)``; the backend follows the tensors:
NCCL). Afterwards what the server serves equals the trainer's model (bf16 tolerance):

* ``serve-reward`` (pooling): ``/score`` against transformers' scores;
* ``serve-policy`` (generative, vLLM's OpenAI app + our control plane): prompt logprobs from
  ``/v1/completions`` against transformers'.

Then the two together, as the Ludic plan lays them out (policy about 65 % and reward about 30 %
of one GPU, GPU 1, both up at once), each receiving its own push; and Ludic's own trainer side
(vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``, the reference's client) pushing into
``serve-policy``, timed beside our push into the same server. Timings go to
``$WEIGHTSYNC_GPU_OUT/ludic_vs_ours.json`` when that variable is set."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(560)]

API_KEY = "gpu-test-token"
GPU1 = {"CUDA_VISIBLE_DEVICES": "1"}


def _need_two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL allows one rank per GPU)")


def _push(url: str, model) -> object:
    from _vllm_helpers import push_broadcast

    return push_broadcast(url, model, API_KEY)


def test_broadcast_into_reward_server_on_gpu1(tmp_path):
    _need_two_gpus()
    import torch
    from _vllm_helpers import close_scores, hf_scores
    from transformers import AutoModelForSequenceClassification

    from weightsync.testing.servers import RewardServerProcess
    from weightsync.testing.tiny_models import build_tiny_reward_model

    base = build_tiny_reward_model(tmp_path / "base", seed=0, head_std=1.0)
    new = build_tiny_reward_model(tmp_path / "new", seed=5, head_std=1.0)
    server = RewardServerProcess(
        base, log_path=str(tmp_path / "reward.log"), env=GPU1,
        extra_args=["--api-key", API_KEY, "--dtype", "bfloat16", "--max-model-len", "256",
                    "--gpu-memory-utilization", "0.25", "--enforce-eager"],
    ).start_healthy()
    url = server.url
    try:
        from weightsync.reward import VLLMRewardClient

        async def scores():
            async with VLLMRewardClient(port=int(url.rsplit(":", 1)[1]), api_key=API_KEY) as c:
                from _vllm_helpers import TEXTS

                return await c.score_batch(TEXTS, normalize=False)  # raw, as transformers

        before = asyncio.run(scores())
        # bf16 scores of a head with std 1: -0.521 served vs -0.443 transformers for a small
        # score (2 x H100, 2026-11-25); the transfer was exact, the tolerance is close_scores'
        assert close_scores(before, hf_scores(base)), (before, hf_scores(base))
        torch.cuda.set_device(0)
        model = AutoModelForSequenceClassification.from_pretrained(
            new, dtype=torch.bfloat16).cuda(0)
        stats = _push(url, model)
        after = asyncio.run(scores())
        assert stats.versions == [1]
        assert close_scores(after, hf_scores(new)), (after, hf_scores(new))
        assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 0.5
    finally:
        server.stop()


def test_broadcast_into_policy_server_on_gpu1(tmp_path):
    _need_two_gpus()
    import torch
    from _vllm_helpers import close, hf_prompt_logprobs, prompt_ids
    from transformers import AutoModelForCausalLM

    from weightsync.testing.tiny_models import build_tiny_causal_lm

    base = build_tiny_causal_lm(tmp_path / "base", seed=0)
    new = build_tiny_causal_lm(tmp_path / "new", seed=5)
    ids = prompt_ids(base)
    server = _policy_server(tmp_path, base)
    url = server.url

    def served() -> list[float]:
        return _served_logprobs(url, base, ids)

    try:
        before = served()
        assert close(before, hf_prompt_logprobs(base, ids))
        torch.cuda.set_device(0)
        model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.bfloat16).cuda(0)
        stats = _push(url, model)
        after = served()
        assert stats.versions == [1]
        assert close(after, hf_prompt_logprobs(new, ids)), after
    finally:
        server.stop()


def _policy_server(tmp_path, model_dir) -> object:
    """``serve-policy`` on GPU 1 (45 % of its memory), started and healthy."""
    from weightsync.testing.servers import PolicyServerProcess

    return PolicyServerProcess(
        model_dir, log_path=str(tmp_path / "policy.log"), env=GPU1,
        extra_args=["--api-key", API_KEY, "--dtype", "bfloat16", "--max-model-len", "256",
                    "--gpu-memory-utilization", "0.45", "--enforce-eager"],
    ).start_healthy()


def _served_logprobs(url: str, model_name: str, ids: list[list[int]]) -> list[float]:
    import httpx

    out = []
    for p in ids:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": model_name, "prompt": p, "max_tokens": 1,
                             "temperature": 0, "prompt_logprobs": 0})
        r.raise_for_status()
        lps = r.json()["choices"][0]["prompt_logprobs"]
        out += [lps[i][str(p[i])]["logprob"] for i in range(1, len(p))]
    return out


def test_policy_and_reward_servers_share_one_gpu_and_each_takes_its_push(tmp_path):
    """The Ludic plan's colocation: both servers on GPU 1 at once (65 % / 30 %), a trainer on
    GPU 0 pushes a policy into one and a reward model into the other (two sessions, two NCCL
    groups); each then serves what transformers computes for what it was sent."""
    _need_two_gpus()
    import torch
    from _vllm_helpers import TEXTS, close, close_scores, hf_prompt_logprobs, hf_scores, prompt_ids
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from weightsync.reward import VLLMRewardClient
    from weightsync.testing.servers import PolicyServerProcess, RewardServerProcess
    from weightsync.testing.tiny_models import build_tiny_causal_lm, build_tiny_reward_model

    lm_base = build_tiny_causal_lm(tmp_path / "lm_base", seed=0)
    lm_new = build_tiny_causal_lm(tmp_path / "lm_new", seed=5)
    rm_base = build_tiny_reward_model(tmp_path / "rm_base", seed=0, head_std=1.0)
    rm_new = build_tiny_reward_model(tmp_path / "rm_new", seed=5, head_std=1.0)
    common = ["--api-key", API_KEY, "--dtype", "bfloat16", "--max-model-len", "256",
              "--enforce-eager"]
    policy = PolicyServerProcess(lm_base, log_path=str(tmp_path / "policy.log"), env=GPU1,
                                 extra_args=[*common, "--gpu-memory-utilization", "0.65"],
                                 ).start_healthy()
    reward = None
    try:
        reward = RewardServerProcess(rm_base, log_path=str(tmp_path / "reward.log"), env=GPU1,
                                     extra_args=[*common, "--gpu-memory-utilization", "0.3"],
                                     ).start_healthy()
        torch.cuda.set_device(0)
        lm = AutoModelForCausalLM.from_pretrained(lm_new, dtype=torch.bfloat16).cuda(0)
        rm = AutoModelForSequenceClassification.from_pretrained(rm_new, dtype=torch.bfloat16).cuda(0)
        assert _push(policy.url, lm).versions == [1]
        assert _push(reward.url, rm).versions == [1]
        ids = prompt_ids(lm_base)
        assert close(_served_logprobs(policy.url, lm_base, ids), hf_prompt_logprobs(lm_new, ids))

        async def scores():
            async with VLLMRewardClient(port=int(reward.url.rsplit(":", 1)[1]),
                                        api_key=API_KEY) as c:
                return await c.score_batch(TEXTS, normalize=False)  # raw, as transformers

        assert close_scores(asyncio.run(scores()), hf_scores(rm_new))
    finally:
        if reward is not None:
            reward.stop()
        policy.stop()


class _LudicPyNcclTrainer:
    """Ludic's trainer side on GPU as the reference writes it: vLLM's ``StatelessProcessGroup``
    and ``PyNcclCommunicator`` (the trainer is the last rank), the HTTP control plane of the
    Ludic endpoints, one NCCL broadcast per tensor, a barrier, then polling until done."""

    def __init__(self, url: str, port: int) -> None:
        import httpx
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.http = httpx.Client(base_url=url, timeout=300,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
        workers = self.http.get("/get_world_size").raise_for_status().json()["world_size"]
        self.rank = workers
        self.http.post("/init_communicator", json={"host": "127.0.0.1", "port": port,
                                                   "world_size": workers + 1}).raise_for_status()
        self.spg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=workers,
                                                world_size=workers + 1, store_timeout=120)
        self.comm = PyNcclCommunicator(self.spg, device=torch.device("cuda", 0))

    def push(self, params: dict) -> int:
        import torch

        names = list(params)
        body = {"metadata": [{"name": n, "dtype": str(params[n].dtype),
                              "shape": list(params[n].shape)} for n in names]}
        self.http.post("/update_param_batch", json=body).raise_for_status()
        stream = torch.cuda.current_stream()
        for n in names:
            self.comm.broadcast(params[n].contiguous(), src=self.rank, stream=stream)
        stream.synchronize()
        self.spg.barrier()
        while self.http.post("/get_num_background_tasks").json()["num_background_tasks"]:
            time.sleep(0.001)
        return self.http.get("/runtime_version").json()["version"]

    def close(self) -> None:
        self.http.post("/close_communicator", json={})
        self.http.close()


def test_ludic_pynccl_trainer_pushes_into_the_policy_server_timed_beside_ours(tmp_path):
    _need_two_gpus()
    import torch
    from _vllm_helpers import close, hf_prompt_logprobs, prompt_ids
    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from weightsync.testing.servers import free_port
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    base = build_tiny_causal_lm(tmp_path / "base", seed=0)
    new = build_tiny_causal_lm(tmp_path / "new", seed=5)
    ids = prompt_ids(base)
    server = _policy_server(tmp_path, base)
    times: dict[str, list[float]] = {"ludic_pynccl": [], "ours": []}
    try:
        torch.cuda.set_device(0)
        model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.bfloat16).cuda(0)
        trainer = _LudicPyNcclTrainer(server.url, free_port())
        params = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"
                  or not model.config.tie_word_embeddings}
        try:
            version = 0
            for _ in range(4):  # the same values each time: what is timed is the push alone
                t0 = time.perf_counter()
                version = trainer.push(params)
                times["ludic_pynccl"].append(time.perf_counter() - t0)
            assert close(_served_logprobs(server.url, base, ids), hf_prompt_logprobs(new, ids))
        finally:
            trainer.close()

        async def ours() -> int:
            async with ws.connect([server.url], strategy="broadcast", api_key=API_KEY,
                                  timeout_s=120) as sync:
                v = version
                for _ in range(4):
                    v += 1
                    t0 = time.perf_counter()
                    stats = await sync.push(model, version=v)
                    times["ours"].append(time.perf_counter() - t0)
                return stats.versions[0]

        assert asyncio.run(ours()) == version + 4
        assert close(_served_logprobs(server.url, base, ids), hf_prompt_logprobs(new, ids))
    finally:
        server.stop()
    record = {k: {"median_s": statistics.median(v[1:]), "all_s": v} for k, v in times.items()}
    print("ludic_vs_ours", json.dumps(record))
    out = os.environ.get("WEIGHTSYNC_GPU_OUT")
    if out:
        with open(os.path.join(out, "ludic_vs_ours.json"), "w") as f:
            json.dump(record, f, indent=2)
