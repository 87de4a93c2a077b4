"""Which of vLLM's routes the policy server leaves out: a route whose handler vLLM set to
``None`` (the model cannot do it) would only answer 501, so it is not mounted (404)."""

from types import SimpleNamespace

from weightsync.servers.policy import HANDLER_ROUTES, unserved_paths


def test_routes_of_a_none_handler_are_unserved_and_others_stay():
    state = SimpleNamespace(serving_structured_decisions=None, serving_scores=None,
                            serving_embedding=object())
    paths = unserved_paths(state)
    assert "/v1/systemone" in paths
    assert set(HANDLER_ROUTES["serving_scores"]) <= set(paths)
    assert not set(HANDLER_ROUTES["serving_embedding"]) & set(paths)  # it has a handler
    # an attribute this vLLM version does not set: its routes are vLLM's business
    assert not set(HANDLER_ROUTES["serving_render"]) & set(paths)

