"""Policy-gradient losses the reward presets pair with: ``PolicyLoss(name, ...)`` is a callable
``loss(logprobs, weights, *, mask=None, old_logprobs=None) -> scalar tensor`` (to minimise).

Who calls: the trainer, once per optimisation step, with

- ``logprobs``: ``[B, T]`` log-probabilities of the sampled tokens under the policy being trained
  (with grad), or ``[B]`` (one summed log-probability per sample);
- ``weights``: ``[B]`` (tensor or list) one credit weight per sample: the credit assigner's value
  for that sample's ``(rollout.id, step.index)``;
- ``mask``: ``[B, T]``, 1 on the action tokens (default: all ones);
- ``old_logprobs``: the sampling policy's log-probabilities, same shape as ``logprobs``
  (default: ``logprobs.detach()``, i.e. on-policy, ratio 1).

Objectives per token (``A`` = weight, ``r = exp(logprobs - old_logprobs)``), from the registry:

=====================  =====================================================================
``reinforce``          ``A * logp``
``clipped_surrogate``  ``min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`` (PPO / GRPO)
``cispo``              ``sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp`` (ScaleRL's loss:
                       the importance weight is truncated and detached, no token loses its
                       gradient)
=====================  =====================================================================

Aggregation: ``"token_mean"`` averages over every action token of the batch; ``"sequence_mean"``
averages tokens within each sample, then samples (with equal group sizes this equals ScaleRL's
prompt-level averaging). torch is imported when a loss is called, not before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OBJECTIVES: dict[str, Callable[..., Any]] = {
    "reinforce": lambda logp, old, adv, lo, hi: adv * logp,
    "clipped_surrogate": lambda logp, old, adv, lo, hi: _clipped(logp, old, adv, lo, hi),
    "cispo": lambda logp, old, adv, lo, hi: (
        (logp - old).exp().clamp(1.0 - lo, 1.0 + hi).detach() * adv * logp
    ),
}
AGGREGATIONS = ("token_mean", "sequence_mean")


def _clipped(logp: Any, old: Any, adv: Any, lo: float, hi: float) -> Any:
    import torch

    ratio = (logp - old).exp()
    return torch.minimum(ratio * adv, ratio.clamp(1.0 - lo, 1.0 + hi) * adv)


@dataclass(frozen=True)
class PolicyLoss:
    """A named policy-gradient loss (see the module docstring)."""

    name: str = "reinforce"
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "token_mean"

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"unknown loss {self.name!r}; choose one of {sorted(OBJECTIVES)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if not 0.0 <= self.clip_low <= 1.0 or not self.clip_high >= 0.0:
            raise ValueError(
                f"clips: need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low="
                f"{self.clip_low}, clip_high={self.clip_high}"
            )

    def __call__(
        self, logprobs: Any, weights: Any, *, mask: Any = None, old_logprobs: Any = None
    ) -> Any:
        import torch

        if logprobs.dim() not in (1, 2):
            raise ValueError(f"logprobs: expected [B, T] or [B], got shape {list(logprobs.shape)}")
        logp = logprobs.reshape(logprobs.shape[0], -1)
        adv = torch.as_tensor(weights, dtype=logp.dtype, device=logp.device).reshape(-1)
        if adv.shape[0] != logp.shape[0]:
            raise ValueError(f"weights: {adv.shape[0]} values for {logp.shape[0]} samples "
                             f"(logprobs shape {list(logprobs.shape)})")
        m = torch.ones_like(logp) if mask is None else _like("mask", mask, logprobs, logp)
        old = logp.detach() if old_logprobs is None else _like(
            "old_logprobs", old_logprobs, logprobs, logp).detach()
        obj = OBJECTIVES[self.name](logp, old, adv[:, None], self.clip_low, self.clip_high) * m
        if self.aggregation == "token_mean":
            return -obj.sum() / m.sum().clamp(min=1.0)
        return -(obj.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean()


def _like(name: str, x: Any, logprobs: Any, logp: Any) -> Any:
    import torch

    t = torch.as_tensor(x)
    if list(t.shape) != list(logprobs.shape):
        raise ValueError(f"{name}: shape {list(t.shape)} does not match logprobs "
                         f"{list(logprobs.shape)}")
    return t.to(logp).reshape(logp.shape)
