"""``benchmarks/bench_copies.py`` on the CPU: every row copies every source into its place in
vLLM's fused layout (checked equal), and the table and JSON carry every row with its ratio to
the flat copy measured in the same run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_copies",
                                                  ROOT / "benchmarks" / "bench_copies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_copy_row_lands_every_tensor_in_its_fused_place(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "copies.json"
    assert bench.main(["--shape", "tiny", "--repeats", "2", "--device", "cpu",
                       "--split-mb", "0.001,1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["flat_copy", "foreach", "per_tensor", "split_0.001", "split_1"]
    assert all(r["exact"] for r in rows.values())
    assert rows["flat_copy"]["x_flat"] == 1.0 and all(r["ms"] > 0 for r in rows.values())
    assert report["tensors"] == 27 and report["bytes"] > 0
    table = capsys.readouterr().out
    assert "split_0.001" in table and " NO" not in table


def test_the_fused_layout_puts_q_k_v_in_row_ranges_of_one_parameter():
    import torch

    from weightsync.bench.shapes import shape_specs

    names = [n for n, _ in shape_specs("tiny")]
    sources, views, params = _bench()._pairs("tiny", torch.device("cpu"), torch.float32)
    assert len(sources) == len(views) == len(names) == 27
    # per layer q/k/v weights and biases become 2 parameters, gate/up 1: 2 x (8 -> 3)
    assert len(params) == 27 - 2 * 8 + 2 * 3
    at = {n: i for i, n in enumerate(names)}
    q, k, v = (views[at[f"model.layers.1.self_attn.{x}_proj.weight"]] for x in "qkv")
    storage = q.untyped_storage().data_ptr()
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() == storage
    assert (q.storage_offset(), k.storage_offset(), v.storage_offset()) == (0, 64 * 64, 96 * 64)
    gate, up = (views[at[f"model.layers.0.mlp.{x}_proj.weight"]] for x in ("gate", "up"))
    assert up.storage_offset() == gate.numel()
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    o = views[at["model.layers.0.self_attn.o_proj.weight"]]
    assert o.storage_offset() == 0 and o.shape == sources[at["model.layers.0.self_attn.o_proj.weight"]].shape
