"""``benchmarks/bench_adapter_slots.py`` end to end, short (two policy servers on vLLM CPU, one
timed round): both rows are measured and checked (each push's version served, the stream on one
version), and with one slot the push waited for the adapter's stream while with two it did not."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _bench():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_adapter_slots.py"
    spec = importlib.util.spec_from_file_location("bench_adapter_slots", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_adapter_slots_measures_both_rows():
    bench = _bench()
    result = bench.run(argparse.Namespace(rounds=1, stream_tokens=150))
    one, two = result["rows"]
    assert (one["adapter_slots"], two["adapter_slots"]) == (1, 2)
    # one slot: the push returned after the stream ended (it drained it); two: before
    assert one["stream_after_push_s"] < 0 < two["stream_after_push_s"], result
    assert two["push_s"] < one["push_s"]
    assert "| 2 |" in bench.table(result)
