"""``benchmarks/bench_fp8.py`` runs end to end on the tiny shape: three rows, the FP8 ones exact
and carrying fewer bytes than bf16, the JSON record written."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_fp8_tiny(tmp_path, capsys):
    from weightsync.bench.fp8 import main

    out = tmp_path / "fp8.json"
    assert main(["--size", "tiny", "--repeats", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = {r["row"]: r for r in record["rows"]}
    assert list(rows) == ["bf16", "fp8_block", "fp8_tensor"] and record["all_exact"]
    for name in ("fp8_block", "fp8_tensor"):
        assert rows[name]["wire_bytes"] < rows["bf16"]["wire_bytes"]
        assert rows[name]["quantize_ms"] > 0 and rows[name]["ratio"] > 0
    assert "fp8_block" in capsys.readouterr().out
