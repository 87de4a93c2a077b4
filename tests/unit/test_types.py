"""Plain data types: JSON round trips and the errors bad dicts raise (weightsync/types.py)."""

from __future__ import annotations

import json

import pytest
import torch

from weightsync.strategies.broadcast import (
    BroadcastWeightUpdateRequest,
    TorchDistributedWeightSyncInfo,
)
from weightsync.strategies.cuda_ipc import CudaIpcWeightUpdateRequest
from weightsync.strategies.packed_cuda_ipc import PackedCudaIpcWeightUpdateRequest
from weightsync.types import (
    EmptyWeightSyncInfo,
    IpcBufferHandle,
    TensorMeta,
    WeightChunk,
    WeightSyncInfo,
    WeightUpdateFinish,
    WeightUpdateRequest,
    WeightUpdateStart,
    dtype_itemsize,
    dtype_to_str,
    str_to_dtype,
)

NAMES = ["model.embed_tokens.weight", "score.weight", "model.norm.weight"]
DTYPES = ["bfloat16", "float32", "float16"]
SHAPES = [[16, 8], [1, 8], [8]]
COMMON = dict(names=NAMES, dtypes=DTYPES, shapes=SHAPES, update_id="u1", chunk_index=2,
              is_last=False, version=7)


def _shm(nbytes: int, name: str = "ws_seg") -> IpcBufferHandle:
    return IpcBufferHandle(kind="shm", nbytes=nbytes, name=name)


def _requests() -> list[WeightUpdateRequest]:
    sizes = [16 * 8 * 2, 8 * 4, 8 * 2]
    cuda = IpcBufferHandle(kind="cuda", nbytes=4096, handle="AAEC", offset=512,
                           alloc_nbytes=1 << 20, device_uuid="GPU-1234")
    return [
        WeightUpdateRequest(**COMMON),
        BroadcastWeightUpdateRequest(**COMMON, src_rank=0, packed=False, align_bytes=128),
        CudaIpcWeightUpdateRequest(**COMMON, handles=[_shm(s, f"ws_seg{i}") for i, s in enumerate(sizes)]),
        CudaIpcWeightUpdateRequest(**COMMON, handles=[cuda, cuda, cuda]),
        PackedCudaIpcWeightUpdateRequest(
            **COMMON, buffers=[_shm(256, "ws_bf16"), _shm(64, "ws_f32f16")],
            buffer_index=[0, 1, 1], offsets=[0, 0, 32],
        ),
    ]


def _json(d: dict) -> dict:
    return json.loads(json.dumps(d))


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("req", _requests(), ids=lambda r: type(r).__name__)
def test_requests_round_trip_through_json(req):
    d = _json(req.to_dict())
    assert d["type"] == req.TYPE
    back = WeightUpdateRequest.from_dict(d)  # the base class dispatches on "type"
    assert type(back) is type(req)
    assert back == req
    assert type(req).from_dict(d) == req
    assert back.metas() == [TensorMeta(n, t, s) for n, t, s in zip(NAMES, DTYPES, SHAPES, strict=True)]


@pytest.mark.parametrize(
    "info",
    [
        EmptyWeightSyncInfo(),
        TorchDistributedWeightSyncInfo(master_addr="127.0.0.1", master_port=29555, world_size=3,
                                       group_name="g", backend="nccl", timeout_s=12.5),
    ],
    ids=lambda i: type(i).__name__,
)
def test_sync_infos_round_trip_through_json(info):
    back = WeightSyncInfo.from_dict(_json(info.to_dict()))
    assert type(back) is type(info) and back == info


def test_start_and_finish_round_trip_through_json():
    start = WeightUpdateStart(update_id="u", version=3,
                              manifest=[TensorMeta(n, d, s) for n, d, s in zip(NAMES, DTYPES, SHAPES, strict=True)],
                              extras={"training_mode": "head_only", "nested": {"a": [1, 2]}})
    back = WeightUpdateStart.from_dict(_json(start.to_dict()))
    assert back == start and isinstance(back.manifest[0], TensorMeta)
    no_manifest = WeightUpdateStart(update_id="v")
    assert WeightUpdateStart.from_dict(_json(no_manifest.to_dict())) == no_manifest
    finish = WeightUpdateFinish(update_id="u", version=3, num_chunks=4, ok=False, error="boom")
    assert WeightUpdateFinish.from_dict(_json(finish.to_dict())) == finish


def test_start_options_are_typed_and_round_trip():
    from weightsync.types import TrainingMode

    start = WeightUpdateStart(update_id="u", training_mode="HEAD_ONLY", head_name_patterns=["v_head."])
    assert start.training_mode is TrainingMode.HEAD_ONLY
    d = _json(start.to_dict())
    assert d["training_mode"] == "head_only" and d["head_name_patterns"] == ["v_head."]
    back = WeightUpdateStart.from_dict(d)
    assert back == start and back.training_mode is TrainingMode.HEAD_ONLY
    assert WeightUpdateStart.from_dict(_json(WeightUpdateStart(update_id="v").to_dict())).training_mode is None
    with pytest.raises(ValueError, match="training_mode must be one of"):
        WeightUpdateStart.from_dict({"type": "start", "update_id": "u", "training_mode": "partial"})
    with pytest.raises(ValueError, match="head_name_patterns"):
        WeightUpdateStart.from_dict({"type": "start", "update_id": "u", "head_name_patterns": "score."})


def test_to_dict_is_plain_json_data():
    for req in _requests():
        d = req.to_dict()
        assert json.loads(json.dumps(d)) == d  # nothing that json would change (tuples, objects)


# -- dtype helpers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                torch.float8_e4m3fn])
def test_dtype_strings(dt):
    s = dtype_to_str(dt)
    assert "torch" not in s
    assert str_to_dtype(s) is dt and str_to_dtype(f"torch.{s}") is dt
    assert dtype_itemsize(s) == dt.itemsize


@pytest.mark.parametrize("bad", ["bf16", "float33", "Size", ""])
def test_unknown_dtype_string_lists_known_ones(bad):
    with pytest.raises(ValueError, match="unknown dtype.*bfloat16"):
        str_to_dtype(bad)


# -- bad dicts ---------------------------------------------------------------------------------------


def _good() -> dict:
    return _json(BroadcastWeightUpdateRequest(**COMMON).to_dict())


def test_unknown_type_lists_known_types():
    d = _good() | {"type": "carrier_pigeon"}
    with pytest.raises(ValueError, match="unknown WeightUpdateRequest type 'carrier_pigeon'.*broadcast"):
        WeightUpdateRequest.from_dict(d)
    with pytest.raises(ValueError, match="unknown WeightSyncInfo type 'x'.*torch_distributed"):
        WeightSyncInfo.from_dict({"type": "x"})


def test_request_of_other_kind_refused_by_a_specific_class():
    d = _json(CudaIpcWeightUpdateRequest(**COMMON, handles=[_shm(1)] * 3).to_dict())
    with pytest.raises(ValueError, match="expected a 'broadcast' request, got 'cuda_ipc'"):
        BroadcastWeightUpdateRequest.from_dict(d)


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match=r"unknown fields \['chunk_idx'\]"):
        WeightUpdateRequest.from_dict(_good() | {"chunk_idx": 1})


def test_missing_field_is_named():
    d = _good()
    del d["shapes"]
    with pytest.raises(ValueError, match="shapes"):
        WeightUpdateRequest.from_dict(d)


def test_not_a_dict():
    with pytest.raises(ValueError, match="expects a dict, got list"):
        WeightUpdateRequest.from_dict([1, 2])


@pytest.mark.parametrize("field", ["names", "dtypes", "shapes"])
def test_wrong_lengths(field):
    d = _good()
    d[field] = d[field][:-1]
    with pytest.raises(ValueError, match=r"lengths differ \(\d/\d/\d\)"):
        WeightUpdateRequest.from_dict(d)


def test_bad_dtype_string_names_the_parameter():
    d = _good()
    d["dtypes"][1] = "fp32"
    with pytest.raises(ValueError, match="parameter 'score.weight': unknown dtype 'fp32'"):
        WeightUpdateRequest.from_dict(d)


@pytest.mark.parametrize("shape", [[-1, 8], [1.5, 8], "1x8", [None]])
def test_bad_shape_names_the_parameter(shape):
    d = _good()
    d["shapes"][1] = shape
    with pytest.raises(ValueError, match="parameter 'score.weight': shape must be a list of ints"):
        WeightUpdateRequest.from_dict(d)


def test_empty_name_refused():
    d = _good()
    d["names"][0] = ""
    with pytest.raises(ValueError, match="non-empty strings"):
        WeightUpdateRequest.from_dict(d)


def _packed() -> dict:
    return _json(_requests()[-1].to_dict())


def test_packed_offset_out_of_range_names_the_parameter():
    d = _packed()
    d["offsets"][2] = 56  # 8 fp16 = 16 bytes at 56 end past the 64-byte buffer
    with pytest.raises(ValueError, match=r"parameter 'model.norm.weight': bytes \[56, 72\) fall outside buffer 1 of 64"):
        WeightUpdateRequest.from_dict(d)
    d["offsets"][2] = -8
    with pytest.raises(ValueError, match="model.norm.weight"):
        WeightUpdateRequest.from_dict(d)


def test_packed_buffer_index_out_of_range_and_lengths():
    d = _packed()
    d["buffer_index"][0] = 2
    with pytest.raises(ValueError, match="parameter 'model.embed_tokens.weight': buffer index 2 out of range"):
        WeightUpdateRequest.from_dict(d)
    d = _packed()
    d["offsets"] = d["offsets"][:2]
    with pytest.raises(ValueError, match="3 names but 3 buffer indices and 2 offsets"):
        WeightUpdateRequest.from_dict(d)


def test_ipc_handles_checked():
    d = _json(_requests()[2].to_dict())
    d["handles"] = d["handles"][:2]
    with pytest.raises(ValueError, match="3 names but 2 handles"):
        WeightUpdateRequest.from_dict(d)
    d = _json(_requests()[2].to_dict())
    d["handles"][0]["kind"] = "tcp"
    with pytest.raises(ValueError, match="kind must be 'shm' or 'cuda', got 'tcp'"):
        WeightUpdateRequest.from_dict(d)
    d = _json(_requests()[2].to_dict())
    d["handles"][0]["nbytes"] = -1
    with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
        WeightUpdateRequest.from_dict(d)
    d = _json(_requests()[2].to_dict())
    d["handles"][0]["pickle"] = "gASV"
    with pytest.raises(ValueError, match=r"unknown fields \['pickle'\]"):
        WeightUpdateRequest.from_dict(d)


@pytest.mark.parametrize("field,value,match", [("backend", "mpi", "backend must be 'gloo' or 'nccl'"),
                                               ("world_size", 1, r"world_size must be an int in \[2, 4096\]"),
                                               ("timeout_s", 1e9, "timeout_s must be a number of seconds"),
                                               ("master_port", 0, "master_port must be a TCP port")])
def test_bad_sync_info(field, value, match):
    d = _json(TorchDistributedWeightSyncInfo(master_addr="h", master_port=1, world_size=2).to_dict())
    d[field] = value
    with pytest.raises(ValueError, match=match):
        WeightSyncInfo.from_dict(d)


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"name": "a", "dtype": "float32"}, r"'a': missing fields \['shape'\]"),
        ({"name": "a", "dtype": "fp32", "shape": [2]}, "parameter 'a': unknown dtype 'fp32'"),
        ({"name": "a", "dtype": "float32", "shape": [-2]}, "parameter 'a': shape must be"),
        ({"name": "", "dtype": "float32", "shape": [2]}, "non-empty string"),
        ("a:float32:[2]", "must be a dict, got str"),
    ],
)
def test_bad_manifest_entry_in_start_names_the_problem(entry, match):
    d = _json(WeightUpdateStart(update_id="u", manifest=[TensorMeta("a", "float32", [2])]).to_dict())
    d["manifest"][0] = entry
    with pytest.raises(ValueError, match=match):
        WeightUpdateStart.from_dict(d)


def test_manifest_dtype_prefix_normalised():
    d = {"type": "start", "update_id": "u",
         "manifest": [{"name": "a", "dtype": "torch.bfloat16", "shape": [2]}]}
    assert WeightUpdateStart.from_dict(d).manifest == [TensorMeta("a", "bfloat16", [2])]


# -- WeightChunk / TensorMeta ------------------------------------------------------------------------


def test_weight_chunk_derived_fields():
    c = WeightChunk(["a", "b"], [torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64)],
                    module_name="m")
    assert c.dtypes == [torch.bfloat16, torch.int64]  # the interface design's types
    assert c.shapes == [(2, 3), (4,)]
    assert (c.dtype_names, c.shape_lists) == (["bfloat16", "int64"], [[2, 3], [4]])
    assert c.total_size_bytes == 2 * 3 * 2 + 4 * 8
    assert len(c) == 2
    assert c.metas() == [TensorMeta("a", "bfloat16", [2, 3]), TensorMeta("b", "int64", [4])]
    assert [m.nbytes for m in c.metas()] == [12, 32]


def test_weight_chunk_rejects_mismatch_and_duplicates():
    with pytest.raises(ValueError, match="2 names but 1 tensors"):
        WeightChunk(["a", "b"], [torch.zeros(1)])
    with pytest.raises(ValueError, match=r"names repeated: \['a'\]"):
        WeightChunk(["a", "a"], [torch.zeros(1), torch.zeros(1)])


def test_weight_chunk_takes_the_design_fields_in_order_and_checks_them():
    a, b = torch.zeros(2, 3), torch.ones(4, dtype=torch.float16)
    # the design's four required fields given positionally, then the optional ones
    c = WeightChunk(["a", "b"], [a, b], [torch.float32, torch.float16], [(2, 3), (4,)],
                    "layers.0", 32, False)
    assert (c.module_name, c.total_size_bytes, c.packed) == ("layers.0", 32, False)
    assert WeightChunk(["a"], [a], ["float32"]).dtypes == [torch.float32]  # a name is accepted
    with pytest.raises(ValueError, match=r"dtypes disagree.*b: dtype torch.float32 but the tensor "
                                         r"has torch.float16"):
        WeightChunk(["a", "b"], [a, b], [torch.float32, torch.float32])
    with pytest.raises(ValueError, match=r"shapes disagree.*a: shape \(3, 2\) but the tensor "
                                         r"has \(2, 3\)"):
        WeightChunk(["a", "b"], [a, b], None, [(3, 2), (4,)])
    with pytest.raises(ValueError, match="1 shapes for 2 tensors"):
        WeightChunk(["a", "b"], [a, b], shapes=[(2, 3)])
    with pytest.raises(ValueError, match="total_size_bytes=10 but the tensors hold 32 bytes"):
        WeightChunk(["a", "b"], [a, b], total_size_bytes=10)


def test_request_total_size_bytes():
    assert WeightUpdateRequest(**COMMON).total_size_bytes == 16 * 8 * 2 + 8 * 4 + 8 * 2


@pytest.mark.parametrize("name", ["dev_shm_other", "/etc/passwd", "ws", "ws_../x", "psm_123"])
def test_shm_handles_name_only_weightsync_segments(name):
    d = _json(_requests()[2].to_dict())
    d["handles"][0]["name"] = name
    with pytest.raises(ValueError, match="not a weightsync shared-memory segment"):
        WeightUpdateRequest.from_dict(d)


@pytest.mark.parametrize("shape,match", [
    ([1 << 21, 1 << 21], "elements; at most"),
    ([1] * 9, "9 dimensions; at most 8"),
    ([2, -1], "shape must be a list of ints >= 0"),
    ([2, True], "shape must be a list of ints >= 0"),
])
def test_absurd_shapes_are_refused_while_parsing(shape, match):
    d = _json(_requests()[0].to_dict())
    d["shapes"][0] = shape
    with pytest.raises(ValueError, match=match):
        WeightUpdateRequest.from_dict(d)
    with pytest.raises(ValueError, match=match):
        TensorMeta.from_dict({"name": "x", "dtype": "float32", "shape": shape})


@pytest.mark.parametrize("field,value,match", [
    ("checksums", [1, 2], "checksums must be a list of 3"),
    ("checksums", [1, 2, 1 << 63], "signed 64-bit ints"),
    ("chunk_index", -1, "chunk_index must be an int >= 0"),
    ("names", "abc", "names must be a list"),
    ("dtypes", [["float32"], "float32", "float32"], "dtype must be a string"),
    ("type", ["broadcast"], "type must be a string"),
])
def test_bad_request_fields_are_value_errors(field, value, match):
    d = _json(_requests()[1].to_dict())
    d[field] = value
    with pytest.raises(ValueError, match=match):
        WeightUpdateRequest.from_dict(d)


def test_checksums_round_trip():
    req = _requests()[1]
    req.checksums = [-(1 << 63), 0, (1 << 63) - 1]
    back = WeightUpdateRequest.from_dict(_json(req.to_dict()))
    assert back.checksums == req.checksums


@pytest.mark.parametrize("field,value,match", [
    ("staged", "yes", "staged must be true or false"),
    ("idle_timeout_s", -1, "idle_timeout_s must be a number of seconds"),
    ("version", -3, "version must be an int >= 0"),
    ("manifest", "all", "manifest must be a list"),
    ("update_id", 5, "update_id must be a string"),
])
def test_bad_start_fields_are_value_errors(field, value, match):
    d = WeightUpdateStart(update_id="u").to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        WeightUpdateStart.from_dict(d)


@pytest.mark.parametrize("field,value,match", [
    ("ok", "true", "ok must be true or false"), ("num_chunks", -1, "num_chunks must be"),
])
def test_bad_finish_fields_are_value_errors(field, value, match):
    d = WeightUpdateFinish(update_id="u").to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        WeightUpdateFinish.from_dict(d)


def test_a_request_equal_to_the_last_checked_one_skips_the_entry_checks_but_not_the_rest():
    """An engine gets the same names / dtypes / shapes at every step: a request equal to the
    last one checked is not checked entry by entry again; anything else still is, and its
    other fields always are."""
    from weightsync.strategies.broadcast import BroadcastWeightUpdateRequest as Req

    base = {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
            "update_id": "u", "stream": True, "packed": False}
    first = Req.from_dict(dict(base))
    again = Req.from_dict({**base, "names": ["a", "b"], "shapes": [[2, 3], [4]]})
    assert (again.names, again.dtypes, again.shapes) == (first.names, first.dtypes,
                                                          first.shapes)
    assert again.names is first.names  # the checked lists, not checked again
    with pytest.raises(ValueError, match="dtype"):
        Req.from_dict({**base, "dtypes": ["bfloat16", "float99"]})
    with pytest.raises(ValueError, match="shape"):
        Req.from_dict({**base, "shapes": [[2, -3], [4]]})
    with pytest.raises(ValueError, match="chunk_index"):
        Req.from_dict({**base, "chunk_index": -1})
    with pytest.raises(ValueError, match="checksums"):
        Req.from_dict({**base, "checksums": [1]})
    assert Req.from_dict(dict(base)).names == ["a", "b"]


def test_a_start_refers_to_a_manifest_only_without_one():
    from weightsync.types import TensorMeta, WeightUpdateStart

    ok = WeightUpdateStart.from_dict({"update_id": "b", "manifest_of": "a"})
    assert ok.manifest_of == "a" and ok.manifest is None
    with pytest.raises(ValueError, match="manifest_of"):
        WeightUpdateStart.from_dict({"update_id": "b", "manifest_of": "a",
                                     "manifest": [TensorMeta("w", "float32", [1]).to_dict()]})
    with pytest.raises(ValueError, match="manifest_of"):
        WeightUpdateStart.from_dict({"update_id": "b", "manifest_of": 3})
