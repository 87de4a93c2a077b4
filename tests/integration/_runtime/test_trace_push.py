"""A traced push between real processes: the trainer (this process, ``trace.configure``) and a
``LocalEngineProcess`` engine (``WEIGHTSYNC_TRACE_DIR`` in its environment) over a real gloo
streamed broadcast; ``benchmarks/trace_timeline.py`` merges both files into one push whose
trainer and engine events are in the protocol's order."""

from __future__ import annotations

import asyncio

import pytest

import weightsync as ws
from weightsync._runtime import trace
from weightsync.local import LocalEngineProcess
from weightsync.local.modules import qwen2_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FACTORY = "weightsync.local.modules:qwen2_module"
SMALL = {"size": "small", "dtype": "float32"}
# ~13 MB in 2 MB chunks; tensors from 256 KB on written in place, the smaller ones packed
STREAM = {"type": "broadcast", "backend": "gloo", "timeout_s": 30, "bucket_size_mb": 2,
          "pack_below_mb": 0.25, "checksum": True}


def _first(rows: list[dict], proc: str, label: str) -> int:
    return next(i for i, r in enumerate(rows) if r["proc"] == proc and r["label"] == label)


def test_a_traced_push_has_the_trainer_and_the_engine_in_protocol_order(tmp_path, capsys,
                                                                      trace_timeline):
    trace.flush()
    trace.configure(tmp_path)
    engine = LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name="engine0",
                                      env={trace.ENV: str(tmp_path)})
    try:
        async def go():
            async with ws.connect([engine], STREAM) as sync:
                return [await sync.push(qwen2_module(**SMALL, seed=v), version=v)
                        for v in (1, 2)]

        stats = asyncio.run(go())
    finally:
        engine.stop()
        trace.configure(None)
    assert [s.versions for s in stats] == [[1], [2]]

    tl = trace_timeline
    events = tl.read_events(str(tmp_path))
    assert len(list(tmp_path.glob("trace-*.jsonl"))) == 2  # the trainer's and the engine's
    names = tl.process_names(events)
    assert sorted(names.values()) == ["engine", "trainer"]
    pushes = tl.split_pushes(events)
    assert len(pushes) == 2
    rows = tl.timeline(pushes[-1], names)
    chunks = stats[1].num_chunks
    assert chunks > 3
    order = [_first(rows, "trainer", "push.begin"), _first(rows, "trainer", "rpc.apply.begin"),
             _first(rows, "engine", "endpoint.start.begin"),
             _first(rows, "engine", "recv.chunk.post.begin"),
             _first(rows, "engine", "recv.end"), _first(rows, "engine", "endpoint.finish.end"),
             _first(rows, "trainer", "rpc.apply.end"), _first(rows, "trainer", "push.end")]
    assert order == sorted(order), [rows[i]["label"] for i in order]
    assert rows[order[-1]] is rows[-1] and rows[0]["ms"] == 0.0
    # one engine that carries apply_update: start, request and finish went as one call
    assert not any(r["label"] in ("rpc.start.end", "rpc.request.end", "rpc.finish.end")
                   for r in rows)
    assert [r["label"] for r in rows].count("rpc.apply.end") == 1
    # the engine took the start before its receiver posted a byte
    assert (_first(rows, "engine", "endpoint.start.end")
            < _first(rows, "engine", "recv.chunk.post.begin"))
    assert _first(rows, "trainer", "lane.vote") < _first(rows, "trainer", "lane.chunk.end")
    labels = [(r["proc"], r["label"], r["fields"].get("chunk")) for r in rows]
    for k in range(chunks):  # every chunk: issued and done on the trainer, landed on the engine
        for who, label in (("trainer", "lane.chunk.end"), ("trainer", "lane.chunk.done"),
                           ("trainer", "feed.chunk"), ("engine", "recv.finish"),
                           ("engine", "recv.checksums"), ("engine", "recv.in_place")):
            assert labels.count((who, label, k)) == 1, (who, label, k)
    assert ("engine", "recv.load", 0) not in labels  # chunk 0 is one large tensor: in place

    assert tl.main([str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    print(out)  # the sample in the test log (-s)
    # the push's line, the column names, at most 120 events (and the "..." line between the
    # halves when there are more), the largest gaps, the blank line after the push
    assert out.startswith("push 2 of 2: ") and len(out.splitlines()) <= 1 + 1 + 120 + 1 + 1 + 1
    assert (tmp_path / "rows.json").exists()


def test_a_held_update_is_compared_with_the_model_while_its_call_travels(tmp_path,
                                                                        trace_timeline):
    """Pushing the same model again sends its held chunks; the model is compared with them
    after the engine's call left and before any chunk does (``push.held.checked`` between
    ``rpc.post``-side ``rpc.apply.begin`` and the first ``feed.chunk``). A model whose tensor
    was replaced since is caught there: that stream aborts before a byte moves (the engine
    refuses it and keeps its weights), the model is extracted again and pushed, and the engine
    then holds it exactly; the group stays usable for the next held push. After such a push
    the next one compares the model first (so a trainer that replaces a tensor every step pays
    one refused update, not one a step)."""
    import torch

    from weightsync.digest import module_digest

    trace.flush()
    trace.configure(tmp_path)
    engine = LocalEngineProcess.spawn(FACTORY, {**SMALL, "fill": "zeros"}, name="engine0",
                                      env={trace.ENV: str(tmp_path)})
    model = qwen2_module(**SMALL, seed=1)
    try:
        async def go():
            seen = []
            async with ws.connect([engine], STREAM) as sync:
                await sync.push(model, version=1)  # extracted
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)  # a training step in place: the update is held
                await sync.push(model, version=2)
                seen.append(await engine.call("state_digest") == module_digest(model))
                head = model.model.norm
                head.weight = torch.nn.Parameter(head.weight.detach() * 3)  # replaced
                stats = await sync.push(model, version=3)
                seen.append(await engine.call("state_digest") == module_digest(model))
                with torch.no_grad():
                    model.model.norm.weight.add_(1.0)
                await sync.push(model, version=4)  # held again, over the same group
                seen.append(await engine.call("state_digest") == module_digest(model))
                served = await engine.call("state_digest")
                with torch.no_grad():
                    model.model.norm.weight.add_(1.0)
                with pytest.raises(ws.UpdateRefusedError, match="not newer"):
                    await sync.push(model, version=4)  # refused at the start: votes no
                seen.append(await engine.call("state_digest") == served)  # nothing landed
                await sync.push(model, version=5)
                seen.append(await engine.call("state_digest") == module_digest(model))
                for v in (6, 7):  # a trainer that replaces a tensor every step
                    head = model.model.norm
                    head.weight = torch.nn.Parameter(head.weight.detach() + 1)
                    await sync.push(model, version=v)
                    seen.append(await engine.call("state_digest") == module_digest(model))
                return seen, stats, (await sync.status())[0]
        seen, stats, status = asyncio.run(go())
    finally:
        engine.stop()
        trace.configure(None)
    assert seen == [True] * 7
    assert stats.versions == [3] and status["version"] == 7
    tl = trace_timeline
    events = tl.read_events(str(tmp_path))
    names = tl.process_names(events)
    pushes = [tl.timeline(p, names) for p in tl.split_pushes(events)]
    assert len(pushes) == 8
    labels = [[(r["proc"], r["label"]) for r in rows] for rows in pushes]
    early = []
    for k in (1, 5):  # the held pushes: compared after the call left, before a chunk went
        at = labels[k].index
        assert (at(("trainer", "rpc.apply.begin")) < at(("trainer", "push.held.checked"))
                < at(("trainer", "feed.chunk"))), labels[k]
        assert ("trainer", "feed.abort") not in labels[k]
        if ("trainer", "lane.chunk.early") in labels[k]:  # taken while the engine voted
            early.append(at(("trainer", "lane.chunk.early")) < at(("trainer", "lane.vote")))
    assert early and all(early)  # (the engine's start takes longer than the model's check)
    refused = labels[4]
    assert ("trainer", "lane.chunk.begin") not in refused  # prepared at most; never sent
    assert ("engine", "recv.chunk.post.begin") not in refused
    changed = labels[2]
    assert changed.count(("trainer", "rpc.apply.begin")) == 2  # refused once, then extracted
    assert changed.count(("trainer", "feed.abort")) == 1
    first_abort = changed.index(("trainer", "feed.abort"))
    assert ("engine", "recv.chunk.post.begin") not in changed[:first_abort]  # no byte moved
    assert [e for e in labels[0] if e == ("trainer", "push.held.checked")] == []
    # after a push whose model had changed, the next one compares the model first (it held:
    # sent held, one call, no abort); then the pushes go back to comparing during the call
    after = labels[3]
    assert ("trainer", "push.held.checked") not in after and ("trainer", "feed.abort") not in after
    assert after.count(("trainer", "rpc.apply.begin")) == 1
    # a trainer that replaces a tensor every step: one refused update at the first change,
    # then each push compares first and extracts, with no refused update
    assert labels[6].count(("trainer", "feed.abort")) == 1
    assert ("trainer", "feed.abort") not in labels[7]
    assert labels[7].count(("trainer", "rpc.apply.begin")) == 1
