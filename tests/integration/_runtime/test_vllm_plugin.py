"""weightsync's vLLM plugin (``weightsync/_runtime/vllm_plugin.py``) in a real vLLM engine: after
generation filled the prefix cache, the fast reset leaves exactly what vLLM's own reset leaves
(no block holds a hash, the hash map is empty), the next generation equals the first, and the
reset visits only the hashed blocks. And vLLM's engine core has the utility the plugin gives it,
``weightsync_flip``. The engine core runs in the script's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its block pool can be read; vLLM loads the plugin
there through the entry point the install registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent('''
    import json, sys
    from weightsync.testing.tiny_models import build_tiny_causal_lm
    from vllm import LLM, SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from weightsync._runtime import vllm_plugin

    visited = []
    original_iter = vllm_plugin.OnlyHashed.__iter__
    vllm_plugin.OnlyHashed.__iter__ = lambda self: (visited.append(len(self.hashed)),
                                                    original_iter(self))[1]
    llm = LLM(model=build_tiny_causal_lm(sys.argv[1]), dtype="float32", max_model_len=256,
              enforce_eager=True, kv_cache_memory_bytes=64 << 20, seed=0, block_size=32)
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["the quick brown fox jumps over the lazy dog " * 4, "hello world " * 12]
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    hashed_before = sum(b.block_hash is not None for b in pool.blocks)
    ok = llm.reset_prefix_cache()
    hashed_after = sum(b.block_hash is not None for b in pool.blocks)
    in_map = len(pool.cached_block_hash_to_block._cache)
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    core = llm.llm_engine.engine_core.engine_core
    probe = core.weightsync_flip(None)
    flip = core.weightsync_flip(lambda worker: type(worker).__name__)
    print(json.dumps({
        "patched": getattr(BlockPool.reset_prefix_cache, "_weightsync_fast", False),
        "blocks": len(pool.blocks), "hashed_before": hashed_before, "reset": ok,
        "hashed_after": hashed_after, "in_map": in_map, "visited": visited,
        "first": first, "again": again, "probe": probe, "flip_answers": flip["answers"],
        "flip_counts": flip["counts"], "flip_held_ms": flip["held_ms"],
    }))
''')


def _run(tmp_path, **env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "model")], capture_output=True, text=True,
        timeout=240, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_fast_reset_leaves_what_vllms_own_leaves_visiting_only_the_hashed_blocks(tmp_path):
    fast = _run(tmp_path)
    assert fast["patched"] and fast["reset"] is True, fast
    assert 0 < fast["hashed_before"] < fast["blocks"]
    assert fast["hashed_after"] == 0 and fast["in_map"] == 0  # no hash survives
    # the reset walked the hashed blocks only (vLLM's own walks every block)
    assert fast["visited"] and max(fast["visited"]) <= fast["hashed_before"]
    assert fast["again"] == fast["first"]  # greedy outputs after the reset: the same
    plain = _run(tmp_path, WEIGHTSYNC_FAST_PREFIX_RESET="0")  # the switch: vLLM's own reset
    assert not plain["patched"] and plain["visited"] == []
    keys = ("blocks", "hashed_before", "reset", "hashed_after", "in_map", "first", "again")
    assert {k: plain[k] for k in keys} == {k: fast[k] for k in keys}


def test_the_engine_core_gets_the_flip_utility_which_runs_the_workers_method(tmp_path):
    """The plugin gives vLLM's ``EngineCore`` ``weightsync_flip`` (``_runtime/vllm_flip.py``): a
    probe answers ready; a flip runs the given method on the worker and counts the requests
    the scheduler holds (none between two ``generate`` calls)."""
    got = _run(tmp_path)
    assert got["probe"] == {"ready": True}
    assert len(got["flip_answers"]) == 1 and "Worker" in got["flip_answers"][0], got
    assert got["flip_counts"] == {} and got["flip_held_ms"] >= 0
