"""Modules with given parameter names/shapes/dtypes, for engines, tests and benchmarks.

``module_from_metas`` builds an ``nn.Module`` whose ``state_dict()`` has exactly the given names
(dotted names become nested submodules), so a ``TorchModuleWeightLoader`` over it accepts what
an HF model of that architecture would send. ``qwen2_metas`` gives the names/shapes of real Qwen2
checkpoints (nothing downloaded). Use them as ``LocalEngineProcess`` factories, e.g.
``"weightsync.local.modules:qwen2_module"`` with ``{"size": "0.5b", "dtype": "bfloat16"}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from weightsync.types import TensorMeta, str_to_dtype

# hidden, intermediate, layers, heads, kv_heads, vocab, tied embeddings
QWEN2_SIZES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "tiny": (64, 128, 2, 2, 1, 512, True),
    "small": (256, 512, 4, 4, 2, 4096, True),
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
}


def qwen2_metas(size: str = "0.5b", dtype: str = "bfloat16") -> list[TensorMeta]:
    """Names/shapes of ``Qwen2ForCausalLM`` of ``size`` in HF order (a tied lm_head is omitted)."""
    if size not in QWEN2_SIZES:
        raise ValueError(f"unknown Qwen2 size {size!r}; known: {', '.join(QWEN2_SIZES)}")
    h, inter, layers, heads, kv, vocab, tied = QWEN2_SIZES[size]
    hd = h // heads
    out = [TensorMeta("model.embed_tokens.weight", dtype, [vocab, h])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            TensorMeta(p + "self_attn.q_proj.weight", dtype, [heads * hd, h]),
            TensorMeta(p + "self_attn.q_proj.bias", dtype, [heads * hd]),
            TensorMeta(p + "self_attn.k_proj.weight", dtype, [kv * hd, h]),
            TensorMeta(p + "self_attn.k_proj.bias", dtype, [kv * hd]),
            TensorMeta(p + "self_attn.v_proj.weight", dtype, [kv * hd, h]),
            TensorMeta(p + "self_attn.v_proj.bias", dtype, [kv * hd]),
            TensorMeta(p + "self_attn.o_proj.weight", dtype, [h, heads * hd]),
            TensorMeta(p + "mlp.gate_proj.weight", dtype, [inter, h]),
            TensorMeta(p + "mlp.up_proj.weight", dtype, [inter, h]),
            TensorMeta(p + "mlp.down_proj.weight", dtype, [h, inter]),
            TensorMeta(p + "input_layernorm.weight", dtype, [h]),
            TensorMeta(p + "post_attention_layernorm.weight", dtype, [h]),
        ]
    out.append(TensorMeta("model.norm.weight", dtype, [h]))
    if not tied:
        out.append(TensorMeta("lm_head.weight", dtype, [vocab, h]))
    return out


def _as_metas(metas: Iterable[Any]) -> list[TensorMeta]:
    out = []
    for m in metas:
        if isinstance(m, TensorMeta):
            out.append(m)
        elif isinstance(m, Mapping):
            out.append(TensorMeta.from_dict(m))
        else:
            name, dtype, shape = m
            out.append(TensorMeta(str(name), str(dtype), [int(s) for s in shape]))
    return out


def module_from_metas(
    metas: Iterable[Any], *, seed: int | None = 0, fill: str = "random", device: str = "cpu"
) -> Any:
    """An ``nn.Module`` whose state dict holds exactly ``metas`` (TensorMeta, dicts or
    ``(name, dtype, shape)`` tuples). ``fill``: ``"random"`` (seeded normal / random ints) or
    ``"zeros"``. Floating tensors become parameters (requires_grad=False), others buffers."""
    import torch

    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    root = torch.nn.Module()
    for m in _as_metas(metas):
        dtype = str_to_dtype(m.dtype)
        if fill == "zeros":
            t = torch.zeros(m.shape, dtype=dtype)
        elif dtype.is_floating_point:
            t = torch.randn(m.shape, generator=gen, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, m.shape, generator=gen).bool()
        else:
            t = torch.randint(0, 100, m.shape, generator=gen).to(dtype)
        t = t.to(device)
        parent = root
        *path, leaf = m.name.split(".")
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                parent.add_module(part, child)
            parent = child
        if dtype.is_floating_point:
            parent.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
        else:
            parent.register_buffer(leaf, t)
    return root


def qwen2_module(
    size: str = "tiny", dtype: str = "bfloat16", *, seed: int | None = 0, fill: str = "random",
    device: str = "cpu",
) -> Any:
    """``module_from_metas(qwen2_metas(size, dtype))``: a LocalEngineProcess factory."""
    return module_from_metas(qwen2_metas(size, dtype), seed=seed, fill=fill, device=device)


def metas_module(
    metas: list[Any], seed: int | None = 0, fill: str = "zeros", device: str = "cpu"
) -> Any:
    """Factory form of ``module_from_metas`` (JSON-friendly kwargs: metas as dicts/lists)."""
    return module_from_metas(metas, seed=seed, fill=fill, device=device)
