"""``benchmarks/bench_vllm_sync.py`` on CPU, end to end: a real vLLM CPU engine with dummy
weights of the ``tiny`` shape, every CPU row (the front door's pushes, gloo broadcast,
shared-memory IPC, the per-parameter ways), each checked against the trainer by on-device checksums and prompt
logprobs against transformers; then, on a model with tied embeddings, the check is shown to
pass after a sync and to fail when the engine's weights are not the trainer's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_cli_runs_every_cpu_row_and_verifies_it(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_vllm_sync.py"), "--device", "cpu",
         "--shape", "tiny", "--dtype", "float32", "--repeats", "1", "--json", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"push_broadcast", "push_cuda_ipc", "broadcast", "broadcast_ungrouped",
                         "broadcast_serial", "broadcast_staged", "cuda_ipc", "packed_cuda_ipc",
                         "cuda_ipc_1chunk",
                         "cuda_ipc_load_weights", "per_param", "ludic"}  # native: GPU-only
    # the headline rows go through the front door and say what it adds to the path it drives,
    # split: the extractor and manifest, the sender, the sender's send_chunks
    for push in ("push_broadcast", "push_cuda_ipc"):
        assert rows[push]["note"] == "ws.connect(...).push(model)"
        assert rows[push]["x_internal"] > 0
        front = rows[push]["front_ms"]
        assert set(front) == {"prepare", "sender", "send", "total"}, front
        assert 0 < front["send"] <= front["total"] <= rows[push]["seconds"] * 1e3 * 1.5 + 5
        assert front["prepare"] + front["sender"] + front["send"] <= front["total"] + 0.01
    assert "the front door's split" in proc.stdout
    # gloo cannot group its calls: the ungrouped row is the same protocol (both exact, above)
    assert rows["broadcast_ungrouped"]["strategy"]["group_calls"] is False
    assert rows["broadcast_serial"]["strategy"]["overlap_chunks"] is False
    assert rows["broadcast_staged"]["strategy"]["staged"] is True  # exact below, like the rest
    for r in rows.values():
        assert r["verified"] and r["bit_exact"] and r["logprobs"]["ok"], r
        assert r["check"]["compared"] > 0 and not r["check"]["mismatched"]
        assert r["seconds"] > 0 and r["x_reference"] > 0
    assert rows["per_param"]["num_chunks"] == result["meta"]["tensors"]  # one chunk per tensor
    assert rows["broadcast"]["num_chunks"] == rows["cuda_ipc_1chunk"]["num_chunks"] == 1
    assert set(result["references"]) == {"memcpy", "flat_broadcast"}
    for row in ("broadcast", "cuda_ipc", "packed_cuda_ipc", "cuda_ipc_1chunk", "per_param"):
        st = result["stages"][row]
        # into one engine every row's update is one apply_update call (start, chunk, finish):
        # an IPC strategy's one chunk, a streamed broadcast's one request
        rpc = st["apply_rpc_s"]
        assert not {"start_rpc_s", "chunk_rpc_s", "finish_rpc_s"} & set(st), (row, st)
        assert st["engine_load_s"] > 0 and rpc >= st["engine_chunk_s"] > 0, (row, st)
        assert st["control_overhead_s"] > -0.005, (row, st)  # round trips hold the engine time
    table = proc.stdout
    assert "flat_broadcast" in table and "stage split" in table and "per_param" in table


def test_check_fails_when_the_engine_does_not_hold_the_trainers_weights(tmp_path):
    from weightsync.bench.vllm_config import VllmBenchConfig
    from weightsync.bench.vllm_engine import stop_engine, write_model_dir
    from weightsync.bench.vllm_runner import Bench

    # tied embeddings: vLLM on CPU keeps a prepacked copy of the LM head, which a reload of the
    # embedding alone left stale (the logprob check caught it; the loader now refreshes it)
    bench = Bench(VllmBenchConfig(device="cpu", shape="tiny-tied", dtype="float32", repeats=1,
                                  rows=["packed_cuda_ipc"], quiet=True))
    bench.model_dir = write_model_dir("tiny-tied", str(tmp_path / "model"), "float32")
    bench.build_trainer_model()
    llm = bench.start("cpu", None)
    try:
        before = bench.verify(llm)  # dummy weights: nothing matches yet
        assert not before["bit_exact"] and before["num_mismatched"] == before["compared"]
        asyncio.run(bench.run_rows(llm, ["packed_cuda_ipc"], "cpu"))
        (rec,) = bench.rows
        assert rec["verified"] and rec["logprobs"]["ok"], rec
        bench.negate()  # the trainer moves on; the engine keeps the last sync
        after = bench.verify(llm)
        assert not after["bit_exact"] and after["num_mismatched"] == after["compared"]
        assert not bench.logprob_check(llm)["ok"]
    finally:
        stop_engine(llm)
