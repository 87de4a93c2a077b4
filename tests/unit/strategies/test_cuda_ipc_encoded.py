"""When the CUDA IPC sender may reuse the handles it encoded for a request (``_Encoded``): only
for the very same tensor objects, in the same order, at the same address with the same dtype
and shape, under the same names. Tensors here are CPU tensors: the check reads identities and
addresses only (the GPU test sends through it: tests/gpu/test_gpu_transports.py)."""

from __future__ import annotations

import torch

from weightsync.strategies.cuda_ipc import _Encoded
from weightsync.types import WeightChunk


def _chunk(names, tensors):
    return WeightChunk(list(names), list(tensors), borrowed=True)


def test_the_same_tensors_in_a_new_chunk_are_held_and_updated_in_place_still():
    a, b = torch.zeros(4, 3), torch.ones(5)
    enc = _Encoded(_chunk("ab", [a, b]), handles=[])
    a.add_(1)  # a trainer's step: in place
    assert enc.holds(_chunk("ab", [a, b]))


def test_a_replaced_resized_or_reordered_tensor_or_a_renamed_one_is_not_held():
    a, b = torch.zeros(4, 3), torch.ones(5)
    enc = _Encoded(_chunk("ab", [a, b]), handles=[])
    assert not enc.holds(_chunk("ab", [a.clone(), b]))  # a new allocation
    assert not enc.holds(_chunk("ab", [b, a]))
    assert not enc.holds(_chunk("ac", [a, b]))
    assert not enc.holds(_chunk("a", [a]))
    a.data = torch.zeros(4, 3)  # the same object, its storage replaced
    assert not enc.holds(_chunk("ab", [a, b]))
    enc = _Encoded(_chunk("ab", [a, b]), handles=[])
    b.resize_(2)  # the same object and address, a new shape
    assert not enc.holds(_chunk("ab", [a, b]))


def test_a_dead_tensor_whose_id_came_back_is_not_held():
    enc = _Encoded(_chunk("a", [torch.zeros(3)]), handles=[])
    again = torch.zeros(3)  # may take the dead tensor's id (and even its address)
    assert not enc.holds(_chunk("a", [again]))
