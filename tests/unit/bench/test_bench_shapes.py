"""Bench shapes (HF names and sizes, built from config, nothing downloaded) and the bench's pure
helpers (digest comparison, table, config validation)."""

from __future__ import annotations

import pytest
import torch

from weightsync.bench import BenchConfig, format_table, validate_config
from weightsync.bench.shapes import build_module, shape_numel, shape_specs
from weightsync.digest import compare_digests


@pytest.mark.parametrize(
    ("shape", "params", "tensors"),
    [
        # published parameter counts (tied embeddings counted once)
        ("qwen2-0.5b", 494_032_768, 290),
        ("qwen2-1.5b", 1_543_714_304, 338),
        ("qwen2-7b", 7_615_616_512, 339),
        ("llama3-8b", 8_030_261_248, 291),
    ],
)
def test_decoder_shapes_match_published_sizes(shape, params, tensors):
    assert shape_numel(shape) == params
    assert len(shape_specs(shape)) == tensors


def test_hf_names_and_shapes():
    specs = dict(shape_specs("qwen2-0.5b"))
    assert specs["model.embed_tokens.weight"] == (151936, 896)
    assert specs["model.layers.23.self_attn.k_proj.weight"] == (128, 896)  # 2 kv heads x 64
    assert specs["model.layers.0.self_attn.q_proj.bias"] == (896,)
    assert "lm_head.weight" not in specs  # tied: sent once, under the embedding name
    llama = dict(shape_specs("llama3-8b"))
    assert llama["lm_head.weight"] == (128256, 4096)
    assert "model.layers.0.self_attn.q_proj.bias" not in llama
    assert llama["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)


def test_many_small_is_thousands_of_small_tensors():
    specs = shape_specs("many-small")
    assert len(specs) >= 4000
    sizes = [torch.Size(s).numel() * 2 for _, s in specs]  # bf16 bytes
    assert max(sizes) <= 16 * 1024 and sum(sizes) / len(sizes) < 8 * 1024


def test_build_module_state_dict_follows_specs():
    m = build_module("tiny", dtype="bfloat16", seed=3)
    sd = m.state_dict()
    assert [(n, tuple(t.shape)) for n, t in sd.items()] == shape_specs("tiny")
    assert all(t.dtype == torch.bfloat16 and not t.requires_grad for t in sd.values())
    again = build_module("tiny", dtype="bfloat16", seed=3).state_dict()
    other = build_module("tiny", dtype="bfloat16", seed=4).state_dict()
    assert all(torch.equal(sd[n], again[n]) for n in sd)
    assert not any(torch.equal(sd[n], other[n]) for n in sd)
    # tensors differ from each other too (each starts at its own offset of the random pool)
    assert not torch.equal(sd["model.layers.0.input_layernorm.weight"],
                           sd["model.layers.1.input_layernorm.weight"])
    filled = build_module("tiny", fill=0.5).state_dict()
    assert all(bool((t == 0.5).all()) for t in filled.values())


def test_unknown_shape_lists_valid_ones():
    with pytest.raises(ValueError, match="valid shapes: tiny, tiny-tied, qwen2-0.5b"):
        shape_specs("qwen3-235b")


def test_compare_digests_finds_changed_missing_and_extra():
    a = {"x": {"digest": "1", "dtype": "float32", "shape": [2]},
         "y": {"digest": "2", "dtype": "float32", "shape": [2]}}
    assert compare_digests(a, dict(a)) == []
    b = {"x": {"digest": "9", "dtype": "float32", "shape": [2]},
         "z": {"digest": "2", "dtype": "float32", "shape": [2]}}
    assert compare_digests(a, b) == ["x", "y", "z"]


def test_table_shows_rows_and_errors():
    recs = [
        {"strategy": "packed_cuda_ipc", "backend": "shm", "transport": "shared memory",
         "device": "cpu", "bytes": 1000, "num_tensors": 3, "num_chunks": 1, "seconds": 0.5,
         "gbps": 2e-6, "reference": "memcpy", "reference_gbps": 4e-6, "ratio": 0.5,
         "bit_exact": True},
        {"strategy": "broadcast", "backend": "gloo", "transport": "gloo broadcast",
         "device": "cpu", "bytes": 1000, "bit_exact": False, "error": "WeightSyncTimeout: boom",
         "raw_broadcast_gbps": float("nan")},
    ]
    out = format_table(recs).splitlines()
    # a 1 KB model: sizes in KB, rates in MB/s, times in ms (no 0.000 GB)
    assert out[0].split()[:8] == ["strategy", "transport", "device", "KB", "tensors", "chunks",
                                  "ms/sync", "MB/s"]
    row = out[2].split()
    assert row[:4] == ["packed_cuda_ipc", "shared", "memory", "cpu"]
    assert row[4:9] == ["1", "3", "1", "500", "0.002"] and out[2].endswith("True")
    assert out[3].endswith("ERROR")
    assert "broadcast: WeightSyncTimeout: boom" in out
    assert any(line.startswith("on CPU the cuda_ipc and packed_cuda_ipc rows move the tensors "
                               "through POSIX shared memory") for line in out)
    assert out[-1] == ("verdict: packed_cuda_ipc (shared memory) is fastest, 500 ms per sync of "
                       "1 KB; 0.5x the memcpy reference; failed or not bit-exact: broadcast")


def test_units_fit_the_model_and_the_verdict_names_the_winner():
    from weightsync.bench.runner import Units, readable, verdict

    assert Units.for_bytes(214_144).size(214_144) == "214 KB"
    assert Units.for_bytes(50e6).rate(0.0349) == "34.9 MB/s"
    big = Units.for_bytes(988e6)
    assert (big.size(988e6), big.rate(2.5), big.time(0.4)) == ("0.988 GB", "2.5 GB/s", "0.4 s")
    assert [readable(v) for v in (82869.2, 214.0, 6.14, 0.00043, 4.2e-5)] == [
        "82,869", "214", "6.14", "0.00043", "4.2e-05"]
    rows = [{"strategy": s, "transport": t, "bytes": 214_144, "seconds": sec, "bit_exact": True,
             "reference": "memcpy", "ratio": None}
            for s, t, sec in (("broadcast", "gloo broadcast", 0.006),
                              ("packed_cuda_ipc", "shared memory", 0.002),
                              ("naive", "gloo broadcast", 0.04))]
    assert verdict(rows) == (
        "verdict: packed_cuda_ipc (shared memory) is fastest, 2 ms per sync of 214 KB, 3.00x "
        "faster than the next best (broadcast), 20.0x faster than the slowest (naive); every "
        "row bit-exact")
    assert verdict([]) == "verdict: no strategy completed bit-exact"


def test_validate_config_names_the_field():
    with pytest.raises(ValueError, match="unknown strategy quantum"):
        validate_config(BenchConfig(strategies=["quantum"]))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        validate_config(BenchConfig(repeats=0))
