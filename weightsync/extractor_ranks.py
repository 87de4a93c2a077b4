"""Which training ranks run an extractor and which keep its chunks, for the front door.

Who calls: ``weightsync.connect`` on every training rank, for an extractor given to ``connect``
(an object, e.g. one written to the interface design) or built from a config. The rules:

- an extractor whose config says nothing of ranks (the design's: its config is the trainer's)
  takes the rank's role from ``connect`` (``rank`` / ``src_rank`` / ``is_sender``); one whose
  config decides must agree with ``connect`` (a ``ValueError`` otherwise);
- an extractor runs on every rank, in lockstep, when it says so (``lockstep``: the built-in
  sharded ones) or when the model is sharded (FSDP2 DTensors, DeepSpeed ZeRO-3): then its
  extraction gathers, whoever wrote it;
- with ``every_rank`` IPC every rank keeps its copy and sends handles to it, so every rank's
  extractor is a sender. It is on when the strategy config says so, else for an IPC strategy,
  more than one training rank and an extractor that runs on every rank
  (``every_rank_wanted``; the Ray trainer asks it, the front door decides the same way).
"""

from __future__ import annotations

from typing import Any

#: model kinds (``weightsync.extractors.auto.model_kind``) whose parameters are sharded
SHARDED_KINDS = ("fsdp", "deepspeed")
#: strategies that can send from every training rank (``every_rank``)
EVERY_RANK_STRATEGIES = ("cuda_ipc", "packed_cuda_ipc")


def adopt_sender(extractor: Any, sender: bool, rank: int, src_rank: int) -> None:
    """Give an extractor passed to ``connect`` this rank's role (see the module docstring).

    Raises:
        ValueError: the extractor's config says otherwise than ``connect``.
    """
    if bool(extractor.is_sender) == sender:
        return
    states = getattr(extractor, "states_sender", None)
    if states is not None and not states():
        extractor.is_sender = sender
        return
    raise ValueError(
        f"connect: the extractor given says is_sender={extractor.is_sender} but this rank "
        f"({rank}, src_rank {src_rank}) {'is' if sender else 'is not'} the sending rank; give "
        f"both the same rank / src_rank (or is_sender)")


def runs_on_every_rank(extractor: Any, model: Any) -> bool:
    """Whether every training rank must run ``extractor`` (an instance or its class) on
    ``model``: it says so (``lockstep``), or the model is sharded."""
    if getattr(extractor, "lockstep", False):
        return True
    from weightsync.extractors.auto import model_kind

    return model_kind(model) in SHARDED_KINDS


def send_from_every_rank(extractor: Any) -> None:
    """Make ``extractor`` keep its chunks on this rank (``every_rank`` IPC: each rank sends
    handles to its own copy).

    Raises:
        ValueError: the extractor's ``is_sender`` cannot be set.
    """
    if extractor.is_sender:
        return
    try:
        extractor.is_sender = True
    except AttributeError:
        raise ValueError(
            f"connect: every_rank IPC needs the extractor to keep its chunks on every rank, "
            f"but {type(extractor).__name__}.is_sender cannot be set; give it is_sender: true "
            f"or use every_rank: false") from None


def every_rank_wanted(strategy: Any, extractor: Any, model: Any) -> bool:
    """Whether every training rank should send its own copy (``every_rank`` IPC): as the
    strategy config (a mapping with its ``type``) says when it says, else for an IPC strategy
    with more than one rank in ``torch.distributed``'s default group and an extractor that runs
    on every rank (``runs_on_every_rank``)."""
    if strategy.get("type") not in EVERY_RANK_STRATEGIES:
        return False
    if strategy.get("every_rank") is not None:
        return bool(strategy["every_rank"])
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return runs_on_every_rank(extractor, model)
