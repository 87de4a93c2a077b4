"""Named model shapes for ``weightsync bench`` and tests: HF parameter names and shapes, random
values, nothing downloaded.

``shape_specs(name)`` lists ``(hf_name, shape)`` in the order HF's ``named_parameters()`` yields
them; ``build_module(shape=..., dtype=..., seed=..., device=..., fill=...)`` builds an
``nn.Module`` whose ``state_dict()`` has exactly those names. ``build_module`` is importable as
``"weightsync.bench.shapes:build_module"``, the factory string that ``LocalEngineProcess`` and
the Ray actors take, so the sender and every engine build the same names and shapes.

Tied embeddings (Qwen2-0.5B/1.5B) appear once, under ``model.embed_tokens.weight``: what an
extractor sends for a tied model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """A Llama/Qwen2-style decoder: what ``config.json`` would say."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool
    qkv_bias: bool  # Qwen2 has q/k/v biases, Llama has none

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True, kw_only=True)
class ManySmallShape:
    """Thousands of small tensors (norms, biases, small projections): where per-tensor overhead
    dominates and packing pays."""

    blocks: int
    width: int


SHAPES: dict[str, DecoderShape | ManySmallShape] = {
    "tiny": DecoderShape(
        hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=256,
        tie_embeddings=False, qkv_bias=True,
    ),
    # tiny with tied embeddings (like Qwen2-0.5B/1.5B): the head shares the embedding's tensor
    "tiny-tied": DecoderShape(
        hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=256,
        tie_embeddings=True, qkv_bias=True,
    ),
    "qwen2-0.5b": DecoderShape(
        hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936,
        tie_embeddings=True, qkv_bias=True,
    ),
    "qwen2-1.5b": DecoderShape(
        hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936,
        tie_embeddings=True, qkv_bias=True,
    ),
    "qwen2-7b": DecoderShape(
        hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064,
        tie_embeddings=False, qkv_bias=True,
    ),
    "llama3-8b": DecoderShape(
        hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
        tie_embeddings=False, qkv_bias=False,
    ),
    # 512 blocks x 8 tensors = 4096 tensors of 0.25-16 KiB each (bf16), ~21 MB in all.
    "many-small": ManySmallShape(blocks=512, width=64),
}


def shape_names() -> list[str]:
    return list(SHAPES)


def get_shape(name: str) -> DecoderShape | ManySmallShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; valid shapes: {', '.join(SHAPES)}") from None


def shape_specs(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(hf_name, shape)`` for every tensor of the named shape, in HF order."""
    s = get_shape(name)
    if isinstance(s, ManySmallShape):
        return _many_small_specs(s)
    return _decoder_specs(s)


def _decoder_specs(s: DecoderShape) -> list[tuple[str, tuple[int, ...]]]:
    h, kv = s.hidden, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, h))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out.append((p + "self_attn.q_proj.weight", (h, h)))
        if s.qkv_bias:
            out.append((p + "self_attn.q_proj.bias", (h,)))
        out.append((p + "self_attn.k_proj.weight", (kv, h)))
        if s.qkv_bias:
            out.append((p + "self_attn.k_proj.bias", (kv,)))
        out.append((p + "self_attn.v_proj.weight", (kv, h)))
        if s.qkv_bias:
            out.append((p + "self_attn.v_proj.bias", (kv,)))
        out += [
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (s.intermediate, h)),
            (p + "mlp.up_proj.weight", (s.intermediate, h)),
            (p + "mlp.down_proj.weight", (h, s.intermediate)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not s.tie_embeddings:
        out.append(("lm_head.weight", (s.vocab, h)))
    return out


def _many_small_specs(s: ManySmallShape) -> list[tuple[str, tuple[int, ...]]]:
    w = s.width
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(s.blocks):
        p = f"blocks.{i}."
        out += [
            (p + "norm1.weight", (w,)),
            (p + "norm1.bias", (w,)),
            (p + "attn.qkv.weight", (3 * w, w // 4)),
            (p + "attn.qkv.bias", (3 * w,)),
            (p + "attn.proj.weight", (w, w)),
            (p + "mlp.fc.weight", (2 * w, w)),
            (p + "mlp.fc.bias", (2 * w,)),
            (p + "norm2.weight", (w,)),
        ]
    return out


def shape_numel(name: str) -> int:
    n = 0
    for _, shp in shape_specs(name):
        k = 1
        for d in shp:
            k *= d
        n += k
    return n


def build_module(
    shape: str = "tiny",
    dtype: str = "float32",
    seed: int | None = 0,
    device: str = "cpu",
    fill: float | None = None,
) -> torch.nn.Module:
    """An ``nn.Module`` whose ``state_dict()`` names/shapes are ``shape_specs(shape)``.

    Values: ``fill`` (a constant, cheap: what benchmark receivers use so that they differ from
    the sender) or, if ``fill`` is None, pseudo-random from ``seed``: each tensor is tiled from a
    shared pool of uniform [-1, 1) values starting at its own random offset, so tensors differ
    from each other and from other seeds while building 8B parameters costs memcpy time, not RNG
    time. Parameters do not require grad (nothing here trains).
    """
    import torch

    from weightsync.types import str_to_dtype

    dt = str_to_dtype(dtype)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0 if seed is None else int(seed))
    pool = None
    if fill is None:
        pool = torch.empty(_POOL, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen).to(dt)
    root = torch.nn.Module()
    for name, shp in shape_specs(shape):
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        t = torch.empty(shp, dtype=dt, device="cpu")
        if pool is None:
            t.fill_(float(fill))  # type: ignore[arg-type]
        else:
            _tile(t.view(-1), pool, int(torch.randint(_POOL, (1,), generator=gen)))
        mod.register_parameter(leaf, torch.nn.Parameter(t.to(device), requires_grad=False))
    return root


_POOL = (1 << 22) + 17  # odd length: consecutive tiles do not line up with power-of-two shapes


def _tile(flat: torch.Tensor, pool: torch.Tensor, start: int) -> None:
    """Fill ``flat`` with ``pool`` repeated, starting at ``pool[start]``."""
    pos, n = 0, flat.numel()
    while pos < n:
        take = min(n - pos, pool.numel() - start)
        flat[pos : pos + take].copy_(pool[start : start + take])
        pos += take
        start = 0
