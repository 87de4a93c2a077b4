"""``RewardModelPublisher`` end to end through the real vLLM reward server (CPU, real HTTP).

Uses the session's shared ``reward_server`` (tests/integration/conftest.py) and restores its base
weights first. Each training mode trains the tiny Qwen2 reward model in this process for a few
steps, publishes it through ``create_reward_publisher(client)`` (the client's configured
strategy: gloo broadcast), and checks that the served scores equal a transformers forward of
the same weights (<= 1e-4, fp32) and that the version rose by one. LORA twice in a row (train,
sync, train, sync), against PEFT's ``merge_and_unload``. Bad input is refused before any byte
moves: version and served scores unchanged.
"""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch

from weightsync.errors import WeightMismatchError
from weightsync.reward import RewardModelTrainingMode as Mode
from weightsync.reward.publisher import create_reward_publisher

pytestmark = pytest.mark.slow

TEXTS = [
    "The model is helpful today.",
    "hi",
    "A policy was rude according to the judge!",
    "Question: what is 2 + 2? Answer: 4.",
    "def add(a, b):\n    return a + b",
    "Refusing is sometimes the right call.",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def base(reward_server, tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_server.restore()
    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir)
    return tok, model.float().eval()


def _reference(tok, model) -> list[float]:
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in TEXTS]


def _train(tok, model, *, steps: int = 3, seed: int = 0, lr: float = 5e-2) -> None:
    """A few MSE steps toward random targets on padded batches (what moves: whatever
    requires grad)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(seed)
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    for _ in range(steps):
        target = torch.randn(len(TEXTS), 1, generator=g) * 3
        loss = ((model(**enc).logits - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


async def _publish_and_score(reward_server, model, mode, *, rounds=1, tok=None, between=None):
    """Publish ``model`` ``rounds`` times (calling ``between(i)`` before each round) and return
    [(stats, version_before, served_scores, reference_scores)] per round."""
    out = []
    async with reward_server.client() as client:
        pub = create_reward_publisher(client)
        for i in range(rounds):
            if between is not None:
                between(i)
            before = await client.get_model_version()
            stats = await pub.publish_async(model, training_mode=mode)
            served = await client.score_batch(TEXTS, normalize=False)
            out.append((stats, before, served, None))
        await pub.close()
    return out


def _check_round(stats, before, served, ref, *, expect_tensors=None) -> float:
    assert stats.versions == [before + 1]
    if expect_tensors is not None:
        assert stats.num_tensors == expect_tensors
    err = max(abs(a - b) for a, b in zip(served, ref, strict=True))
    assert err <= TOL, (served, ref)
    return err


def test_head_only_end_to_end(reward_server, base) -> None:
    tok, base_model = base
    model = copy.deepcopy(base_model)
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("score."))
    before_scores = _reference(tok, model)
    _train(tok, model, seed=1)
    ref = _reference(tok, model)
    assert max(abs(a - b) for a, b in zip(ref, before_scores, strict=True)) > 1e-2

    ((stats, before, served, _),) = asyncio.run(
        _publish_and_score(reward_server, model, Mode.HEAD_ONLY))
    err = _check_round(stats, before, served, ref, expect_tensors=1)
    print(f"head_only: max |served - transformers| = {err:.2e}")


def test_full_end_to_end(reward_server, base) -> None:
    tok, base_model = base
    reward_server.restore()
    model = copy.deepcopy(base_model)
    _train(tok, model, seed=2, lr=1e-2)
    ref = _reference(tok, model)

    ((stats, before, served, _),) = asyncio.run(_publish_and_score(reward_server, model, Mode.FULL))
    err = _check_round(stats, before, served, ref, expect_tensors=len(model.state_dict()))
    print(f"full: max |served - transformers| = {err:.2e}")


def test_lora_twice_in_a_row_equals_merged_transformers(reward_server, base) -> None:
    import peft

    tok, base_model = base
    reward_server.restore()
    model = peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=16, target_modules="all-linear"))
    base_sd = {n: t.clone() for n, t in base_model.state_dict().items()}
    refs: list[list[float]] = []

    def train_then_reference(i: int) -> None:
        _train(tok, model, seed=10 + i, lr=2e-2)
        refs.append(_reference(tok, copy.deepcopy(model).merge_and_unload()))

    rounds = asyncio.run(_publish_and_score(reward_server, model, Mode.LORA, rounds=2,
                                            between=train_then_reference))
    for i, ((stats, before, served, _), ref) in enumerate(zip(rounds, refs, strict=True)):
        err = _check_round(stats, before, served, ref)
        print(f"lora sync {i + 1}: max |served - transformers(merged)| = {err:.2e}")
    assert rounds[1][1] == rounds[0][1] + 1  # version rose once per sync
    assert max(abs(a - b) for a, b in zip(refs[0], refs[1], strict=True)) > 1e-3
    # the frozen base weights were never touched by the merges (bit-for-bit)
    for n, p in model.named_parameters():
        if "base_layer" in n:
            key = n.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(p, base_sd[key]), n


def test_bad_input_refused_before_any_byte_moves(reward_server, base, tiny_reward_model_dir):
    import peft

    from weightsync.reward.publisher import RewardModelPublisher

    tok, base_model = base
    sd = {n: t.clone() for n, t in base_model.state_dict().items()}
    lora_sd = dict(peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(
        task_type="SEQ_CLS", r=2, target_modules=["q_proj"])).state_dict())
    unknown = {**sd, "model.layers.9.mlp.up_proj.weight": sd["model.layers.0.mlp.up_proj.weight"]}

    async def go():
        async with reward_server.client() as client:
            version = await client.get_model_version()
            scores = await client.score_batch(TEXTS, normalize=False)
            pub = create_reward_publisher(client)
            local = RewardModelPublisher(client, engine_metadata=tiny_reward_model_dir, rank=0)
            cases = [
                (pub, {"model.norm.weight": sd["model.norm.weight"]}, Mode.HEAD_ONLY,
                 "not a head parameter"),
                (pub, {"score.weight": sd["score.weight"]}, Mode.FULL, "requires backbone"),
                (pub, lora_sd, Mode.LORA, "unmerged LoRA tensor"),
                (pub, unknown, Mode.FULL, "model.layers.9.mlp.up_proj.weight"),  # server refuses
                (local, unknown, Mode.FULL, "not a parameter of the target"),  # refused locally
            ]
            errors = []
            for p, params, mode, needle in cases:
                with pytest.raises(WeightMismatchError) as e:
                    await p.publish_async(params, training_mode=mode)
                assert needle in str(e.value), str(e.value)
                errors.append(str(e.value))
                assert await client.get_model_version() == version
            assert await client.score_batch(TEXTS, normalize=False) == scores
            await pub.close()
            return errors

    errors = asyncio.run(go())
    assert len(errors) == 5


def test_head_only_state_dict_keeps_the_head_and_warns(reward_server, base) -> None:
    """The design's HEAD_ONLY given a whole state dict: the head is published, the rest is
    dropped with a warning naming it (blocking ``publish``, as the design has it)."""
    from weightsync.reward.selection import TrainingModeWarning

    tok, base_model = base
    reward_server.restore()
    model = copy.deepcopy(base_model)
    with torch.no_grad():
        model.score.weight.add_(torch.randn(model.score.weight.shape,
                                            generator=torch.Generator().manual_seed(5)))
        model.model.norm.weight.mul_(3.0)  # moved, but not part of a head-only update
    client = reward_server.client()
    pub = create_reward_publisher(client)
    try:
        before = httpx.get(reward_server.url + "/runtime_version").json()["version"]
        with pytest.warns(TrainingModeWarning, match=r"dropped \d+ other\(s\): "
                                                     r"model\.embed_tokens\.weight"):
            stats = pub.publish(model.state_dict(), before + 1, training_mode=Mode.HEAD_ONLY)
        assert stats.num_tensors == 1 and stats.versions == [before + 1]
        served = client.score_batch_sync(TEXTS, normalize=False)
    finally:
        pub.close_sync()
        client.close_sync()
    with torch.no_grad():
        model.model.norm.weight.div_(3.0)  # the server kept its backbone: compare with that
    err = max(abs(a - b) for a, b in zip(served, _reference(tok, model), strict=True))
    assert err <= TOL


def test_a_model_is_streamed_not_collected(reward_server, base) -> None:
    """With the client's own strategy (comm=None) the publisher hands the extractor's chunks to
    the sender as they come: the first chunk reaches the server before the last one is
    extracted. Observed by recording wrappers around the extractor's generator and the
    control client's per-chunk call (observation only: both still do their real work)."""
    from weightsync.reward.publisher import RewardModelPublisher

    tok, base_model = base
    reward_server.restore()
    model = copy.deepcopy(base_model)
    _train(tok, model, seed=7, lr=1e-2)
    events: list[tuple[str, int]] = []

    class Recording(RewardModelPublisher):
        def _extractor_for(self, m, mode):
            ext = super()._extractor_for(m, mode)
            inner = ext.extract_weights

            async def recorded(*a, **k):
                i = 0
                async for chunk in inner(*a, **k):
                    events.append(("extracted", i))
                    i += 1
                    yield chunk

            ext.extract_weights = recorded
            return ext

    async def go():
        async with reward_server.client() as client:
            pub = Recording(client, bucket_size_mb=0.02)
            await pub.publish_async(model, training_mode=Mode.FULL)  # joins the group
            engines = client._session.client
            count = iter(range(10_000))
            # a request goes out alone, or with its finish as one apply_update (the streamed
            # broadcast into a server): record whichever call carries it
            for method in ("update_named_weights", "apply_update"):
                real = getattr(engines, method)

                async def recorded_send(*args, _real=real, **kwargs):
                    events.append(("sent", next(count)))
                    return await _real(*args, **kwargs)

                setattr(engines, method, recorded_send)
            events.clear()
            stats = await pub.publish_async(model, training_mode=Mode.FULL)
            return stats, await client.score_batch(TEXTS, normalize=False)

    stats, served = asyncio.run(go())
    extracted = [i for e, i in events if e == "extracted"]
    assert stats.num_chunks == len(extracted) > 5
    first_sent = events.index(("sent", 0))
    last_extracted = events.index(("extracted", len(extracted) - 1))
    assert first_sent < last_extracted, events
    assert max(abs(a - b) for a, b in zip(served, _reference(tok, model), strict=True)) <= TOL
