"""Serve a policy with `weightsync serve-policy`, train a copy in the trainer, push it, generate.

    python examples/push_to_policy_server.py                 # starts its own server (~1 min)
    python examples/push_to_policy_server.py --url http://127.0.0.1:8000 --model-dir DIR \\
        --api-key TOKEN                                      # a server already serving DIR

The shape of an RL policy loop on CPU with a tiny model: the policy server (vLLM's OpenAI server
plus weightsync's control plane) generates; the trainer owns a transformers copy, takes a few
optimizer steps on a sentence, and pushes the new weights with `VLLMChatClient.sync_weights`
(the front door, a gloo broadcast here). Afterwards the served prompt logprobs of that sentence
equal transformers' for the trained weights, and every response says which version made it.
Exit code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import urllib.parse

SENTENCE = "The trainer pushes fresh weights to the policy server after every step."


def served_prompt_logprobs(client, text: str) -> tuple[list[float], int]:
    from weightsync.policy import ChatCompletionRequest

    async def go():
        req = ChatCompletionRequest(prompt=text, sampling={"max_tokens": 1, "temperature": 0},
                                    return_token_ids=True, extra_body={"prompt_logprobs": 0})
        return await client.complete(req)

    response, info = asyncio.run(go())
    choice = info["raw_response"]["choices"][0]
    ids = response.prompt_token_ids
    lps = [choice["prompt_logprobs"][i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    return lps, response.weight_version


def reference_logprobs(model, tok, text: str) -> list[float]:
    import torch

    ids = tok(text).input_ids
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def train_steps(model, tok, text: str, steps: int) -> None:
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = tok(text, return_tensors="pt")
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=batch.input_ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def run(url: str, model_dir: str, api_key: str | None, steps: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from weightsync.policy import VLLMChatClient
    from weightsync.testing.servers import free_port

    torch.set_num_threads(1)  # leave the other core to the server
    parsed = urllib.parse.urlparse(url)
    client = VLLMChatClient(parsed.hostname, parsed.port, group_port=free_port(),
                            enable_weight_updates=True, device="cpu", api_key=api_key)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        before, v0 = served_prompt_logprobs(client, SENTENCE)
        train_steps(model, tok, SENTENCE, steps)
        version = client.sync_weights(model.state_dict(), version=v0 + 1)
        after, v1 = served_prompt_logprobs(client, SENTENCE)
        expected = reference_logprobs(model, tok, SENTENCE)
    finally:
        client.close_communicator()
    err = max(abs(a - b) for a, b in zip(after, expected, strict=True))
    checks = {
        "served version is the pushed one": version == str(v0 + 1) and v1 == v0 + 1,
        "served logprobs == transformers (<= 1e-4)": err <= 1e-4,
        "training raised the sentence's logprob": sum(after) > sum(before),
    }
    print(f"version {v0} -> {v1} (pushed {client.last_sync_stats.num_tensors} tensors, "
          f"{client.last_sync_stats.seconds:.3f} s)")
    print(f"sentence logprob {sum(before):.3f} -> {sum(after):.3f}; max |served - transformers| "
          f"{err:.2e}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running policy server (default: start one on a tiny model)")
    p.add_argument("--model-dir", help="the model the --url server serves (its base weights)")
    p.add_argument("--api-key", help="the server's control-plane token")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps before the push (3)")
    args = p.parse_args()
    if args.url:
        if not args.model_dir:
            p.error("--url needs --model-dir (the trainer starts from the served weights)")
        return run(args.url, args.model_dir, args.api_key, args.steps)

    from weightsync.testing.servers import RewardServerProcess, signals_raise_system_exit
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_causal_lm(f"{tmp}/policy", family="qwen2", tie_word_embeddings=True)
        with signals_raise_system_exit(), RewardServerProcess(  # stopped on any exit
            model_dir, scratch_dir=tmp, module="weightsync.servers.policy",
            extra_args=["--max-model-len", "256", "--api-key", "example-token"],
        ) as server:
            server.wait_healthy(progress=print)
            return run(server.url, model_dir, "example-token", args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
