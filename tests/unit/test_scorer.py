"""``RewardModelScorer`` against a real (tiny, random) transformers reward model.

``HFForwardClient`` implements the scorer's client protocol in process: each ``score_batch`` is a
real padded transformers forward (real compute, no network; the HTTP client and the vLLM server
are tested in tests/integration). ``Flaky`` wraps it to inject a failure on chosen calls, a fault
the real model cannot produce on demand (test double, said where used).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from weightsync.reward.scorer import RewardModelScorer, ScoringError


class HFForwardClient:
    """``async score_batch(texts)`` = one padded forward of a HF sequence-classification model."""

    def __init__(self, model_dir: str, *, version: int = 0) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
        self.version = version
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def forward(self, texts: list[str]) -> list:
        import torch

        enc = self.tok(texts, return_tensors="pt", padding=True)
        with self._lock, torch.no_grad():  # one forward at a time on these 2 cores
            logits = self.model(**enc).logits
        rows = logits.tolist()
        return [r[0] for r in rows] if logits.shape[-1] == 1 else rows

    async def score_batch(self, texts: list[str]) -> list:
        self.calls += 1
        self.batch_sizes.append(len(texts))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)  # let the other batches in flight start (concurrency check)
            return await asyncio.to_thread(self.forward, texts)
        finally:
            self.in_flight -= 1

    async def get_model_version(self) -> int:
        return self.version


class Flaky:
    """Test double (fault injection): raises on the listed call numbers, else delegates."""

    def __init__(self, inner: HFForwardClient, fail_calls: set[int], exc=None) -> None:
        self.inner, self.fail_calls, self.calls = inner, fail_calls, 0
        self.exc = exc or ConnectionError("503 Service Unavailable: weights are being updated")

    async def score_batch(self, texts):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise self.exc
        return await self.inner.score_batch(texts)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[int, str]:
    from weightsync.testing.tiny_models import build_tiny_reward_model

    root = tmp_path_factory.mktemp("rm")
    return {
        n: build_tiny_reward_model(root / f"labels{n}", num_labels=n, head_std=1.0, seed=n)
        for n in (1, 3)
    }


@pytest.fixture(scope="module")
def client1(model_dirs) -> HFForwardClient:
    return HFForwardClient(model_dirs[1], version=4)


def _rollouts(n: int) -> list[dict]:
    prompts = ["What is 2+2?", "Write a haiku about rain.", "Name a prime number."]
    responses = [" 4", " Four.", " I think it is 5", " Rain falls softly down", " 7", " 9 is prime",
                 " def add(a, b): return a + b", " The answer is 4.", " ok", " Seventeen."]
    return [
        {"prompt": prompts[i % 3], "response": responses[i % len(responses)], "metadata": {"i": i}}
        for i in range(n)
    ]


def _run(coro):
    return asyncio.run(coro)


# -- scores are the model's -------------------------------------------------------------------------


@pytest.mark.slow  # builds two tiny models (tokenizer training) on first use
@pytest.mark.parametrize("labels", [1, 3])
def test_scores_equal_single_text_forward_and_land_in_metadata(model_dirs, labels):
    client = HFForwardClient(model_dirs[labels], version=2)
    rollouts = _rollouts(10)
    scorer = RewardModelScorer(client, batch_size=4, max_concurrency=2)
    scores = _run(scorer.score_rollouts(rollouts))
    assert client.batch_sizes == [4, 4, 2]
    for ro, s in zip(rollouts, scores, strict=True):
        (ref,) = client.forward([ro["prompt"] + ro["response"]])  # unpadded, one text
        assert ro["metadata"]["rm_score"] == s
        assert ro["metadata"]["rm_score_version"] == 2
        assert ro["metadata"]["i"] == rollouts.index(ro)  # other metadata kept
        if labels == 1:
            assert isinstance(s, float) and s == pytest.approx(ref, abs=1e-5)
        else:
            assert len(s) == 3 and s == pytest.approx(ref, abs=1e-5)
    assert len({round(s if labels == 1 else s[0], 6) for s in scores}) > 3  # not a constant
    stats = scorer.last_stats
    assert (stats.num_rollouts, stats.num_batches, stats.versions) == (10, 3, [2])
    assert not stats.mixed_versions


def test_concurrency_is_bounded(client1):
    client1.max_in_flight = 0
    scorer = RewardModelScorer(client1, batch_size=2, max_concurrency=3)
    _run(scorer.score_rollouts(_rollouts(14)))
    assert client1.max_in_flight == 3  # 7 batches, never more than 3 at once (and 3 reached)


@dataclasses.dataclass
class Rollout:
    prompt: str
    response: str
    metadata: dict | None = None


def test_dataclass_rollouts_text_fn_and_missing_metadata(client1):
    rollouts = [Rollout("Q: hi", " A: hello"), Rollout("Q: 2+2", " A: 4", {"keep": 1})]
    template = "<user>{}</user><assistant>{}</assistant>"
    scorer = RewardModelScorer(
        client1, metadata_key="rm", text_fn=lambda r: template.format(r.prompt, r.response)
    )
    scores = _run(scorer.score_rollouts(rollouts))
    refs = client1.forward([template.format(r.prompt, r.response) for r in rollouts])
    assert scores == pytest.approx(refs, abs=1e-5)
    assert rollouts[0].metadata == {"rm": scores[0], "rm_version": 4}
    assert rollouts[1].metadata == {"keep": 1, "rm": scores[1], "rm_version": 4}


def test_sync_wrapper(client1):
    rollouts = _rollouts(3)
    scores = RewardModelScorer(client1).score_rollouts_sync(rollouts)
    assert [r["metadata"]["rm_score"] for r in rollouts] == scores

    async def inside_a_loop():
        RewardModelScorer(client1).score_rollouts_sync(rollouts)

    with pytest.raises(RuntimeError, match="await score_rollouts instead"):
        _run(inside_a_loop())


def test_empty_input_makes_no_call(client1):
    calls = client1.calls
    assert _run(RewardModelScorer(client1).score_rollouts([])) == []
    assert client1.calls == calls


# -- versions ----------------------------------------------------------------------------------------


class VersionedClient:
    """Returns a ScoringResponse per batch (as a server response carries its version); the
    reward model is "updated" after the first batch."""

    def __init__(self, inner: HFForwardClient) -> None:
        self.inner, self.version = inner, 7

    async def score_batch(self, texts):
        from weightsync.reward.types import ScoringResponse

        scores = await self.inner.score_batch(texts)
        resp = ScoringResponse(scores=scores, version=self.version, prompt_tokens=1)
        self.version += 1
        return resp


def test_per_batch_versions_from_responses(client1):
    rollouts = _rollouts(5)
    scorer = RewardModelScorer(VersionedClient(client1), batch_size=2, max_concurrency=1)
    _run(scorer.score_rollouts(rollouts))
    assert [r["metadata"]["rm_score_version"] for r in rollouts] == [7, 7, 8, 8, 9]
    assert scorer.last_stats.versions == [7, 8, 9] and scorer.last_stats.mixed_versions


def test_version_that_moves_mid_run_is_not_attributed(model_dirs):
    client = HFForwardClient(model_dirs[1], version=1)
    inner = client.score_batch

    async def bump_then_score(texts):
        client.version += 1  # the reward model was updated while we scored
        return await inner(texts)

    client.score_batch = bump_then_score
    rollouts = _rollouts(3)
    scorer = RewardModelScorer(client)
    _run(scorer.score_rollouts(rollouts))
    assert all(r["metadata"]["rm_score_version"] is None for r in rollouts)
    assert scorer.last_stats.version_changed and scorer.last_stats.mixed_versions


def test_client_without_version_records_none(client1):
    class Bare:
        async def score_batch(self, texts):
            return await client1.score_batch(texts)

    rollouts = _rollouts(2)
    _run(RewardModelScorer(Bare()).score_rollouts(rollouts))
    assert [r["metadata"]["rm_score_version"] for r in rollouts] == [None, None]
    assert all(isinstance(r["metadata"]["rm_score"], float) for r in rollouts)


# -- failures write nothing ----------------------------------------------------------------------------


def test_bad_rollout_found_before_any_request(client1):
    calls = client1.calls
    rollouts = _rollouts(3)
    del rollouts[2]["response"]
    with pytest.raises(ValueError, match="rollout 2: no 'response' field"):
        _run(RewardModelScorer(client1).score_rollouts(rollouts))
    rollouts = _rollouts(2)
    rollouts[1]["prompt"] = ["not", "a", "string"]
    with pytest.raises(ValueError, match="rollout 1: 'prompt' must be a string, got list"):
        _run(RewardModelScorer(client1).score_rollouts(rollouts))
    with pytest.raises(ValueError, match="rollout 0: text_fn returned int"):
        _run(RewardModelScorer(client1, text_fn=lambda r: 3).score_rollouts(_rollouts(1)))
    rollouts = _rollouts(1)
    rollouts[0]["metadata"] = "tags"
    with pytest.raises(ValueError, match="rollout 0: metadata must be a dict, got str"):
        _run(RewardModelScorer(client1).score_rollouts(rollouts))
    assert client1.calls == calls


def test_failed_batch_writes_nothing_and_names_the_batch(client1):
    rollouts = _rollouts(6)
    flaky = Flaky(client1, fail_calls={2})  # test double: the second request fails
    scorer = RewardModelScorer(flaky, batch_size=2, max_concurrency=1)
    with pytest.raises(ScoringError, match=r"batch 1 \(2 texts\) failed after 1 attempt\(s\): ConnectionError: 503"):
        _run(scorer.score_rollouts(rollouts))
    assert all("rm_score" not in r["metadata"] for r in rollouts)


def test_retry_recovers_from_a_transient_failure(client1):
    rollouts = _rollouts(4)
    flaky = Flaky(client1, fail_calls={1})  # test double: the first request fails once
    scorer = RewardModelScorer(flaky, batch_size=2, max_retries=2, retry_backoff_s=0.01)
    scores = _run(scorer.score_rollouts(rollouts))
    assert scorer.last_stats.retries == 1 and flaky.calls == 3
    assert scores == pytest.approx(client1.forward([r["prompt"] + r["response"] for r in rollouts]), abs=1e-5)


def test_timeout(client1):
    class Slow:
        async def score_batch(self, texts):
            await asyncio.sleep(5)

    with pytest.raises(ScoringError, match="batch 0 .* timed out"):
        _run(RewardModelScorer(Slow(), timeout_s=0.05).score_rollouts(_rollouts(1)))


@pytest.mark.parametrize(
    "returned,match",
    [
        ([1.0], "returned 1 scores for 2 texts"),
        ([1.0, float("nan")], "text 1: non-finite score nan"),
        ([1.0, "high"], "text 1: score is a str"),
        ({"score": [1, 2]}, "dict without 'scores'"),
        (None, "returned NoneType"),
    ],
)
def test_unusable_scores_refused(returned, match):
    class Bad:
        async def score_batch(self, texts):
            return returned

    rollouts = _rollouts(2)
    with pytest.raises(ScoringError, match=match):
        _run(RewardModelScorer(Bad()).score_rollouts(rollouts))
    assert all("rm_score" not in r["metadata"] for r in rollouts)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"max_concurrency": 1.5}, "max_concurrency must be an int >= 1"),
        ({"metadata_key": ""}, "metadata_key must be a non-empty string"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
    ],
)
def test_bad_arguments(client1, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardModelScorer(client1, **kwargs)


def test_client_without_score_batch():
    with pytest.raises(TypeError, match="async score_batch"):
        RewardModelScorer(object())


def test_scores_feed_credit_assignment(client1):
    from weightsync.reward.credit import RewardModelCreditAssigner

    rollouts = _rollouts(9)  # 3 prompts x 3 responses
    for i, r in enumerate(rollouts):
        r["reward"] = float(i % 2)  # a verifier's pass/fail
    _run(RewardModelScorer(client1, batch_size=4).score_rollouts(rollouts))
    credit = RewardModelCreditAssigner("add", weight=0.5, group_normalize=True)
    out = credit.assign_rollouts(rollouts, output_key="advantage")
    for prompt in {r["prompt"] for r in rollouts}:
        group = [o for o, r in zip(out, rollouts, strict=True) if r["prompt"] == prompt]
        assert abs(sum(group)) < 1e-6
    r0 = rollouts[0]
    assert r0["metadata"]["advantage"] == out[0]


class ProtocolClient:
    """The full RewardModelClient shape over the real forward: ``score(ScoringRequest)`` returns
    ``(ScoringResponse, info)`` with the version; ``score_batch`` must then not be used."""

    def __init__(self, inner: HFForwardClient) -> None:
        self.inner, self.version, self.requests = inner, 11, []

    async def score(self, request):
        from weightsync.reward.types import ScoringResponse

        self.requests.append(request)
        scores = await self.inner.score_batch(request.texts)
        return ScoringResponse(scores=scores, version=self.version, prompt_tokens=1), {}

    async def score_batch(self, texts):
        raise AssertionError("the scorer should use score() for a RewardModelClient")

    async def get_model_version(self):
        return self.version

    async def sync_weights(self, params, **kw):
        raise NotImplementedError

    def score_batch_sync(self, inputs):
        raise NotImplementedError


def test_reward_model_client_goes_through_score_with_versions(client1):
    from weightsync.reward.client import RewardModelClient

    proto = ProtocolClient(client1)
    assert isinstance(proto, RewardModelClient)  # the shape VLLMRewardClient has
    rollouts = _rollouts(5)
    scorer = RewardModelScorer(proto, batch_size=2, use_activation=True)
    assert scorer.use_score_api
    scores = _run(scorer.score_rollouts(rollouts))
    assert [len(r) for r in proto.requests] == [2, 2, 1]
    assert all(r.use_activation for r in proto.requests)
    assert [r["metadata"]["rm_score_version"] for r in rollouts] == [11] * 5
    assert scores == pytest.approx(client1.forward([r["prompt"] + r["response"] for r in rollouts]), abs=1e-5)
    with pytest.raises(ValueError, match="use_activation=True needs a client with score"):
        RewardModelScorer(client1, use_activation=True)


def test_failing_version_lookup_does_not_fail_scoring(client1):
    class NoVersion:
        async def score_batch(self, texts):
            return await client1.score_batch(texts)

        async def get_model_version(self):
            raise ConnectionError("runtime_version unreachable")

    rollouts = _rollouts(2)
    _run(RewardModelScorer(NoVersion()).score_rollouts(rollouts))
    assert [r["metadata"]["rm_score_version"] for r in rollouts] == [None, None]
    assert all(isinstance(r["metadata"]["rm_score"], float) for r in rollouts)
