"""``custom_reward_function``: loading a function from a file, binding ``reward_kwargs``,
sync and async detected, failures that name the function and the sample."""

from __future__ import annotations

import asyncio
import functools
import textwrap

import pytest

from weightsync.reward_loop.functions import (
    RewardFunctionError,
    call_reward_fn,
    get_custom_reward_fn,
    is_async,
)

SOURCE = textwrap.dedent('''
    import asyncio

    def compute_score(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
        return float(solution_str == ground_truth) + bonus

    async def compute_score_async(data_source, solution_str, ground_truth, extra_info, **kw):
        await asyncio.sleep(0)
        return {"score": len(solution_str), "source": data_source, "kw": sorted(kw)}

    def broken(**kwargs):
        raise KeyError("no such field")
''')


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SOURCE)
    return str(path)


def _cfg(path, name="compute_score", **kwargs):
    return {"custom_reward_function": {"path": path, "name": name, "reward_kwargs": kwargs}}


def test_no_path_is_no_function():
    assert get_custom_reward_fn({}) is None
    assert get_custom_reward_fn({"custom_reward_function": {"path": None}}) is None


def test_sync_function_with_reward_kwargs_bound(reward_file):
    fn = get_custom_reward_fn(_cfg(reward_file, bonus=0.5))
    assert not is_async(fn)
    assert fn(data_source="d", solution_str="a", ground_truth="a", extra_info={}) == 1.5
    # the configured kwargs win over the call's (verl's rule)
    assert fn(data_source="d", solution_str="a", ground_truth="b", extra_info={}, bonus=9) == 0.5


def test_async_function_detected_and_awaited(reward_file):
    fn = get_custom_reward_fn(_cfg(reward_file, "compute_score_async", tag=1))
    assert is_async(fn)
    out = asyncio.run(call_reward_fn(fn, what="sample 0", data_source="d", solution_str="abc",
                                     ground_truth="x", extra_info={}))
    assert out == {"score": 3, "source": "d", "kw": ["tag"]}
    assert is_async(functools.partial(fn))


def test_sync_function_runs_off_the_loop(reward_file):
    import threading

    seen = []

    def fn(**kwargs):
        seen.append(threading.current_thread() is threading.main_thread())
        return 1.0

    assert asyncio.run(call_reward_fn(fn, what="s", x=1)) == 1.0
    assert seen == [False]  # an executor thread, not the event loop's


def test_failures_name_the_file_the_function_and_the_sample(reward_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path .*nope.py"):
        get_custom_reward_fn(_cfg(str(tmp_path / "nope.py")))
    with pytest.raises(AttributeError, match=r"'missing'.*its functions: .*compute_score"):
        get_custom_reward_fn(_cfg(reward_file, "missing"))
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(ImportError, match="importing it failed: ModuleNotFoundError"):
        get_custom_reward_fn(_cfg(str(bad)))
    fn = get_custom_reward_fn(_cfg(reward_file, "broken"))
    with pytest.raises(RewardFunctionError, match=r"broken raised on sample 7: KeyError"):
        asyncio.run(call_reward_fn(fn, what="sample 7", data_source="d"))
