"""Trainer side of the demo: a transformers reward model, Bradley-Terry training, the reference.

Runs in the trainer process (``weightsync demo``, the examples, tests). Everything is plain
transformers + torch on whatever device the model sits on; nothing here talks to a server.

- ``load_reward_model(dir)``: an HF ``*ForSequenceClassification`` and its tokenizer, fp32, eval.
- ``hf_scores(model, tok, texts)``: the transformers forward (batched, no_grad): the reference
  the served scores must equal.
- ``train_head(...)``: Bradley-Terry on the head only. The backbone is frozen, so the pooled
  hidden states are computed once (``pooled_features``) and the head is trained on them; the
  loss and gradients are exactly those of the full forward with only ``score.weight``
  trainable, just without recomputing a frozen backbone every step.
- ``train_full(...)``: a short full fine-tune with the same loss (all parameters trainable).

Bradley-Terry loss: ``-log sigmoid(r_chosen - r_rejected)``, averaged over pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

HEAD_NAME = "score"  # the head of HF *ForSequenceClassification in the Qwen2 / Llama families


@dataclass(kw_only=True, slots=True)
class TrainResult:
    """What a training run did: losses at start and end, steps, seconds, trained names."""

    steps: int
    loss_first: float
    loss_last: float
    seconds: float
    trained: list[str]


def load_reward_model(model_dir: str, *, device: str = "cpu") -> tuple[Any, Any]:
    """-> (model, tokenizer) for ``model_dir``: fp32, eval mode, all parameters frozen, right
    padding, pad token set."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    if model.config.pad_token_id is None:
        raise ValueError(
            f"{model_dir}: config.pad_token_id is None; batched reward scoring needs a pad token"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.convert_ids_to_tokens(model.config.pad_token_id)
    head = getattr(model, HEAD_NAME, None)
    if head is None or not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{model_dir}: expected a linear head named {HEAD_NAME!r} "
            f"(a *ForSequenceClassification model), got {type(head).__name__}"
        )
    model.requires_grad_(False)  # frozen; train_head / train_full enable what they train
    return model.to(device).eval(), tok


def _batches(texts: Sequence[str], batch_size: int):
    for i in range(0, len(texts), batch_size):
        yield texts[i : i + batch_size]


def _encode(tok: Any, texts: Sequence[str], device: Any) -> dict[str, torch.Tensor]:
    enc = tok(list(texts), return_tensors="pt", padding=True)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def hf_logits(model: Any, tok: Any, texts: Sequence[str], *, batch_size: int = 32) -> torch.Tensor:
    """The transformers forward on ``texts`` (batched, no_grad) -> ``[len(texts), num_labels]``."""
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for batch in _batches(texts, batch_size):
            out.append(model(**_encode(tok, batch, device)).logits.float().cpu())
    return torch.cat(out)


def hf_scores(model: Any, tok: Any, texts: Sequence[str], *, batch_size: int = 32) -> list[float]:
    """Scalar reward per text (``num_labels == 1``), as transformers computes it."""
    logits = hf_logits(model, tok, texts, batch_size=batch_size)
    if logits.shape[-1] != 1:
        raise ValueError(f"hf_scores wants num_labels == 1, model has {logits.shape[-1]}")
    return logits[:, 0].tolist()


def pooled_features(
    model: Any, tok: Any, texts: Sequence[str], *, batch_size: int = 32
) -> torch.Tensor:
    """The hidden state the head reads for each text (last non-pad token) -> ``[N, hidden]``."""
    import torch

    device = next(model.parameters()).device
    backbone = getattr(model, model.base_model_prefix)
    feats = []
    with torch.no_grad():
        for batch in _batches(texts, batch_size):
            enc = _encode(tok, batch, device)
            hidden = backbone(**enc).last_hidden_state
            last = enc["attention_mask"].sum(-1) - 1
            feats.append(hidden[torch.arange(hidden.shape[0], device=device), last].float())
    return torch.cat(feats)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Mean of ``-log sigmoid(r_chosen - r_rejected)``."""
    import torch.nn.functional as F

    return -F.logsigmoid(r_chosen - r_rejected).mean()


def train_head(
    model: Any,
    chosen_features: torch.Tensor,
    rejected_features: torch.Tensor,
    *,
    steps: int = 300,
    lr: float = 1e-2,
    batch_size: int = 64,
    seed: int = 0,
) -> TrainResult:
    """Bradley-Terry on ``model.score.weight`` only (Adam), in place, from cached features."""
    import time

    import torch

    if chosen_features.shape != rejected_features.shape:
        raise ValueError(
            f"train_head: chosen features {tuple(chosen_features.shape)} != rejected "
            f"{tuple(rejected_features.shape)}"
        )
    head: torch.nn.Linear = getattr(model, HEAD_NAME)
    if head.out_features != 1:
        raise ValueError(f"Bradley-Terry needs a scalar reward head, {HEAD_NAME} has {head.out_features} outputs")
    weight = head.weight
    weight.requires_grad_(True)
    opt = torch.optim.Adam([weight], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n = chosen_features.shape[0]
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, n, (min(batch_size, n),), generator=gen)
        loss = bradley_terry_loss(
            (chosen_features[idx] @ weight.T)[:, 0], (rejected_features[idx] @ weight.T)[:, 0]
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weight.requires_grad_(False)
    return TrainResult(
        steps=steps, loss_first=losses[0], loss_last=losses[-1],
        seconds=time.perf_counter() - t0, trained=[f"{HEAD_NAME}.weight"],
    )


def train_full(
    model: Any,
    tok: Any,
    chosen_texts: Sequence[str],
    rejected_texts: Sequence[str],
    *,
    steps: int = 30,
    lr: float = 1e-3,
    batch_size: int = 16,
    seed: int = 0,
) -> TrainResult:
    """A short full fine-tune with the Bradley-Terry loss; every parameter trainable."""
    import time

    import torch

    if len(chosen_texts) != len(rejected_texts):
        raise ValueError("train_full: chosen_texts and rejected_texts differ in length")
    device = next(model.parameters()).device
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n = len(chosen_texts)
    losses = []
    model.train()
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            idx = torch.randint(0, n, (min(batch_size, n),), generator=gen).tolist()
            enc = _encode(tok, [chosen_texts[i] for i in idx] + [rejected_texts[i] for i in idx], device)
            r = model(**enc).logits[:, 0]
            loss = bradley_terry_loss(r[: len(idx)], r[len(idx) :])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        model.eval()
        for p in params:
            p.requires_grad_(False)
    return TrainResult(
        steps=steps, loss_first=losses[0], loss_last=losses[-1],
        seconds=time.perf_counter() - t0, trained=[n for n, _ in model.named_parameters()],
    )


def head_params(model: Any) -> dict[str, torch.Tensor]:
    """The head's parameters under engine (checkpoint) names, detached copies."""
    head = getattr(model, HEAD_NAME)
    return {f"{HEAD_NAME}.{n}": p.detach().clone() for n, p in head.named_parameters()}


def all_params(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter under checkpoint names (what ``save_pretrained`` would write)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}
