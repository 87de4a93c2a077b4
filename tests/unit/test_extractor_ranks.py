"""Which ranks run an extractor and which keep its chunks (``weightsync.extractor_ranks``): an
extractor written to the interface design takes connect's role, one whose config decides must
agree, a sharded model or a lockstep extractor runs on every rank, and ``every_rank`` makes
every rank a sender. The multi-process runs are in
``tests/integration/test_connect_processes.py``."""

from __future__ import annotations

import pytest
import torch

import weightsync as ws
from weightsync.extractor_ranks import adopt_sender, runs_on_every_rank, send_from_every_rank


class Design(ws.WeightExtractor):
    async def _extract_raw_weights(self, model, generator_dtype):
        return dict(model.state_dict())


def test_a_design_extractor_takes_the_role_and_a_stated_one_must_agree():
    for cfg in (None, {}, {"generator": {"weight_sync_backend": "gloo"}}):
        ext = Design(cfg)
        assert ext.is_sender and not ext.states_sender()
        adopt_sender(ext, False, rank=1, src_rank=0)
        assert ext.is_sender is False
        adopt_sender(ext, True, rank=0, src_rank=0)
        assert ext.is_sender is True
    stated = Design({"is_sender": False})
    assert stated.states_sender()
    with pytest.raises(ValueError, match=r"says is_sender=False but this rank \(0, src_rank 0\) "
                                         r"is the sending rank"):
        adopt_sender(stated, True, rank=0, src_rank=0)
    fsdp = ws.build_extractor({"type": "fsdp", "rank": 1})  # its rank decides: not the sender
    assert fsdp.states_sender() and not fsdp.is_sender
    adopt_sender(fsdp, False, rank=1, src_rank=0)  # agrees: nothing to do
    with pytest.raises(ValueError, match="is_sender=False"):
        adopt_sender(fsdp, True, rank=1, src_rank=1)


def test_every_rank_runs_a_lockstep_extractor_or_a_sharded_model():
    plain = torch.nn.Linear(2, 2)
    assert not runs_on_every_rank(Design({}), plain)
    assert runs_on_every_rank(ws.build_extractor({"type": "fsdp"}), plain)  # it says so
    assert runs_on_every_rank(ws.registry.EXTRACTORS.get("megatron"), plain)  # a class too
    assert not runs_on_every_rank(ws.registry.EXTRACTORS.get("hf"), plain)


def test_every_rank_ipc_makes_each_extractor_a_sender():
    fsdp = ws.build_extractor({"type": "fsdp", "rank": 1})
    send_from_every_rank(fsdp)
    assert fsdp.is_sender  # set on the extractor, its config untouched
    assert fsdp.cfg.is_sender is None

    class Fixed:  # duck-typed: an extract_weights and a read-only is_sender
        is_sender = property(lambda self: False)

    with pytest.raises(ValueError, match="Fixed.is_sender cannot be set"):
        send_from_every_rank(Fixed())
