"""``RewardModelScorer`` against a real (tiny, random) transformers reward model.

``HFForwardClient`` implements the scorer's client protocol in process: each ``score_batch`` is a
real padded transformers forward (real compute, no network; the HTTP client and the vLLM server
are tested in tests/integration). ``Flaky`` and ``Delayed`` wrap it to cause a failure on chosen
calls or to finish batches out of order, faults and timings the real model cannot produce on
demand (test doubles, said where used).
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from weightsync.reward.rollout import Rollout, Step
from weightsync.reward.scorer import RewardModelScorer, ScoringError, rollout_text


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
        self.batches: list[list[str]] = []
        self.kwargs: list[dict] = []
        self._lock = threading.Lock()

    def forward(self, texts: list[str]) -> list:
        import torch

        enc = self.tok(texts, return_tensors="pt", padding=True)
        with self._lock, torch.no_grad():  # one forward at a time on these 2 cores
            logits = self.model(**enc).logits
        rows = logits.tolist()
        return [r[0] for r in rows] if logits.shape[-1] == 1 else rows

    def one(self, text: str):
        return self.forward([text])[0]  # unpadded, one text: the reference score

    async def score_batch(self, texts: list[str], **kwargs) -> list:
        self.calls += 1
        self.batches.append(list(texts))
        self.kwargs.append(kwargs)
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

    base_url = "http://127.0.0.1:9"  # named in the error like a real reward server

    def __init__(self, inner: HFForwardClient, fail_calls: set[int], exc=None) -> None:
        self.inner, self.fail_calls, self.calls = inner, fail_calls, 0
        self.exc = exc or ConnectionError("503 Service Unavailable: weights are being updated")

    async def score_batch(self, texts, *, normalize=True):
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


PROMPTS = ["What is 2+2?", "Write a haiku about rain.", "Name a prime number."]
RESPONSES = [" 4", " Four.", " I think it is 5", " Rain falls softly down", " 7", " 9 is prime",
             " def add(a, b): return a + b", " The answer is 4.", " ok", " Seventeen."]


def _rollouts(n: int) -> list[Rollout]:
    return [
        Rollout(f"r{i}", [Step(0, PROMPTS[i % 3], RESPONSES[i % len(RESPONSES)])],
                {"initial_obs": PROMPTS[i % 3], "i": i})
        for i in range(n)
    ]


def _multi_step(n: int) -> list[Rollout]:
    """Rollouts of 1..3 steps (an agent turn, the environment's answer, the next turn...)."""
    out = []
    for i in range(n):
        steps = [Step(j, f"obs {i}.{j}: {PROMPTS[(i + j) % 3]}", RESPONSES[(i + 2 * j) % 10])
                 for j in range(1 + i % 3)]
        out.append(Rollout(f"m{i}", steps))
    return out


def _run(coro):
    return asyncio.run(coro)


# -- scores are the model's -------------------------------------------------------------------------


def test_rollout_text_joins_non_empty_observations_and_actions():
    r = Rollout("x", [Step(0, "Q: hi", " A: hello"), Step(1, "", "bye"), Step(2, "env says", "")])
    assert rollout_text(r, r.steps) == "Q: hi\n A: hello\nbye\nenv says"
    assert rollout_text(r, r.steps[:1]) == "Q: hi\n A: hello"


@pytest.mark.slow  # builds two tiny models (tokenizer training) on first use
@pytest.mark.parametrize("labels", [1, 3])
def test_sequence_scores_equal_single_text_forward_and_land_in_rollout_meta(model_dirs, labels):
    client = HFForwardClient(model_dirs[labels], version=2)
    rollouts = _rollouts(10)
    scorer = RewardModelScorer(client, batch_size=4, max_concurrency=2, vector_key="rm_vector")
    assert _run(scorer.score(rollouts)) is None  # in place, as the design says
    assert [len(b) for b in client.batches] == [4, 4, 2]
    for r in rollouts:
        ref = client.one(rollout_text(r, r.steps))
        vec = ref if labels > 1 else [ref]
        assert r.meta["rm_vector"] == pytest.approx(vec, abs=1e-5)
        assert r.meta["rm_score"] == pytest.approx(vec[0], abs=1e-5)  # aggregate "first"
        assert isinstance(r.meta["rm_score"], float)
        assert r.meta["rm_score_version"] == 2
        assert r.meta["i"] == int(r.id[1:])  # other metadata kept
        assert "rm_score" not in r.steps[0].meta
    assert len({round(r.meta["rm_score"], 6) for r in rollouts}) > 3  # not a constant
    stats = scorer.last_stats
    assert (stats.num_texts, stats.num_batches, stats.versions) == (10, 3, [2])
    assert not stats.mixed_versions


def test_step_level_scores_each_state_action_pair(client1):
    """The spec's per-step text: each step's own ``f"{prev_obs}\n{action}"``."""
    rollouts = _multi_step(5)  # 1, 2, 3, 1, 2 steps: 9 steps
    scorer = RewardModelScorer(client1, score_level="step", batch_size=4)
    _run(scorer.score(rollouts))
    assert scorer.last_stats.num_texts == 9
    for r in rollouts:
        assert "rm_score" not in r.meta
        for s in r.steps:
            text = f"{s.prev_obs}\n{s.action}"
            assert s.meta["rm_score"] == pytest.approx(client1.one(text), abs=1e-5)
            assert s.meta["rm_score_version"] == 4
    assert r.steps[0].meta["rm_score"] != r.steps[1].meta["rm_score"]


def test_step_level_scores_every_prefix_with_rollout_text(client1):
    rollouts = _multi_step(5)
    _run(RewardModelScorer(client1, score_level="step", text_fn=rollout_text).score(rollouts))
    for r in rollouts:
        for i, s in enumerate(r.steps):
            prefix = rollout_text(r, r.steps[: i + 1])
            assert s.meta["rm_score"] == pytest.approx(client1.one(prefix), abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "aggregate,reduce",
    [
        ("first", lambda v: v[0]), ("last", lambda v: v[2]), ("mean", lambda v: sum(v) / 3),
        ("sum", lambda v: v[0] + v[1] + v[2]), ("max", max), ("min", min), (1, lambda v: v[1]),
        (-1, lambda v: v[2]), (lambda v: v[0] - v[1], lambda v: v[0] - v[1]),
    ],
    ids=["first", "last", "mean", "sum", "max", "min", "index1", "index-1", "callable"],
)
def test_multi_label_scores_are_reduced_by_aggregate(model_dirs, aggregate, reduce):
    client = HFForwardClient(model_dirs[3])
    rollouts = _rollouts(4)
    _run(RewardModelScorer(client, aggregate=aggregate, vector_key="vec").score(rollouts))
    for r in rollouts:
        vec = client.one(rollout_text(r, r.steps))
        assert r.meta["vec"] == pytest.approx(vec, abs=1e-5)
        assert r.meta["rm_score"] == pytest.approx(reduce(vec), abs=1e-5)
    with pytest.raises(ScoringError, match=r"rollout 'r0': aggregate=5: the score has only 3 labels"):
        _run(RewardModelScorer(client, aggregate=5).score(_rollouts(2)))


def test_batches_in_flight_are_bounded_and_order_is_kept(client1):
    class Delayed:
        """Test double (timing): earlier batches take longer, so later ones return first and
        the order must be restored; counts the batches in flight."""

        def __init__(self):
            self.calls = self.in_flight = self.max_in_flight = 0

        async def score_batch(self, texts, *, normalize=True):
            self.calls += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.05 * (8 - self.calls))
                return await client1.score_batch(texts)
            finally:
                self.in_flight -= 1

    delayed = Delayed()
    rollouts = _rollouts(14)
    _run(RewardModelScorer(delayed, batch_size=2, max_concurrency=3).score(rollouts))
    assert delayed.calls == 7
    assert delayed.max_in_flight == 3  # never more than 3 at once (and 3 reached)
    refs = [client1.one(rollout_text(r, r.steps)) for r in rollouts]
    assert [r.meta["rm_score"] for r in rollouts] == pytest.approx(refs, abs=1e-5)


def test_text_fn_and_missing_meta(client1):
    rollouts = _rollouts(2)
    rollouts[0].meta = None
    template = "<user>{}</user><assistant>{}</assistant>"

    def text_fn(rollout, steps):
        return "".join(template.format(s.prev_obs, s.action) for s in steps)

    _run(RewardModelScorer(client1, "rm", text_fn=text_fn).score(rollouts))
    refs = client1.forward([text_fn(r, r.steps) for r in rollouts])
    assert rollouts[0].meta == {"rm": pytest.approx(refs[0], abs=1e-5), "rm_version": 4}
    assert rollouts[1].meta["rm"] == pytest.approx(refs[1], abs=1e-5)


def test_score_sync_and_empty_input(client1):
    rollouts = _rollouts(3)
    assert RewardModelScorer(client1).score_sync(rollouts) is None
    assert all(isinstance(r.meta["rm_score"], float) for r in rollouts)

    async def inside_a_loop():  # blocks this loop while the scorer's own loop works
        RewardModelScorer(client1, "inner").score_sync(rollouts)

    _run(inside_a_loop())
    assert all(r.meta["inner"] == r.meta["rm_score"] for r in rollouts)
    calls = client1.calls
    _run(RewardModelScorer(client1).score([]))
    assert client1.calls == calls


def test_normalize_is_passed_to_the_client(client1):
    client1.kwargs.clear()
    _run(RewardModelScorer(client1, normalize=False).score(_rollouts(1)))
    _run(RewardModelScorer(client1).score(_rollouts(1)))
    _run(RewardModelScorer(client1, normalize=True).score(_rollouts(1)))
    # raw scores by default; normalize=True asks for the activated ones (the reference's)
    assert client1.kwargs == [{"normalize": False}, {"normalize": False}, {"normalize": True}]


# -- versions ----------------------------------------------------------------------------------------


class VersionedClient:
    """Returns a ScoringResponse per batch (as a server response carries its version); the
    reward model is "updated" after the first batch."""

    def __init__(self, inner: HFForwardClient) -> None:
        self.inner, self.version = inner, 7

    async def score_batch(self, texts, *, normalize=True):
        from weightsync.reward.types import ScoringResponse

        scores = await self.inner.score_batch(texts)
        resp = ScoringResponse(scores=scores, version=self.version)
        self.version += 1
        return resp


def test_per_batch_versions_from_responses(client1):
    rollouts = _rollouts(5)
    scorer = RewardModelScorer(VersionedClient(client1), batch_size=2, max_concurrency=1)
    _run(scorer.score(rollouts))
    assert [r.meta["rm_score_version"] for r in rollouts] == [7, 7, 8, 8, 9]
    assert scorer.last_stats.versions == [7, 8, 9] and scorer.last_stats.mixed_versions


def test_version_that_moves_mid_run_is_not_attributed(model_dirs):
    client = HFForwardClient(model_dirs[1], version=1)
    inner = client.score_batch

    async def bump_then_score(texts, *, normalize=True):
        client.version += 1  # the reward model was updated while we scored
        return await inner(texts)

    client.score_batch = bump_then_score
    rollouts = _rollouts(3)
    scorer = RewardModelScorer(client)
    _run(scorer.score(rollouts))
    assert all(r.meta["rm_score_version"] is None for r in rollouts)
    assert scorer.last_stats.version_changed and scorer.last_stats.mixed_versions


def test_client_without_version_or_with_a_failing_lookup_records_none(client1):
    class Bare:
        async def score_batch(self, texts, *, normalize=True):
            return await client1.score_batch(texts)

    class NoVersion(Bare):
        async def get_model_version(self):
            raise ConnectionError("runtime_version unreachable")

    for client in (Bare(), NoVersion()):
        rollouts = _rollouts(2)
        _run(RewardModelScorer(client).score(rollouts))
        assert [r.meta["rm_score_version"] for r in rollouts] == [None, None]
        assert all(isinstance(r.meta["rm_score"], float) for r in rollouts)


class ProtocolClient:
    """The ``RewardModelClient`` shape over the real forward: ``score(ScoringRequest)`` returns
    ``(ScoringResponse, info)`` with the version; ``score_batch`` must then not be used."""

    def __init__(self, inner: HFForwardClient) -> None:
        self.inner, self.version, self.requests = inner, 11, []

    async def score(self, request):
        from weightsync.reward.types import ScoringResponse

        self.requests.append(request)
        scores = await self.inner.score_batch(request.texts)
        return ScoringResponse(scores=scores, version=self.version), {}

    async def score_batch(self, texts, *, normalize=True):
        raise AssertionError("the scorer should use score() for a RewardModelClient")

    async def get_model_version(self):
        return self.version


def test_reward_model_client_goes_through_score_with_versions(client1):
    proto = ProtocolClient(client1)
    rollouts = _rollouts(5)
    scorer = RewardModelScorer(proto, batch_size=2)
    assert scorer.use_score_api
    _run(scorer.score(rollouts))
    assert [len(r) for r in proto.requests] == [2, 2, 1]
    assert [r.meta["rm_score_version"] for r in rollouts] == [11] * 5
    refs = client1.forward([rollout_text(r, r.steps) for r in rollouts])
    assert [r.meta["rm_score"] for r in rollouts] == pytest.approx(refs, abs=1e-5)


# -- failures write nothing ----------------------------------------------------------------------------


def test_bad_rollouts_are_found_before_any_request(client1):
    calls = client1.calls
    cases = [
        ([{"prompt": "a", "response": "b"}], {}, r"rollouts\[0\]: a dict is not a Rollout"),
        ([Rollout("e", [])], {}, "rollout 'e': has no steps"),
        (_rollouts(1), {"text_fn": lambda r, steps: 3}, "rollout 'r0': text_fn returned int"),
        (_multi_step(2), {"text_fn": lambda r, steps: None if len(steps) == 2 else "t",
                          "score_level": "step"}, "rollout 'm1' step 1: text_fn returned NoneType"),
    ]
    bad_meta = _rollouts(2)
    bad_meta[1].meta = "tags"
    cases.append((bad_meta, {}, "rollout 'r1': meta must be a dict, got str"))
    for rollouts, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            _run(RewardModelScorer(client1, **kwargs).score(rollouts))
    assert client1.calls == calls


def test_failed_batch_names_batch_texts_rollouts_and_server_and_writes_nothing(client1):
    rollouts = _rollouts(6)
    flaky = Flaky(client1, fail_calls={2})  # test double: the second request fails
    scorer = RewardModelScorer(flaky, batch_size=2, max_concurrency=1)
    with pytest.raises(ScoringError, match=(
        r"scoring batch 1 \(texts 2..3 of 6: rollout 'r2' .. rollout 'r3'\) failed against "
        r"reward server http://127.0.0.1:9 after 1 attempt\(s\): ConnectionError: 503")):
        _run(scorer.score(rollouts))
    assert all("rm_score" not in r.meta for r in rollouts)


def test_retry_recovers_from_a_transient_failure(client1):
    rollouts = _rollouts(4)
    flaky = Flaky(client1, fail_calls={1})  # test double: the first request fails once
    scorer = RewardModelScorer(flaky, batch_size=2, max_retries=2, retry_backoff_s=0.01)
    _run(scorer.score(rollouts))
    assert scorer.last_stats.retries == 1 and flaky.calls == 3
    refs = client1.forward([rollout_text(r, r.steps) for r in rollouts])
    assert [r.meta["rm_score"] for r in rollouts] == pytest.approx(refs, abs=1e-5)


def test_timeout():
    class Slow:
        async def score_batch(self, texts, *, normalize=True):
            await asyncio.sleep(5)

    with pytest.raises(ScoringError, match=r"batch 0 .* against client Slow .* timed out"):
        _run(RewardModelScorer(Slow(), timeout_s=0.05).score(_rollouts(1)))


@pytest.mark.parametrize(
    "returned,match",
    [
        ([1.0], "returned 1 scores for 2 texts"),
        ([1.0, float("nan")], "rollout 'r1': non-finite score nan"),
        ([1.0, "high"], "rollout 'r1': score is a str"),
        ([[1.0], []], "rollout 'r1': empty score list"),
        ({"score": [1, 2]}, "dict without 'scores'"),
        (None, "returned NoneType"),
    ],
)
def test_unusable_scores_refused(returned, match):
    class Bad:
        async def score_batch(self, texts, *, normalize=True):
            return returned

    rollouts = _rollouts(2)
    with pytest.raises(ScoringError, match=match):
        _run(RewardModelScorer(Bad()).score(rollouts))
    assert all("rm_score" not in r.meta for r in rollouts)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"max_concurrency": 1.5}, "max_concurrency must be an int >= 1"),
        ({"score_key": ""}, "score_key must be a non-empty string"),
        ({"score_level": "token"}, "score_level must be one of"),
        ({"vector_key": "rm_score"}, "vector_key must differ from score_key"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"aggregate": "median"}, "aggregate: unknown name 'median'"),
        ({"normalize": "yes"}, "normalize must be a bool"),
    ],
)
def test_bad_arguments(client1, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardModelScorer(client1, **kwargs)


def test_client_without_score_methods():
    with pytest.raises(TypeError, match="async score_batch"):
        RewardModelScorer(object())


def test_scores_feed_the_grpo_preset(client1):
    from weightsync.reward.presets import make_grpo_with_rm

    algo = make_grpo_with_rm(3)  # 9 rollouts: 3 prompts x 3 responses
    rollouts = _rollouts(9)
    for r in rollouts:
        r.steps[0].reward = float(int(r.id[1:]) % 2)  # a verifier's pass/fail
    _run(algo.make_scorer(client1, batch_size=4).score(rollouts))
    credit = algo.credit_assigner.compute(rollouts)
    assert len(credit) == 9
    for prompt in PROMPTS:
        group = [credit[(r.id, 0)] for r in rollouts if r.meta["initial_obs"] == prompt]
        assert abs(math.fsum(group)) < 1e-6 and len(group) == 3
        # bonus: env + rm; the group's combined returns decide the order of the advantages
        combined = [r.steps[0].reward + r.meta["rm_score"] for r in rollouts
                    if r.meta["initial_obs"] == prompt]
        assert sorted(range(3), key=lambda i: group[i]) == sorted(range(3),
                                                                   key=lambda i: combined[i])


def test_step_tag_needs_step_level_and_a_score_client(client1):
    with pytest.raises(ValueError, match="step_tag is for score_level='step'"):
        RewardModelScorer(client1, step_tag="<|step|>")
    with pytest.raises(TypeError, match="needs a client with score"):
        RewardModelScorer(client1, score_level="step", step_tag="<|step|>")  # score_batch only
    with pytest.raises(ValueError, match="step_tag must be a non-empty string"):
        RewardModelScorer(client1, score_level="step", step_tag="")


def test_tagged_rollout_text_puts_the_tag_after_every_step():
    from weightsync.reward.scorer import tagged_rollout_text

    r = Rollout("r", [Step(0, "Q?", "a1"), Step(1, "", "a2")])
    assert tagged_rollout_text("<t>")(r, r.steps) == "Q?\na1<t>\na2<t>"


# -- the plan's client type, version drift -----------------------------------------------------------


def test_the_plans_client_type_is_exported(client1):
    from weightsync.reward import RewardScoringClient as exported
    from weightsync.reward.client import VLLMRewardClient
    from weightsync.reward.scorer import RewardScoringClient

    assert exported is RewardScoringClient
    assert isinstance(client1, RewardScoringClient)
    assert isinstance(VLLMRewardClient(), RewardScoringClient)
    assert not isinstance(object(), RewardScoringClient)


def test_policy_and_reward_versions_drifting_apart_warn(client1):
    from weightsync.reward.staleness import VersionDriftWarning

    rollouts = _rollouts(2)
    for r in rollouts:
        r.meta["policy_version"] = 9
    scorer = RewardModelScorer(VersionedClient(client1), batch_size=2)  # reward version 7
    with pytest.warns(VersionDriftWarning, match="reward model version 7 and policy version 9"):
        _run(scorer.score(rollouts))
    assert scorer.last_stats.version_gap == 2
    import warnings

    with warnings.catch_warnings():  # once per drift: the same drift again is quiet
        warnings.simplefilter("error", VersionDriftWarning)
        for r in rollouts:
            r.meta["policy_version"] = 10
        _run(scorer.score(rollouts))
    for r in rollouts:
        r.meta["policy_version"] = 9
    _run(scorer.score(rollouts))  # reward version 9: back in step, so the next drift warns
    assert scorer.last_stats.version_gap == 0
    for r in rollouts:
        r.meta["policy_version"] = 20
    with pytest.warns(VersionDriftWarning, match="reward model version 10 and policy version 20"):
        _run(scorer.score(rollouts))
    for r in rollouts:
        r.meta["policy_version"] = 9
    quiet = RewardModelScorer(VersionedClient(client1), batch_size=2, max_version_gap=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", VersionDriftWarning)
        _run(quiet.score(rollouts))
    assert quiet.last_stats.version_gap == 2
