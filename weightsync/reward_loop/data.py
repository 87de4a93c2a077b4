"""What the reward loop scores: a batch of rollouts in verl's ``DataProto`` shape.

verl hands its reward managers a ``DataProto``: ``batch`` (tensors whose first dimension is the
sample), ``non_tensor_batch`` (numpy object arrays of the same length) and ``meta_info``;
``data[i]`` is one item, ``data[i:j]`` a smaller batch. ``RewardBatch`` is that shape without
verl, so a manager or reward function written for verl runs unchanged on it (and a real
``DataProto`` works wherever a ``RewardBatch`` is taken: only ``len``, indexing, ``batch``,
``non_tensor_batch`` and ``meta_info`` are used).

The keys the reward loop reads, as verl fills them:

- ``batch["prompts"]`` ``[N, P]`` (left-padded), ``batch["responses"]`` ``[N, R]``
  (right-padded), ``batch["attention_mask"]`` ``[N, P + R]``; the valid response length is the
  response part of the mask;
- ``non_tensor_batch["data_source"]`` (picks the rule), ``["reward_model"]`` (a dict with
  ``"ground_truth"``), ``["extra_info"]`` (a dict), ``["raw_prompt"]`` (the chat messages the
  discriminative reward model sees before the response).

``RewardBatch.from_texts`` builds one from prompt and response texts with the policy's
tokenizer (callers: tests, the example, anyone without verl). Plain data: it pickles, so it
travels to Ray workers as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardItem:
    """One sample: ``batch`` holds 1-D tensors, ``non_tensor_batch`` plain values."""

    batch: dict[str, Any]
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardBatch:
    """A batch in verl's ``DataProto`` shape (see the module docstring)."""

    batch: dict[str, Any] = field(default_factory=dict)
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: _object_array(v) for k, v in self.non_tensor_batch.items()}
        sizes = {f"batch[{k!r}]": int(v.shape[0]) for k, v in self.batch.items()}
        sizes.update({f"non_tensor_batch[{k!r}]": len(v)
                      for k, v in self.non_tensor_batch.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"RewardBatch: every field must hold one entry per sample; sizes "
                             f"differ: {sizes}")

    def __len__(self) -> int:
        for v in self.batch.values():
            return int(v.shape[0])
        for v in self.non_tensor_batch.values():
            return len(v)
        return 0

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return RewardBatch({k: v[index] for k, v in self.batch.items()},
                               {k: v[index] for k, v in self.non_tensor_batch.items()},
                               dict(self.meta_info))
        if not -len(self) <= index < len(self):
            raise IndexError(f"RewardBatch index {index} out of range for {len(self)} samples")
        return RewardItem({k: v[index] for k, v in self.batch.items()},
                          {k: v[index] for k, v in self.non_tensor_batch.items()},
                          dict(self.meta_info))

    def chunk(self, chunks: int) -> list[RewardBatch]:
        """``chunks`` consecutive parts as equal as possible (verl's ``DataProto.chunk``, which
        needs equal parts; here the first ``len % chunks`` parts get one more)."""
        if chunks < 1:
            raise ValueError(f"chunks: must be >= 1, got {chunks}")
        n = len(self)
        base, extra = divmod(n, chunks)
        out, start = [], 0
        for i in range(chunks):
            size = base + (1 if i < extra else 0)
            out.append(self[start:start + size])
            start += size
        return out

    @classmethod
    def from_texts(
        cls,
        tokenizer: Any,
        prompts: Sequence[str | list[dict]],
        responses: Sequence[str],
        *,
        data_sources: Sequence[str] | str,
        ground_truths: Sequence[Any] | None = None,
        extra_infos: Sequence[dict] | None = None,
    ) -> RewardBatch:
        """Tokenize ``prompts`` (texts, or chat message lists rendered with the tokenizer's chat
        template and a generation prompt) and ``responses`` with the policy's ``tokenizer``
        into verl's tensors; ``raw_prompt`` keeps the chat (a text prompt becomes one user
        message). ``data_sources``: one per sample, or one for all."""
        import torch

        n = len(prompts)
        if len(responses) != n:
            raise ValueError(f"responses: {len(responses)} for {n} prompts")
        sources = [data_sources] * n if isinstance(data_sources, str) else list(data_sources)
        truths = list(ground_truths) if ground_truths is not None else [None] * n
        infos = [dict(x) for x in extra_infos] if extra_infos is not None else [{} for _ in range(n)]
        for name, values in (("data_sources", sources), ("ground_truths", truths),
                             ("extra_infos", infos)):
            if len(values) != n:
                raise ValueError(f"{name}: {len(values)} for {n} prompts")
        chats = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
        prompt_texts = [p if isinstance(p, str) else tokenizer.apply_chat_template(
            p, add_generation_prompt=True, tokenize=False) for p in prompts]
        prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
        response_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in responses]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        plen = max((len(x) for x in prompt_ids), default=0)
        rlen = max(max((len(x) for x in response_ids), default=0), 1)
        prompts_t = torch.full((n, plen), pad, dtype=torch.long)
        responses_t = torch.full((n, rlen), pad, dtype=torch.long)
        mask = torch.zeros((n, plen + rlen), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            if p:
                prompts_t[i, plen - len(p):] = torch.tensor(p)
                mask[i, plen - len(p):plen] = 1
            if r:
                responses_t[i, :len(r)] = torch.tensor(r)
                mask[i, plen:plen + len(r)] = 1
        return cls(
            batch={"prompts": prompts_t, "responses": responses_t,
                   "input_ids": torch.cat([prompts_t, responses_t], dim=1),
                   "attention_mask": mask},
            non_tensor_batch={
                "data_source": sources,
                "reward_model": [{"ground_truth": gt, "style": "rule"} for gt in truths],
                "extra_info": infos,
                "raw_prompt": chats,
            },
        )


def _object_array(values: Any) -> Any:
    """A 1-D numpy object array of ``values`` (dicts and lists stay whole, one per sample)."""
    import numpy as np

    if isinstance(values, np.ndarray) and values.ndim == 1:
        return values
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def response_part(item: RewardItem) -> tuple[Any, int]:
    """(the valid response token ids, their count) of one item, as verl reads them: the
    response part of the attention mask says how many of ``responses`` are real."""
    response_ids = item.batch["responses"]
    length = int(item.batch["attention_mask"][-response_ids.shape[-1]:].sum())
    return response_ids[:length], length
