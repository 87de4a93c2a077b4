"""``serve-policy --in-flight-requests continue`` on GPU: how long generation stands still while
a 7B update lands under requests in flight (issue target: <= 10 ms).

The server runs on GPU 1 with the qwen2-7b shape (dummy weights; a tiny model's tokenizer), a
trainer on GPU 0 pushes over NCCL with one call per chunk (``stream: false``: requests decode
between chunks) through the front door. Four streams decode while a push lands. Measured: the
server's own figure for the flip ("generation paused N ms": pause, load of the staged tensors,
resume; with the KV kept, "generation not paused: flipped between two steps in N ms": the engine
core's flip, while the step in flight runs on), the longest gap between two events of a stream
while the push ran against the median gap before it, the gaps around the event that brought each
stream's first token of the new version (the flip alone), and the push's seconds. Checked:
every stream ends with all its tokens and reports where its version changed (``weight_version_spans``). Run twice: the requests' KV
recomputed by the new weights after the flip (``--in-flight-kv recompute``) or kept
(``keep``, PipelineRL's way: no recompute, and no pause either). Figures go to
``$WEIGHTSYNC_GPU_OUT/continue_7b_<kv>.json`` when that variable is set."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(560)]

API_KEY = "gpu-test-token"
STREAMS = 4
TOKENS = 384


def _stream(url: str, out: dict, started: threading.Event) -> None:
    import httpx

    body = {"model": "m7b", "prompt": "The weights move", "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    times: list[float] = []
    counts: list[int] = []  # the stream's tokens so far, at each event of ``times``
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            event = json.loads(line[6:])
            if "weight_version_spans" in event:
                out["spans"] = event["weight_version_spans"]
            if event.get("usage"):
                out["completion_tokens"] = event["usage"].get("completion_tokens")
            if not event.get("choices"):
                continue  # the usage event carries no token
            times.append(now)  # one event per engine step that gave this stream tokens
            counts.append((counts[-1] if counts else 0)
                          + len(event["choices"][0].get("token_ids") or []))
            if len(times) == 16:
                started.set()
    out["times"], out["counts"] = times, counts
    started.set()


def _flip_gaps(out: dict) -> tuple[float, list[float]] | None:
    """(the gap (s) before the event of one stream that brought its first token of the new
    version (``weight_version_spans``: [[old, 0], [new, k]]), the gaps of the events just
    before and after it); None when the stream saw no flip."""
    spans = next(iter((out.get("spans") or {}).values()), None)
    if not spans or len(spans) < 2:
        return None
    k = spans[1][1]
    times, counts = out.get("times", []), out.get("counts", [])
    e = next((i for i, c in enumerate(counts) if c > k), None)
    if e is None or e == 0:
        return None
    gap = [times[i] - times[i - 1] for i in range(1, len(times))]  # gap[i - 1]: event i's
    return gap[e - 1], gap[max(0, e - 2):e - 1] + gap[e:e + 1]


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_generation_stands_still_only_for_the_flip_of_a_7b_update(tmp_path, kv):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL allows one rank per GPU)")
    from transformers import AutoConfig, AutoModelForCausalLM

    import weightsync as ws
    from weightsync.bench.vllm_engine import write_model_dir
    from weightsync.testing.servers import PolicyServerProcess
    from weightsync.testing.tiny_models import build_tiny_causal_lm

    tiny = Path(build_tiny_causal_lm(tmp_path / "tiny"))
    model_dir = Path(write_model_dir("qwen2-7b", str(tmp_path / "m7b"), "bfloat16"))
    for f in tiny.iterdir():  # the tokenizer (and its chat template) of the tiny model
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, model_dir / f.name)
    log = tmp_path / "policy.log"
    server = PolicyServerProcess(
        str(model_dir), log_path=str(log), env={"CUDA_VISIBLE_DEVICES": "1"},
        extra_args=["--api-key", API_KEY, "--dtype", "bfloat16", "--max-model-len", "1024",
                    "--load-format", "dummy", "--served-model-name", "m7b",
                    # vLLM's share leaves room for the staged copy of the update (15 GB)
                    "--gpu-memory-utilization", "0.5", "--enforce-eager",
                    "--in-flight-requests", "continue", "--in-flight-kv", kv],
    ).start_healthy(timeout_s=480)
    try:
        torch.cuda.set_device(0)
        with torch.device("cuda:0"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
        strategy = {"type": "broadcast", "stream": False, "bucket_size_mb": 512}
        with ws.connect_sync([server.url], strategy, api_key=API_KEY, timeout_s=300) as sync:
            sync.push(model)  # not measured: the group forms, the engine takes the trainer's
            outs = [{} for _ in range(STREAMS)]
            ready = [threading.Event() for _ in range(STREAMS)]
            readers = [threading.Thread(target=_stream, args=(server.url, o, e))
                       for o, e in zip(outs, ready, strict=True)]
            for r in readers:
                r.start()
            for e in ready:
                assert e.wait(120)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.001)
            t0 = time.monotonic()
            stats = sync.push(model)
            t1 = time.monotonic()
            for r in readers:
                r.join(300)
        landed = [ln for ln in log.read_text(errors="replace").splitlines()
                  if "which continue on it" in ln]
    finally:
        server.stop()
    paused = (re.search(r"generation (?:paused|not paused: flipped between two steps in) "
                        r"([0-9.]+) ms", landed[-1])
              if landed else None)
    gaps_before, gaps_during = [], []
    for o in outs:
        t = o.get("times", [])
        for a, b in zip(t, t[1:], strict=False):
            if b < t0:
                gaps_before.append(b - a)
            elif a < t1 + 0.1:  # a gap that overlaps the push (or just after its return)
                gaps_during.append(b - a)
    flips = [_flip_gaps(o) for o in outs]  # per stream: (its gap at the flip, the ones around)
    record = {  # written before the checks below, so a failing run still reports its figures
        "device": torch.cuda.get_device_name(0), "shape": "qwen2-7b", "streams": STREAMS,
        "in_flight_kv": kv,
        "push_s": t1 - t0, "push_stats_s": stats.seconds, "bytes": stats.total_bytes,
        "flip_paused_ms": float(paused.group(1)) if paused else None,
        "median_gap_before_ms": 1e3 * statistics.median(gaps_before) if gaps_before else None,
        "max_gap_during_push_ms": 1e3 * max(gaps_during) if gaps_during else None,
        # per stream: [the gap that brought its first token of the new version, [the gaps just
        # before and after it]]: what the flip itself costs a stream (the receive is over then)
        "flip_gaps_ms": [None if f is None else [round(1e3 * f[0], 1),
                                                 [round(1e3 * g, 1) for g in f[1]]]
                         for f in flips],
        "max_gap_at_flip_ms": max((1e3 * f[0] for f in flips if f), default=None),
        "events": [len(o.get("times", [])) for o in outs],
        "completion_tokens": [o.get("completion_tokens") for o in outs],
        "statuses": [o.get("status") for o in outs],
        "server_line": landed[-1] if landed else None,
    }
    print(json.dumps(record, indent=2))
    where = os.environ.get("WEIGHTSYNC_GPU_OUT")
    if where:
        Path(where, f"continue_7b_{kv}.json").write_text(json.dumps(record, indent=2))
    for o in outs:
        assert o["status"] == 200 and o.get("completion_tokens") == TOKENS, record
        assert len(o["times"]) >= TOKENS * 0.9, record  # an event for (nearly) every token
        assert "spans" in o, "a stream did not see the flip"
    assert paused is not None
    assert all(flips), f"a stream's flip was not found in its events: {record}"
    if kv == "keep":  # the target: the flip stalls a stream <= 10 ms beyond a step
        for at, around in flips:
            assert at <= max(around, default=at) + 0.010, record
