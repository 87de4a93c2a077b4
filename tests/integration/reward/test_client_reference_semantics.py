"""``VLLMRewardClient`` on the reward spec's semantics, end to end against the shared reward
server (CPU, the tiny float32 reward model): names under ``model.model.`` / bare ``layers.``
land, unmerged LoRA keys are skipped with a warning on request, HEAD_ONLY given a backbone sends
it too, a sync ends on the server's background-task count, and a client that is never closed
leaves the weight-sync group at interpreter exit. Every score is checked against transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from weightsync.errors import WeightMismatchError
from weightsync.reward.selection import TrainingModeWarning

pytestmark = pytest.mark.slow

TEXTS = ["The model is helpful today.", "hi", "A policy was rude according to the judge!"]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(reward_server):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_server.restore()
    tok = AutoTokenizer.from_pretrained(reward_server.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        reward_server.model_dir, dtype=torch.float32).eval()
    yield tok, model
    reward_server.restore()


def perturbed(model, scale: float) -> dict[str, torch.Tensor]:
    """The model's weights with every backbone norm and the head scaled: scores move."""
    return {n: (p.detach() * scale if ("norm" in n or n.startswith("score.")) else p.detach())
            for n, p in model.named_parameters()}


def hf_logits(tok, model, state: dict[str, torch.Tensor]) -> list[float]:
    import copy

    m = copy.deepcopy(model)
    m.load_state_dict(state, strict=False)
    with torch.no_grad():
        return [float(m(**tok(t, return_tensors="pt")).logits[0, 0]) for t in TEXTS]


def test_spec_names_lora_keys_and_head_only_backbone_land(reward_server, hf):
    tok, model = hf
    client = reward_server.client(unmerged_lora="skip")
    try:
        # names under model.model. (a wrapper holding the HF model as .model) and bare layers.
        state = perturbed(model, 1.5)
        renamed = {(f"model.{n}" if n.startswith("model.") and i % 2 else
                    n[len("model."):] if n.startswith("model.layers.") else n): t
                   for i, (n, t) in enumerate(state.items())}
        assert any(n.startswith("model.model.") for n in renamed)
        assert any(n.startswith("layers.") for n in renamed)
        client.sync_weights(renamed)
        assert client.last_background_polls >= 1  # the reference's end of a sync
        got = client.score_batch_sync(TEXTS, normalize=False)
        assert got == pytest.approx(hf_logits(tok, model, state), abs=TOL)

        # unmerged LoRA keys: skipped with a warning (unmerged_lora="skip", the reference's)
        lora = {**perturbed(model, 0.5),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight":
                torch.ones(2, model.config.hidden_size)}
        with pytest.warns(TrainingModeWarning, match=r"skipped 1 unmerged LoRA tensor"):
            client.sync_weights(lora)
        got = client.score_batch_sync(TEXTS, normalize=False)
        assert got == pytest.approx(hf_logits(tok, model, perturbed(model, 0.5)), abs=TOL)

        # HEAD_ONLY given the whole model: sent too, with a warning (the reference client's)
        state = perturbed(model, 2.0)
        with pytest.warns(TrainingModeWarning, match=r"as well \(a full update\)"):
            client.sync_weights(state, training_mode="head_only")
        got = client.score_batch_sync(TEXTS, normalize=False)
        assert got == pytest.approx(hf_logits(tok, model, state), abs=TOL)
    finally:
        client.close_sync()
    strict = reward_server.client()  # ours by default: unmerged LoRA keys are refused
    try:
        with pytest.raises(WeightMismatchError, match="an unmerged LoRA tensor"):
            strict.sync_weights(lora)
    finally:
        strict.close_sync()


def test_a_client_never_closed_leaves_the_group_at_exit(reward_server):
    """A real child process builds a client with weight updates and exits without closing it;
    a handler it registered first runs last (atexit is LIFO) and reports whether the client's
    own handler had left the group by then."""
    child = textwrap.dedent(f"""
        import atexit
        from weightsync.reward import VLLMRewardClient
        holder = []
        atexit.register(lambda: print("GROUP", "open" if holder[0]._session else "closed"))
        holder.append(VLLMRewardClient(port={reward_server.port}, enable_weight_updates=True,
                                       api_key={reward_server.api_key!r}, device="cpu"))
        print("JOINED", holder[0]._session is not None)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, cwd=os.getcwd())
    assert "JOINED True" in out.stdout, out.stderr[-2000:]
    assert "GROUP closed" in out.stdout, out.stderr[-2000:]
