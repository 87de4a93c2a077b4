"""``weightsync/_runtime/vllm_flip.py`` without an engine: which tokens a flip counts as the old
weights', and the ids it reports them under. The objects are stand-ins with the attributes of
vLLM's ``Request`` / ``AsyncLLM`` the module reads; the utility inside a real engine core is
tested in ``tests/integration/_runtime/test_vllm_plugin.py`` and through the policy server in
``tests/integration/servers/test_policy_server_continue.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from weightsync._runtime import vllm_flip


def test_a_request_counts_its_tokens_and_those_of_steps_still_in_flight():
    scheduler = SimpleNamespace(requests={
        "a-1": SimpleNamespace(num_output_tokens=20, num_output_placeholders=1),
        "b-2": SimpleNamespace(num_output_tokens=5, num_output_placeholders=0),
        "c-3": SimpleNamespace(num_output_tokens=0),  # waiting; a vLLM without async scheduling
    })
    assert vllm_flip.tokens_made(scheduler) == {"a-1": 21, "b-2": 5, "c-3": 0}
    assert vllm_flip.tokens_made(None) == {}


def test_the_server_gets_the_counts_under_its_own_request_ids():
    calls = []

    class Core:
        async def call_utility_async(self, method, *args):
            calls.append((method, args))
            if args[0] is None:
                return {"ready": True}
            return {"counts": {"int-1": 7, "gone-2": 3}, "answers": [{"ok": True}],
                    "held_ms": 2.5}

    engine = SimpleNamespace(engine_core=Core(), output_processor=SimpleNamespace(
        request_states={"int-1": SimpleNamespace(external_req_id="cmpl-abc-0")}))
    assert asyncio.run(vllm_flip.flip_supported(engine)) is True
    got = asyncio.run(vllm_flip.flip_between_steps(engine, "weightsync_call", ("m", {}), 5.0))
    # a request the server no longer tracks keeps vLLM's id
    assert got == {"counts": {"cmpl-abc-0": 7, "gone-2": 3}, "answers": [{"ok": True}],
                   "held_ms": 2.5}
    assert calls[-1] == (vllm_flip.UTILITY, ("weightsync_call", 5.0, ("m", {})))


def test_a_data_parallel_engine_flips_in_every_engine_core():
    class Cores:
        async def call_utility_all_async(self, method, *args):
            return [{"counts": {"a": 4}, "answers": [{"ok": True, "w": 0}], "held_ms": 1.0},
                    {"counts": {"b": 9}, "answers": [{"ok": True, "w": 1}], "held_ms": 3.0}]

    got = asyncio.run(vllm_flip.flip_between_steps(SimpleNamespace(engine_core=Cores()),
                                                   "weightsync_call", (), None))
    assert got == {"counts": {"a": 4, "b": 9}, "held_ms": 3.0,
                   "answers": [{"ok": True, "w": 0}, {"ok": True, "w": 1}]}


def test_an_engine_without_the_utility_is_not_flipped_between_steps():
    class Core:
        async def call_utility_async(self, method, *args):
            raise RuntimeError(f"Call to {method} method failed: no attribute")

    assert asyncio.run(vllm_flip.flip_supported(SimpleNamespace(engine_core=Core()))) is False
    assert asyncio.run(vllm_flip.flip_supported(SimpleNamespace())) is False
