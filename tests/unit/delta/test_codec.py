"""``weightsync.delta.codec``: every encoding rebuilds the new tensor bit for bit (signed zeros,
NaNs, subnormals, sign changes included), the choice follows the exact byte count, and a
malformed spec is refused with the field named."""

from __future__ import annotations

import pytest
import torch

from weightsync.delta.codec import (
    DENSE,
    UNCHANGED,
    DeltaSpec,
    DeltaTarget,
    apply,
    encode,
    full_spec,
    target_of,
)
from weightsync.types import TensorMeta


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _roundtrip(base: torch.Tensor, new: torch.Tensor) -> DeltaTarget:
    target, wire = encode("w", new, base)
    assert [m.name for m in target.wire_metas()] == list(wire)
    for m in target.wire_metas():  # the announced metadata is what travels
        assert (str(wire[m.name].dtype).removeprefix("torch."), list(wire[m.name].shape)) == (
            m.dtype, m.shape)
    dst = base.clone()
    apply(dst, target, {target_of(k)[1]: v for k, v in wire.items()})
    assert torch.equal(_bits(dst), _bits(new)), target.encoding
    return target


def _nudged(base: torch.Tensor, frac: float, ulps: int = 1, seed: int = 0) -> torch.Tensor:
    """``base`` with a fraction of its elements moved by ``ulps`` units in the last place."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    pick = torch.rand(base.shape, generator=g) < frac
    _bits(new)[pick] += ulps
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_small_steps_are_sparse_and_exact(dtype):
    base = (torch.randn(256, 512) * 0.02).to(dtype)
    t = _roundtrip(base, _nudged(base, 0.01))
    assert (t.positions, t.values) == ("gaps", "bitdiff")
    wire = sum(m.nbytes for m in t.wire_metas())
    assert wire == 3 * t.nnz < 0.05 * base.numel() * base.element_size()


def test_denser_changes_use_the_mask_and_whole_values_where_bits_jump():
    base = (torch.randn(128, 128) * 0.02).to(torch.bfloat16)
    assert _roundtrip(base, _nudged(base, 0.2)).encoding == "mask+bitdiff"
    jumped = _nudged(base, 0.2, ulps=1000)  # differences that do not fit in int8
    assert _roundtrip(base, jumped).encoding == "mask+values"


def test_a_few_large_jumps_travel_whole_beside_one_byte_differences():
    base = (torch.randn(64, 512) * 0.02).to(torch.bfloat16)
    new = _nudged(base, 0.01)
    new.view(-1)[[3, 4000, 9000]] = torch.tensor([-0.5, 1e-30, 7.0], dtype=torch.bfloat16)
    t = _roundtrip(base, new)
    assert t.encoding == "gaps+bitdiff" and t.escapes == 3
    assert [m.name for m in t.wire_metas()][-1] == "w#delta.esc"


def test_long_runs_of_unchanged_elements_use_absolute_indices():
    base = torch.zeros(300_000, dtype=torch.bfloat16)
    new = base.clone()
    new[[5, 200_000]] = 1.0  # a gap of more than 65536 elements; sign/exponent change
    t = _roundtrip(base, new)
    assert t.encoding == "indices+values" and t.nnz == 2


def test_unchanged_dense_and_special_values():
    base = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-40, -3.5])
    assert _roundtrip(base, base.clone()).encoding == UNCHANGED
    assert encode("w", base, base.clone())[1] == {}
    new = torch.tensor([-0.0, 0.0, 1.0, float("-inf"), -1e-40, float("nan")])
    assert _roundtrip(base, new).encoding == DENSE  # every element changed: dense is smallest
    one = base.clone()
    one[1] = 0.0  # -0.0 -> +0.0 compares equal as a float but is a changed bit pattern
    assert _roundtrip(base, one).nnz == 1


def test_no_base_or_another_layout_is_dense():
    new = torch.randn(4, 4)
    assert encode("w", new, None)[0].encoding == DENSE
    assert encode("w", new, new.to(torch.bfloat16))[0].encoding == DENSE
    assert encode("w", new, new.reshape(16))[0].encoding == DENSE
    ints = torch.arange(1000)
    changed = ints.clone()
    changed[7] = -1
    assert _roundtrip(ints, changed).encoding == "gaps+values"


def test_spec_round_trips_and_names_what_is_wrong():
    spec = DeltaSpec(3, [DeltaTarget("a.weight", "bfloat16", (4, 8), "gaps+bitdiff", 5, 1, 17),
                         DeltaTarget("a.bias", "bfloat16", (4,), UNCHANGED),
                         DeltaTarget("b.weight", "float32", (2, 2), DENSE, 4)])
    again = DeltaSpec.from_dict(spec.to_dict())
    assert again == spec
    assert [m.to_dict() for m in again.wire_metas()] == [
        {"name": "a.weight#delta.pos", "dtype": "int16", "shape": [5]},
        {"name": "a.weight#delta.val", "dtype": "int8", "shape": [5]},
        {"name": "a.weight#delta.esc", "dtype": "bfloat16", "shape": [1]},
        {"name": "b.weight", "dtype": "float32", "shape": [2, 2]}]
    assert sum(m.nbytes for m in spec.wire_metas()) == 5 * 2 + 5 + 2 + 16
    assert spec.full_bytes == 64 + 8 + 16
    full = full_spec([TensorMeta("x", "bfloat16", [3])])
    assert full.base_version is None and full.wire_metas() == [TensorMeta("x", "bfloat16", [3])]
    bad = [
        ({"base_version": -1, "targets": [["x", "bfloat16", [3], "dense", 3, 0, None]]}, "base_version"),
        ({"base_version": 1, "targets": []}, "non-empty"),
        ({"base_version": 1, "targets": [["x", "bfloat16", [3], "zip", 3, 0, None]]}, "unknown encoding"),
        ({"base_version": 1, "targets": [["x", "bfloat16", [3], "dense", 4, 0, None]]}, "nnz"),
        ({"base_version": 1, "targets": [["x", "bf17", [3], "dense", 3, 0, None]]}, "bf17"),
        ({"base_version": 1, "targets": [["x", "bfloat16", [3], "dense", 3, 0, None]] * 2}, "repeat"),
        ({"base_version": 1, "targets": [["x", "bfloat16", [3], "gaps+values", 2, 1, None]]},
         "escapes"),
        ({"base_version": None, "targets": [["x", "bfloat16", [3], "unchanged", 0, 0, None]]},
         "every target dense"),
    ]
    for d, match in bad:
        with pytest.raises(ValueError, match=match):
            DeltaSpec.from_dict(d)


def test_positions_that_do_not_fit_are_refused():
    base = torch.zeros(16, dtype=torch.bfloat16)
    target = DeltaTarget("w", "bfloat16", (16,), "indices+values", 1)
    with pytest.raises(ValueError, match="positions do not fit"):
        apply(base, target, {"pos": torch.tensor([16], dtype=torch.int32),
                             "val": torch.ones(1, dtype=torch.bfloat16)})
