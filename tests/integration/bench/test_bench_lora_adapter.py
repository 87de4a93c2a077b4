"""``benchmarks/bench_lora_adapter.py`` end to end on a small model (vLLM CPU): every step's
pushed adapter serves the greedy tokens of vLLM's own file load of the same adapter and of the
PEFT model, only the adapter's bytes travel, and the
table and the JSON record say so."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_lora_adapter_runs_and_checks_every_step(tmp_path, capsys):
    from weightsync.bench.lora_adapter import main

    out = tmp_path / "lora.json"
    rc = main(["--hidden-size", "64", "--layers", "2", "--vocab-size", "512", "--rank", "8",
               "--steps", "2", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [r["step"] for r in rows] == [1, 2] and all(r["exact"] for r in rows)
    # the engine holds the pushed adapter byte for byte as vLLM's own file load builds it, and
    # in float32 it serves what that file load and transformers serve
    assert all(r["bytes_equal"] and r["file_repeatable"] for r in rows)
    assert rows[0]["adapter_digest"] != rows[1]["adapter_digest"]  # a trained step changed it
    assert all(r["file_equal"] and r["hf_equal"] for r in rows)
    # rank 8 on 7 linear kinds x 2 layers, float32: (r x in + out x r) per module
    h, i, kv = 64, 128, 32  # hidden, intermediate (tiny default 2 x hidden), k/v width
    per_layer = 8 * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)
    assert rows[0]["adapter_bytes"] == 2 * per_layer * 4
    assert rows[0]["full_bytes"] == record["model_bytes"] > rows[0]["adapter_bytes"]
    # where each adapter push's time went, on both sides
    for r in rows:
        assert set(r["front_ms"]) == {"prepare", "sender", "send", "total"}
        assert set(r["engine_ms"]) == {"start", "chunks", "commit", "finish"}
        assert r["engine_ms"]["finish"] > 0  # the adapter is built and installed at finish
    out = capsys.readouterr().out
    assert "exact: True" in out and "adapter push, engine" in out
