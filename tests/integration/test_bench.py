"""``weightsync bench`` end to end on the ``tiny`` shape: real receiver processes, every
strategy (and the naive per-tensor row), bit-exact, table on stdout, JSON records on disk."""

from __future__ import annotations

import json

import pytest

from weightsync import cli
from weightsync.bench import DEFAULT_STRATEGIES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REQUIRED = ("strategy", "backend", "device", "shape", "bytes", "seconds", "gbps",
            "reference_gbps", "ratio", "bit_exact")


def test_bench_cli_every_strategy_bit_exact(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--shape", "tiny", "--strategy", "all", "--repeats", "2",
                   "--bucket-mb", "0.1", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    records = json.loads(out.read_text())
    assert [r["strategy"] for r in records] == DEFAULT_STRATEGIES
    for r in records:
        assert all(k in r for k in REQUIRED), (r["strategy"], sorted(r))
        assert r["error"] is None and r["bit_exact"] is True and r["mismatched"] == []
        assert r["shape"] == "tiny" and r["device"] == "cpu"
        assert r["bytes"] == 107072 * 2 and r["num_tensors"] == 27  # bfloat16
        assert r["seconds"] > 0 and r["gbps"] > 0 and r["reference_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["reference_gbps"])
        assert len(r["seconds_all"]) == 2 and r["version"] == 3  # warm-up + 2 timed syncs
    by = {r["strategy"]: r for r in records}
    assert by["broadcast"]["backend"] == "gloo" and by["broadcast"]["raw_broadcast_gbps"] > 0
    assert by["cuda_ipc"]["backend"] == "shm"
    assert by["naive"]["num_chunks"] == 27  # one request per tensor
    assert by["packed_cuda_ipc"]["num_chunks"] < 27  # bucketed
    table = captured.out.splitlines()
    assert table[0].split()[0] == "strategy"
    assert sum(line.rstrip().endswith("True") for line in table) == len(DEFAULT_STRATEGIES)
    assert "sync 1/3 (warm-up)" in captured.err  # progress on stderr
