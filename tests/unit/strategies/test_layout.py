"""Packing layout (offsets, alignment, dtype groups) and pack/unpack round trips."""

from __future__ import annotations

import pytest
import torch

from weightsync.strategies._layout import align_up, as_bytes, pack_into, plan_layout, view_as
from weightsync.types import TensorMeta


def _metas():
    return [
        TensorMeta("a", "bfloat16", [3, 5]),  # 30 bytes
        TensorMeta("b", "float32", [7]),  # 28 bytes
        TensorMeta("c", "bfloat16", [1]),  # 2 bytes
        TensorMeta("empty", "float32", [0, 4]),
        TensorMeta("d", "int64", []),  # scalar, 8 bytes
        TensorMeta("e", "float32", [2, 2]),
    ]


def test_groups_by_dtype_in_first_appearance_order_and_request_order_inside():
    lay = plan_layout(_metas(), 64)
    assert [g.dtype for g in lay.groups] == ["bfloat16", "float32", "int64"]
    assert [list(g.members) for g in lay.groups] == [[0, 2], [1, 3, 5], [4]]
    assert lay.group_of == (0, 1, 0, 1, 2, 1)


def test_offsets_and_group_starts_are_aligned_and_disjoint():
    for align in (1, 2, 64, 256):
        lay = plan_layout(_metas(), align)
        for i, m in enumerate(lay.metas):
            if m.nbytes:
                assert lay.offsets[i] % align == 0
        for g in lay.groups:
            assert g.start % align == 0
            spans = sorted(
                (lay.offsets[i], lay.offsets[i] + lay.metas[i].nbytes)
                for i in g.members if lay.metas[i].nbytes
            )
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert spans[-1][1] == g.nbytes
        ends = [g.start + g.nbytes for g in lay.groups]
        assert all(e <= s.start for e, s in zip(ends, lay.groups[1:], strict=False))
        assert lay.total_nbytes == ends[-1]


def test_exact_offsets_for_a_known_case():
    lay = plan_layout(_metas(), 256)
    assert lay.offsets == (0, 0, 256, 28, 0, 256)  # empty tensor takes no bytes
    assert [(g.start, g.nbytes) for g in lay.groups] == [(0, 258), (512, 272), (1024, 8)]
    assert lay.total_nbytes == 1032


def test_bad_alignment_rejected():
    with pytest.raises(ValueError, match="power of two"):
        plan_layout(_metas(), 3)
    with pytest.raises(ValueError):
        align_up(5, 0)


@pytest.mark.parametrize("align", [2, 8, 256])
def test_pack_then_views_round_trip_bit_exact(align):
    g = torch.Generator().manual_seed(0)
    metas = _metas()
    tensors = []
    for m in metas:
        dt = getattr(torch, m.dtype)
        t = torch.randn(m.shape, generator=g).to(dt) if dt.is_floating_point else torch.randint(
            0, 1 << 40, m.shape, generator=g).to(dt)
        tensors.append(t)
    lay = plan_layout(metas, align)
    whole = torch.full((lay.total_nbytes,), 0xAB, dtype=torch.uint8)
    pack_into(lay, tensors, lay.split(whole))
    views = lay.tensor_views(lay.split(whole))
    for m, t in zip(metas, tensors, strict=True):
        v = views[m.name]
        assert v.dtype == t.dtype and list(v.shape) == m.shape
        assert torch.equal(as_bytes(v), as_bytes(t))
    # views share memory with the buffer (no copy)
    whole.zero_()
    assert float(views["a"].abs().sum()) == 0.0


def test_view_as_checks_bounds_and_alignment():
    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        view_as(buf, 12, TensorMeta("x", "float32", [2]))
    with pytest.raises(ValueError, match="aligned"):
        view_as(buf, 2, TensorMeta("x", "float32", [2]))


def test_as_bytes_of_non_contiguous_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(as_bytes(t), as_bytes(t.contiguous()))
