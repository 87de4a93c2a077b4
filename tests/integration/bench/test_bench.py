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
    assert by["cuda_ipc"]["backend"] == "shm" and by["cuda_ipc"]["transport"] == "shared memory"
    # one copy reference for every row (the median of the whole run's samples)
    assert len({r["reference_gbps"] for r in records}) == 1
    assert by["naive"]["num_chunks"] == 27  # one request per tensor
    assert by["packed_cuda_ipc"]["num_chunks"] < 27  # bucketed
    table = captured.out.splitlines()
    assert table[0].split()[:4] == ["strategy", "transport", "device", "KB"]  # 214 KB: not GB
    assert sum(line.rstrip().endswith("True") for line in table) == len(DEFAULT_STRATEGIES)
    best = min(records, key=lambda r: r["seconds"])["strategy"]
    assert table[-1].startswith(f"verdict: {best} (") and "every row bit-exact" in table[-1]
    assert "sync 1/3 (warm-up)" in captured.err  # progress on stderr


def test_bench_integrity_variants_alternate_and_stay_bit_exact(tmp_path, capsys):
    """``--integrity``: every round syncs plain, checksum, staged, checksum+staged in turn on
    one sender and engine; the last sync (checksum+staged) leaves the engine bit-exact."""
    from weightsync.bench.runner import INTEGRITY_VARIANTS

    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--shape", "tiny", "--strategy", "broadcast,packed_cuda_ipc",
                   "--repeats", "2", "--bucket-mb", "0.1", "--integrity", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    for r in json.loads(out.read_text()):
        assert r["error"] is None and r["bit_exact"] is True, r
        assert r["version"] == 3 * len(INTEGRITY_VARIANTS)  # warm-up + 2 rounds of 4 syncs
        assert sorted(r["integrity"]) == sorted(INTEGRITY_VARIANTS)
        for v, got in r["integrity"].items():
            assert len(got["seconds_all"]) == 2 and got["seconds"] > 0, v
            assert got["cost"] == pytest.approx(got["seconds"] / r["seconds"] - 1)
        assert r["checksum_cost"] == r["integrity"]["checksum"]["cost"]
    assert "checksum cost" in captured.out.splitlines()[0]
    assert "[checksum+staged]" in captured.err


@pytest.mark.gpu
def test_bench_cuda_every_strategy_bit_exact(tmp_path):
    """On a GPU machine: IPC rows on one GPU (CUDA IPC handles), NCCL broadcast rows when a
    second GPU exists (NCCL refuses two ranks on one GPU)."""
    import torch

    from weightsync.bench import BenchConfig, run_bench

    strategies = ["cuda_ipc", "packed_cuda_ipc"]
    if torch.cuda.device_count() >= 2:
        strategies += ["broadcast", "naive"]
    records = run_bench(BenchConfig(shape="tiny", strategies=strategies, device="cuda",
                                    repeats=2, quiet=True, json_path=str(tmp_path / "b.json")))
    assert [r["strategy"] for r in records] == strategies
    for r in records:
        assert r["error"] is None and r["bit_exact"] is True, r
        assert r["backend"] == ("nccl" if r["strategy"] in ("broadcast", "naive") else "cuda_ipc")
        assert r["reference_gbps"] > 0
