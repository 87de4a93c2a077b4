"""Transformers' scores of the shared reward server's base model (float32, CPU): the reference
the peer-protocol tests compare the server's answers against."""

from __future__ import annotations

import torch


class HFReward:
    """The tiny reward model of ``model_dir`` in transformers, one text at a time."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=torch.float32).eval()

    def scores(self, texts: list[str]) -> list[float]:
        with torch.no_grad():
            return [float(self.model(**self.tok(t, return_tensors="pt")).logits[0, -1])
                    for t in texts]
